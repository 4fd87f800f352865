package service_test

import (
	"encoding/json"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/stacktest"
	"github.com/sandgate/sandgate/relay/audit"
)

// auditPage is the audit route's page, its events read.
type auditPage struct {
	Events []audit.Event
	Raw    []json.RawMessage
	Cursor string
	More   bool
}

func (r *rig) audit(name, query string) auditPage {
	r.t.Helper()
	out := r.must(200, "GET", "/v1/sandboxes/"+name+"/audit"+query, nil)
	var p struct {
		Events []json.RawMessage `json:"events"`
		Cursor string            `json:"cursor"`
		More   bool              `json:"more"`
	}
	if err := json.Unmarshal([]byte(out), &p); err != nil {
		r.t.Fatalf("audit page %s: %v", out, err)
	}
	page := auditPage{Raw: p.Events, Cursor: p.Cursor, More: p.More}
	for _, raw := range p.Events {
		var e audit.Event
		if err := json.Unmarshal(raw, &e); err != nil {
			r.t.Fatalf("audit event %s: %v", raw, err)
		}
		page.Events = append(page.Events, e)
	}
	return page
}

// auditN waits (bounded) for name's audit to list n events: a route's
// event is recorded once its answer is written, a tunnel's once it
// closes, so a command can end a moment before its event is there.
func (r *rig) auditN(name string, n int) auditPage {
	r.t.Helper()
	var p auditPage
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if p = r.audit(name, ""); len(p.Events) >= n {
			return p
		}
	}
	r.t.Fatalf("the audit of %s lists %d events after 20s, want %d: %s", name, len(p.Events), n, hosts(p.Events))
	return p
}

// hosts lists the events' decisions and hosts, "deny denied.example.com".
func hosts(evs []audit.Event) string {
	var s []string
	for _, e := range evs {
		s = append(s, e.Decision()+" "+e.Host)
	}
	return strings.Join(s, ", ")
}

