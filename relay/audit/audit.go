// Package audit records egress decisions: one canonical event per CONNECT
// tunnel and captured connection (when it closes), per routed or
// intercepted request, and per lookup refused in a sandbox without
// capture, in one JSON shape (AppendJSON, versioned) that is the same
// bytes in the audit log, in the store, in the API and in the CLI's
// --json; kept per sandbox in segments that outlive it running
// (Journals); and counted in Prometheus metrics. An event never carries a
// header value, a query string or a body.
package audit

import (
	"io"
	"sync"
	"time"
)

// Kind says what carried the egress.
type Kind string

// Event kinds.
const (
	// Connect is an HTTPS CONNECT tunnel; its event is written when it closes.
	Connect Kind = "connect"
	// Route is a base-URL request (/https/<host>/<path>) forwarded over HTTPS.
	Route Kind = "route"
	// Refused is a request the proxy refused before it had a destination
	// (a malformed request, plain http://, a limit).
	Refused Kind = "refused"
	// Capture is a connection a sandbox process made without the proxy
	// variables, to an address the sandbox's DNS responder gave a name,
	// captured in the sandbox and judged as CONNECT name:port would be;
	// its event is written when it closes.
	Capture Kind = "capture"
	// Intercept is one request inside an intercepted TLS connection (a
	// CONNECT tunnel or a captured connection to a host of the policy's
	// intercept list), carried as a base-URL route is.
	Intercept Kind = "intercept"
	// DNS is a name lookup made inside the sandbox that could not be
	// served (no capture there): the process tried a direct connection,
	// not one through the proxy. Host is the name, Method the query type
	// (A, AAAA).
	DNS Kind = "dns"
)

// Codes of the events of capture and interception, beside netpolicy's and
// relay's.
const (
	// CodeDirectLookup: a lookup inside a sandbox without capture; it was
	// answered at once with NXDOMAIN.
	CodeDirectLookup = "direct_lookup"
	// CodeInterceptRefused: the client refused the certificate sandgate
	// presented for an intercepted host (it pins certificates, or does
	// not trust the sandbox CA).
	CodeInterceptRefused = "intercept_refused"
	// CodeInterceptTLS: the TLS handshake of an intercepted connection
	// failed otherwise (no common version or cipher, a broken hello).
	CodeInterceptTLS = "intercept_tls"
	// CodeMisdirected: a request inside an intercepted connection named
	// another host than the one the connection was judged for (421).
	CodeMisdirected = "misdirected"
)

// Event is the one record of an egress decision. Its JSON form (the line
// AppendJSON writes, and MarshalJSON and UnmarshalJSON read and write) is
// versioned: log queries, the API and tests depend on its keys.
type Event struct {
	Time    time.Time // "time"
	Sandbox string
	Kind    Kind
	// Allow is what was decided, written as "decision": "allow" when the
	// policy admitted the destination, whatever then happened to its
	// lookup, the upstream or the request; "deny" when sandgate refused to
	// carry it (a rule, an address class, or one of the proxy's own checks:
	// not TLS, another server name, a module's refusal, a malformed
	// request, a limit).
	Allow bool
	// Code is the short code of the outcome: the refusal's (a netpolicy
	// code or a relay code) when denied; when allowed, the code of what
	// failed afterwards (relay.CodeDNSFailure, CodeUpstream, ...), or else
	// the allowing rule's (netpolicy.CodeAllowedHost, ...).
	Code string
	// Reason is the sentence for the decision: the rule that allowed, or
	// why it was refused. What failed after an allow is in Error.
	Reason string
	Host   string
	Port   int
	// PID and Cmd name the process in the sandbox that opened the
	// connection, as the sandbox's agent found it (see relay.Peer): its
	// pid in the sandbox and its command line, cut and with credentials
	// redacted (CommandLine). Cmd "" is unknown: written "unknown" (a
	// proxy reached without an agent, or a sandbox CLI that relays bytes).
	// What a sandbox says of itself: a process can rewrite its own
	// command line, so it attributes, it never decides.
	PID    int
	Cmd    string
	Method string
	// Path is the request path without its query string.
	Path string
	Rule string
	// Module is the WebAssembly transform module that answered, refused or
	// failed the request (see transforms/wasm); empty when none did.
	Module string
	// Addr is the address and port connected to (empty when nothing was).
	Addr       string
	Status     int
	BytesIn    int64         // from the sandbox
	BytesOut   int64         // to the sandbox
	Duration   time.Duration // "duration_ms"
	DNSTime    time.Duration // "dns_ms"
	Transforms []string
	// Notes are the audit notes modules attached to the request, each
	// "module: text", scrubbed of secrets like Error. NotesDropped counts
	// the notes over the caps (count and size), which were dropped.
	Notes        []string
	NotesDropped int
	Error        string
	// InterceptRule is the policy's intercept rule under which the proxy
	// terminated the connection's TLS (on the connection's event and on
	// each of its requests'), or, for a host a credential rule of the
	// sandbox targets, "credentials " and that rule ("credentials
	// rule[0] api.example.com"); empty when the bytes were tunnelled as
	// they were.
	InterceptRule string
}

