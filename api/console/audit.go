package console

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
)

// eventView is one audit event as the console shows it (the page's rows
// and the stream's messages alike). The audit event itself never holds a
// header value, a query string or a body; neither does this.
type eventView struct {
	Key      string `json:"key"`  // tells a repeated event (a stream resumed) from a new one
	Time     string `json:"time"` // RFC 3339, UTC
	Clock    string `json:"clock"`
	Decision string `json:"decision"`
	Kind     string `json:"kind"`
	Code     string `json:"code"`
	Reason   string `json:"reason"`
	Fix      string `json:"fix,omitempty"` // what would make a refusal pass, and who can
	Host     string `json:"host"`
	Port     int    `json:"port"`
	Cmd      string `json:"cmd"`
	PID      int    `json:"pid,omitempty"`
	Method   string `json:"method,omitempty"`
	Path     string `json:"path,omitempty"`
	Status   int    `json:"status,omitempty"`
	Module   string `json:"module,omitempty"`
	Error    string `json:"error,omitempty"`
	BytesIn  int64  `json:"bytesIn"`
	BytesOut int64  `json:"bytesOut"`
	Bytes    string `json:"bytes"`
}

// view reads an audit line into what the console shows; ok is false for
// a line that is not an event this sandgate reads.
func view(line []byte, sandbox string) (eventView, audit.Event, bool) {
	var e audit.Event
	if err := json.Unmarshal(line, &e); err != nil {
		return eventView{}, e, false
	}
	sum := sha256.Sum256(line)
	v := eventView{
		Key: hex.EncodeToString(sum[:8]), Time: e.Time.UTC().Format(time.RFC3339Nano), Clock: e.Time.UTC().Format("Jan 2 15:04:05"),
		Decision: e.Decision(), Kind: string(e.Kind), Code: e.Code, Reason: e.Reason, Host: e.Host, Port: e.Port,
		Cmd: e.Cmd, PID: e.PID, Method: e.Method, Path: e.Path, Status: e.Status, Module: e.Module, Error: e.Error,
		BytesIn: e.BytesIn, BytesOut: e.BytesOut, Bytes: humanBytes(e.BytesIn) + " ↑ " + humanBytes(e.BytesOut) + " ↓",
	}
	if v.Cmd == "" {
		v.Cmd = audit.Unknown
	}
	if !e.Allow {
		v.Fix = fixFor(e, sandbox)
	}
	return v, e, true
}

