//go:build !wasip1

package guest_test

import (
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// abi lists every function of the http-wasm handler ABI's host module
// "http_handler" with its signature as the ABI document declares it
// (https://http-wasm.io/http-handler-abi/), and sandgate's host module
// "sandgate" as transforms/wasm implements it.
var abi = map[string]string{
	"http_handler.enable_features":      "(i32) i32",
	"http_handler.get_config":           "(i32,i32) i32",
	"http_handler.log":                  "(i32,i32,i32) ",
	"http_handler.log_enabled":          "(i32) i32",
	"http_handler.get_method":           "(i32,i32) i32",
	"http_handler.set_method":           "(i32,i32) ",
	"http_handler.get_uri":              "(i32,i32) i32",
	"http_handler.set_uri":              "(i32,i32) ",
	"http_handler.get_protocol_version": "(i32,i32) i32",
	"http_handler.get_source_addr":      "(i32,i32) i32",
	"http_handler.get_header_names":     "(i32,i32,i32) i64",
	"http_handler.get_header_values":    "(i32,i32,i32,i32,i32) i64",
	"http_handler.set_header_value":     "(i32,i32,i32,i32,i32) ",
	"http_handler.add_header_value":     "(i32,i32,i32,i32,i32) ",
	"http_handler.remove_header":        "(i32,i32,i32) ",
	"http_handler.read_body":            "(i32,i32,i32) i64",
	"http_handler.write_body":           "(i32,i32,i32) ",
	"http_handler.get_status_code":      "() i32",
	"http_handler.set_status_code":      "(i32) ",
	"sandgate.sandbox_id":               "(i32,i32) i32",
	"sandgate.audit_note":               "(i32,i32) ",
	"sandgate.refuse":                   "(i32,i32,i32) ",
}

// exports are what every module built with the library exports: the two
// handlers with the ABI's signatures, and the reactor's initialiser.
var exports = map[string]string{
	"handle_request":         "() i64",
	"handle_response":        "(i32,i32) ",
	"sandgate_response_noop": "() i32",
	"_initialize":            "() ",
}

// module is what a compiled module imports from the http-wasm host modules
// and exports, as "name" → "signature".
type module struct {
	imports, exports map[string]string
	memory           bool
}

// compile builds testdata/<name> as a wasip1 reactor and reads its import
// and export sections.
func compile(t *testing.T, name string) module {
	t.Helper()
	if testing.Short() {
		t.Skip("builds a wasm module with the Go toolchain; skipped in -short mode")
	}
	bin, err := os.ReadFile(gobuild.WasmBinary(t, "./testdata/"+name))
	if err != nil {
		t.Fatal(err)
	}
	m, err := readSections(bin)
	if err != nil {
		t.Fatalf("reading %s: %v", name, err)
	}
	return m
}

// checkShape asserts what every module made with the library has: memory
// and the handler exports with the ABI's signatures.
func checkShape(t *testing.T, m module) {
	t.Helper()
	if !m.memory {
		t.Error(`no "memory" export: the host cannot read or write the module's buffers`)
	}
	for n, want := range exports {
		if got, ok := m.exports[n]; !ok || got != want {
			t.Errorf("export %s = %q (present %v), want %q", n, got, ok, want)
		}
	}
}

func TestEveryBindingMatchesTheABI(t *testing.T) {
	m := compile(t, "all")
	checkShape(t, m)
	for name, want := range abi {
		if !strings.HasPrefix(name, "http_handler.") {
			continue
		}
		if got, ok := m.imports[name]; !ok {
			t.Errorf("%s is not imported by a module that uses every function of package guest", name)
		} else if got != want {
			t.Errorf("%s imported as %s, the ABI says %s", name, got, want)
		}
	}
	for name := range m.imports {
		if !strings.HasPrefix(name, "http_handler.") {
			t.Errorf("a module using only package guest imports %s", name)
		}
	}
}

// TestAModuleImportsOnlyWhatItUses is the portability promise: a module
// that calls nothing of package sandgate imports nothing from "sandgate"
// and runs on any http-wasm host.
func TestAModuleImportsOnlyWhatItUses(t *testing.T) {
	m := compile(t, "none")
	checkShape(t, m)
	if len(m.imports) != 0 {
		t.Errorf("a module that calls no host function imports %v", slices.Sorted(maps.Keys(m.imports)))
	}
}

func TestSandgateBindingsMatchTheHost(t *testing.T) {
	m := compile(t, "sandgateonly")
	checkShape(t, m)
	for name, want := range abi {
		if !strings.HasPrefix(name, "sandgate.") {
			continue
		}
		if got, ok := m.imports[name]; !ok || got != want {
			t.Errorf("%s imported as %q (present %v), want %s", name, got, ok, want)
		}
	}
	for name := range m.imports {
		if strings.HasPrefix(name, "http_handler.") {
			t.Errorf("a module calling only package sandgate imports %s", name)
		}
	}
}
