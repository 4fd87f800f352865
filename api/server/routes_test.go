package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/relay/audit"
)

// These tests run every route against an in-memory backend (fakeBackend):
// no root, no sandbox. They check what the HTTP layer owns — parsing,
// statuses, bodies, headers, frames, the order of checks — and that it
// hands the backend what the request said. What the backend does is
// tested against the real stack (rig_test.go, appliance, e2e).

type routeRig struct {
	t  *testing.T
	b  *fakeBackend
	hs *httptest.Server
}

func newRouteRig(t *testing.T) *routeRig {
	t.Helper()
	b := newFakeBackend()
	s, err := New(Config{Backend: b, Token: "tok", Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return &routeRig{t: t, b: b, hs: hs}
}

func (r *routeRig) do(method, path string, body any) (int, string, http.Header) {
	r.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		js, _ := json.Marshal(b)
		rd = bytes.NewReader(js)
	}
	req, _ := http.NewRequest(method, r.hs.URL+path, rd)
	req.Header.Set(api.HeaderProtocol, "1")
	req.Header.Set(api.HeaderToken, "tok")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		r.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out), resp.Header
}

func TestRoutesLifecycle(t *testing.T) {
	r := newRouteRig(t)
	steps := []struct {
		method, path string
		body         any
		want         int
		contains     string
	}{
		{"POST", "/v1/sandboxes", map[string]any{"name": "Bad_Name"}, 400, "invalid sandbox name"},
		{"POST", "/v1/sandboxes", map[string]any{"name": "b", "allowedHosts": "x"}, 400, "allowedHosts"},
		{"POST", "/v1/sandboxes", map[string]any{"name": "b", "template": "Bad_T"}, 400, "invalid template name"},
		{"POST", "/v1/sandboxes", map[string]any{"name": "b", "template": "missing"}, 404, "no such template"},
		{"POST", "/v1/sandboxes", `[1]`, 400, ""},
		{"POST", "/v1/sandboxes", map[string]any{"name": "b", "allowedHosts": []string{"localhost"}, "baseUrls": map[string]string{"M": "http://127.0.0.1:9/api"}}, 201, `"workingDirectory":"/workspace"`},
		{"POST", "/v1/sandboxes", map[string]any{"name": "b"}, 409, ""},
		{"GET", "/v1/sandboxes/b", nil, 200, `"state":"running"`},
		{"GET", "/v1/sandboxes", nil, 200, `"name":"b"`},
		{"PUT", "/v1/sandboxes/b/network", map[string]any{"allowedHosts": []string{"a.example"}}, 204, ""},
		{"PUT", "/v1/sandboxes/b/network", map[string]any{"policy": map[string]any{"mode": "sideways"}}, 400, "policy"},
		{"PUT", "/v1/sandboxes/none/network", map[string]any{}, 404, ""},
		{"POST", "/v1/sandboxes/b/transformations", map[string]any{"transformations": "x"}, 400, "transformations"},
		{"POST", "/v1/sandboxes/b/transformations", map[string]any{"transformations": []any{}}, 204, ""},
		{"PUT", "/v1/sandboxes/none/transformations", map[string]any{"transformations": []any{}}, 404, ""},
		{"POST", "/v1/sandboxes/b/template", map[string]any{}, 400, "id"},
		{"POST", "/v1/sandboxes/b/template", map[string]any{"id": "tpl"}, 204, ""},
		{"GET", "/v1/templates/tpl", nil, 200, `"id":"tpl"`},
		{"GET", "/v1/templates/other", nil, 404, ""},
		{"GET", "/v1/templates", nil, 200, `"id":"tpl"`},
		{"POST", "/v1/sandboxes/b/fork", map[string]any{"name": "c"}, 201, `"state":"running"`},
		{"POST", "/v1/sandboxes/b/fork", map[string]any{"name": "c"}, 409, ""},
		{"POST", "/v1/sandboxes/b/suspend", nil, 204, ""},
		{"POST", "/v1/sandboxes/b/suspend", nil, 204, ""}, // idempotent
		{"POST", "/v1/sandboxes/Bad_Name/suspend", nil, 204, ""},
		{"GET", "/v1/sandboxes/b", nil, 200, `"state":"suspended"`},
		{"PUT", "/v1/sandboxes/b/network", map[string]any{}, 404, "not running"},
		{"POST", "/v1/sandboxes/none/resume", map[string]any{}, 404, ""},
		{"POST", "/v1/sandboxes/b/resume", map[string]any{"allowedHosts": []string{"*"}}, 200, `"name":"b"`},
		{"DELETE", "/v1/templates/tpl", nil, 204, ""},
		{"DELETE", "/v1/sandboxes/b", nil, 204, ""},
		{"DELETE", "/v1/sandboxes/b", nil, 204, ""}, // idempotent
		{"DELETE", "/v1/sandboxes/Bad_Name", nil, 400, ""},
		{"GET", "/v1/sandboxes/b", nil, 404, ""},
		{"PATCH", "/v1/sandboxes/c", nil, 405, "not allowed"},
		{"GET", "/v1/nothing", nil, 404, "no route"},
	}
	for _, s := range steps {
		code, body, h := r.do(s.method, s.path, s.body)
		if code != s.want || !strings.Contains(body, s.contains) {
			t.Errorf("%s %s: %d %s; want %d containing %q", s.method, s.path, code, body, s.want, s.contains)
		}
		if code >= 400 && (!strings.HasPrefix(body, `{"error":`) || h.Get("Content-Type") != "application/json") {
			t.Errorf("%s %s: error body %q (%s); want {\"error\": ...} as JSON", s.method, s.path, body, h.Get("Content-Type"))
		}
		if code == 204 && (body != "" || h.Get("Content-Type") != "") {
			t.Errorf("%s %s: 204 with a body or a content type", s.method, s.path)
		}
	}
	// What the create asked for reached the backend as it was said.
	if b := r.b.boxes["c"]; b == nil || b.spec.BaseURLs["M"] != "http://127.0.0.1:9/api" || b.spec.AllowedHosts[0] != "a.example" {
		t.Errorf("the fork's network as the backend has it: %+v", b)
	}
}

