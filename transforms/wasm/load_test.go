package wasm

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
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
