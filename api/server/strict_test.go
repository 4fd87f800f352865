package server

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/netpolicy"
)

// sandgate's own bodies refuse a field they do not know, by name;
// protocol 1's stay as lenient as the protocol says.
func TestUnknownFieldsRefusedInSandgatesOwnBodies(t *testing.T) {
	r := newRouteRig(t)
	if code, body, _ := r.do("POST", "/v1/sandboxes", map[string]any{"name": "b", "allowHosts": []string{"x.example"}}); code != 201 {
		t.Fatalf("protocol 1's create with an unknown field: %d %s, want 201 (the protocol ignores unknown fields)", code, body)
	}
	for _, tc := range []struct {
		method, path string
		body         any
		want         string
	}{
		{"POST", "/v1/sandboxes/b/fork", map[string]any{"name": "c", "nme": "d"}, `fork: unknown field "nme" (it takes "name")`},
		{"PUT", "/v1/sandboxes/b/modules", map[string]any{"modules": []any{}, "modlues": 1}, `unknown field "modlues"`},
		{"PUT", "/v1/sandboxes/b/modules", map[string]any{"modules": []any{map[string]any{"name": "m", "wasm": "AA==", "confg": "x"}}},
			`modules[0]: unknown field "confg" (it takes "name", "wasm" and "config")`},
		{"PUT", "/v1/sandboxes/b/modules", map[string]any{"modules": []any{"x"}}, `modules[0]`},
		{"PUT", "/v1/sandboxes/b/network", map[string]any{"policy": map[string]any{"mode": "custom", "allowHosts": []string{"x"}}}, `unknown key "allowHosts"`},
		{"POST", "/v1/sandboxes", map[string]any{"name": "d", "policy": map[string]any{"mode": "custom", "allowedHost": []string{"x"}}}, `unknown key "allowedHost"`},
		{"POST", "/v1/sandboxes", map[string]any{"name": "d", "allowedHosts": []string{}, "policy": map[string]any{"mode": "deny-all"}}, `"allowedHosts" or "policy", not both`},
		{"POST", "/v1/sandboxes/b/resume", map[string]any{"policy": map[string]any{"mode": "allow-all", "allowedCIDRs": []string{"1.2.3.4/32"}}}, "takes no rules"},
		{"POST", "/v1/sandboxes", map[string]any{"name": "d", "limits": map[string]any{"cpus": 2}}, `unknown field "cpus"`},
		{"POST", "/v1/sandboxes", map[string]any{"name": "d", "limits": map[string]any{"memory": "1m"}}, `limits.memory`},
		{"POST", "/v1/sandboxes", map[string]any{"name": "d", "limits": map[string]any{"lifetime": 60}}, `limits`},
	} {
		code, body, _ := r.do(tc.method, tc.path, tc.body)
		var e api.Error
		json.Unmarshal([]byte(body), &e)
		if code != http.StatusBadRequest || !strings.Contains(e.Error, tc.want) {
			t.Errorf("%s %s %v: %d %s; want 400 containing %q", tc.method, tc.path, tc.body, code, body, tc.want)
		}
	}
	if _, ok := r.b.boxes["c"]; ok {
		t.Errorf("a refused fork made its copy")
	}
	if _, ok := r.b.boxes["d"]; ok {
		t.Errorf("a refused create made its sandbox")
	}
}

// Create and resume take sandgate's whole policy, as the network route
// does: resume used to ignore it and leave the sandbox with none.
func TestCreateAndResumeHonourPolicy(t *testing.T) {
	r := newRouteRig(t)
	policy := map[string]any{"mode": "custom", "allowedHosts": []string{"api.example.com"}, "deniedCIDRs": []string{"140.82.121.4/32"}}
	if code, body, _ := r.do("POST", "/v1/sandboxes", map[string]any{"name": "b", "policy": policy, "baseUrls": map[string]string{"X_BASE_URL": "https://x.example"}}); code != 201 {
		t.Fatalf("create: %d %s", code, body)
	}
	got := r.b.boxes["b"].spec
	if got.Policy == nil || got.Policy.Mode != netpolicy.Custom || len(got.Policy.DeniedCIDRs) != 1 || got.AllowedHosts != nil || got.BaseURLs["X_BASE_URL"] == "" {
		t.Errorf("create handed the backend %+v", got)
	}
	r.do("POST", "/v1/sandboxes/b/suspend", nil)
	if code, body, _ := r.do("POST", "/v1/sandboxes/b/resume", map[string]any{"policy": map[string]any{"mode": "deny-all"}}); code != 200 {
		t.Fatalf("resume: %d %s", code, body)
	}
	if got := r.b.boxes["b"].spec; got.Policy == nil || got.Policy.Mode != netpolicy.DenyAll {
		t.Errorf("resume handed the backend %+v, want the deny-all policy", got)
	}
}

// progressLines asks a long route for its progress and returns its lines.
func (r *routeRig) progressLines(method, path string, body string) []api.ProgressLine {
	r.t.Helper()
	req, _ := http.NewRequest(method, r.hs.URL+path, strings.NewReader(body))
	req.Header.Set(api.HeaderToken, "tok")
	req.Header.Set("Accept", "application/json, application/x-ndjson")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		r.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != api.MediaProgress {
		r.t.Fatalf("%s %s with progress: %d %s", method, path, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var lines []api.ProgressLine
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var l api.ProgressLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			r.t.Fatalf("a progress line that is not JSON: %q", sc.Text())
		}
		lines = append(lines, l)
	}
	return lines
}

