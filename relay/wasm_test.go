package relay

import (
	"context"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
	"github.com/sandgate/sandgate/transforms/wasm"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// probeWasm is the probe guest (transforms/wasm/testdata/probe), built
// once per test run; its config is a script of ABI calls whose results come
// back as audit notes.
func probeWasm(t *testing.T) []byte {
	t.Helper()
	bin, err := os.ReadFile(gobuild.Wasm(t, "github.com/sandgate/sandgate/transforms/wasm/testdata/probe"))
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// wasmRuntime is one runtime per test, closed when it ends.
func wasmRuntime(t *testing.T, cfg wasm.Config) *wasm.Runtime {
	t.Helper()
	cfg.CacheDir = gobuild.WasmCache(t)
	if cfg.CallTimeout == 0 {
		// Normal work: a deadline only a hang exceeds, whatever the load.
		cfg.CallTimeout = time.Minute
	}
	r, err := wasm.NewRuntime(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(context.Background()) })
	return r
}

func probeModule(t *testing.T, r *wasm.Runtime, name string, script ...string) *wasm.Module {
	t.Helper()
	m, err := r.Load(context.Background(), name, probeWasm(t), []byte(strings.Join(script, "\n")))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func withModules(c *wasm.Chain) envOpt { return func(cfg *Config) { cfg.Modules = c } }

const swapRules = `[{"match":{"host":"api.example.com"},"transform":{"headers":{"authorization":{"env":"CANARY_KEY","prefix":"Bearer "}}}}]`

// A module runs before the secret swap: copying every header it sees into
// audit notes shows the placeholder, never the secret, which still reaches
// the upstream.
func TestModuleNeverSeesTheSecret(t *testing.T) {
	r := wasmRuntime(t, wasm.Config{})
	spy := probeModule(t, r, "spy", "req copyheaders", "init enable 3", "req read 0 4096", "resp copyheaders", "resp echo authorization")
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, swapRules, withModules(wasm.NewChain(spy)))
	var gotAuth string
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotAuth = r.Header.Get("Authorization")
		io.WriteString(w, "ok")
	}))
	ph := transforms.PlaceholderPrefix + "CANARY_KEY"
	req, _ := http.NewRequest("POST", e.routeURL("api.example.com/v1/messages"), strings.NewReader(`{"key":"`+ph+`"}`))
	req.Header.Set("Authorization", "Bearer "+ph)
	resp, err := e.routeClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 200 || b != "ok" {
		t.Fatalf("got %d %q", resp.StatusCode, b)
	}
	// handle_response runs after the swap: it still sees the placeholder.
	if h := resp.Header.Get("X-Echo-Authorization"); h != "Bearer "+ph {
		t.Errorf("handle_response saw Authorization %q, want the placeholder", h)
	}
	if gotAuth != "Bearer "+canary {
		t.Fatalf("upstream got Authorization %q, want the swapped secret", gotAuth)
	}
	ev := e.event(1)
	all := strings.Join(ev.Notes, "\n")
	if strings.Count(all, "spy: authorization: Bearer "+ph) != 2 || !strings.Contains(all, `body="{\"key\":\"`+ph) {
		t.Errorf("notes do not show the placeholder:\n%s", all)
	}
	if strings.Contains(all, canary) {
		t.Errorf("a module saw the secret:\n%s", all)
	}
}

func TestModuleRewritesRequestAndResponse(t *testing.T) {
	r := wasmRuntime(t, wasm.Config{})
	service := probeModule(t, r, "service", "req add 0 X-Order service", "req seturi /v2/moved?x=1", "resp set 1 X-Resp service")
	sandbox := probeModule(t, r, "sandbox", "req add 0 X-Order sandbox", "req write 0 replaced", "req note from-sandbox-module",
		"init enable 2", "resp read 1 100", "resp write 1 rewritten", "resp setstatus 202")
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", withModules(wasm.NewChain(service)))
	e.tenant.SetModules(wasm.NewChain(sandbox))
	var got struct {
		uri, body string
		order     []string
	}
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.uri, got.body, got.order = r.RequestURI, string(b), r.Header.Values("X-Order")
		io.WriteString(w, "upstream answer")
	}))
	resp, err := e.routeClient().Post(e.routeURL("api.example.com/v1/x"), "text/plain", strings.NewReader("original"))
	if err != nil {
		t.Fatal(err)
	}
	b := body(t, resp)
	if resp.StatusCode != 202 || b != "rewritten" || resp.Header.Get("X-Resp") != "service" || resp.ContentLength != 9 {
		t.Errorf("sandbox got %d %q %v", resp.StatusCode, b, resp.Header)
	}
	if got.uri != "/v2/moved?x=1" || got.body != "replaced" || !slices.Equal(got.order, []string{"service", "sandbox"}) {
		t.Errorf("upstream got %+v", got)
	}
	ev := e.event(1)
	if !slices.Contains(ev.Notes, "sandbox: from-sandbox-module") || !slices.Contains(ev.Notes, `sandbox: body="upstream answer" reads=1`) || ev.Status != 202 || ev.Module != "" {
		t.Errorf("event = %+v", ev)
	}
}

