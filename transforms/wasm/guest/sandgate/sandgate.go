package sandgate

import "github.com/sandgate/sandgate/transforms/wasm/guest/internal/hostbuf"

// SandboxID returns the id of the sandbox that sent the request being
// handled, so that one module serving several sandboxes can treat them
// differently. The proxy knows the id from the link the request came on,
// never from anything the sandbox sent.
func SandboxID() string { return string(hostbuf.Get("sandbox_id", hostSandboxID)) }

// AuditNote attaches note to the audit event of the request being handled,
// e.g. which rule of the module matched. The host caps how many notes an
// event keeps and how long each is (see transforms/wasm/README.md), drops
// the rest and counts them; it also scrubs secrets from notes.
func AuditNote(note string) { hostAuditNote(note) }

// Refuse refuses the request being handled with the HTTP status (400–599;
// the host answers 403 for anything else) and a reason that the audit
// event records with this module's name. After calling it, a
// RequestHandler returns next=false; the host refuses even if it does not.
// The sandbox receives the status and whatever the module wrote to the
// response body, or, if it wrote nothing, the proxy's JSON error with the
// module's name and reason.
func Refuse(status int, reason string) {
	if status < 0 || status > 0xffff {
		status = 0 // out of range for the host too; it answers 403
	}
	hostRefuse(uint32(status), reason)
}
