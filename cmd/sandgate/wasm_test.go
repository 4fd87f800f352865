package main

import (
	"bufio"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// probeGuest builds the host tests' probe guest (a script-driven http-wasm
// module) once per test run.
func probeGuest(t *testing.T) string {
	t.Helper()
	return gobuild.Wasm(t, "github.com/sandgate/sandgate/transforms/wasm/testdata/probe")
}

func TestWasmCheck(t *testing.T) {
	probe := probeGuest(t)
	cache := "--wasm-cache-dir=" + gobuild.WasmCache(t)
	code, out, errOut := runCLI(t, "wasm", "check", probe, "--config", "init enable 1", cache)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{"module: probe\n", "exports: _initialize, handle_request, handle_response", "http_handler.get_header_names", "sandgate.audit_note", "wasi_snapshot_preview1.", "features enabled at start: buffer_request\n", "ok: the proxy would load it\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("check output lacks %q:\n%s", want, out)
		}
	}
	// Each import once, sorted (a Go guest imports fd_write twice).
	for _, line := range strings.Split(out, "\n") {
		if list, ok := strings.CutPrefix(line, "imports: "); ok {
			imports := strings.Split(list, ", ")
			if !slices.IsSorted(imports) || len(slices.Compact(slices.Clone(imports))) != len(imports) {
				t.Errorf("imports listed out of order or twice: %s", list)
			}
		}
	}
	dir := t.TempDir()
	cfg := filepath.Join(dir, "cfg")
	os.WriteFile(cfg, []byte("init enable 3"), 0o600)
	if code, out, _ := runCLI(t, "wasm", "check", "--config", "@"+cfg, cache, probe); code != 0 || !strings.Contains(out, "buffer_request|buffer_response") {
		t.Errorf("--config @FILE: %d %q", code, out)
	}
	bad := filepath.Join(dir, "bad.wasm")
	os.WriteFile(bad, []byte("\x00asm\x01\x00\x00\x00\xff"), 0o600)
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{bad}, "wasm module bad: does not compile"},
		{[]string{filepath.Join(dir, "missing.wasm")}, "cannot read"},
		{nil, "takes one module FILE"},
		{[]string{probe, "--wasm-memory-pages", "0"}, "--wasm-memory-pages"},
		// The cache directory's fix in this CLI's words, not the Go field's.
		{[]string{probe, "--wasm-cache-dir", "/proc/sandgate-cannot-be-here"}, "--wasm-cache-dir (SANDGATE_WASM_CACHE_DIR): wasm: compilation cache directory"},
	} {
		code, _, errOut := runCLI(t, append([]string{"wasm", "check", cache}, tt.args...)...)
		if code != exitBadInput || !strings.Contains(errOut, tt.want) {
			t.Errorf("check %v = %d %q; want 2 and %q", tt.args, code, errOut, tt.want)
		}
	}
}

// TestWasmCheckBadConfigIsOneLine: a module whose init refuses its config
// (guest.Abort) made wasm check print the message in a log line, again as a
// Go panic, and a wasm stack trace. It is one line, the message once, exit 2.
func TestWasmCheckBadConfigIsOneLine(t *testing.T) {
	probe := probeGuest(t)
	code, out, errOut := runCLI(t, "wasm", "check", probe, "--wasm-cache-dir="+gobuild.WasmCache(t),
		"--config", "init log 2 probe:%20config:%20missing%20closing%20)\ninit panic")
	want := "sandgate: wasm module probe: its start function failed: probe: config: missing closing )\n"
	if code != exitBadInput || out != "" || errOut != want {
		t.Errorf("got %d, stdout %q, stderr %q; want 2 and only %q", code, out, errOut, want)
	}
}

