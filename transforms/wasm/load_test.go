package wasm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

func TestLoadRefusesWithTheNameOfWhatIsWrong(t *testing.T) {
	r := newRuntime(t, Config{})
	noHandlers := handler(opI64Const1...)
	noHandlers.exports = [][3]any{{"memory", 2, 0}}
	noMemory := handler(opI64Const1...)
	noMemory.memory = -1
	noMemory.exports = noMemory.exports[1:]
	unknownImport := handler(opI64Const1...)
	unknownImport.types = append(unknownImport.types, [2][]byte{nil, nil})
	unknownImport.imports = [][3]any{{"env", "launch_missiles", 2}}
	unknownImport.exports = [][3]any{{"memory", 2, 0}, {"handle_request", 0, 1}}
	wrongImportType := handler(opI64Const1...)
	wrongImportType.types = append(wrongImportType.types, [2][]byte{nil, nil})
	wrongImportType.imports = [][3]any{{"http_handler", "get_uri", 2}}
	wrongImportType.exports = [][3]any{{"memory", 2, 0}, {"handle_request", 0, 1}}
	wrongExport := handler(0x41, 0x01) // i32.const 1
	wrongExport.types[0] = [2][]byte{nil, {tI32}}
	// A command module: _start calls proc_exit(0).
	command := wmodule{
		types:   [][2][]byte{{nil, {tI64}}, {{tI32}, nil}, {nil, nil}},
		imports: [][3]any{{"wasi_snapshot_preview1", "proc_exit", 1}},
		funcs:   []wfunc{{0, opI64Const1}, {2, []byte{0x41, 0x00, 0x10, 0x00}}}, // i32.const 0; call 0
		memory:  1,
		exports: [][3]any{{"memory", 2, 0}, {"handle_request", 0, 1}, {"_start", 0, 2}},
	}
	tests := []struct {
		name string
		bin  []byte
		want string
	}{
		{"garbage", []byte("\x00asm\x01\x00\x00\x00\xff\xff"), "wasm module garbage: does not compile"},
		{"empty", nil, "wasm module empty: does not compile"},
		{"no-handlers", noHandlers.bytes(), "exports neither handle_request nor handle_response"},
		{"no-memory", noMemory.bytes(), `does not export its memory as "memory"`},
		{"unknown-import", unknownImport.bytes(), "imports function env.launch_missiles, which this host does not provide"},
		{"wrong-import-type", wrongImportType.bytes(), "imports http_handler.get_uri with type () -> (); the host's is (i32, i32) -> (i32)"},
		{"wrong-export-type", wrongExport.bytes(), "exports handle_request with type () -> (i32); the ABI's is () -> i64"},
		{"command", command.bytes(), "its start function exited with code 0: it is a command module"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := r.Load(context.Background(), tt.name, tt.bin, nil)
			if err == nil {
				m.Close(context.Background())
				t.Fatalf("Load succeeded; want an error containing %q", tt.want)
			}
			var we *Error
			if !errors.As(err, &we) || we.Module != tt.name {
				t.Fatalf("error %v (%T) does not name module %s", err, err, tt.name)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %q, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestLoadRefusesAGoCommandModule(t *testing.T) {
	r := newRuntime(t, Config{})
	_, err := r.Load(context.Background(), "cmd", guest(t, "command"), nil)
	if err == nil || !strings.Contains(err.Error(), "command module") {
		t.Fatalf("got %v, want a command-module refusal", err)
	}
}

func TestLoadReportsExportsImportsAndFeatures(t *testing.T) {
	r := newRuntime(t, Config{})
	m := probe(t, r, "init enable 3")
	if m.Features() != FeatureBufferRequest|FeatureBufferResponse {
		t.Errorf("features = %s, want buffer_request|buffer_response", m.Features())
	}
	if ex := strings.Join(m.Exports(), ","); !strings.Contains(ex, "handle_request") || !strings.Contains(ex, "handle_response") || !strings.Contains(ex, "_initialize") {
		t.Errorf("exports = %s", ex)
	}
	if im := strings.Join(m.Imports(), ","); !strings.Contains(im, "http_handler.get_header_names") || !strings.Contains(im, "sandgate.refuse") {
		t.Errorf("imports = %s", im)
	}
	// Trailers are not supported: asking for them enables only the rest.
	m2 := probe(t, r, "init enable 7")
	if m2.Features() != FeatureBufferRequest|FeatureBufferResponse {
		t.Errorf("enable_features(7) = %s, want trailers left out", m2.Features())
	}
}

func TestHandwrittenHandlerRuns(t *testing.T) {
	r := newRuntime(t, Config{})
	onlyRequest := handler(opI64Const1...)
	onlyRequest.exports = onlyRequest.exports[:2]
	m, err := r.Load(context.Background(), "min", onlyRequest.bytes(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close(context.Background())
	x, err := run(t, outbound(t, "GET", "/", ""), m)
	if err != nil || x.Answer() != nil {
		t.Fatalf("got %v, %+v; want the request to continue", err, x.Answer())
	}
	// next=0 with nothing written: the ABI's default empty 200.
	stop, err := r.Load(context.Background(), "stop", handler(opI64Const0...).bytes(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer stop.Close(context.Background())
	x, err = run(t, outbound(t, "GET", "/", ""), stop)
	if err != nil || x.Answer() == nil || x.Answer().Status != http.StatusOK || x.Answer().Refused || len(x.Answer().Body) != 0 {
		t.Fatalf("got %v, %+v; want the default empty 200", err, x.Answer())
	}
}

// TestStartFailureIsOneLineWithTheMessageOnce: a guest whose init refused
// its config (guest.Abort: log the message, then panic) was refused with
// the message in the log, again in "(stderr: panic: …)", and wazero's
// error with the guest's stack trace. The load error is one line naming the
// guest's message once, and nothing is logged above debug.
func TestStartFailureIsOneLineWithTheMessageOnce(t *testing.T) {
	tests := []struct {
		name   string
		script string
		want   string
	}{
		{"abort", "init log 2 probe:%20config%20must%20name%20a%20header\ninit panic", "wasm module probe: its start function failed: probe: config must name a header"},
		{"bare panic", "init panic", "wasm module probe: its start function failed: probe was told to panic"},
		{"last error logged", "init log 2 first\ninit log 2 second\ninit panic", "wasm module probe: its start function failed: second"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var logs syncbuf.Buffer
			r := newRuntime(t, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			m, err := r.Load(context.Background(), "probe", guest(t, "probe"), []byte(tt.script))
			if err == nil {
				m.Close(context.Background())
				t.Fatal("Load succeeded; want the start to fail")
			}
			if err.Error() != tt.want {
				t.Errorf("got %q, want %q", err, tt.want)
			}
			if tt.name == "abort" && strings.Contains(logs.String(), "must name a header") {
				t.Errorf("the message was logged as well as returned:\n%s", logs.String())
			}
			if tt.name == "last error logged" && !strings.Contains(logs.String(), "msg=first") {
				t.Errorf("the earlier error message was not logged:\n%s", logs.String())
			}
		})
	}
}

// TestStartErrorsLoggedWhenTheStartSucceeds: error messages a guest logs
// while it starts are held back only to explain a failed start.
func TestStartErrorsLoggedWhenTheStartSucceeds(t *testing.T) {
	var logs syncbuf.Buffer
	r := newRuntime(t, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	probe(t, r, "init log 2 deprecated%20config")
	if !strings.Contains(logs.String(), `level=ERROR msg="deprecated config" module=probe`) {
		t.Errorf("the start's error message was not logged:\n%s", logs.String())
	}
}

// TestLiveCounts: Live counts modules, their shared code and their
// instances, and closing every module brings each back to where it was.
func TestLiveCounts(t *testing.T) {
	r := newRuntime(t, Config{})
	ctx := context.Background()
	if got := r.Live(); got != (LiveCounts{}) {
		t.Fatalf("a new runtime holds %+v", got)
	}
	var mods []*Module
	for i := range 3 {
		m, err := r.Load(ctx, fmt.Sprint("probe", i), guest(t, "probe"), nil)
		if err != nil {
			t.Fatal(err)
		}
		mods = append(mods, m)
	}
	// Concurrent calls make a module start instances beyond its first.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { mustRun(t, outbound(t, "GET", "http://x/", ""), mods[0]) })
	}
	wg.Wait()
	got := r.Live()
	if got.Modules != 3 || got.Compiled != 1 || got.Instances < 3 {
		t.Fatalf("three modules of one binary: %+v, want 3 modules, 1 compiled, at least 3 instances", got)
	}
	for _, m := range mods {
		m.Close(ctx)
	}
	if got := r.Live(); got != (LiveCounts{}) {
		t.Errorf("every module closed, the runtime still holds %+v", got)
	}
}
