package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"iter"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// AuditEvent is one egress decision of a sandbox: a CONNECT tunnel, a
// captured connection, a routed or intercepted request, a request refused
// before it had a destination, or a refused lookup;
// allowed or denied, why, and which command in the sandbox made it. It
// reads version 1 of the event's shape (the service's relay/audit, whose
// keys a test keeps these equal to; the client does not import it, nor
// the Prometheus it brings). JSON returns the event's bytes exactly as the
// service sent them: its audit log line, the same in the store, the API
// and `sandgate audit --json`.
type AuditEvent struct {
	V        int       `json:"v"` // the shape's version: 1
	Time     time.Time `json:"time"`
	Severity string    `json:"severity"` // INFO (allow) or WARNING (deny), as Cloud Logging reads it
	Message  string    `json:"message"`  // "egress"
	Sandbox  string    `json:"sandbox"`
	Kind     string    `json:"kind"`     // connect, route, refused, capture, intercept, dns
	Decision string    `json:"decision"` // allow or deny
	Code     string    `json:"code"`
	Reason   string    `json:"reason"`
	Host     string    `json:"host"`
	Port     int       `json:"port"`
	// Cmd is the command line of the process that made the connection,
	// cut and with credentials redacted, or "unknown"; PID its pid in the
	// sandbox (0 when unknown). What the sandbox says of itself: it
	// attributes, it proves nothing.
	Cmd        string   `json:"cmd"`
	PID        int      `json:"pid,omitempty"`
	Method     string   `json:"method,omitempty"`
	Path       string   `json:"path,omitempty"`
	Rule       string   `json:"rule,omitempty"`
	Module     string   `json:"module,omitempty"`
	Addr       string   `json:"addr,omitempty"`
	Status     int      `json:"status,omitempty"`
	BytesIn    int64    `json:"bytes_in"`
	BytesOut   int64    `json:"bytes_out"`
	DurationMS float64  `json:"duration_ms"`
	DNSMS      float64  `json:"dns_ms,omitempty"`
	Transforms []string `json:"transforms,omitempty"`
	Notes      []string `json:"notes,omitempty"`
	// NotesDropped counts the modules' notes over the service's caps.
	NotesDropped int    `json:"notes_dropped,omitempty"`
	Error        string `json:"error,omitempty"`
	// InterceptRule is the policy's intercept rule the connection's TLS
	// was terminated under; empty when its bytes were tunnelled as sent.
	InterceptRule string `json:"intercept,omitempty"`

	raw []byte
}

// Allow reports whether the decision was allow.
func (e AuditEvent) Allow() bool { return e.Decision == "allow" }

// JSON returns the event as the service sent it (nil for an event not
// read from the service).
func (e AuditEvent) JSON() []byte { return e.raw }

// UnmarshalJSON reads an event and keeps its bytes (JSON).
func (e *AuditEvent) UnmarshalJSON(b []byte) error {
	type plain AuditEvent
	var p plain
	if err := json.Unmarshal(b, &p); err != nil {
		return err
	}
	if p.V != 1 {
		return fmt.Errorf("an audit event of version %d: this client reads version 1; use a client of the service's release", p.V)
	}
	*e = AuditEvent(p)
	e.raw = bytes.Clone(b)
	return nil
}

// AuditQuery selects a sandbox's events. The zero value is all of them,
// from the first, a page of the service's default size (1000) at a time.
type AuditQuery struct {
	// Since (inclusive) and Until (exclusive) bound the events' times;
	// zero is unbounded.
	Since, Until time.Time
	// Decision is "allow", "deny", or "" for both.
	Decision string
	// Host is a destination host, "*.example.com" for its subdomains, or
	// "" for all.
	Host string
	// Cursor resumes after the event a page's Cursor names.
	Cursor string
	// Limit is the most events of a page (1 to 10000); 0 is the service's
	// default.
	Limit int
}

func (q AuditQuery) values() url.Values {
	v := url.Values{}
	if !q.Since.IsZero() {
		v.Set("since", q.Since.UTC().Format(time.RFC3339Nano))
	}
	if !q.Until.IsZero() {
		v.Set("until", q.Until.UTC().Format(time.RFC3339Nano))
	}
	for k, s := range map[string]string{"decision": q.Decision, "host": q.Host, "cursor": q.Cursor} {
		if s != "" {
			v.Set(k, s)
		}
	}
	if q.Limit != 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	return v
}

// AuditPage is one page of a sandbox's events, oldest first.
type AuditPage struct {
	Events []AuditEvent `json:"events"`
	// Cursor names the last event the page looked at: a query with it as
	// Cursor lists what comes after (now, or later: what came since).
	Cursor string `json:"cursor"`
	// More says the page was cut at its limit: ask again with Cursor.
	More bool `json:"more"`
}

// Audit returns a page of sandbox id's egress events that q selects,
// oldest first: running or suspended (the service keeps them with the
// sandbox, in its store, for its audit retention), those of every run of
// it. A sandbox neither running nor suspended is ErrSandboxNotFound.
func (c *Client) Audit(ctx context.Context, id string, q AuditQuery) (AuditPage, error) {
	if err := checkName("sandbox", id); err != nil {
		return AuditPage{}, err
	}
	var page AuditPage
	if _, err := c.doJSON(ctx, call{route: routeAudit, args: []string{id}, query: q.values(), idempotent: true}, &page); err != nil {
		return AuditPage{}, c.auditError(id, err)
	}
	return page, nil
}

// AuditAll yields every event of sandbox id that q selects, page after
// page, then ends.
func (c *Client) AuditAll(ctx context.Context, id string, q AuditQuery) iter.Seq2[AuditEvent, error] {
	return func(yield func(AuditEvent, error) bool) {
		for {
			p, err := c.Audit(ctx, id, q)
			if err != nil {
				yield(AuditEvent{}, err)
				return
			}
			for _, e := range p.Events {
				if !yield(e, nil) {
					return
				}
			}
			if !p.More {
				return
			}
			q.Cursor = p.Cursor
		}
	}
}

// FollowAudit yields sandbox id's egress events that q selects (q.Limit
// aside): every one so far, then each new one as it happens, across its
// suspends and resumes (while it is suspended the stream waits for it to
// run again), until ctx ends (then it stops without an error), the sandbox
// is destroyed, or the stream fails (yielded as the last error).
func (c *Client) FollowAudit(ctx context.Context, id string, q AuditQuery) iter.Seq2[AuditEvent, error] {
	return func(yield func(AuditEvent, error) bool) {
		if err := checkName("sandbox", id); err != nil {
			yield(AuditEvent{}, err)
			return
		}
		v := q.values()
		v.Del("limit")
		v.Set("follow", "1")
		resp, err := c.do(ctx, call{route: routeAudit, args: []string{id}, query: v})
		if err != nil {
			yield(AuditEvent{}, c.auditError(id, err))
			return
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			line := bytes.TrimSpace(sc.Bytes())
			if len(line) == 0 {
				continue // keepalive
			}
			var e AuditEvent
			if err := json.Unmarshal(line, &e); err != nil {
				yield(AuditEvent{}, fmt.Errorf("audit of %s: an event that is not one: %w", id, err))
				return
			}
			if !yield(e, nil) {
				return
			}
		}
		if err := sc.Err(); err != nil && ctx.Err() == nil {
			yield(AuditEvent{}, fmt.Errorf("audit of %s: %w", id, err))
		}
	}
}

func (c *Client) auditError(id string, err error) error {
	if statusOf(err) == http.StatusNotFound {
		return categorize(ErrSandboxNotFound, err, "sandbox %q is neither running nor suspended", id)
	}
	return err
}