// A caller that accepts JSON lines gets the outcome of a long route as
// the last line (its progress before, which the real stack's tests see);
// any other caller gets the route's own answer.
func TestProgressOutcome(t *testing.T) {
	r := newRouteRig(t)
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "b"})
	for _, tc := range []struct {
		method, path, body string
		status             int
		result, err        string
	}{
		{"POST", "/v1/sandboxes/b/template", `{"id":"tpl"}`, 204, "", ""},
		{"POST", "/v1/sandboxes/b/suspend", "", 204, "", ""},
		{"POST", "/v1/sandboxes/b/resume", "{}", 200, `"name":"b"`, ""},
		{"POST", "/v1/sandboxes/none/resume", "{}", 404, "", "neither running nor suspended"},
	} {
		lines := r.progressLines(tc.method, tc.path, tc.body)
		last := lines[len(lines)-1]
		res, _ := json.Marshal(last.Result)
		if last.Status != tc.status || !strings.Contains(last.Error, tc.err) || (tc.result != "" && !strings.Contains(string(res), tc.result)) {
			t.Errorf("%s %s: last line %+v (result %s), want status %d", tc.method, tc.path, last, res, tc.status)
		}
	}
	// Bad input is still refused before anything runs, as a plain 400.
	if code, body, _ := r.do("POST", "/v1/sandboxes/b/template", `{"id":"Bad_T"}`); code != 400 {
		t.Errorf("%d %s", code, body)
	}
}

// The terminal route's refusals before and after the WebSocket opens.
func TestTerminalRouteRefusals(t *testing.T) {
	r := newRouteRig(t)
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "b"})
	if code, body, _ := r.do("GET", "/v1/sandboxes/b/pty", nil); code != http.StatusUpgradeRequired || !strings.Contains(body, "WebSocket") {
		t.Errorf("a plain GET: %d %s, want 426", code, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h := http.Header{api.HeaderToken: {"tok"}}
	_, resp, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(r.hs.URL, "http")+"/v1/sandboxes/none/pty", &websocket.DialOptions{HTTPHeader: h})
	if err == nil || resp == nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("a sandbox that does not run: %v %v, want 404 before the WebSocket opens", err, resp)
	}
	for _, tc := range []struct{ first, want string }{
		{`{"command":"sh","row":3}`, `unknown field "row"`},
		{`{"cols":3}`, `field "command" is required`},
		{`{"command":"sh","rows":-1}`, `"rows" must be a whole number`},
		{`{"command":"sh","rows":70000}`, `"rows" must be a whole number`},
	} {
		ws, _, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(r.hs.URL, "http")+"/v1/sandboxes/b/pty", &websocket.DialOptions{HTTPHeader: h})
		if err != nil {
			t.Fatal(err)
		}
		ws.Write(ctx, websocket.MessageText, []byte(tc.first))
		typ, data, err := ws.Read(ctx)
		var end ptyEnd
		if err != nil || typ != websocket.MessageText || json.Unmarshal(data, &end) != nil || end.Status != 400 || !strings.Contains(end.Error, tc.want) || end.ExitCode != nil {
			t.Errorf("first message %s: %v %s, want a 400 end naming %q", tc.first, err, data, tc.want)
		}
		if _, _, err := ws.Read(ctx); websocket.CloseStatus(err) != websocket.StatusNormalClosure {
			t.Errorf("after the end: %v, want a normal close", err)
		}
		ws.CloseNow()
	}
}

// A sandbox's own limits reach the backend from sandgate's create body
// and come back in its description.
func TestCreateTakesLimits(t *testing.T) {
	r := newRouteRig(t)
	limits := map[string]any{"cpu": 0.5, "cpuWeight": 50, "memory": "256m", "pids": 64, "disk": "2g", "lifetime": "24h", "keepSuspended": "48h"}
	if code, body, _ := r.do("POST", "/v1/sandboxes", map[string]any{"name": "b", "limits": limits}); code != 201 {
		t.Fatalf("create: %d %s", code, body)
	}
	want := appliance.Limits{CPU: 0.5, CPUWeight: 50, Memory: 256 << 20, Pids: 64, Disk: 2 << 30, Lifetime: 24 * time.Hour, KeepSuspended: 48 * time.Hour}
	if got := r.b.boxes["b"].limits; got != want {
		t.Errorf("the backend got %+v, want %+v", got, want)
	}
	code, body, _ := r.do("GET", "/v1/sandboxes/b", nil)
	var sb struct {
		Limits map[string]any `json:"limits"`
	}
	if err := json.Unmarshal([]byte(body), &sb); code != 200 || err != nil {
		t.Fatalf("get: %d %s", code, body)
	}
	if sb.Limits["memory"] != float64(256<<20) || sb.Limits["lifetime"] != "24h0m0s" || sb.Limits["cpu"] != 0.5 {
		t.Errorf("described limits: %v", sb.Limits)
	}
}