func TestRoutesExec(t *testing.T) {
	r := newRouteRig(t)
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "b"})
	r.b.run = func(_ *fakeBox, req appliance.ExecRequest, p *appliance.Process) int {
		in, _ := io.ReadAll(req.Stdin)
		fmt.Fprintf(p.Output(appliance.Stdout), "%s|%s|%s", req.Args[2], req.Dir, in)
		fmt.Fprint(p.Output(appliance.Stderr), "e")
		return 3
	}
	code, body, h := r.do("POST", "/v1/sandboxes/b/exec", `{"command":"echo hi","env":{"A":"1"}}`+"\nstdin!")
	if code != 200 || h.Get(api.HeaderProcessID) == "" || h.Get("Content-Type") != "application/octet-stream" {
		t.Fatalf("exec: %d %q %v", code, body, h)
	}
	res, err := api.ReadExec(strings.NewReader(body))
	if err != nil || res.PID != h.Get(api.HeaderProcessID) || string(res.Stdout) != "echo hi|/workspace|stdin!" || string(res.Stderr) != "e" || !res.Exited || res.ExitCode != 3 {
		t.Errorf("exec frames: %+v %v", res, err)
	}
	if got := r.b.boxes["b"].execs[0]; strings.Join(got.Env, ",") != "A=1" || got.Args[0] != "/bin/sh" || !got.MissingDirFails {
		t.Errorf("the backend was asked %+v", got)
	}
	pid := res.PID
	if code, body, _ := r.do("GET", "/v1/sandboxes/b/processes/"+pid, nil); code != 200 || body != `{"exitCode":3}`+"\n" {
		t.Errorf("wait: %d %q", code, body)
	}
	if code, _, _ := r.do("GET", "/v1/sandboxes/b/processes/"+pid+"/output?offset=5", nil); code != 200 {
		t.Errorf("output from 5: %d", code)
	}
	for _, c := range []struct {
		path, body string
		want       int
	}{
		{"/v1/sandboxes/b/exec", `{"command":"x"}`, 400},                         // no newline
		{"/v1/sandboxes/b/exec", "[1]\n", 400},                                   // not an object
		{"/v1/sandboxes/b/exec", `{"command":1}` + "\n", 400},                    // not a string
		{"/v1/sandboxes/b/exec", `{"command":"x","env":{"1A":"x"}}` + "\n", 400}, // a bad name
		{"/v1/sandboxes/b/exec", strings.Repeat(" ", api.MaxJSONBody+1) + "\n", 413},
		{"/v1/sandboxes/none/exec", `{"command":"x"}` + "\n", 404},
	} {
		if code, body, _ := r.do("POST", c.path, c.body); code != c.want {
			t.Errorf("POST %s %.40q: %d %s; want %d", c.path, c.body, code, body, c.want)
		}
	}
	for _, c := range []struct {
		method, path string
		want         int
	}{
		{"GET", "/v1/sandboxes/b/processes/nope", 404},
		{"DELETE", "/v1/sandboxes/b/processes/nope", 404},
		{"DELETE", "/v1/sandboxes/b/processes/" + pid, 204},
		{"DELETE", "/v1/sandboxes/b/processes", 204},
		{"DELETE", "/v1/sandboxes/none/processes", 404},
		{"GET", "/v1/sandboxes/b/processes/" + pid + "/output?offset=x", 400},
		{"GET", "/v1/sandboxes/b/processes/" + pid + "/output?offset=999", 400},
	} {
		if code, body, _ := r.do(c.method, c.path, nil); code != c.want {
			t.Errorf("%s %s: %d %s; want %d", c.method, c.path, code, body, c.want)
		}
	}
}

