package wasm

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/internal/gobuild"
)

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// guest returns the wasm of testdata/<name>, a Go program built once per
// test run as a reactor ("command" as a command module).
func guest(t testing.TB, name string) []byte {
	t.Helper()
	build := gobuild.Wasm
	if name == "command" {
		build = gobuild.WasmCommand
	}
	b, err := os.ReadFile(build(t, "./testdata/"+name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// newRuntime returns a runtime whose compilation cache is the test
// process's own (shared by its tests), closed when the test ends.
func newRuntime(t testing.TB, cfg Config) *Runtime {
	t.Helper()
	if cfg.CacheDir == "" {
		cfg.CacheDir = gobuild.Scratch(t, "wasm-cache")
	}
	r, err := NewRuntime(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(context.Background()) })
	return r
}

// probe loads the probe guest with a script (lines "PHASE CMD ARGS…").
func probe(t testing.TB, r *Runtime, script ...string) *Module {
	t.Helper()
	m, err := r.Load(context.Background(), "probe", guest(t, "probe"), []byte(strings.Join(script, "\n")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(context.Background()) })
	return m
}

// outbound returns a request shaped like the one the proxy sends upstream.
func outbound(t testing.TB, method, uri string, body string, hdr ...string) *http.Request {
	t.Helper()
	var rb io.Reader
	if body != "" {
		rb = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "https://api.example.com"+uri, rb)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	return req
}

var info = RequestInfo{Sandbox: "sb-1", SourceAddr: "127.0.0.1:5555", Proto: "HTTP/1.1"}

// run runs req through mods and returns the exchange (closed at cleanup).
func run(t testing.TB, req *http.Request, mods ...*Module) (*Exchange, error) {
	t.Helper()
	x, err := HandleRequest(context.Background(), req, info, NewChain(mods...))
	t.Cleanup(x.Close)
	return x, err
}

// mustRun runs req through mods, closes the exchange (as if the upstream
// failed, so handle_response runs with is_error=1), fails the test on
// error and returns the notes.
func mustRun(t testing.TB, req *http.Request, mods ...*Module) []string {
	t.Helper()
	x, err := HandleRequest(context.Background(), req, info, NewChain(mods...))
	x.Close()
	if err != nil {
		t.Fatal(err)
	}
	return x.Notes()
}

func jsonLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