// fixFor says what would let a refused request through, and who can do
// it: the operator, through the sandbox's policy (`sandgate policy set`,
// PUT /v1/sandboxes/{name}/network) or the service's settings.
func fixFor(e audit.Event, name string) string {
	host := e.Host
	if host == "" {
		host = "the host"
	}
	policySet := fmt.Sprintf("sandgate policy set %s --allow %s", name, host)
	switch e.Code {
	case string(netpolicy.CodeNoRule):
		return fmt.Sprintf("Allow it: the operator adds %s to this sandbox's allowed hosts (%s, or PUT /v1/sandboxes/%s/network), or to every sandbox's (SANDBOX_ALLOWED_HOSTS).", host, policySet, name)
	case string(netpolicy.CodeDenyAll):
		return fmt.Sprintf("This sandbox's policy is deny-all: the operator gives it a custom policy that allows %s (%s).", host, policySet)
	case string(netpolicy.CodePort):
		return "Only HTTPS on port 443 leaves a sandbox: use https:// on 443, or a base URL for a service on another port (SANDBOX_BASE_URLS, or the sandbox's baseUrls)."
	case string(netpolicy.CodeInvalidHost):
		return "The name is not a valid host name: check the URL the tool was given."
	case string(netpolicy.CodeLocalName):
		return "Names of the local network (localhost, single labels, .local, .internal) are never reached from a sandbox: use the service's public name."
	case string(netpolicy.CodeAddressClass):
		return fmt.Sprintf("%s resolves to a private, loopback, link-local or metadata address, which sandboxes never reach; where that network is meant, the operator exempts its range (SANDBOX_ALLOW_PRIVATE).", host)
	case string(netpolicy.CodeDeniedCIDR):
		return "The address is in one of the policy's denied CIDRs, which win over every allow: the operator removes that range from the sandbox's policy."
	case relay.CodePlainHTTP: // netpolicy.CodePlainHTTP too
		return "Plain http:// is never carried: use https:// (through the proxy), or the base-URL route http://127.0.0.1:3128/https/HOST/PATH."
	case relay.CodeNotTLS, relay.CodeSNIMismatch:
		return "A tunnel carries only TLS to the name it was opened for: the client sent something else through CONNECT; use https:// to the same host."
	case relay.CodeNoRoute:
		return "Base-URL routes look like /https/HOST/PATH: fix the base URL the tool was given."
	case relay.CodeBadRequest, relay.CodeSmuggling:
		return "The request was malformed (see the reason): fix or update the client."
	case relay.CodeLimit:
		return "A limit of the proxy was reached (see the reason): retry later, or send less at once."
	case relay.CodeModuleRefused:
		return fmt.Sprintf("The WebAssembly module %s refused it (its reason is above): the operator changes the module or its configuration (sandgate modules set %s).", orUnknown(e.Module), name)
	case relay.CodeModule:
		return fmt.Sprintf("The WebAssembly module %s failed: the operator fixes or removes it (sandgate modules set %s).", orUnknown(e.Module), name)
	case relay.CodeNoCA:
		return "The policy intercepts this host but the service has no interception CA: the operator turns it on (SANDGATE_INTERCEPT_CA), or removes the host from the policy's intercept list."
	case relay.CodeUpgrade:
		return "A credential rule targets this host, so switching protocols (WebSocket) with it is refused: use plain HTTPS requests, or the operator removes the rule."
	case audit.CodeDirectLookup:
		return "The process looked the name up itself instead of using the proxy: use HTTPS_PROXY (every command has it), or the operator turns capture on (SANDGATE_CAPTURE=true)."
	case audit.CodeInterceptRefused:
		return fmt.Sprintf("The client does not trust the sandbox CA (it pins certificates, or reads another bundle): point it at SSL_CERT_FILE / NODE_EXTRA_CA_CERTS, or the operator removes %s from the policy's intercept list.", host)
	case audit.CodeInterceptTLS:
		return "The TLS handshake of an intercepted connection failed: update the client, or the operator removes the host from the policy's intercept list."
	case audit.CodeMisdirected:
		return "The connection was opened for another host: open one connection per host."
	}
	return fmt.Sprintf("See the reason. The sandbox's network policy decides what it may reach; the operator changes it (sandgate inspect %s shows it).", name)
}

func orUnknown(s string) string {
	if s == "" {
		return "(unnamed)"
	}
	return s
}

// eventFilter is what the audit view selects: decision and host are the
// audit's own query; code and command are matched here.
type eventFilter struct {
	Decision, Host, Code, Cmd string
}

var codePattern = regexp.MustCompile(`^[a-z0-9_]{0,64}$`)

// readFilter reads the filter of a page or a stream, naming a bad value.
func readFilter(v url.Values) (eventFilter, error) {
	f := eventFilter{Decision: v.Get("decision"), Host: strings.TrimSpace(v.Get("host")), Code: strings.TrimSpace(v.Get("code")), Cmd: strings.TrimSpace(v.Get("cmd"))}
	if f.Decision != "" && f.Decision != "allow" && f.Decision != "deny" {
		return f, errorf(http.StatusBadRequest, "decision %q: want allow, deny or nothing", audit.Truncate(f.Decision, 20))
	}
	if err := (audit.Query{Host: f.Host}).Check(); err != nil {
		return f, errorf(http.StatusBadRequest, "host filter: %v", err)
	}
	if !codePattern.MatchString(f.Code) {
		return f, errorf(http.StatusBadRequest, "code %q: want a code such as no_rule or address_class", audit.Truncate(f.Code, 40))
	}
	if len(f.Cmd) > 200 {
		return f, errorf(http.StatusBadRequest, "command filter: at most 200 characters")
	}
	return f, nil
}

// nameAndFilter reads the sandbox a page or stream is of, and its filter.
func nameAndFilter(r *http.Request) (string, eventFilter, error) {
	name := r.PathValue("name")
	if err := checkName(name); err != nil {
		return "", eventFilter{}, err
	}
	f, err := readFilter(r.URL.Query())
	return name, f, err
}

func (f eventFilter) query() audit.Query { return audit.Query{Decision: f.Decision, Host: f.Host} }

// match is the part of the filter the audit query does not do.
func (f eventFilter) match(e audit.Event) bool {
	if f.Code != "" && e.Code != f.Code {
		return false
	}
	if f.Cmd != "" && !strings.Contains(strings.ToLower(e.Cmd), strings.ToLower(f.Cmd)) {
		return false
	}
	return true
}