// Decision renders Allow as the word used in logs and metrics: "allow" or
// "deny".
func (e Event) Decision() string {
	if e.Allow {
		return "allow"
	}
	return "deny"
}

// Severity is the event's Cloud Logging severity: INFO for an allow,
// WARNING for a deny.
func (e Event) Severity() string {
	if e.Allow {
		return "INFO"
	}
	return "WARNING"
}

// Sink receives events. Implementations must be safe for concurrent use and
// must not block for long: they run on the proxy's connection goroutines.
type Sink interface {
	Record(Event)
}

// Multi fans an event out to several sinks, skipping nil ones.
type Multi []Sink

// Record implements Sink.
func (m Multi) Record(e Event) {
	for _, s := range m {
		if s != nil {
			s.Record(e)
		}
	}
}

// Rings keeps the most recent events of each sandbox in memory: the sink
// of a proxy that keeps no durable audit (an embedding, a test). The
// service keeps its sandboxes' events in Journals. The zero value is not
// usable; use NewRings.
type Rings struct {
	size int
	mu   sync.Mutex
	by   map[string]*ring
}

type ring struct {
	buf  []Event
	next int
	full bool
}

// NewRings keeps up to perSandbox events for each sandbox (at least 1).
func NewRings(perSandbox int) *Rings {
	if perSandbox < 1 {
		perSandbox = 1
	}
	return &Rings{size: perSandbox, by: make(map[string]*ring)}
}

// Record implements Sink.
func (r *Rings) Record(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rg := r.by[e.Sandbox]
	if rg == nil {
		rg = &ring{buf: make([]Event, r.size)}
		r.by[e.Sandbox] = rg
	}
	rg.buf[rg.next] = e
	rg.next = (rg.next + 1) % len(rg.buf)
	if rg.next == 0 {
		rg.full = true
	}
}

// Events returns a sandbox's kept events, oldest first.
func (r *Rings) Events(sandbox string) []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	rg := r.by[sandbox]
	if rg == nil {
		return nil
	}
	if !rg.full {
		return append([]Event(nil), rg.buf[:rg.next]...)
	}
	out := make([]Event, 0, len(rg.buf))
	out = append(out, rg.buf[rg.next:]...)
	return append(out, rg.buf[:rg.next]...)
}

// Forget drops a sandbox's events.
func (r *Rings) Forget(sandbox string) {
	r.mu.Lock()
	delete(r.by, sandbox)
	r.mu.Unlock()
}

// JSONLines writes each event's line (AppendJSON) to a writer: the audit
// log. An event is written on the connection's goroutine after each routed
// request, so what it costs is paid per request: the line is encoded
// straight into a reused buffer, without allocating.
//
// Writes are group-committed: a Record that finds another one writing adds
// its line to the next write and waits; when a write ends, one of those
// waiting writes everything that accumulated meanwhile. Under load many
// lines go out in one write, and no Record writes for others more than
// once. Every Record returns once its own line has been written (an event
// is never only in memory when the request it describes has been
// answered). Lines are never interleaved or reordered. No goroutine is
// involved.
type JSONLines struct {
	mu      sync.Mutex
	done    sync.Cond // a write ended
	w       io.Writer
	pending []byte // encoded lines not written yet
	spare   []byte // the buffer being written, reused for pending
	writing bool
	queued  uint64 // lines appended to pending, ever
	written uint64 // lines whose write has returned, ever
}

// NewJSONLines returns a sink writing to w.
func NewJSONLines(w io.Writer) *JSONLines {
	j := &JSONLines{w: w}
	j.done.L = &j.mu
	return j
}

// jsonLinesKeep bounds the buffers kept between writes.
const jsonLinesKeep = 256 << 10

// Record implements Sink. A write error is dropped, as a logger drops it.
func (j *JSONLines) Record(e Event) {
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	j.mu.Lock()
	j.pending = AppendJSON(j.pending, &e)
	j.queued++
	j.waitLocked(j.queued)
	j.mu.Unlock()
}

// recordLine is Record of an encoded line: Journals encode a line once,
// for the store and the log.
func (j *JSONLines) recordLine(line []byte) {
	j.mu.Lock()
	j.pending = append(j.pending, line...)
	j.queued++
	j.waitLocked(j.queued)
	j.mu.Unlock()
}

func (j *JSONLines) waitLocked(mine uint64) {
	for j.written < mine {
		if j.writing {
			j.done.Wait()
			continue
		}
		// Write everything pending, this line among it.
		j.writing = true
		b, upTo := j.pending, j.queued
		j.pending = j.spare[:0]
		j.mu.Unlock()
		j.w.Write(b)
		j.mu.Lock()
		if cap(b) <= jsonLinesKeep {
			j.spare = b[:0]
		} else {
			j.spare = nil
		}
		j.written = upTo
		j.writing = false
		j.done.Broadcast()
	}
}