func TestWasmRun(t *testing.T) {
	probe := probeGuest(t)
	cache := "--wasm-cache-dir=" + gobuild.WasmCache(t)
	// The probe's calls are normal work: a deadline only a hang exceeds.
	deadline := "--wasm-call-timeout=1m"
	dir := t.TempDir()
	reqFile := filepath.Join(dir, "req.http")
	os.WriteFile(reqFile, []byte("POST /v1/messages?x=1 HTTP/1.1\r\nHost: api.example.com\r\nAuthorization: Bearer sandgate-placeholder-KEY\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello"), 0o600)
	code, out, errOut := runCLI(t, "wasm", "run", probe, "--request", reqFile, cache, deadline,
		"--config", "req set 0 X-Added yes\nreq seturi /v2/messages\nreq write 0 bye\nreq note seen")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	want := "POST /v2/messages HTTP/1.1\r\nHost: api.example.com\r\nAuthorization: Bearer sandgate-placeholder-KEY\r\nContent-Length: 3\r\nX-Added: yes\r\n\r\nbye"
	if out != want {
		t.Errorf("got\n%q\nwant\n%q", out, want)
	}
	if !strings.Contains(errOut, "note: probe: seen\n") {
		t.Errorf("notes not on stderr: %q", errOut)
	}
	code, out, _ = runCLI(t, "wasm", "run", probe, "--request", reqFile, cache, deadline, "--config", "req refuse 451 no%20way")
	if code != exitDenied || out != "refused by probe: 451 no way\n" {
		t.Errorf("refusal: %d %q", code, out)
	}
	code, _, errOut = runCLI(t, "wasm", "run", probe, "--request", reqFile, cache, deadline, "--config", "req set 0 Host evil.example")
	if code != exitFailure || !strings.Contains(errOut, "cannot change the destination host") {
		t.Errorf("failure: %d %q", code, errOut)
	}
	noHost := filepath.Join(dir, "nohost.http")
	os.WriteFile(noHost, []byte("GET / HTTP/1.0\r\n\r\n"), 0o600)
	if code, _, errOut := runCLI(t, "wasm", "run", probe, "--request", noHost, cache, deadline); code != exitBadInput || !strings.Contains(errOut, "Host") {
		t.Errorf("no Host: %d %q", code, errOut)
	}
}

// TestProxyTransformModule runs `sandgate proxy --transform-module` as a
// process: the module's header reaches the upstream and its note the audit
// log.
func TestProxyTransformModule(t *testing.T) {
	bin, probe := binary(t), probeGuest(t)
	d := dnstest.Start(t)
	ca := tlstest.MustCA(t)
	got := make(chan string, 1)
	srv := ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Get("X-Order")
		io.WriteString(w, "ok")
	}), "api.example.com")
	a := tlstest.Addr(srv)
	d.Set("api.example.com", a)
	dir := t.TempDir()
	caFile, err := ca.WritePEM(dir)
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "second.cfg")
	os.WriteFile(cfg, []byte("req add 0 X-Order second\nreq note tagged"), 0o600)
	auditLog := filepath.Join(dir, "audit.jsonl")
	cmd := exec.Command(bin, "proxy", "--listen", "127.0.0.1:0", "--allow", "api.example.com", "--dns", d.Addr,
		"--allow-private", a.String()+"/32", "--upstream-ca", caFile, "--audit-log", auditLog, "--wasm-cache-dir", gobuild.WasmCache(t), "--wasm-call-timeout", "1m",
		"--transform-module", probe+"?req add 0 X-Order first,with-comma",
		"--transform-module", probe+"?@"+cfg)
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["message"] == "proxy listening" {
				addr <- m["addr"].(string)
			}
		}
	}()
	var proxyAddr string
	select {
	case proxyAddr = <-addr:
	case <-time.After(30 * time.Second):
		t.Fatal("proxy did not say it was listening within 30s")
	}
	resp, err := http.Get("http://" + proxyAddr + "/https/api.example.com/v1/x")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "ok" {
		t.Fatalf("got %d %q", resp.StatusCode, b)
	}
	if h := <-got; h != "first,with-comma" {
		t.Errorf("upstream saw X-Order %q", h)
	}
	cmd.Process.Signal(os.Interrupt)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("proxy did not stop within 20s")
	}
	audit, _ := os.ReadFile(auditLog)
	if !strings.Contains(string(audit), `"notes":["probe: tagged"]`) {
		t.Errorf("audit log lacks the note:\n%s", audit)
	}
}

// The proxy's headroom for long module calls: one more P per call running
// long, back to the cores' number once they end; nothing when GOMAXPROCS
// is set in the environment.
func TestWasmHeadroomFollowsLongCalls(t *testing.T) {
	base := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(base)
	orig, had := os.LookupEnv("GOMAXPROCS")
	t.Cleanup(func() {
		if had {
			os.Setenv("GOMAXPROCS", orig)
		} else {
			os.Unsetenv("GOMAXPROCS")
		}
	})
	os.Unsetenv("GOMAXPROCS")
	logger := slog.New(slog.DiscardHandler)
	hook := wasmHeadroom(logger)
	if hook == nil {
		t.Fatal("no hook without GOMAXPROCS in the environment")
	}
	for _, n := range []int{2, 1, 0} {
		hook(n)
		if got := runtime.GOMAXPROCS(0); got != base+n {
			t.Fatalf("after %d long calls GOMAXPROCS is %d, want %d", n, got, base+n)
		}
	}
	os.Setenv("GOMAXPROCS", strconv.Itoa(base))
	if wasmHeadroom(logger) != nil {
		t.Fatal("a hook although GOMAXPROCS is set in the environment")
	}
}