// Values is the filter as a query string's values (links, the stream).
func (f eventFilter) Values() url.Values {
	v := url.Values{}
	for k, s := range map[string]string{"decision": f.Decision, "host": f.Host, "code": f.Code, "cmd": f.Cmd} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

// Bounds of the audit shown on a sandbox's page.
const (
	recentEvents = 100            // rows rendered with the page
	recentWindow = 24 * time.Hour // from how far back
)

// recent is what a sandbox's page shows of its audit before the stream
// goes on: the last recentEvents that f selects in the last recentWindow,
// newest first, reading at most max events; and the position the stream
// goes on from. capped says the read stopped at max.
func (c *Console) recent(ctx context.Context, name string, f eventFilter, max int) (rows []eventView, cursor audit.Pos, capped bool, err error) {
	q := f.query()
	q.Since, q.Limit = c.cfg.Now().Add(-recentWindow), audit.MaxLimit
	read := 0
	for {
		p, err := c.b.AuditEvents(ctx, name, q)
		if err != nil {
			return nil, cursor, false, err
		}
		for _, l := range p.Lines {
			read++
			v, e, ok := view(l, name)
			if !ok || !f.match(e) {
				continue
			}
			rows = append(rows, v)
			if len(rows) > 2*recentEvents {
				rows = append(rows[:0], rows[len(rows)-recentEvents:]...)
			}
		}
		cursor, q.After = p.Next, p.Next
		if !p.More {
			break
		}
		if read >= max {
			capped = true
			break
		}
	}
	if len(rows) > recentEvents {
		rows = rows[len(rows)-recentEvents:]
	}
	for i, j := 0, len(rows)-1; i < j; i, j = i+1, j-1 {
		rows[i], rows[j] = rows[j], rows[i]
	}
	return rows, cursor, capped, nil
}

// events streams a sandbox's audit to its page as server-sent events:
// each event the filter selects from the cursor on ("audit", its view as
// JSON), a comment now and then while nothing happens, and "end" with why
// when the stream ends (the sandbox destroyed, the service stopping).
// A browser that reconnects (Last-Event-ID: the last event's time) gets
// what came from that time on; the page drops what it already has.
func (c *Console) events(w http.ResponseWriter, r *http.Request) error {
	if r.Method == http.MethodHead {
		w.Header().Set("Allow", "GET")
		return errorf(http.StatusMethodNotAllowed, "HEAD is not served on a stream: use GET")
	}
	name, f, err := nameAndFilter(r)
	if err != nil {
		return err
	}
	q := f.query()
	if q.After, err = audit.ParseCursor(r.URL.Query().Get("cursor")); err != nil {
		return errorf(http.StatusBadRequest, "cursor: %v", err)
	}
	if last := r.Header.Get("Last-Event-ID"); last != "" {
		if t, err := time.Parse(time.RFC3339Nano, last); err == nil {
			q.After, q.Since = audit.Pos{}, t
		}
	}
	if q.After.IsZero() && q.Since.IsZero() {
		q.Since = c.cfg.Now().Add(-recentWindow)
	}
	rc := http.NewResponseController(w)
	started := false
	var buf []byte
	err = c.b.FollowAudit(r.Context(), name, q, func(line []byte) error {
		if !started {
			started = true
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("X-Accel-Buffering", "no")
			w.WriteHeader(http.StatusOK)
			if _, err := w.Write([]byte("retry: 3000\n\n")); err != nil {
				return err
			}
		}
		buf = buf[:0]
		if line == nil {
			buf = append(buf, ": keep-alive\n\n"...)
		} else {
			v, e, ok := view(line, name)
			if !ok || !f.match(e) {
				return nil
			}
			js, _ := json.Marshal(v)
			buf = fmt.Appendf(buf, "id: %s\nevent: audit\ndata: %s\n\n", v.Time, js)
		}
		if _, err := w.Write(buf); err != nil {
			return err
		}
		return rc.Flush()
	})
	if !started {
		return err
	}
	if r.Context().Err() != nil {
		return nil // the page went away
	}
	why := "the stream ended: reload the page to follow again"
	switch {
	case err != nil:
		why = "the stream failed (" + err.Error() + "): reload the page to follow again"
	default:
		if _, gerr := c.b.Get(r.Context(), name); errors.Is(gerr, appliance.ErrNotFound) {
			why = "the sandbox was destroyed"
		}
	}
	js, _ := json.Marshal(map[string]string{"reason": why})
	fmt.Fprintf(w, "event: end\ndata: %s\n\n", js)
	rc.Flush()
	return nil
}