func TestRoutesFilesPortsAuditModules(t *testing.T) {
	r := newRouteRig(t)
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "b"})
	if code, body, _ := r.do("PUT", "/v1/sandboxes/b/files/workspace/a.txt", "content"); code != 204 {
		t.Fatalf("PUT file: %d %s", code, body)
	}
	if code, body, h := r.do("GET", "/v1/sandboxes/b/files/workspace/a.txt", nil); code != 200 || body != "content" || h.Get("Content-Length") != "7" {
		t.Errorf("GET file: %d %q %v", code, body, h)
	}
	for _, c := range []struct {
		method, path string
		want         int
	}{
		{"GET", "/v1/sandboxes/b/files/workspace/none", 404},
		{"GET", "/v1/sandboxes/none/files/x", 404},
		{"GET", "/v1/sandboxes/b/audit", 200},
		{"GET", "/v1/sandboxes/none/audit", 404},
		{"GET", "/v1/sandboxes/b/workspace", 200},
		{"GET", "/v1/sandboxes/none/workspace", 404},
		{"GET", "/v1/sandboxes/b/tcp/0", 400},
		{"GET", "/v1/sandboxes/b/tcp/80", 426},
	} {
		if code, body, _ := r.do(c.method, c.path, nil); code != c.want {
			t.Errorf("%s %s: %d %s; want %d", c.method, c.path, code, body, c.want)
		}
	}
	mod := map[string]any{"modules": []any{map[string]string{"name": "m", "wasm": "AGFzbQ==", "config": "c"}}}
	if code, body, _ := r.do("PUT", "/v1/sandboxes/b/modules", mod); code != 204 {
		t.Errorf("PUT modules: %d %s", code, body)
	}
	if _, body, _ := r.do("GET", "/v1/sandboxes/b", nil); !strings.Contains(body, `"modules":[{"name":"m"`) {
		t.Errorf("the description lists no module: %s", body)
	}
	if code, _, _ := r.do("PUT", "/v1/sandboxes/b/modules", map[string]any{"modules": []any{map[string]string{"name": "m", "wasm": "!"}}}); code != 400 {
		t.Errorf("a module that is not base64: %d", code)
	}

	// The port tunnel: a listener on the host stands in for the sandbox's.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		head := make([]byte, 4096)
		n, _ := c.Read(head)
		fmt.Fprintf(c, "HTTP/1.1 101 Switching Protocols\r\nX-Seen: %q\r\n\r\n", strings.SplitN(string(head[:n]), "\r\n", 2)[0])
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	conn, err := net.Dial("tcp", r.hs.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /v1/sandboxes/b/ports/%d/sub?q=1 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nX-Ai-Sdk-Sandbox-Token: tok\r\n\r\n", port)
	buf := make([]byte, 4096)
	n, _ := io.ReadAtLeast(conn, buf, 20)
	if got := string(buf[:n]); !strings.Contains(got, "101") || !strings.Contains(got, `GET /sub?q=1 HTTP/1.1`) {
		t.Errorf("the tunnel: %q", got)
	}
}

