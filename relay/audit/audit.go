// Package audit records egress decisions: one canonical event per CONNECT
// tunnel and captured connection (when it closes), per routed or
// intercepted request, and per lookup refused in a sandbox without
// capture, written as a JSON log
// line, kept in a bounded ring per sandbox, and counted in Prometheus
// metrics. An event never carries a header value, a query string or a body.
package audit

import (
	"context"
	"io"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
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

// Event is the one record of an egress decision. Field names are stable: log
// queries and tests depend on them.
type Event struct {
	Time    time.Time `json:"time"`
	Sandbox string    `json:"sandbox"`
	Kind    Kind      `json:"kind"`
	Host    string    `json:"host,omitempty"`
	Port    int       `json:"port,omitempty"`
	Method  string    `json:"method,omitempty"`
	// Path is the request path without its query string.
	Path string `json:"path,omitempty"`
	// Allow is what was decided, logged as "decision": true when the policy
	// admitted the destination, whatever then happened to its lookup, the
	// upstream or the request; false when sandgate refused to carry it (a
	// rule, an address class, or one of the proxy's own checks: not TLS,
	// another server name, a module's refusal, a malformed request, a
	// limit).
	Allow bool `json:"allow"`
	// Code is the short code of the outcome: the refusal's (a netpolicy
	// code or a relay code) when denied; when allowed, the code of what
	// failed afterwards (relay.CodeDNSFailure, CodeUpstream, ...), or else
	// the allowing rule's (netpolicy.CodeAllowedHost, ...).
	Code string `json:"code"`
	// Reason is the sentence for the decision: the rule that allowed, or
	// why it was refused. What failed after an allow is in Error.
	Reason string `json:"reason"`
	Rule   string `json:"rule,omitempty"`
	// Addr is the address connected to (or, when refused after a lookup,
	// empty).
	Addr       string        `json:"addr,omitempty"`
	Status     int           `json:"status,omitempty"`
	BytesIn    int64         `json:"bytes_in"`
	BytesOut   int64         `json:"bytes_out"`
	Duration   time.Duration `json:"duration_ns"`
	DNSTime    time.Duration `json:"dns_ns,omitempty"`
	Transforms []string      `json:"transforms,omitempty"`
	// Module is the WebAssembly transform module that answered, refused or
	// failed the request (see transforms/wasm); empty when none did.
	Module string `json:"module,omitempty"`
	// Notes are the audit notes modules attached to the request, each
	// "module: text", scrubbed of secrets like Error. NotesDropped counts
	// the notes over the caps (count and size), which were dropped.
	Notes        []string `json:"notes,omitempty"`
	NotesDropped int      `json:"notes_dropped,omitempty"`
	Error        string   `json:"error,omitempty"`
	// InterceptRule is the policy's intercept rule under which the proxy
	// terminated the connection's TLS (on the connection's event and on
	// each of its requests'); empty when the bytes were tunnelled as
	// they were.
	InterceptRule string `json:"intercept,omitempty"`
}

// Decision renders Allow as the word used in logs and metrics: "allow" or
// "deny".
func (e Event) Decision() string {
	if e.Allow {
		return "allow"
	}
	return "deny"
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

// Logger writes each event as one JSON line through slog (message "egress").
type Logger struct{ L *slog.Logger }

// Record implements Sink.
func (l Logger) Record(e Event) {
	level := slog.LevelInfo
	if !e.Allow {
		level = slog.LevelWarn
	}
	attrs := []slog.Attr{
		slog.String("sandbox", e.Sandbox),
		slog.String("kind", string(e.Kind)),
		slog.String("decision", e.Decision()),
		slog.String("code", e.Code),
		slog.String("reason", e.Reason),
		slog.String("host", e.Host),
		slog.Int("port", e.Port),
		slog.Int64("bytes_in", e.BytesIn),
		slog.Int64("bytes_out", e.BytesOut),
		slog.Float64("duration_ms", float64(e.Duration)/1e6),
	}
	add := func(a slog.Attr, ok bool) {
		if ok {
			attrs = append(attrs, a)
		}
	}
	add(slog.String("method", e.Method), e.Method != "")
	add(slog.String("path", e.Path), e.Path != "")
	add(slog.String("rule", e.Rule), e.Rule != "")
	add(slog.String("addr", e.Addr), e.Addr != "")
	add(slog.Int("status", e.Status), e.Status != 0)
	add(slog.Float64("dns_ms", float64(e.DNSTime)/1e6), e.DNSTime != 0)
	add(slog.Any("transforms", e.Transforms), len(e.Transforms) > 0)
	add(slog.String("module", e.Module), e.Module != "")
	add(slog.Any("notes", e.Notes), len(e.Notes) > 0)
	add(slog.Int("notes_dropped", e.NotesDropped), e.NotesDropped != 0)
	add(slog.String("error", e.Error), e.Error != "")
	add(slog.String("intercept", e.InterceptRule), e.InterceptRule != "")
	l.L.LogAttrs(context.Background(), level, "egress", attrs...)
}

// Rings keeps the most recent events of each sandbox in memory, for the API
// to serve. The zero value is not usable; use NewRings.
type Rings struct {
	size int
	mu   sync.Mutex
	by   map[string]*ring
	subs map[string]map[*Follower]struct{}
}

// Follower receives a sandbox's events as they are recorded (Rings.Follow).
type Follower struct {
	// C delivers the events. It is buffered; when a reader falls that far
	// behind, events are dropped and counted in Dropped rather than the
	// proxy waiting for it.
	C       chan Event
	dropped atomic.Int64
}

// Dropped counts the events C could not take.
func (f *Follower) Dropped() int64 { return f.dropped.Load() }

// followBuffer is how many events a Follower holds before dropping.
const followBuffer = 1024

// Follow returns a Follower of sandbox's events from now on, and a func
// that stops it.
func (r *Rings) Follow(sandbox string) (*Follower, func()) {
	f := &Follower{C: make(chan Event, followBuffer)}
	r.mu.Lock()
	if r.subs == nil {
		r.subs = map[string]map[*Follower]struct{}{}
	}
	if r.subs[sandbox] == nil {
		r.subs[sandbox] = map[*Follower]struct{}{}
	}
	r.subs[sandbox][f] = struct{}{}
	r.mu.Unlock()
	return f, func() {
		r.mu.Lock()
		delete(r.subs[sandbox], f)
		if len(r.subs[sandbox]) == 0 {
			delete(r.subs, sandbox)
		}
		r.mu.Unlock()
	}
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
	for f := range r.subs[e.Sandbox] {
		select {
		case f.C <- e:
		default:
			f.dropped.Add(1)
		}
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

// Forget drops a sandbox's events (when it is destroyed).
func (r *Rings) Forget(sandbox string) {
	r.mu.Lock()
	delete(r.by, sandbox)
	r.mu.Unlock()
}

// JSONLines writes each event as one JSON line to a writer: the line
// Logger writes through a cloudlog logger ("time", "severity", "message":
// "egress", then the event's keys, the optional ones only when set), but
// encoded straight into a reused buffer, without allocating. It is the
// proxy's audit log: an event is written on the connection's goroutine after
// each routed request, so what it costs is paid per request.
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
	defer j.mu.Unlock()
	j.pending = appendEvent(j.pending, &e)
	j.queued++
	mine := j.queued
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

// appendEvent appends e's line to b.
func appendEvent(b []byte, e *Event) []byte {
	b = append(b, `{"time":"`...)
	b = e.Time.AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","severity":"`...)
	if e.Allow {
		b = append(b, "INFO"...)
	} else {
		b = append(b, "WARNING"...)
	}
	b = append(b, `","message":"egress"`...)
	b = appendStr(b, "sandbox", e.Sandbox)
	b = appendStr(b, "kind", string(e.Kind))
	b = appendStr(b, "decision", e.Decision())
	b = appendStr(b, "code", e.Code)
	b = appendStr(b, "reason", e.Reason)
	b = appendStr(b, "host", e.Host)
	b = appendInt(b, "port", int64(e.Port))
	b = appendInt(b, "bytes_in", e.BytesIn)
	b = appendInt(b, "bytes_out", e.BytesOut)
	b = appendFloat(b, "duration_ms", float64(e.Duration)/1e6)
	if e.Method != "" {
		b = appendStr(b, "method", e.Method)
	}
	if e.Path != "" {
		b = appendStr(b, "path", e.Path)
	}
	if e.Rule != "" {
		b = appendStr(b, "rule", e.Rule)
	}
	if e.Addr != "" {
		b = appendStr(b, "addr", e.Addr)
	}
	if e.Status != 0 {
		b = appendInt(b, "status", int64(e.Status))
	}
	if e.DNSTime != 0 {
		b = appendFloat(b, "dns_ms", float64(e.DNSTime)/1e6)
	}
	if len(e.Transforms) > 0 {
		b = appendStrs(b, "transforms", e.Transforms)
	}
	if e.Module != "" {
		b = appendStr(b, "module", e.Module)
	}
	if len(e.Notes) > 0 {
		b = appendStrs(b, "notes", e.Notes)
	}
	if e.NotesDropped != 0 {
		b = appendInt(b, "notes_dropped", int64(e.NotesDropped))
	}
	if e.Error != "" {
		b = appendStr(b, "error", e.Error)
	}
	if e.InterceptRule != "" {
		b = appendStr(b, "intercept", e.InterceptRule)
	}
	return append(b, "}\n"...)
}

func appendKey(b []byte, k string) []byte {
	b = append(b, ',', '"')
	b = append(b, k...)
	return append(b, '"', ':')
}

func appendStr(b []byte, k, v string) []byte { return appendJSONString(appendKey(b, k), v) }

func appendInt(b []byte, k string, v int64) []byte { return strconv.AppendInt(appendKey(b, k), v, 10) }

func appendStrs(b []byte, k string, vs []string) []byte {
	b = append(appendKey(b, k), '[')
	for i, v := range vs {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, v)
	}
	return append(b, ']')
}

// appendFloat formats f as encoding/json does (and so as slog's JSON
// handler does).
func appendFloat(b []byte, k string, f float64) []byte {
	b = appendKey(b, k)
	if math.IsInf(f, 0) || math.IsNaN(f) {
		return append(b, `null`...)
	}
	format := byte('f')
	if abs := math.Abs(f); abs != 0 && (abs < 1e-6 || abs >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' { // e-09 → e-9, as encoding/json writes it
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b
}

// appendJSONString appends s as a JSON string, escaped as encoding/json
// escapes it without HTML escaping: quotes, backslashes, control
// characters, U+2028 and U+2029; invalid UTF-8 becomes U+FFFD.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
