//go:build !wasip1

// Package examples_test builds every example module with the Go toolchain
// (GOOS=wasip1 GOARCH=wasm -buildmode=c-shared) and runs it through the
// real `sandgate proxy` binary, built from ./cmd/sandgate, against an HTTPS
// upstream on loopback resolved by a DNS server on loopback.
package examples_test

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

// upstreamHost is the name every test routes to.
const upstreamHost = "api.example.com"

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// skipUnlessE2E skips in -short mode: these tests build Go programs and
// run a proxy process.
func skipUnlessE2E(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds wasm modules and the sandgate binary and runs the proxy; skipped in -short mode")
	}
}

// buildModule builds the module in dir (relative to wasm-examples) once per
// run, exactly as build.sh and the READMEs say, and returns its path.
func buildModule(t *testing.T, dir string) string {
	t.Helper()
	return gobuild.Wasm(t, "./"+dir)
}

// config reads an example's config.txt as the proxy flag takes it: inline,
// without the trailing newline.
func config(t *testing.T, example string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(example, "config.txt"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimRight(string(b), "\n")
}

// example returns the --transform-module value for an example with its
// own config.
func example(t *testing.T, name string) string {
	return buildModule(t, name) + "?" + config(t, name)
}

// echo is what the upstream saw of a request; it answers with it as JSON.
type echo struct {
	Method           string      `json:"method"`
	URI              string      `json:"uri"`
	Header           http.Header `json:"header"`
	Body             string      `json:"body"`
	ContentLength    int64       `json:"content_length"`
	TransferEncoding []string    `json:"transfer_encoding"`
}

// env is one proxy process with its upstream.
type env struct {
	proxy    string // host:port of the proxy
	auditLog string
	cmd      *exec.Cmd
	logs     *syncbuf.Buffer
	exited   chan error

	mu   sync.Mutex
	seen []echo // what the upstream received, in order

	caPEM []byte // the upstream's CA
}

// startProxy starts `sandgate proxy` with the given --transform-module
// values, in order, and fails the test if it does not start listening.
func startProxy(t *testing.T, mods ...string) *env {
	t.Helper()
	e, err := launch(t, mods...)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// launch starts the upstream and the proxy and waits until the proxy says
// it is listening, or exits (the error then carries its stderr).
func launch(t *testing.T, mods ...string) (*env, error) {
	t.Helper()
	return launchWith(t, nil, mods...)
}

// launchWith is launch with more proxy flags (extra).
func launchWith(t *testing.T, extra []string, mods ...string) (*env, error) {
	t.Helper()
	skipUnlessE2E(t)
	bin := gobuild.Sandgate(t)
	e := &env{logs: &syncbuf.Buffer{}, exited: make(chan error, 1)}
	d := dnstest.Start(t)
	ca := tlstest.MustCA(t)
	srv := ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		ec := echo{Method: r.Method, URI: r.RequestURI, Header: r.Header, Body: string(b), ContentLength: r.ContentLength, TransferEncoding: r.TransferEncoding}
		e.mu.Lock()
		e.seen = append(e.seen, ec)
		e.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Upstream", "yes")
		json.NewEncoder(w).Encode(ec)
	}), upstreamHost)
	addr := tlstest.Addr(srv)
	d.Set(upstreamHost, addr)
	dir := t.TempDir()
	caFile, err := ca.WritePEM(dir)
	if err != nil {
		t.Fatal(err)
	}
	e.auditLog = filepath.Join(dir, "audit.jsonl")
	args := []string{"proxy", "--listen", "127.0.0.1:0", "--allow", upstreamHost, "--dns", d.Addr,
		"--allow-private", addr.String() + "/32", "--upstream-ca", caFile, "--audit-log", e.auditLog,
		"--sandbox-id", "examples-sandbox", "--wasm-cache-dir", gobuild.WasmCache(t),
		// Normal work: a call deadline only a hang exceeds, however loaded
		// the machine (the production default is 100ms).
		"--wasm-call-timeout", "1m"}
	for _, m := range mods {
		args = append(args, "--transform-module", m)
	}
	args = append(args, extra...)
	e.caPEM = ca.PEM
	e.cmd = exec.Command(bin, args...)
	stderr, err := e.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := e.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	listening := make(chan string, 1)
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			e.logs.Write(append(sc.Bytes(), '\n'))
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["message"] == "proxy listening" {
				if a, ok := m["addr"].(string); ok {
					listening <- a
				}
			}
		}
	}()
	go func() {
		<-scanned // Wait must not run before the pipe is drained
		e.exited <- e.cmd.Wait()
	}()
	t.Cleanup(func() {
		e.cmd.Process.Kill()
		select {
		case <-e.exited:
		case <-time.After(10 * time.Second):
		}
	})
	select {
	case e.proxy = <-listening:
		return e, nil
	case err := <-e.exited:
		e.exited <- err
		return nil, fmt.Errorf("sandgate proxy exited before listening (%v):\n%s", err, e.logs.String())
	case <-time.After(60 * time.Second):
		return nil, fmt.Errorf("sandgate proxy did not say it was listening within 60s:\n%s", e.logs.String())
	}
}

