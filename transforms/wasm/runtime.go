package wasm

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/imports/wasi_snapshot_preview1"
)

// Config configures a Runtime. Zero values take the documented defaults.
type Config struct {
	// CacheDir holds wazero's compilation cache, so that a module compiled
	// once is not compiled again by the next process. Empty means
	// <os.UserCacheDir>/sandgate/wasm, or a directory under os.TempDir when
	// there is no user cache directory. "off" disables the disk cache.
	CacheDir string
	// MemoryLimitPages caps each instance's linear memory, in 64 KiB pages;
	// default 512 (32 MiB). A guest that grows past it fails its request
	// (a Go guest exits with "out of memory") and is replaced.
	MemoryLimitPages uint32
	// CallTimeout bounds each call into a guest (handle_request,
	// handle_response); default 100ms. A guest still running then is
	// stopped at its next function or loop entry (the checks Load adds to
	// its code) and its request fails. The runtime's watchdog enforces it
	// within a tenth of it (at most 10ms late), without arming a timer or
	// starting a goroutine per call.
	CallTimeout time.Duration
	// MaxConcurrentCalls caps the calls into guests running at once, all
	// modules together; default 2×GOMAXPROCS, at least 4. A guest's code
	// is preempted by the Go scheduler only at the yields of its checks,
	// after it has run for 10ms, so each running call holds a P (a slot of
	// GOMAXPROCS) for such slices until it returns or its deadline stops
	// it: the cap bounds how many Ps guests that loop can hold. Give the
	// process that many Ps more than it has cores (`sandgate proxy` does)
	// and looping guests never hold every P. A call waits for a slot,
	// bounded by its request's context and PoolWait (then 503).
	MaxConcurrentCalls int
	// LongCalls, when set, is told how many calls are running long — for
	// more than the watchdog's tick (CallTimeout/10, between 1 and 10 ms) —
	// each time that number changes, and 0 once they have ended. It is
	// called from the watchdog's goroutine and must not block for long. A
	// call that returns in microseconds never counts. `sandgate proxy` uses
	// it to give the process more Ps only while guests loop or run long
	// (see README.md, "Sandboxing and failure").
	LongCalls func(n int)
	// StartTimeout bounds instantiating a guest (its _initialize); default 5s.
	StartTimeout time.Duration
	// PoolSize caps the instances of one module alive at once (in use or
	// idle); default 8×GOMAXPROCS, at least 16. Instances start on demand
	// (a Go guest's is about 3 MiB of linear memory), and those left
	// unused for 30 s while the module serves are closed. A request keeps its
	// instance from handle_request until its response pass, across the
	// upstream's time to its response headers (seconds for a model call),
	// so the cap is on requests in flight through a module with a response
	// handler, not on CPU (MaxConcurrentCalls is); a module that says its
	// handle_response does nothing (sandgate_response_noop, as package
	// guest does) gives its instance back when handle_request returns.
	PoolSize int
	// PoolWait bounds how long a request waits for a free instance when
	// every one is busy; default 10s (the request's context may end it
	// sooner). Past it the request fails with 503.
	PoolWait time.Duration
	// MaxBodyBytes caps a body buffered for a module (buffer_request,
	// buffer_response) and a body a module writes; default 1 MiB. A request
	// body over it fails with 413, a response body with 502: never a silent
	// truncation.
	MaxBodyBytes int
	// MaxModuleBytes caps a module's size; default DefaultMaxModuleBytes.
	// A larger one is refused (ErrModuleTooLarge) before it is compiled.
	MaxModuleBytes int
	// MaxConcurrentLoads caps the modules read and compiled at once, all
	// callers together (compiling a large module takes memory of the order
	// of its size, several times over); default 1 per two Ps, at least 1.
	// MaxLoadQueue caps the loads waiting for one of those slots, each
	// for as long as its context allows; default 8. A load that finds the
	// queue full is refused at once (ErrLoadBusy: try again later).
	MaxConcurrentLoads, MaxLoadQueue int
	// MaxNotes and MaxNoteBytes cap the audit notes of one request (all
	// modules together) and the length of one note; defaults 32 and 1024.
	// A note over either cap is dropped and counted (audit notes_dropped).
	MaxNotes, MaxNoteBytes int
	// Logger receives what guests log (http_handler.log) and module
	// failures. Nil discards.
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.MemoryLimitPages == 0 {
		c.MemoryLimitPages = 512
	}
	if c.CallTimeout <= 0 {
		c.CallTimeout = 100 * time.Millisecond
	}
	if c.StartTimeout <= 0 {
		c.StartTimeout = 5 * time.Second
	}
	if c.PoolSize <= 0 {
		c.PoolSize = max(16, 8*runtime.GOMAXPROCS(0))
	}
	if c.MaxConcurrentCalls <= 0 {
		c.MaxConcurrentCalls = max(4, 2*runtime.GOMAXPROCS(0))
	}
	if c.PoolWait <= 0 {
		c.PoolWait = 10 * time.Second
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = 1 << 20
	}
	if c.MaxModuleBytes <= 0 {
		c.MaxModuleBytes = DefaultMaxModuleBytes
	}
	if c.MaxConcurrentLoads <= 0 {
		c.MaxConcurrentLoads = max(1, runtime.GOMAXPROCS(0)/2)
	}
	if c.MaxLoadQueue <= 0 {
		c.MaxLoadQueue = 8
	}
	if c.MaxNotes <= 0 {
		c.MaxNotes = 32
	}
	if c.MaxNoteBytes <= 0 {
		c.MaxNoteBytes = 1024
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// maxMemoryLimitPages is WebAssembly's own cap (4 GiB).
const maxMemoryLimitPages = 65536

// Runtime is the one wazero runtime every module runs in. It is safe for
// concurrent use. Close it when done: it releases the compiled code and
// every instance.
type Runtime struct {
	cfg   Config
	wr    wazero.Runtime
	cache wazero.CompilationCache
	// hostFuncs are the functions guests may import, by "module.name",
	// with their signatures.
	hostFuncs map[string]signature
	// wd enforces call deadlines; callSlots holds one token per running
	// call (MaxConcurrentCalls).
	wd        *watchdog
	callSlots chan struct{}
	// loadSlots holds one token per load reading or compiling a module
	// (MaxConcurrentLoads); loadWaiting counts those queued for one.
	loadSlots   chan struct{}
	loadWaiting atomic.Int64

	// modules and instances count those loaded and not closed, those
	// started and not closed (Live).
	modules, instances atomic.Int64

	mu       sync.Mutex
	compiled map[[32]byte]*compiledEntry
	closed   bool
}

// LiveCounts is what a runtime holds: a sandbox's modules closed on
// suspend and destroy leave these where they were before it loaded them.
type LiveCounts struct {
	// Modules are loaded and not closed; Compiled their distinct code
	// (modules loaded from the same bytes share it); Instances started and
	// not closed, idle or serving a call.
	Modules, Compiled, Instances int
}

// Live counts what the runtime holds now.
func (r *Runtime) Live() LiveCounts {
	r.mu.Lock()
	compiled := len(r.compiled)
	r.mu.Unlock()
	return LiveCounts{Modules: int(r.modules.Load()), Compiled: compiled, Instances: int(r.instances.Load())}
}

type compiledEntry struct {
	// ready is closed once cm (or err) is set: loads of the same bytes
	// wait for the one compiling them, without holding the runtime's lock.
	ready chan struct{}
	err   error
	cm    wazero.CompiledModule
	refs  int
	// start says whether the guest had a start section, now the export
	// boundStartName.
	start bool
}

// NewRuntime creates the runtime: wazero's compiler with the compilation
// cache and memory limit, and the host modules.
func NewRuntime(ctx context.Context, cfg Config) (*Runtime, error) {
	cfg = cfg.withDefaults()
	if cfg.MemoryLimitPages > maxMemoryLimitPages {
		return nil, fmt.Errorf("wasm: MemoryLimitPages %d is over WebAssembly's %d (4 GiB); use a smaller limit", cfg.MemoryLimitPages, maxMemoryLimitPages)
	}
	// No WithCloseOnContextDone: calls are bounded by the checks bound
	// adds to every guest (bound.go), which cost a call nothing until it
	// must stop.
	//
	// No debug info: with it, wazero keeps every custom section of every
	// module compiled (a Go guest's DWARF is megabytes; a hostile upload's
	// custom section is as large as the module cap), for source lines in
	// a guest's stack trace, which sandgate's failures do not print.
	rc := wazero.NewRuntimeConfigCompiler().
		WithMemoryLimitPages(cfg.MemoryLimitPages).
		WithDebugInfoEnabled(false)
	var cache wazero.CompilationCache
	if cfg.CacheDir != "off" {
		dir, err := cacheDir(cfg.CacheDir)
		if err != nil {
			return nil, err
		}
		if cache, err = wazero.NewCompilationCacheWithDir(dir); err != nil {
			return nil, fmt.Errorf("wasm: compilation cache %s: %w (set another directory, or \"off\")", dir, err)
		}
		rc = rc.WithCompilationCache(cache)
	}
	r := &Runtime{cfg: cfg, wr: wazero.NewRuntimeWithConfig(ctx, rc), cache: cache, compiled: map[[32]byte]*compiledEntry{},
		wd: newWatchdog(cfg.CallTimeout, cfg.LongCalls), callSlots: make(chan struct{}, cfg.MaxConcurrentCalls),
		loadSlots: make(chan struct{}, cfg.MaxConcurrentLoads)}
	if _, err := wasi_snapshot_preview1.Instantiate(ctx, r.wr); err != nil {
		r.Close(ctx)
		return nil, fmt.Errorf("wasm: instantiating WASI: %w", err)
	}
	if err := r.instantiateHost(ctx); err != nil {
		r.Close(ctx)
		return nil, err
	}
	r.hostFuncs = map[string]signature{}
	for _, mod := range []string{wasi_snapshot_preview1.ModuleName, moduleHTTPHandler, moduleSandgate} {
		for name, def := range r.wr.Module(mod).ExportedFunctionDefinitions() {
			r.hostFuncs[mod+"."+name] = signature{params: string(def.ParamTypes()), results: string(def.ResultTypes())}
		}
	}
	return r, nil
}

// cacheDir resolves the compilation cache directory and creates it.
func cacheDir(dir string) (string, error) {
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			base = os.TempDir()
		}
		dir = filepath.Join(base, "sandgate", "wasm")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("wasm: compilation cache directory: %w (give another directory, or \"off\" for no cache)", err)
	}
	return dir, nil
}