// The audit route reads its query (each bad value named, 400), passes it
// to the backend, and answers a page whose events are their lines' bytes.
func TestRoutesAuditQuery(t *testing.T) {
	r := newRouteRig(t)
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "b"})
	at := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	var lines []string
	for i, h := range []string{"a.example.com", "evil.example.com", "a.example.com"} {
		e := audit.Event{Time: at.Add(time.Duration(i) * time.Hour), Sandbox: "b", Kind: audit.Connect, Host: h, Port: 443, Allow: i != 1}
		r.b.record("b", e)
		lines = append(lines, strings.TrimSuffix(string(audit.AppendJSON(nil, &e)), "\n"))
	}
	for _, c := range []struct {
		query string
		want  int
		has   string
	}{
		{"", 200, `{"events":[` + strings.Join(lines, ",") + `],"cursor":"` + fakeSegment + `/2","more":false}`},
		{"?decision=deny", 200, `{"events":[` + lines[1] + `]`},
		{"?host=a.example.com&limit=1", 200, `{"events":[` + lines[0] + `],"cursor":"` + fakeSegment + `/0","more":true}`},
		{"?cursor=" + fakeSegment + "/0&host=a.example.com", 200, `{"events":[` + lines[2] + `]`},
		{"?since=2025-06-01T12:30:00Z&until=2025-06-01T13:30:00Z", 200, `{"events":[` + lines[1] + `]`},
		{"?since=yesterday", 400, "since"},
		{"?until=2025-06-01", 400, "until"},
		{"?decision=maybe", 400, "decision"},
		{"?limit=0", 400, "limit"},
		{"?limit=100001", 400, "limit"},
		{"?cursor=nope", 400, "cursor"},
		{"?host=a%20b", 400, "host"},
		{"?since=2025-06-02T00:00:00Z&until=2025-06-01T00:00:00Z", 400, "until"},
	} {
		code, body, _ := r.do("GET", "/v1/sandboxes/b/audit"+c.query, nil)
		if code != c.want || !strings.Contains(body, c.has) {
			t.Errorf("%s: %d %s; want %d with %s", c.query, code, body, c.want, c.has)
		}
	}
}