// client talks to the proxy directly, never through a proxy from the
// environment.
var client = &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 30 * time.Second}

// response is what the sandbox got back.
type response struct {
	status int
	header http.Header
	body   string
}

// do sends a request to path on the upstream through the proxy's base-URL
// route. A nil body sends none; a body of type io.Reader other than
// *strings.Reader and *bytes.Reader is sent chunked.
func (e *env) do(t *testing.T, method, path string, header http.Header, body io.Reader) response {
	t.Helper()
	req, err := http.NewRequest(method, "http://"+e.proxy+"/https/"+upstreamHost+path, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s through the proxy: %v\nproxy log:\n%s", method, path, err, e.logs.String())
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the response: %v", method, path, err)
	}
	return response{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// lastSeen returns what the upstream received last, failing the test if it
// received nothing.
func (e *env) lastSeen(t *testing.T) echo {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.seen) == 0 {
		t.Fatal("the upstream received no request")
	}
	return e.seen[len(e.seen)-1]
}

// seenCount is how many requests the upstream received.
func (e *env) seenCount() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.seen)
}

// auditEvent is one line of the audit log, raw and decoded.
type auditEvent struct {
	raw    string
	fields map[string]any
}

// stop interrupts the proxy, waits for it to exit and returns its audit
// events, in order.
func (e *env) stop(t *testing.T) []auditEvent {
	t.Helper()
	e.cmd.Process.Signal(os.Interrupt)
	select {
	case err := <-e.exited:
		e.exited <- err
		if err != nil {
			t.Errorf("proxy exited with %v on SIGINT:\n%s", err, e.logs.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("proxy did not stop within 30s of SIGINT:\n%s", e.logs.String())
	}
	b, err := os.ReadFile(e.auditLog)
	if err != nil {
		t.Fatal(err)
	}
	var evs []auditEvent
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if line == "" {
			continue
		}
		ev := auditEvent{raw: line}
		if err := json.Unmarshal([]byte(line), &ev.fields); err != nil {
			t.Fatalf("audit line is not JSON: %v: %s", err, line)
		}
		evs = append(evs, ev)
	}
	return evs
}

// eventFor returns the audit event of the routed request to path.
func eventFor(t *testing.T, evs []auditEvent, path string) auditEvent {
	t.Helper()
	for _, ev := range evs {
		if ev.fields["kind"] == "route" && ev.fields["path"] == path {
			return ev
		}
	}
	var raws []string
	for _, ev := range evs {
		raws = append(raws, ev.raw)
	}
	t.Fatalf("no audit event for %s in:\n%s", path, strings.Join(raws, "\n"))
	return auditEvent{}
}

// notes returns the audit notes of an event ("module: text").
func notes(ev auditEvent) []string {
	var out []string
	if list, ok := ev.fields["notes"].([]any); ok {
		for _, n := range list {
			out = append(out, fmt.Sprint(n))
		}
	}
	return out
}

func TestAddHeader(t *testing.T) {
	e := startProxy(t, example(t, "add-header"))
	if r := e.do(t, "GET", "/v1/models", nil, nil); r.status != 200 {
		t.Fatalf("status %d, want 200: %s", r.status, r.body)
	}
	if got := e.lastSeen(t).Header.Values("X-Sandgate-Example"); !slices.Equal(got, []string{"added by add-header"}) {
		t.Errorf("upstream saw X-Sandgate-Example %q, want the configured value", got)
	}
	// A header the sandbox sent under the same name is replaced, not kept.
	e.do(t, "GET", "/v1/models", http.Header{"X-Sandgate-Example": {"from the sandbox"}}, nil)
	if got := e.lastSeen(t).Header.Values("X-Sandgate-Example"); !slices.Equal(got, []string{"added by add-header"}) {
		t.Errorf("upstream saw X-Sandgate-Example %q, want only the configured value", got)
	}
	e.stop(t)
}

// TestBadConfigIsRefusedAtLoad: an example that cannot use its config
// panics while initialising, and the proxy refuses to start with the
// module's message rather than run it misconfigured.
func TestBadConfigIsRefusedAtLoad(t *testing.T) {
	for name, cfg := range map[string]string{
		"add-header":  "no colon here",
		"deny-path":   "(unclosed",
		"redact-body": "no arrow",
		"audit-tag":   "",
		"budget":      "lots",
	} {
		t.Run(name, func(t *testing.T) {
			_, err := launch(t, buildModule(t, name)+"?"+cfg)
			if err == nil {
				t.Fatalf("the proxy started with %s?%s", name, cfg)
			}
			if !strings.Contains(err.Error(), name+": config") {
				t.Errorf("the refusal does not carry the module's message %q:\n%v", name+": config…", err)
			}
		})
	}
}

func TestDenyPath(t *testing.T) {
	e := startProxy(t, example(t, "deny-path"))
	r := e.do(t, "GET", "/admin/users", nil, nil)
	if r.status != 403 {
		t.Errorf("/admin/users: status %d, want 403", r.status)
	}
	if !strings.Contains(r.body, "matches the deny pattern") {
		t.Errorf("/admin/users: the sandbox got %q, want the module's reason", r.body)
	}
	if n := e.seenCount(); n != 0 {
		t.Errorf("the upstream received %d requests, want none", n)
	}
	for _, path := range []string{"/administrator", "/v1/ok?next=/admin/"} {
		if r := e.do(t, "GET", path, nil, nil); r.status != 200 {
			t.Errorf("%s: status %d, want 200 (not matched): %s", path, r.status, r.body)
		}
	}
	ev := eventFor(t, e.stop(t), "/admin/users")
	if ev.fields["status"] != 403.0 || ev.fields["decision"] != "deny" || ev.fields["module"] != "deny-path" ||
		!strings.Contains(fmt.Sprint(ev.fields["reason"]), "path /admin/users matches the deny pattern ^/admin(/|$)") {
		t.Errorf("the audit event does not record a denial by module deny-path with its reason and 403: %s", ev.raw)
	}
}

// TestDenyPathOverConnect: over CONNECT a module sees nothing of a host
// the policy does not intercept (the tunnel carries TLS the proxy cannot
// read), and every request of one it intercepts.
func TestDenyPathOverConnect(t *testing.T) {
	caDir := filepath.Join(t.TempDir(), "ca")
	policy := filepath.Join(t.TempDir(), "policy.json")
	for _, intercept := range []bool{false, true} {
		p := `{"mode":"custom","allowedHosts":["` + upstreamHost + `"]}`
		extra := []string(nil)
		if intercept {
			p = `{"mode":"custom","allowedHosts":["` + upstreamHost + `"],"intercept":["` + upstreamHost + `"]}`
			extra = []string{"--intercept-ca", caDir}
		}
		if err := os.WriteFile(policy, []byte(p), 0o600); err != nil {
			t.Fatal(err)
		}
		e, err := launchWith(t, append(extra, "--policy", policy), example(t, "deny-path"))
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(e.caPEM)
		if intercept {
			b, err := os.ReadFile(filepath.Join(caDir, "ca.pem"))
			if err != nil {
				t.Fatal(err)
			}
			pool.AppendCertsFromPEM(b)
		}
		pu, _ := url.Parse("http://" + e.proxy)
		cl := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 30 * time.Second}
		resp, err := cl.Get("https://" + upstreamHost + "/admin/users")
		if err != nil {
			t.Fatalf("intercept=%v: %v\n%s", intercept, err, e.logs.String())
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch {
		case intercept && (resp.StatusCode != 403 || !strings.Contains(string(b), "matches the deny pattern")):
			t.Errorf("intercepted: /admin/users got %d %q, want the module's 403", resp.StatusCode, b)
		case !intercept && resp.StatusCode != 200:
			t.Errorf("not intercepted: /admin/users got %d %q: the module cannot see inside a tunnel, the upstream answers", resp.StatusCode, b)
		}
	}
}

func TestRedactBody(t *testing.T) {
	e := startProxy(t, example(t, "redact-body"))
	in := `{"prompt":"my key is sk-abcdefgh12345678, and sk-short stays"}`
	want := `{"prompt":"my key is [redacted-key], and sk-short stays"}`
	if r := e.do(t, "POST", "/v1/messages", nil, strings.NewReader(in)); r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	got := e.lastSeen(t)
	if got.Body != want {
		t.Errorf("upstream got body %q, want %q", got.Body, want)
	}
	if got.ContentLength != int64(len(want)) && got.ContentLength != -1 {
		t.Errorf("upstream got Content-Length %d for a %d-byte body", got.ContentLength, len(want))
	}
	clean := strings.Repeat("nothing to redact here. ", 10000) // larger than one read
	e.do(t, "POST", "/v1/messages", nil, strings.NewReader(clean))
	if got := e.lastSeen(t); got.Body != clean {
		t.Errorf("a body without a match changed: %d bytes, want %d", len(got.Body), len(clean))
	}
	e.do(t, "POST", "/v1/chunked", nil, io.MultiReader(strings.NewReader(in))) // sent chunked
	if got := e.lastSeen(t); got.Body != want {
		t.Errorf("chunked: upstream got body %q, want %q", got.Body, want)
	}
	e.stop(t)
}

func TestAuditTag(t *testing.T) {
	e := startProxy(t, example(t, "audit-tag"))
	e.do(t, "GET", "/v1/tagged", http.Header{"X-Task-Id": {"T-42"}}, nil)
	if got := e.lastSeen(t).Header.Get("X-Task-Id"); got != "T-42" {
		t.Errorf("upstream saw X-Task-Id %q, want it sent on unchanged", got)
	}
	e.do(t, "GET", "/v1/untagged", nil, nil)
	evs := e.stop(t)
	if got := notes(eventFor(t, evs, "/v1/tagged")); !slices.Equal(got, []string{"audit-tag: x-task-id=T-42"}) {
		t.Errorf("the audit event's notes are %q, want [audit-tag: x-task-id=T-42]", got)
	}
	if got := notes(eventFor(t, evs, "/v1/untagged")); len(got) != 0 {
		t.Errorf("an untagged request got notes %q", got)
	}
}

func TestBudget(t *testing.T) {
	e := startProxy(t, example(t, "budget")) // 1KiB
	at := strings.Repeat("b", 1024)
	if r := e.do(t, "POST", "/v1/at-budget", nil, strings.NewReader(at)); r.status != 200 {
		t.Errorf("1024 bytes: status %d, want 200: %s", r.status, r.body)
	} else if got := e.lastSeen(t).Body; got != at {
		t.Errorf("1024 bytes: upstream got %d bytes", len(got))
	}
	before := e.seenCount()
	r := e.do(t, "POST", "/v1/over-budget", nil, strings.NewReader(at+"b"))
	if r.status != 413 || !strings.Contains(r.body, "over the budget of 1024 bytes") {
		t.Errorf("1025 bytes: status %d %q, want 413 and the module's reason", r.status, r.body)
	}
	r = e.do(t, "POST", "/v1/over-budget-chunked", nil, io.MultiReader(strings.NewReader(strings.Repeat("c", 2000))))
	if r.status != 413 || !strings.Contains(r.body, "over the budget") {
		t.Errorf("2000 bytes chunked: status %d %q, want 413 and the module's reason", r.status, r.body)
	}
	if n := e.seenCount(); n != before {
		t.Errorf("the upstream received %d refused requests", n-before)
	}
	small := strings.Repeat("s", 100)
	if r := e.do(t, "POST", "/v1/small-chunked", nil, io.MultiReader(strings.NewReader(small))); r.status != 200 {
		t.Errorf("100 bytes chunked: status %d, want 200: %s", r.status, r.body)
	} else if got := e.lastSeen(t).Body; got != small {
		t.Errorf("100 bytes chunked: upstream got %q, want the whole body (buffer_request)", got)
	}
	if r := e.do(t, "GET", "/v1/no-body", nil, nil); r.status != 200 {
		t.Errorf("no body: status %d, want 200: %s", r.status, r.body)
	}
	evs := e.stop(t)
	for _, path := range []string{"/v1/over-budget", "/v1/over-budget-chunked"} {
		ev := eventFor(t, evs, path)
		if ev.fields["status"] != 413.0 || ev.fields["module"] != "budget" || !strings.Contains(fmt.Sprint(ev.fields["reason"]), "over the budget of 1024 bytes") {
			t.Errorf("%s: the audit event does not record 413 by module budget with its reason: %s", path, ev.raw)
		}
	}
}

// TestModulesRunInOrder: --transform-module is repeatable and the modules
// run in the order given, each seeing what the one before it did.
func TestModulesRunInOrder(t *testing.T) {
	add := buildModule(t, "add-header") + "?X-Task-Id: from-add-header"
	tag := example(t, "audit-tag")

	e := startProxy(t, add, tag)
	e.do(t, "GET", "/v1/order", nil, nil)
	if got := notes(eventFor(t, e.stop(t), "/v1/order")); !slices.Equal(got, []string{"audit-tag: x-task-id=from-add-header"}) {
		t.Errorf("add-header then audit-tag: notes %q, want audit-tag to have seen add-header's header", got)
	}

	e = startProxy(t, tag, add)
	e.do(t, "GET", "/v1/order", nil, nil)
	if got := notes(eventFor(t, e.stop(t), "/v1/order")); len(got) != 0 {
		t.Errorf("audit-tag then add-header: notes %q, want none: audit-tag ran before the header was added", got)
	}
}

// probeReport mirrors testdata/probe's Report.
type probeReport struct {
	Config     string              `json:"config"`
	Features   string              `json:"features"`
	Method     string              `json:"method"`
	URI        string              `json:"uri"`
	Protocol   string              `json:"protocol"`
	SourceAddr string              `json:"source_addr"`
	SandboxID  string              `json:"sandbox_id"`
	Names      []string            `json:"names"`
	Values     map[string][]string `json:"values"`
	HasAbsent  bool                `json:"has_absent"`
	BodySHA256 string              `json:"body_sha256"`
	BodyLen    int                 `json:"body_len"`
}

// TestGuestLibraryProbe runs testdata/probe, which uses every function of
// the guest library, through the real proxy. Values longer than the
// library's first-try buffer (2 KiB) check that it retries with the length
// the host reports.
func TestGuestLibraryProbe(t *testing.T) {
	cfg := "probe-config:" + strings.Repeat("0123456789", 300)
	e := startProxy(t, buildModule(t, "testdata/probe")+"?"+cfg)

	long := strings.Repeat("L", 3000)
	query := "q=" + strings.Repeat("u", 2500) + "&x=%2F"
	body := bytes.Repeat([]byte("body-bytes."), 10000)
	sum := sha256.Sum256(body)
	h := http.Header{
		"X-Long":         {long},
		"X-Empty":        {""},
		"X-Multi":        {"a", "b"},
		"X-Probe-Remove": {"gone"},
		"Content-Type":   {"application/octet-stream"},
	}
	r := e.do(t, "PATCH", "/probe/echo?"+query, h, bytes.NewReader(body))
	if r.status != 203 {
		t.Fatalf("status %d, want 203 set by handle_response: %s\nproxy log:\n%s", r.status, r.body, e.logs.String())
	}

	// Response side: handle_response saw the upstream's response and
	// rewrote it.
	if r.header.Get("X-Probe-Status") != "200" || r.header.Get("X-Probe-Upstream") != "yes" {
		t.Errorf("handle_response saw status %q and X-Upstream %q, want 200 and yes", r.header.Get("X-Probe-Status"), r.header.Get("X-Probe-Upstream"))
	}
	if names := r.header.Get("X-Probe-Upstream-Names"); !strings.Contains(names, "x-upstream") || names != strings.ToLower(names) {
		t.Errorf("response header names %q: want lowercase names including x-upstream", names)
	}
	rest, ok := strings.CutPrefix(r.body, "probe:")
	if !ok {
		t.Fatalf("response body does not start with the probe's prefix: %.200q", r.body)
	}
	var up echo
	if err := json.Unmarshal([]byte(rest), &up); err != nil {
		t.Fatalf("response body after the prefix is not the upstream's echo: %v: %.200q", err, rest)
	}

	// Request side: what the module changed reached the upstream.
	if up.Method != "POST" {
		t.Errorf("upstream saw method %s, want POST (set_method)", up.Method)
	}
	if want := "/probe/echo?" + query + "&probe=1"; up.URI != want {
		t.Errorf("upstream saw URI %.80q…, want %.80q… (set_uri)", up.URI, want)
	}
	if got := up.Header.Get("X-Probe-Long"); got != strings.Repeat("v", 5000) {
		t.Errorf("upstream saw X-Probe-Long of %d bytes, want 5000 (set_header_value)", len(got))
	}
	if got := up.Header.Values("X-Probe-Multi"); !slices.Equal(got, []string{"1", "2"}) {
		t.Errorf("upstream saw X-Probe-Multi %q, want [1 2] (add_header_value)", got)
	}
	if up.Header.Get("X-Probe-Remove") != "" {
		t.Error("upstream saw X-Probe-Remove (remove_header)")
	}
	var rep probeReport
	if err := json.Unmarshal([]byte(up.Body), &rep); err != nil {
		t.Fatalf("upstream body is not the probe's report (write_body): %v: %.200q", err, up.Body)
	}
	if up.ContentLength != int64(len(up.Body)) && up.ContentLength != -1 {
		t.Errorf("upstream got Content-Length %d for a %d-byte body", up.ContentLength, len(up.Body))
	}

	// What the module saw.
	if rep.Config != cfg {
		t.Errorf("get_config: %d bytes, want the %d-byte config", len(rep.Config), len(cfg))
	}
	if !strings.Contains(rep.Features, "buffer_request") || !strings.Contains(rep.Features, "buffer_response") {
		t.Errorf("enable_features answered %s, want buffer_request and buffer_response", rep.Features)
	}
	if rep.Method != "PATCH" {
		t.Errorf("get_method: %q, want PATCH", rep.Method)
	}
	if want := "/probe/echo?" + query; rep.URI != want {
		t.Errorf("get_uri: %.80q…, want %.80q…", rep.URI, want)
	}
	if rep.Protocol != "HTTP/1.1" {
		t.Errorf("get_protocol_version: %q, want HTTP/1.1", rep.Protocol)
	}
	if !strings.HasPrefix(rep.SourceAddr, "127.0.0.1:") {
		t.Errorf("get_source_addr: %q, want the client's 127.0.0.1:port", rep.SourceAddr)
	}
	if rep.SandboxID != "examples-sandbox" {
		t.Errorf("sandbox_id: %q, want examples-sandbox", rep.SandboxID)
	}
	for _, n := range []string{"x-long", "x-empty", "x-multi", "x-probe-remove", "content-type"} {
		if !slices.Contains(rep.Names, n) {
			t.Errorf("get_header_names: %q lacks %s", rep.Names, n)
		}
	}
	for _, n := range rep.Names {
		if n != strings.ToLower(n) {
			t.Errorf("get_header_names: %q is not lowercase", n)
		}
	}
	for n, want := range map[string][]string{"x-long": {long}, "x-empty": {""}, "x-multi": {"a", "b"}} {
		if got := rep.Values[n]; !slices.Equal(got, want) {
			t.Errorf("get_header_values(%s) = %d values %.40q, want %.40q", n, len(got), got, want)
		}
	}
	if rep.HasAbsent {
		t.Error("Has reported an absent header as present")
	}
	if rep.BodyLen != len(body) || rep.BodySHA256 != hex.EncodeToString(sum[:]) {
		t.Errorf("read_body: %d bytes (sha256 %s), want the %d-byte body", rep.BodyLen, rep.BodySHA256, len(body))
	}

	// next=0 with a response written by the module.
	a := e.do(t, "GET", "/probe/answer", nil, nil)
	if a.status != 418 || a.header.Get("X-Probe") != "answered" || a.body != "answered by the probe" {
		t.Errorf("module's own answer: %d %q %q, want 418, X-Probe: answered and its body", a.status, a.header.Get("X-Probe"), a.body)
	}

	evs := e.stop(t)
	if got := notes(eventFor(t, evs, "/probe/echo")); len(got) != 1 || !strings.HasPrefix(got[0], "probe: probe saw ") {
		t.Errorf("audit_note: the event's notes are %q, want the probe's one note", got)
	}
	if !strings.Contains(e.logs.String(), "probe: request rewritten") {
		t.Errorf("log: the proxy's log lacks the probe's message:\n%s", e.logs.String())
	}
}

// TestBuildScript runs build.sh, which users run, and checks it builds
// every example.
func TestBuildScript(t *testing.T) {
	skipUnlessE2E(t)
	out := t.TempDir()
	cmd := exec.Command("sh", "./build.sh", out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build.sh: %v\n%s", err, b)
	}
	for _, name := range []string{"add-header", "deny-path", "redact-body", "audit-tag", "budget"} {
		b, err := os.ReadFile(filepath.Join(out, name+".wasm"))
		if err != nil {
			t.Errorf("build.sh did not build %s: %v", name, err)
			continue
		}
		if !bytes.HasPrefix(b, []byte("\x00asm")) {
			t.Errorf("%s.wasm is not a wasm module", name)
		}
	}
}