// Config returns the runtime's configuration, defaults filled in.
func (r *Runtime) Config() Config { return r.cfg }

// Close releases every module's instances and compiled code. Modules
// loaded from r must not be used after.
func (r *Runtime) Close(ctx context.Context) error {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.wd.close()
	err := r.wr.Close(ctx)
	if r.cache != nil {
		err = errors.Join(err, r.cache.Close(ctx))
	}
	return err
}

// compile returns the compiled form of bin, its time checks added (bound),
// shared by every module loaded from the same bytes; release it with
// uncompile. The runtime's lock is not held while it compiles.
func (r *Runtime) compile(ctx context.Context, bin []byte) (*compiledEntry, [32]byte, error) {
	key := sha256.Sum256(bin)
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil, key, errors.New("runtime is closed")
	}
	if e := r.compiled[key]; e != nil {
		e.refs++
		r.mu.Unlock()
		<-e.ready
		if e.err != nil {
			r.uncompile(ctx, key)
			return nil, key, e.err
		}
		return e, key, nil
	}
	e := &compiledEntry{ready: make(chan struct{}), refs: 1}
	r.compiled[key] = e
	r.mu.Unlock()
	e.cm, e.start, e.err = r.compileNew(ctx, bin)
	close(e.ready)
	if e.err != nil {
		r.uncompile(ctx, key)
		return nil, key, e.err
	}
	return e, key, nil
}

func (r *Runtime) compileNew(ctx context.Context, bin []byte) (wazero.CompiledModule, bool, error) {
	b, err := bound(bin)
	if err != nil {
		return nil, false, err
	}
	cm, err := r.wr.CompileModule(ctx, b.bin)
	if err != nil {
		// Say what is wrong in the guest's own terms (its function
		// indices, not the rewritten ones).
		if cm, oerr := r.wr.CompileModule(ctx, bin); oerr != nil {
			return nil, false, oerr
		} else {
			cm.Close(ctx)
		}
		return nil, false, fmt.Errorf("compiles, but not once its time checks are added (a bug in sandgate): %w", err)
	}
	return cm, b.start, nil
}

func (r *Runtime) uncompile(ctx context.Context, key [32]byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.compiled[key]
	if e == nil {
		return
	}
	if e.refs--; e.refs == 0 {
		delete(r.compiled, key)
		if !r.closed && e.cm != nil {
			e.cm.Close(ctx)
		}
	}
}

// signature is a function type as strings of wazero value types.
type signature struct{ params, results string }