// A sandbox's audit lasts: what a command was refused, and why, as curl
// shows it; the command named in each event; the events kept across a
// suspend and a resume, paged and filtered, from the store; and gone
// with the sandbox.
func TestAuditLasts(t *testing.T) {
	r := newRigOn(t, stacktest.Config{}, nil)
	r.create("box", nil)

	// A refused CONNECT, as curl -v shows it (the status line), and a
	// refused route, as curl shows it (the body).
	res := r.exec("box", "curl -sS -v -x $HTTPS_PROXY https://denied.example.com/ 2>&1; true", nil)
	if !strings.Contains(res.stdout, "< HTTP/1.1 403 Forbidden (sandgate: no allowedHosts rule matches denied.example.com)") {
		t.Errorf("a refused CONNECT, as curl -v shows it:\n%s", res.stdout)
	}
	res = r.exec("box", `curl -sS "$HTTPS_PROXY/https/denied.example.com/x?token=1"`, nil)
	if res.stdout != "sandgate: no allowedHosts rule matches denied.example.com (no_rule)\n" {
		t.Errorf("a refused route, as curl shows it: %q %q", res.stdout, res.stderr)
	}
	if res = r.exec("box", `curl -sS "$ANTHROPIC_BASE_URL/v1/messages"`, nil); !strings.Contains(res.stdout, "path=/v1/messages") {
		t.Fatalf("the allowed route: %q %q", res.stdout, res.stderr)
	}

	// Each event names the command that made it.
	first := r.auditN("box", 3)
	if got := hosts(first.Events); got != "deny denied.example.com, deny denied.example.com, allow api.example.com" {
		t.Fatalf("events: %s", got)
	}
	wantCmds := []string{"curl -sS -v -x http://127.0.0.1:", `curl -sS http://127.0.0.1:`, "curl -sS http://127.0.0.1:"}
	for i, e := range first.Events {
		if e.PID <= 0 || !strings.HasPrefix(e.Cmd, wantCmds[i]) {
			t.Errorf("event %d was made by %d %q, want curl's pid and command line", i, e.PID, e.Cmd)
		}
	}
	if p := first.Events[1].Path; p != "/x" {
		t.Errorf("the refused route's path is %q, without its query: /x", p)
	}

	// Suspended: every event goes to the store (written just after the
	// suspend), and none stays in memory.
	r.must(204, "POST", "/v1/sandboxes/box/suspend", nil)
	for deadline := time.Now().Add(time.Minute); r.stack.Audit.HeldBytes("box") != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a minute after its suspend the sandbox holds %d bytes of events", r.stack.Audit.HeldBytes("box"))
		}
	}
	if got := r.audit("box", ""); !rawEqual(got.Raw, first.Raw) {
		t.Errorf("after suspend: %s, want %s", hosts(got.Events), hosts(first.Events))
	}

	// Resumed: the next run's events follow the first run's.
	r.must(200, "POST", "/v1/sandboxes/box/resume", map[string]any{})
	r.exec("box", "curl -sS -x $HTTPS_PROXY https://again.example.com/ >/dev/null 2>&1; true", nil)
	all := r.auditN("box", 4)
	if !rawEqual(all.Raw[:3], first.Raw) || hosts(all.Events[3:]) != "deny again.example.com" {
		t.Errorf("after resume: %s", hosts(all.Events))
	}

	// Paged one at a time, the same events; filtered.
	var paged []json.RawMessage
	for q := "?limit=1"; ; {
		p := r.audit("box", q)
		paged = append(paged, p.Raw...)
		if !p.More {
			break
		}
		if len(paged) > 10 {
			t.Fatal("paging does not end")
		}
		q = "?limit=1&cursor=" + url.QueryEscape(p.Cursor)
	}
	if !rawEqual(paged, all.Raw) {
		t.Errorf("paged: %d events, want %d", len(paged), len(all.Raw))
	}
	if got := hosts(r.audit("box", "?decision=allow").Events); got != "allow api.example.com" {
		t.Errorf("allows: %s", got)
	}
	if got := hosts(r.audit("box", "?host=*.example.com&decision=deny&since="+url.QueryEscape(all.Events[3].Time.Format("2006-01-02T15:04:05.999999999Z07:00"))).Events); got != "deny again.example.com" {
		t.Errorf("denials since the resume: %s", got)
	}
	// What came since a cursor: nothing, then the new event.
	cursor := all.Cursor
	if p := r.audit("box", "?cursor="+url.QueryEscape(cursor)); len(p.Events) != 0 || p.Cursor != cursor {
		t.Errorf("since the last page: %s, cursor %q", hosts(p.Events), p.Cursor)
	}
	r.exec("box", "curl -sS -x $HTTPS_PROXY https://later.example.com/ >/dev/null 2>&1; true", nil)
	r.auditN("box", 5)
	if p := r.audit("box", "?cursor="+url.QueryEscape(cursor)); hosts(p.Events) != "deny later.example.com" {
		t.Errorf("since the last page, later: %s", hosts(p.Events))
	}

	// Gone with the sandbox, from the store too.
	r.must(204, "DELETE", "/v1/sandboxes/box", nil)
	r.must(404, "GET", "/v1/sandboxes/box/audit", nil)
	r.create("box", nil)
	if p := r.audit("box", ""); len(p.Events) != 0 {
		t.Errorf("a new sandbox of the old one's name has its events: %s", hosts(p.Events))
	}
	if err := stacktest.StoreObjects(r.stack.StoreDir, func(name string, _ []byte) {
		if strings.HasPrefix(name, "audit/") {
			t.Errorf("the destroyed sandbox's audit is still in the store: %s", name)
		}
	}); err != nil {
		t.Error(err)
	}
}

func rawEqual(a, b []json.RawMessage) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if string(a[i]) != string(b[i]) {
			return false
		}
	}
	return true
}