func TestModuleRefuses(t *testing.T) {
	r := wasmRuntime(t, wasm.Config{})
	deny := probeModule(t, r, "deny-admin", "req if X-Admin refuse 451 admin%20paths%20are%20off")
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", withModules(wasm.NewChain(deny)))
	calls := 0
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { calls++ }))
	req, _ := http.NewRequest("GET", e.routeURL("api.example.com/admin"), nil)
	req.Header.Set("X-Admin", "1")
	resp, err := e.routeClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b := body(t, resp)
	want := "wasm module deny-admin refused the request: admin paths are off"
	if resp.StatusCode != 451 || !strings.Contains(b, want) || !strings.Contains(resp.Header.Get("X-Sandgate-Error"), want) {
		t.Errorf("got %d %q %v", resp.StatusCode, b, resp.Header)
	}
	if calls != 0 {
		t.Errorf("the upstream was called %d times", calls)
	}
	ev := e.event(1)
	if ev.Allow || ev.Code != CodeModuleRefused || ev.Module != "deny-admin" || ev.Reason != want || ev.Status != 451 {
		t.Errorf("event = %+v", ev)
	}
	// A refusal with the module's own body.
	withBody := probeModule(t, r, "budget", `req refuse 413 too%20big`, `req write 1 {"error":"budget"}`, "req set 1 Content-Type application/json")
	e.tenant.SetModules(wasm.NewChain(withBody))
	resp, err = e.routeClient().Get(e.routeURL("api.example.com/x"))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 413 || b != `{"error":"budget"}` || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("got %d %q %v", resp.StatusCode, b, resp.Header)
	}
	if ev := e.event(2); ev.Module != "budget" || ev.Code != CodeModuleRefused {
		t.Errorf("event = %+v", ev)
	}
}

// A module that fails fails its request closed with a 502 naming it; the
// proxy goes on serving, on a fresh instance.
func TestModuleFailureFailsClosed(t *testing.T) {
	// Long enough that the normal requests between the failures never
	// reach it on a loaded machine; the looping one waits it out.
	const loopDeadline = 2 * time.Second
	r := wasmRuntime(t, wasm.Config{CallTimeout: loopDeadline})
	bad := probeModule(t, r, "flaky", "req if X-Panic panic", "req if X-Loop loop", "req if X-Host set 0 Host evil.example")
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", withModules(wasm.NewChain(bad)))
	e.upstream("api.example.com", http.HandlerFunc(hello))
	for i, tc := range []struct{ header, want string }{
		{"X-Panic", "wasm module flaky trapped in handle_request"},
		{"X-Loop", "wasm module flaky ran past its " + loopDeadline.String() + " time limit"},
		{"X-Host", "wasm module flaky wrote the Host header; a module cannot change the destination host"},
	} {
		req, _ := http.NewRequest("GET", e.routeURL("api.example.com/x"), nil)
		req.Header.Set(tc.header, "1")
		resp, err := e.routeClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if b := body(t, resp); resp.StatusCode != 502 || !strings.Contains(b, tc.want) {
			t.Errorf("%s: got %d %q", tc.header, resp.StatusCode, b)
		}
		ev := e.event(2*i + 1)
		if ev.Module != "flaky" || !strings.Contains(ev.Error, tc.want) || ev.Status != 502 {
			t.Errorf("%s: event = %+v", tc.header, ev)
		}
		resp, err = e.routeClient().Get(e.routeURL("api.example.com/ok"))
		if err != nil {
			t.Fatal(err)
		}
		if b := body(t, resp); resp.StatusCode != 200 || b != "hello GET /ok" {
			t.Errorf("after %s: got %d %q", tc.header, resp.StatusCode, b)
		}
		e.event(2*i + 2)
	}
}

func TestModuleAnswersAndBodyCap(t *testing.T) {
	r := wasmRuntime(t, wasm.Config{MaxBodyBytes: 16})
	ans := probeModule(t, r, "answer", "req if X-Answer next 0", "req if X-Answer write 1 from-module", "init enable 1", "req read 0 16")
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", withModules(wasm.NewChain(ans)))
	e.upstream("api.example.com", http.HandlerFunc(hello))
	req, _ := http.NewRequest("GET", e.routeURL("api.example.com/x"), nil)
	req.Header.Set("X-Answer", "1")
	resp, err := e.routeClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 200 || b != "from-module" {
		t.Errorf("got %d %q", resp.StatusCode, b)
	}
	if ev := e.event(1); ev.Module != "answer" || !ev.Allow || ev.Status != 200 {
		t.Errorf("event = %+v", ev)
	}
	resp, err = e.routeClient().Post(e.routeURL("api.example.com/x"), "text/plain", strings.NewReader(strings.Repeat("b", 17)))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 413 || !strings.Contains(b, "16-byte buffer of wasm module answer") {
		t.Errorf("got %d %q", resp.StatusCode, b)
	}
	if ev := e.event(2); ev.Module != "answer" || ev.Status != 413 {
		t.Errorf("event = %+v", ev)
	}
}

// The audit event carries notes and the module in its JSON line.
func TestModuleAuditLine(t *testing.T) {
	r := wasmRuntime(t, wasm.Config{MaxNotes: 1})
	tag := probeModule(t, r, "tag", "req note team=infra", "req note dropped")
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", withModules(wasm.NewChain(tag)))
	e.upstream("api.example.com", http.HandlerFunc(hello))
	resp, err := e.routeClient().Get(e.routeURL("api.example.com/x"))
	if err != nil {
		t.Fatal(err)
	}
	body(t, resp)
	ev := e.event(1)
	if !slices.Equal(ev.Notes, []string{"tag: team=infra"}) || ev.NotesDropped != 1 {
		t.Errorf("event = %+v", ev)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(e.log.String(), `"notes":["tag: team=infra"],"notes_dropped":1`) {
		if time.Now().After(deadline) {
			t.Fatalf("audit line lacks notes:\n%s", e.log.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	_ = audit.Route
}
