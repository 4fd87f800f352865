package wasm

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
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

// Call deadlines in tests. A test of normal work must not depend on a wall
// clock it does not control: on a loaded machine a call the guest finishes
// in microseconds can wait a long time for a CPU. So only a test in which
// every call into the runtime loops (or traps) uses a tight deadline;
// normal calls get normalCallTimeout, which only a hang exceeds, and a test
// that runs normal calls beside a looping one uses loopCallTimeout.
const (
	normalCallTimeout = time.Minute
	loopCallTimeout   = 2 * time.Second
)

// newRuntime returns a runtime whose compilation cache is the test
// process's own (shared by its tests), closed when the test ends.
func newRuntime(t testing.TB, cfg Config) *Runtime {
	t.Helper()
	if cfg.CacheDir == "" {
		cfg.CacheDir = gobuild.WasmCache(t)
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = normalCallTimeout
	}
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = time.Minute
	}
	r, err := NewRuntime(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if pin, ok := pins.LoadAndDelete(r); ok {
			pin.(*Module).Close(context.Background())
		}
		r.Close(context.Background())
	})
	return r
}

// pins holds, per runtime made by newRuntime, one loaded probe that keeps
// the probe's compiled code in the runtime while subtests load and close
// their own: otherwise each Load after the last Close decodes and
// validates the module again, about a second under the race detector.
var pins sync.Map // *Runtime → *Module

// probe loads the probe guest with a script (lines "PHASE CMD ARGS…").
func probe(t testing.TB, r *Runtime, script ...string) *Module {
	t.Helper()
	if _, ok := pins.Load(r); !ok {
		pin, err := r.Load(context.Background(), "probe", guest(t, "probe"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, raced := pins.LoadOrStore(r, pin); raced {
			pin.Close(context.Background())
		}
	}
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
