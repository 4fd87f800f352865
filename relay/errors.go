package relay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// Relay reason codes, beside netpolicy's decision codes. An audit event
// whose destination the policy allowed carries one of these when what
// followed failed (CodeDNSFailure, CodeUpstream, CodeUpstreamTimout,
// CodeModule, CodeTransform, CodeLimit, CodeBadRequest); a refusal by the
// proxy's own checks carries the others.
const (
	// CodeDNSFailure is a name the policy allowed whose lookup failed.
	CodeDNSFailure     = "dns_failure"
	CodeBadRequest     = "bad_request"
	CodePlainHTTP      = "plain_http"
	CodeNoRoute        = "no_route"
	CodeSmuggling      = "smuggling"
	CodeLimit          = "limit"
	CodeUpstream       = "upstream_error"
	CodeUpstreamTimout = "upstream_timeout"
	CodeTransform      = "transform_error"
	// CodeModuleRefused is a request a WebAssembly transform module refused
	// (sandgate.refuse); CodeModule one that a module failed (it trapped,
	// ran out of time or memory, or wrote what the proxy cannot send).
	CodeModuleRefused = "module_refused"
	CodeModule        = "module_error"
	// CodeNoCA: a host the policy intercepts, on a proxy without an
	// interception CA.
	CodeNoCA = "intercept_unavailable"
	// CodeCredentialHost: a tunnel (CONNECT, or a captured connection) to
	// a host a credential rule of the sandbox targets, which could only
	// be carried intercepted (so that its answers are scrubbed), on a
	// proxy without an interception CA, or to an address (no certificate
	// is made for one).
	CodeCredentialHost = "credential_host"
	// CodeSealedCredential: a host a credential the sandbox's rules held
	// targets, sealed under a seal key this service does not have: its
	// answers could not be scrubbed of it.
	CodeSealedCredential = "credential_sealed"
)

// Error is a refusal or failure the proxy answers the sandbox with. Status,
// the X-Sandgate-Error header and the body all come from it, in writeError.
type Error struct {
	Status int
	Code   string
	Reason string
	// RetryAfter is sent as Retry-After (whole seconds, at least 1) on 429.
	RetryAfter time.Duration
	Err        error
}

func (e *Error) Error() string {
	if e.Err != nil && !strings.Contains(e.Reason, e.Err.Error()) {
		return e.Reason + ": " + e.Err.Error()
	}
	return e.Reason
}

func (e *Error) Unwrap() error { return e.Err }

// Body is the plain text a refusal answers with: what a person at a
// command in the sandbox reads, "sandgate: <reason> (<code>)". Where
// protocol 1 fixes a refusal's words, the body starts with them instead
// (protocol1Worded).
func (e *Error) Body() string {
	if protocol1Worded[e.Code] {
		return e.Error() + " (" + e.Code + ")\n"
	}
	return "sandgate: " + e.Error() + " (" + e.Code + ")\n"
}

// protocol1Worded are the refusals whose reasons begin with protocol 1's
// words, which its clients' tests match at the start of the body: an
// address a sandbox may not reach, "<address> is not reachable from the
// sandbox" (netpolicy.CodeAddressClass).
var protocol1Worded = map[string]bool{string(netpolicy.CodeAddressClass): true}

// statusLine is the status line's status and reason phrase: the
// standard text, then the reason, on one line of printable ASCII.
func (e *Error) statusLine() string {
	text := http.StatusText(e.Status)
	if text == "" {
		text = "Error"
	}
	return strconv.Itoa(e.Status) + " " + text + " (sandgate: " + headerSafe(truncate(e.Error(), 200)) + ")"
}

func badRequest(format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Code: CodeBadRequest, Reason: fmt.Sprintf(format, args...)}
}

func limitError(reason string, retry time.Duration) *Error {
	return &Error{Status: http.StatusTooManyRequests, Code: CodeLimit, Reason: reason, RetryAfter: retry}
}

// sealedRefusal makes ev a refusal (deny, its code and reason) when err is
// the chain's refusal of a host whose answers could carry a held
// credential this service cannot unseal: sandgate's own check, not a
// failure after the policy allowed.
func sealedRefusal(ev *audit.Event, err error) {
	if errors.Is(err, transforms.ErrSealed) {
		e := asError(err)
		ev.Allow, ev.Code, ev.Reason = false, e.Code, e.Reason
	}
}

// denied turns a policy denial into the 403 the sandbox sees.
func denied(dec netpolicy.Decision) *Error {
	return &Error{Status: http.StatusForbidden, Code: string(dec.Code), Reason: dec.Reason}
}

// asError maps any error met while carrying a request to the status the
// sandbox sees. This is the one place where error categories become
// statuses: denial → 403, DNS failure → 502, upstream timeout → 504,
// limit → 429, anything else from upstream → 502.
func asError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	var ue *transforms.UnscrubbableError
	if errors.As(err, &ue) {
		return &Error{Status: http.StatusForbidden, Code: CodeSealedCredential, Reason: ue.Error()}
	}
	var we *wasm.Error
	if errors.As(err, &we) {
		return &Error{Status: we.Status, Code: CodeModule, Reason: we.Reason, Err: we.Err}
	}
	var dnsErr *netpolicy.DNSError
	if errors.As(err, &dnsErr) {
		return &Error{Status: http.StatusBadGateway, Code: CodeDNSFailure, Reason: dnsErr.Error(), Err: err}
	}
	if isTimeout(err) {
		return &Error{Status: http.StatusGatewayTimeout, Code: CodeUpstreamTimout, Reason: "upstream did not answer in time", Err: err}
	}
	var pe *protocolError
	if errors.As(err, &pe) {
		// Parser errors quote what the upstream sent; keep them out of
		// what the sandbox and the logs see.
		return &Error{Status: http.StatusBadGateway, Code: CodeUpstream, Reason: "upstream sent a malformed HTTP response"}
	}
	return &Error{Status: http.StatusBadGateway, Code: CodeUpstream, Reason: "upstream failed", Err: err}
}

func isTimeout(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var de *netpolicy.DialError
	if errors.As(err, &de) {
		return de.Timeout()
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// header returns the headers of the error response.
func (e *Error) header(closing bool) http.Header {
	h := http.Header{}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("X-Sandgate-Error", headerSafe(e.Error()))
	if e.Status == http.StatusTooManyRequests {
		secs := int((e.RetryAfter + time.Second - 1) / time.Second)
		if secs < 1 {
			secs = 1
		}
		h.Set("Retry-After", strconv.Itoa(secs))
	}
	if closing {
		h.Set("Connection", "close")
	}
	return h
}

// headerSafe keeps a header value to printable ASCII on one line.
func headerSafe(s string) string {
	var b strings.Builder
	for _, r := range truncate(s, 512) {
		if r < 0x20 || r > 0x7e {
			r = '?'
		}
		b.WriteRune(r)
	}
	return b.String()
}

var errConnReset = syscall.ECONNRESET

// protocolError marks an upstream response that could not be parsed. Its
// message is never shown: net/http's parser quotes the offending bytes.
type protocolError struct{ err error }

func (e *protocolError) Error() string { return "malformed upstream response" }
func (e *protocolError) Unwrap() error { return e.err }
