package wasm

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// Test guests are Go programs under testdata/, built once per test run with
// the Go toolchain into a temporary directory removed by TestMain.
var guests struct {
	mu   sync.Mutex
	dir  string
	bins map[string][]byte
}

func TestMain(m *testing.M) {
	code := m.Run()
	if guests.dir != "" {
		os.RemoveAll(guests.dir)
	}
	os.Exit(code)
}

func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(runtime.GOROOT(), "bin", "go")
}

// guest returns the wasm of testdata/<name>, built as a reactor.
func guest(t testing.TB, name string) []byte {
	t.Helper()
	guests.mu.Lock()
	defer guests.mu.Unlock()
	if b, ok := guests.bins[name]; ok {
		return b
	}
	if guests.dir == "" {
		dir, err := os.MkdirTemp("", "sandgate-wasm-guests-")
		if err != nil {
			t.Fatal(err)
		}
		guests.dir, guests.bins = dir, map[string][]byte{}
	}
	out := filepath.Join(guests.dir, name+".wasm")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	args := []string{"build", "-buildmode=c-shared", "-o", out, "./testdata/" + name}
	if name == "command" {
		args = []string{"build", "-o", out, "./testdata/" + name}
	}
	cmd := exec.CommandContext(ctx, goTool(), args...)
	cmd.Env = append(os.Environ(), "GOOS=wasip1", "GOARCH=wasm", "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building test guest %s: %v\n%s", name, err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	guests.bins[name] = b
	return b
}

// newRuntime returns a runtime whose compilation cache lives in the test's
// temporary directory, closed when the test ends.
func newRuntime(t testing.TB, cfg Config) *Runtime {
	t.Helper()
	if cfg.CacheDir == "" {
		cfg.CacheDir = filepath.Join(os.TempDir(), "sandgate-wasm-test-cache")
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

// syncBuffer is a log destination safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func jsonLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
