// Package gobuild builds the programs tests run for real — the sandgate
// binary and WebAssembly guest modules — once per test process each, with
// the Go toolchain running the tests.
package gobuild

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

type result struct {
	path string
	err  error
}

var (
	mu    sync.Mutex
	once  = map[string]*sync.Once{}
	built = map[string]*result{}
	dir   string
)

// Sandgate returns the path of ./cmd/sandgate built for this machine,
// compiled as the image's build stage compiles it (ImageEnv, ImageFlags:
// static, no local paths), so that tests run what the image runs and the
// image test (cmd/sandgate) only has to link. Its wazero calls itself
// "dev", as it does in a test binary, so that the binary and race-built
// tests share compiled modules (see WasmCache): give it `--wasm-cache-dir`
// WasmCache(t) when it loads modules.
func Sandgate(t testing.TB) string {
	t.Helper()
	p, err := SandgateBinary()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// SandgateBinary is Sandgate for code that has no testing.TB: a TestMain
// that starts a service before any test runs.
func SandgateBinary() (string, error) {
	return buildPath("github.com/sandgate/sandgate/cmd/sandgate", "sandgate", ImageEnv, append([]string{wazeroDevVersion}, ImageFlags...))
}

// ImageEnv and ImageFlags are how the Dockerfile's build stage compiles
// sandgate (cmd/sandgate's image test checks that it still does): what
// decides how each package compiles, and so what the build cache shares
// between Sandgate and that stage. Its -ldflags only change the link.
var (
	ImageEnv   = []string{"CGO_ENABLED=0"}
	ImageFlags = []string{"-trimpath"}
)

// GoogleCLI returns the path of internal/testkit/googlecli, a stand-in for Google's
// Cloud Run sandbox CLI, installed as `sandbox` (the name by which
// appliance.Launcher knows Google's CLI) beside a `sandgate` that is
// Sandgate(t), which it runs underneath.
func GoogleCLI(t testing.TB) string {
	t.Helper()
	bin := Sandgate(t)
	p := build(t, "github.com/sandgate/sandgate/internal/testkit/googlecli", filepath.Join("googlecli", "sandbox"), nil, nil)
	linkOnce.Do(func() {
		linkErr = os.Symlink(bin, filepath.Join(filepath.Dir(p), "sandgate"))
	})
	if linkErr != nil {
		t.Fatalf("installing sandgate beside the Google CLI stand-in: %v", linkErr)
	}
	return p
}

var (
	linkOnce sync.Once
	linkErr  error
)

// Static returns the path of the Go package pkg (an import path) built as
// a static program for this machine, as the image builds sandgate: one that
// runs inside a sandbox, whatever its image.
func Static(t testing.TB, pkg string) string {
	t.Helper()
	return build(t, pkg, filepath.Join("static", filepath.Base(pkg)), ImageEnv, ImageFlags)
}

// Wasm returns the path of the Go package pkg (an import path, or a
// directory) built as a WebAssembly reactor module (GOOS=wasip1
// GOARCH=wasm -buildmode=c-shared), the form sandgate loads.
func Wasm(t testing.TB, pkg string) string {
	t.Helper()
	p := WasmBinary(t, pkg)
	warmWasmCache(t, p)
	return p
}

// WasmBinary is Wasm for a test that only reads the module's bytes: it is
// not compiled into WasmCache.
func WasmBinary(t testing.TB, pkg string) string {
	t.Helper()
	return wasm(t, pkg, []string{"-buildmode=c-shared"}, ".wasm")
}

// WasmCommand returns pkg built as a WebAssembly command module (the Go
// default: its start function runs main and exits), which sandgate must
// refuse.
func WasmCommand(t testing.TB, pkg string) string {
	t.Helper()
	p := wasm(t, pkg, nil, ".command.wasm")
	warmWasmCache(t, p)
	return p
}

func wasm(t testing.TB, pkg string, flags []string, suffix string) string {
	t.Helper()
	if !strings.HasPrefix(pkg, "github.com/") {
		abs, err := filepath.Abs(pkg)
		if err != nil {
			t.Fatal(err)
		}
		pkg = abs
	}
	// A module is named after its file: keep the package's own name, in a
	// directory of its own per package.
	sub := strings.NewReplacer("/", "_", ".", "_").Replace(strings.TrimPrefix(pkg, "github.com/sandgate/sandgate/"))
	name := filepath.Join(sub, filepath.Base(pkg)+suffix)
	return build(t, pkg, name, []string{"GOOS=wasip1", "GOARCH=wasm", "CGO_ENABLED=0"}, flags)
}

func build(t testing.TB, pkg, name string, env, flags []string) string {
	t.Helper()
	p, err := buildPath(pkg, name, env, flags)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// buildPath builds pkg once per process and returns the path of the result.
func buildPath(pkg, name string, env, flags []string) (string, error) {
	key := pkg + "\x00" + strings.Join(env, " ") + "\x00" + strings.Join(flags, " ")
	mu.Lock()
	o := once[key]
	if o == nil {
		o = new(sync.Once)
		once[key] = o
	}
	mu.Unlock()
	o.Do(func() {
		r := &result{}
		defer func() { mu.Lock(); built[key] = r; mu.Unlock() }()
		d, err := outDir()
		if err != nil {
			r.err = err
			return
		}
		r.path = filepath.Join(d, name)
		if r.err = os.MkdirAll(filepath.Dir(r.path), 0o755); r.err != nil {
			return
		}
		// No VCS stamp: a checkout owned by another user (CI, or tests
		// run as non-root) makes git refuse to report its status.
		args := append([]string{"build", "-buildvcs=false", "-o", r.path}, flags...)
		// go test puts its own toolchain first on the tests' PATH.
		cmd := exec.Command("go", append(args, pkg)...)
		cmd.Env = append(os.Environ(), env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			r.err = fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
		}
	})
	mu.Lock()
	r := built[key]
	mu.Unlock()
	return r.path, r.err
}

// Scratch returns a directory named name that lives as long as the builds
// (until Cleanup), for what a test process shares between its tests, such
// as a module compilation cache.
func Scratch(t testing.TB, name string) string {
	t.Helper()
	d, err := outDir()
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(d, name)
	if err := os.MkdirAll(p, 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// Cleanup removes what was built. Call it from TestMain after m.Run: builds
// outlive the test that asked first, so no t.Cleanup can remove them.
func Cleanup() {
	mu.Lock()
	defer mu.Unlock()
	if dir != "" {
		os.RemoveAll(dir)
		dir = ""
		once = map[string]*sync.Once{}
		built = map[string]*result{}
		linkOnce, linkErr = sync.Once{}, nil
	}
}

// outDir is one temporary directory per test process.
func outDir() (string, error) {
	mu.Lock()
	defer mu.Unlock()
	if dir == "" {
		d, err := os.MkdirTemp("", "sandgate-gobuild-")
		if err != nil {
			return "", err
		}
		dir = d
	}
	return dir, nil
}

// WasmCache returns the directory tests give transforms/wasm as its
// compilation cache (wasm.Config.CacheDir). It is shared by every test
// process of this user and outlives them: compiling a Go guest under the
// race detector takes wazero about fifteen seconds, so a module is compiled
// once, by the uninstrumented sandgate binary (see warmWasmCache), and every
// test process loads the result. Without a usable cache directory (a user
// with no home) it is a directory of this process's own.
func WasmCache(t testing.TB) string {
	t.Helper()
	cacheOnce.Do(func() { cacheDir = sharedWasmCache() })
	if cacheDir == "" {
		return Scratch(t, "wasm-cache")
	}
	return cacheDir
}

var (
	cacheOnce sync.Once
	cacheDir  string
)

func sharedWasmCache() string {
	base, err := os.UserCacheDir()
	if err != nil {
		return ""
	}
	dir := filepath.Join(base, "sandgate-test", "wasm")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return ""
	}
	return dir
}

// wazeroDevVersion makes the binary's wazero call itself "dev", as it does
// inside a test binary (which carries no module versions): the version is
// part of wazero's cache key, so only then do the race-built tests find
// what the binary compiled.
const wazeroDevVersion = "-ldflags=-X github.com/tetratelabs/wazero/internal/version.version=dev"

// warmWasmCache compiles module into WasmCache with a sandgate binary built
// without the race detector (`sandgate wasm check`, ~2 s where a race-built
// test takes ~15 s). Whether the module then loads does not matter: the
// compilation is cached before anything runs, and a test that loads the
// module reports its own errors.
func warmWasmCache(t testing.TB, module string) {
	t.Helper()
	dir := WasmCache(t)
	_ = exec.Command(Sandgate(t), "wasm", "check", "--wasm-cache-dir", dir, module).Run()
}