// A sandbox the service suspended on its own is woken by the routes that
// need it running; one its caller suspended is protocol 1's 404 until
// resumed; describing, the audit and kill-all never wake one.
func TestRoutesWakeWhatTheServiceSuspended(t *testing.T) {
	r := newRouteRig(t)
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "idle", "allowedHosts": []string{"api.example.com"}})
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "asked"})
	suspend := func(name string, why appliance.SuspendReason) {
		r.b.mu.Lock()
		b := r.b.boxes[name]
		b.state, b.procs, b.suspendedBy = appliance.Suspended, nil, why
		r.b.mu.Unlock()
	}
	state := func(name string) appliance.State {
		r.b.mu.Lock()
		defer r.b.mu.Unlock()
		return r.b.boxes[name].state
	}
	suspend("idle", appliance.SuspendedIdle)
	suspend("asked", appliance.SuspendedByCaller)

	// Never woken: describing, the audit, kill-all (204: its processes
	// ended with the suspend), waiting on a process.
	if code, out, _ := r.do("GET", "/v1/sandboxes/idle", nil); code != 200 || !strings.Contains(out, `"suspendedBy":"idle"`) {
		t.Errorf("describing an idle-suspended sandbox: %d %s", code, out)
	}
	if code, out, _ := r.do("DELETE", "/v1/sandboxes/idle/processes", nil); code != 204 {
		t.Errorf("kill all of an idle-suspended sandbox: %d %s, want 204", code, out)
	}
	if code, _, _ := r.do("DELETE", "/v1/sandboxes/asked/processes", nil); code != 404 {
		t.Errorf("kill all of a sandbox its caller suspended: %d, want 404 (not running)", code)
	}
	r.do("GET", "/v1/sandboxes/idle/audit", nil)
	if state("idle") != appliance.Suspended {
		t.Fatal("describing, the audit or kill-all woke the sandbox")
	}

	// Exec wakes the idle one, with the network it had.
	code, out, _ := r.do("POST", "/v1/sandboxes/idle/exec", "{\"command\":\"echo hi\"}\n")
	if code != 200 || state("idle") != appliance.Running {
		t.Fatalf("exec on an idle-suspended sandbox: %d %q, state %s; want it woken and run", code, out, state("idle"))
	}
	if got := r.b.boxes["idle"].spec.AllowedHosts; len(got) != 1 || got[0] != "api.example.com" {
		t.Errorf("woken with allowed hosts %q, want its own", got)
	}
	// The one its caller suspended stays suspended: 404 before the body
	// is read, as protocol 1 says, on every route that would wake.
	for _, rt := range []struct{ method, path, body string }{
		{"POST", "/v1/sandboxes/asked/exec", "{\"command\":\"true\"}\n"},
		{"PUT", "/v1/sandboxes/asked/files/workspace/x", "data"},
		{"GET", "/v1/sandboxes/asked/files/workspace/x", ""},
		{"PUT", "/v1/sandboxes/asked/network", `{"allowedHosts":[]}`},
		{"POST", "/v1/sandboxes/asked/transformations", `{"transformations":[]}`},
		{"GET", "/v1/sandboxes/asked/workspace", ""},
	} {
		var body any
		if rt.body != "" {
			body = rt.body
		}
		if code, out, _ := r.do(rt.method, rt.path, body); code != 404 || !strings.Contains(out, "is suspended (resume it)") {
			t.Errorf("%s %s on a sandbox its caller suspended: %d %s, want 404 saying to resume it", rt.method, rt.path, code, out)
		}
	}
	if state("asked") != appliance.Suspended {
		t.Error("a sandbox its caller suspended was woken")
	}
}

// Resume with sandgate's keepNetwork keeps the sandbox's network; with a
// network beside it, it is a 400; protocol 1's resume without one gives
// the service's network alone, as before.
func TestRoutesResumeKeepNetwork(t *testing.T) {
	r := newRouteRig(t)
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "b", "allowedHosts": []string{"api.example.com"}})
	r.do("POST", "/v1/sandboxes/b/suspend", nil)
	for _, body := range []map[string]any{
		{"keepNetwork": true, "allowedHosts": []string{}},
		{"keepNetwork": true, "policy": map[string]any{"mode": "deny-all"}},
		{"keepNetwork": true, "baseUrls": map[string]string{}},
		{"keepNetwork": "yes"},
	} {
		if code, out, _ := r.do("POST", "/v1/sandboxes/b/resume", body); code != 400 {
			t.Errorf("resume %v: %d %s, want 400", body, code, out)
		}
	}
	code, out, _ := r.do("POST", "/v1/sandboxes/b/resume", map[string]any{"keepNetwork": true})
	if code != 200 || !strings.Contains(out, `"network":{"kept":`) {
		t.Fatalf("resume keeping the network: %d %s", code, out)
	}
	if got := r.b.boxes["b"].spec.AllowedHosts; len(got) != 1 {
		t.Errorf("kept allowed hosts %q", got)
	}
	r.do("POST", "/v1/sandboxes/b/suspend", nil)
	if code, out, _ := r.do("POST", "/v1/sandboxes/b/resume", map[string]any{}); code != 200 || strings.Contains(out, "network") {
		t.Errorf("protocol 1's resume: %d %s", code, out)
	}
	if got := r.b.boxes["b"].spec.AllowedHosts; len(got) != 0 {
		t.Errorf("protocol 1's resume without allowedHosts kept %q; want the service's network alone", got)
	}
}
