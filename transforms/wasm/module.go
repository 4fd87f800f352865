package wasm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
	"github.com/tetratelabs/wazero/sys"
)

// The guest's exports, as the ABI names them.
const (
	exportHandleRequest  = "handle_request"
	exportHandleResponse = "handle_response"
	exportMemory         = "memory"
	// exportResponseNoop is sandgate's optional export
	// sandgate_response_noop() -> i32, asked once per instance after it
	// started: 1 means its handle_response does nothing (the guest library
	// exports it, answering 1 when no response handler is registered), so
	// a request gives the instance back right after handle_request
	// instead of keeping it while the upstream answers.
	exportResponseNoop = "sandgate_response_noop"
)

// Module is one guest: compiled once, with its name and config bytes, and a
// capped pool of instances. It is safe for concurrent use.
type Module struct {
	rt     *Runtime
	name   string
	config []byte
	cm     wazero.CompiledModule
	key    [32]byte // sha256 of its bytes
	size   int
	// start says whether the guest has a start section (bound exported it
	// as boundStartName; it runs first when an instance starts).
	start bool
	// hasRequest and hasResponse say which handlers the guest exports.
	hasRequest, hasResponse bool
	// features are what the first instance enabled while it started; every
	// instance starts the same way.
	features Features
	imports  []string
	exports  []string

	slots chan struct{} // one token per instance in use
	mu    sync.Mutex
	idle  []*instance
	done  bool
}

// instance is one instantiation of a module, used by one request at a time.
type instance struct {
	mod            api.Module
	handleRequest  api.Function
	handleResponse api.Function
	features       Features
	// responseNoop is the instance's answer to sandgate_response_noop:
	// its handle_response does nothing and is not called.
	responseNoop bool
	stderr       headBuffer
	stack        [2]uint64
	// cc is the context of every call into the instance; the runtime's
	// watchdog closes its Done channel to stop a call.
	cc *callCtx
	// broken is set when the instance failed or was stopped: put closes it
	// instead of pooling it.
	broken bool
	// idleSince is when the instance last went back to the pool.
	idleSince time.Time
}

// LoadFile loads the module in the file at path, named after the file
// (without .wasm), with config bytes.
func (r *Runtime) LoadFile(ctx context.Context, path string, config []byte) (*Module, error) {
	name := strings.TrimSuffix(filepath.Base(path), ".wasm")
	bin, err := os.ReadFile(path)
	if err != nil {
		return nil, loadError(name, err, "cannot read %s", path)
	}
	return r.Load(ctx, name, bin, config)
}

// DefaultMaxModuleBytes is the largest module a runtime loads
// (Config.MaxModuleBytes): Go's own guests are a few MiB, TinyGo's a few
// hundred KiB.
const DefaultMaxModuleBytes = 32 << 20

// Errors of a load that never reached the module's code.
var (
	// ErrModuleTooLarge: the module is over Config.MaxModuleBytes.
	ErrModuleTooLarge = errors.New("module too large")
	// ErrLoadBusy: as many loads as the runtime takes are compiling and
	// queued (Config.MaxConcurrentLoads, MaxLoadQueue); try again later.
	ErrLoadBusy = errors.New("too many modules loading at once")
)

// acquireLoad takes one of the runtime's load slots, queuing for it while
// ctx allows, unless the queue is full (ErrLoadBusy).
func (r *Runtime) acquireLoad(ctx context.Context, name string) (func(), error) {
	release := func() { <-r.loadSlots }
	select {
	case r.loadSlots <- struct{}{}:
		return release, nil
	default:
	}
	if r.loadWaiting.Add(1) > int64(r.cfg.MaxLoadQueue) {
		r.loadWaiting.Add(-1)
		return nil, loadError(name, ErrLoadBusy, "%d modules are loading and %d waiting, as many as this service takes at once; try again shortly", cap(r.loadSlots), r.cfg.MaxLoadQueue)
	}
	defer r.loadWaiting.Add(-1)
	select {
	case r.loadSlots <- struct{}{}:
		return release, nil
	case <-ctx.Done():
		return nil, loadError(name, context.Cause(ctx), "gave up waiting for its turn to load (%d load at once)", cap(r.loadSlots))
	}
}

// LoadReader is Load of the module read from src, at most
// Config.MaxModuleBytes of it (more is ErrModuleTooLarge): it is read only
// once one of the runtime's load slots is held, so loads queued behind
// others hold none of their bytes in memory.
func (r *Runtime) LoadReader(ctx context.Context, name string, src io.Reader, config []byte) (*Module, error) {
	return r.loadInTurn(ctx, name, config, func() ([]byte, error) {
		return io.ReadAll(io.LimitReader(src, int64(r.cfg.MaxModuleBytes)+1))
	})
}

// Load compiles bin (or reuses its compiled form), checks it, and starts
// one instance, which stays in the pool. It refuses, naming what is wrong, a
// module that does not compile, imports a function no host module provides
// (or with another signature), exports neither handle_request nor
// handle_response (or either with the wrong signature), exports no memory,
// or whose start function exits (a command module). name identifies the
// module in errors, logs and audit events. At most Config.MaxConcurrentLoads
// load at once (the others queue, up to Config.MaxLoadQueue: past it
// ErrLoadBusy), and a module over Config.MaxModuleBytes is
// ErrModuleTooLarge.
func (r *Runtime) Load(ctx context.Context, name string, bin []byte, config []byte) (*Module, error) {
	return r.loadInTurn(ctx, name, config, func() ([]byte, error) { return bin, nil })
}

// loadInTurn loads the module read gets, once a load slot is held.
func (r *Runtime) loadInTurn(ctx context.Context, name string, config []byte, read func() ([]byte, error)) (*Module, error) {
	if name == "" {
		name = "module"
	}
	release, err := r.acquireLoad(ctx, name)
	if err != nil {
		return nil, err
	}
	defer release()
	bin, err := read()
	if err != nil {
		return nil, loadError(name, err, "cannot read it")
	}
	return r.load(ctx, name, bin, config)
}

func (r *Runtime) load(ctx context.Context, name string, bin []byte, config []byte) (*Module, error) {
	if len(bin) > r.cfg.MaxModuleBytes {
		return nil, loadError(name, ErrModuleTooLarge, "is over the %d bytes a module may be (Config.MaxModuleBytes, `--wasm-max-module`)", r.cfg.MaxModuleBytes)
	}
	ce, key, err := r.compile(ctx, bin)
	if err != nil {
		return nil, loadError(name, err, "does not compile")
	}
	m := &Module{rt: r, name: name, config: slices.Clone(config), cm: ce.cm, key: key, start: ce.start, slots: make(chan struct{}, r.cfg.PoolSize)}
	if err := m.check(); err != nil {
		r.uncompile(ctx, key)
		return nil, err
	}
	m.slots <- struct{}{}
	inst, err := m.instantiate(ctx)
	if err != nil {
		<-m.slots
		r.uncompile(ctx, key)
		return nil, err
	}
	m.features = inst.features
	m.size = len(bin)
	r.modules.Add(1)
	m.put(inst)
	return m, nil
}

// Digest is the module's sha256, as "sha256:<hex>".
func (m *Module) Digest() string { return "sha256:" + hex.EncodeToString(m.key[:]) }

// Size is the module's bytes.
func (m *Module) Size() int { return m.size }

// check validates imports and exports against the ABI.
func (m *Module) check() error {
	for _, def := range m.cm.ImportedFunctions() {
		mod, fn, _ := def.Import()
		if mod == boundModule {
			continue // added by bound
		}
		full := mod + "." + fn
		if !slices.Contains(m.imports, full) { // a guest may import one function twice
			m.imports = append(m.imports, full)
		}
		want, ok := m.rt.hostFuncs[full]
		if !ok {
			return loadError(m.name, nil, "imports function %s, which this host does not provide (it provides http_handler.*, sandgate.* and wasi_snapshot_preview1.*; see transforms/wasm/README.md)", full)
		}
		got := signature{params: string(def.ParamTypes()), results: string(def.ResultTypes())}
		if got != want {
			return loadError(m.name, nil, "imports %s with type %s; the host's is %s", full, got, want)
		}
	}
	for _, def := range m.cm.ImportedMemories() {
		mod, n, _ := def.Import()
		return loadError(m.name, nil, "imports memory %s.%s; a guest must define and export its own memory", mod, n)
	}
	exports := m.cm.ExportedFunctions()
	for n := range exports {
		if n != boundStartName { // added by bound
			m.exports = append(m.exports, n)
		}
	}
	slices.Sort(m.exports)
	if def, ok := exports[exportHandleRequest]; ok {
		if got := (signature{string(def.ParamTypes()), string(def.ResultTypes())}); got != (signature{"", string([]api.ValueType{api.ValueTypeI64})}) {
			return loadError(m.name, nil, "exports handle_request with type %s; the ABI's is () -> i64", got)
		}
		m.hasRequest = true
	}
	if def, ok := exports[exportHandleResponse]; ok {
		if got := (signature{string(def.ParamTypes()), string(def.ResultTypes())}); got != (signature{string([]api.ValueType{api.ValueTypeI32, api.ValueTypeI32}), ""}) {
			return loadError(m.name, nil, "exports handle_response with type %s; the ABI's is (i32, i32) -> ()", got)
		}
		m.hasResponse = true
	}
	if def, ok := exports[exportResponseNoop]; ok {
		if got := (signature{string(def.ParamTypes()), string(def.ResultTypes())}); got != (signature{"", string([]api.ValueType{api.ValueTypeI32})}) {
			return loadError(m.name, nil, "exports %s with type %s; sandgate's is () -> i32", exportResponseNoop, got)
		}
	}
	if !m.hasRequest && !m.hasResponse {
		return loadError(m.name, nil, "exports neither handle_request nor handle_response; an http-wasm guest exports at least one (Go: //go:wasmexport handle_request)")
	}
	if _, ok := m.cm.ExportedMemories()[exportMemory]; !ok {
		return loadError(m.name, nil, "does not export its memory as %q, which the ABI requires", exportMemory)
	}
	return nil
}

func (s signature) String() string {
	f := func(ts string) string {
		var out []string
		for _, t := range []byte(ts) {
			out = append(out, api.ValueTypeName(t))
		}
		return strings.Join(out, ", ")
	}
	return "(" + f(s.params) + ") -> (" + f(s.results) + ")"
}

// Name returns the module's name.
func (m *Module) Name() string { return m.name }

// Config returns a copy of the module's config bytes.
func (m *Module) Config() []byte { return slices.Clone(m.config) }

// Features returns the features the module enabled while it started
// (enable_features in its _initialize). A module may enable more per
// request; those are not reported here.
func (m *Module) Features() Features { return m.features }

// Imports returns the functions the module imports, as "module.name",
// sorted, each once (Go's wasip1 guests import fd_write twice).
func (m *Module) Imports() []string { return slices.Sorted(slices.Values(m.imports)) }

// Exports returns the names of the functions the module exports, sorted.
func (m *Module) Exports() []string { return slices.Clone(m.exports) }

// Close closes the module's idle instances now and its busy ones when
// they are returned, and releases its compiled code.
func (m *Module) Close(ctx context.Context) error {
	m.mu.Lock()
	if m.done {
		m.mu.Unlock()
		return nil
	}
	m.done = true
	idle := m.idle
	m.idle = nil
	m.mu.Unlock()
	m.rt.modules.Add(-1)
	for _, inst := range idle {
		m.closeInstance(inst)
	}
	m.rt.uncompile(ctx, m.key)
	return nil
}

// startFunctions are the functions an instance runs when it starts, each
// if the guest exports it, as wazero's WithStartFunctions would: the
// guest's start section (exported by bound), then the WASI reactor's and
// command's entry points.
var startFunctions = []string{boundStartName, "_initialize", "_start"}

// instantiate starts a new instance. The caller holds a slot.
//
// The start functions are not left to wazero: they run under the
// watchdog's time limit (StartTimeout) like any call, which needs the
// instance's stop global, so they are called once it is instantiated.
func (m *Module) instantiate(ctx context.Context) (*instance, error) {
	inst := &instance{}
	cfg := wazero.NewModuleConfig().
		WithName("").
		WithArgs(m.name).
		WithStartFunctions().
		WithSysNanotime().
		WithRandSource(rand.Reader).
		WithStdout(io.Discard).
		WithStderr(&inst.stderr)
	mod, err := m.rt.wr.InstantiateModule(ctx, m.cm, cfg)
	if err != nil {
		return nil, loadError(m.name, err, "cannot be instantiated%s", inst.stderr.suffix())
	}
	stop, ok := mod.ExportedGlobal(boundStopName).(api.MutableGlobal)
	m.rt.instances.Add(1)
	if !ok { // cannot happen: bound exports it
		m.rt.instances.Add(-1)
		mod.Close(ctx)
		return nil, loadError(m.name, nil, "has no %s global", boundStopName)
	}
	inst.mod = mod
	inst.cc = newCallCtx(stop)
	m.rt.wd.add(inst.cc)
	st := &callState{m: m, inst: inst, phase: phaseStart}
	for _, name := range startFunctions {
		fn := mod.ExportedFunction(name)
		if fn == nil {
			continue
		}
		if err := m.startCall(ctx, inst, fn, st); err != nil {
			m.closeInstance(inst)
			return nil, err
		}
		if mod.IsClosed() { // proc_exit(0) ends a call without an error
			m.closeInstance(inst)
			return nil, loadError(m.name, nil, "its start function exited with code 0: it is a command module; build a reactor (Go: GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared)")
		}
	}
	for _, msg := range st.startErrors {
		m.rt.cfg.Logger.LogAttrs(context.Background(), slog.LevelError, msg, slog.String("module", m.name))
	}
	if fn := mod.ExportedFunction(exportResponseNoop); fn != nil {
		// Asked after the start functions, so the guest's handlers are
		// registered; under the same limit as they are.
		if err := m.startCall(ctx, inst, fn, st); err != nil {
			m.closeInstance(inst)
			return nil, err
		}
		inst.responseNoop = uint32(inst.stack[0]) == 1
	}
	inst.handleRequest = mod.ExportedFunction(exportHandleRequest)
	inst.handleResponse = mod.ExportedFunction(exportHandleResponse)
	return inst, nil
}

// startFailed is the load error of a start function that trapped (a Go
// guest's init panicked, say on a config it cannot use): one line, with
// the guest's own words once. They are, in order of preference, the last
// error it logged while starting (guest.Abort logs its message before it
// panics), the first line of its stderr without Go's "panic: " (a bare
// panic), or the trap itself. wazero's error, which adds a stack trace of
// the guest, goes to the debug log only.
func (m *Module) startFailed(err error, st *callState, inst *instance) *Error {
	m.rt.cfg.Logger.Debug("wasm module start function failed", "module", m.name, "err", err.Error())
	why := ""
	if n := len(st.startErrors); n > 0 {
		why = st.startErrors[n-1]
		for _, msg := range st.startErrors[:n-1] {
			m.rt.cfg.Logger.LogAttrs(context.Background(), slog.LevelError, msg, slog.String("module", m.name))
		}
	}
	if why == "" {
		why = strings.TrimPrefix(inst.stderr.firstLine(), "panic: ")
	}
	if why == "" {
		why, _, _ = strings.Cut(err.Error(), "\n")
		if _, trap, ok := strings.Cut(why, "] failed: "); ok && strings.HasPrefix(why, "module[") {
			why = trap // "module[] function[_initialize] failed: wasm error: unreachable"
		}
	}
	return loadError(m.name, nil, "its start function failed: %s", why)
}

// startCall runs one start function of inst under StartTimeout.
func (m *Module) startCall(ctx context.Context, inst *instance, fn api.Function, st *callState) error {
	var err error
	if m.rt.wd.begin(inst.cc, ctx, st, m.rt.cfg.StartTimeout) {
		err = fn.CallWithStack(inst.cc, inst.stack[:1])
	}
	if m.rt.wd.end(inst.cc) && err == nil {
		err = sys.NewExitError(exitCode(inst.cc.Err()))
	}
	if err == nil {
		return nil
	}
	var ee *sys.ExitError
	if errors.As(err, &ee) {
		switch ee.ExitCode() {
		case sys.ExitCodeDeadlineExceeded:
			return loadError(m.name, nil, "its start function ran past the %s start limit", m.rt.cfg.StartTimeout)
		case sys.ExitCodeContextCanceled:
			return loadError(m.name, err, "start canceled")
		}
		return loadError(m.name, nil, "its start function exited with code %d%s: it is a command module; build a reactor (Go: GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared)", ee.ExitCode(), inst.stderr.suffix())
	}
	return m.startFailed(err, st, inst)
}

// borrow takes an idle instance, or starts one, waiting (bounded by ctx and
// PoolWait) while PoolSize instances are in use.
func (m *Module) borrow(ctx context.Context) (*instance, error) {
	select {
	case m.slots <- struct{}{}:
	default:
		t := time.NewTimer(m.rt.cfg.PoolWait)
		defer t.Stop()
		select {
		case m.slots <- struct{}{}:
		case <-ctx.Done():
			return nil, &Error{Module: m.name, Status: http.StatusServiceUnavailable, Reason: fmt.Sprintf("wasm module %s: the request ended while waiting for a free instance", m.name), Err: context.Cause(ctx)}
		case <-t.C:
			return nil, failure(http.StatusServiceUnavailable, m.name, "wasm module %s: all %d instances stayed busy for %s", m.name, cap(m.slots), m.rt.cfg.PoolWait)
		}
	}
	m.mu.Lock()
	if m.done {
		m.mu.Unlock()
		<-m.slots
		return nil, failure(http.StatusBadGateway, m.name, "wasm module %s is closed", m.name)
	}
	if n := len(m.idle); n > 0 {
		inst := m.idle[n-1]
		m.idle = m.idle[:n-1]
		m.mu.Unlock()
		return inst, nil
	}
	m.mu.Unlock()
	inst, err := m.instantiate(ctx)
	if err != nil {
		<-m.slots
		var e *Error
		if errors.As(err, &e) {
			e.Status = http.StatusBadGateway
		}
		m.rt.cfg.Logger.Warn("wasm module could not start an instance", "module", m.name, "err", err)
		return nil, err
	}
	return inst, nil
}

// poolIdleTTL is how long an instance may sit unused in the pool while the
// module keeps serving: a burst of requests in flight starts up to PoolSize
// instances, and those the traffic after it does not need are closed as
// instances are returned. Tests shorten it.
var poolIdleTTL = 30 * time.Second

// put returns an instance to the pool after use, or closes it if it is
// broken (it failed, or the watchdog stopped it): a broken instance never
// serves again. The pool is a stack (borrow takes the last one returned),
// so the instances at its bottom are the ones left unused longest; those
// unused for poolIdleTTL are closed, keeping at least one.
func (m *Module) put(inst *instance) {
	var stale []*instance
	m.mu.Lock()
	if m.done || inst.broken {
		m.mu.Unlock()
		m.closeInstance(inst)
	} else {
		now := time.Now()
		inst.idleSince = now
		m.idle = append(m.idle, inst)
		n := 0
		for n < len(m.idle)-1 && now.Sub(m.idle[n].idleSince) > poolIdleTTL {
			n++
		}
		if n > 0 {
			stale = slices.Clone(m.idle[:n])
			m.idle = slices.Delete(m.idle, 0, n)
		}
		m.mu.Unlock()
	}
	<-m.slots
	for _, old := range stale {
		m.closeInstance(old)
	}
}

// closeInstance closes an instance that no call runs on.
func (m *Module) closeInstance(inst *instance) {
	m.rt.wd.remove(inst.cc)
	inst.mod.Close(context.Background())
	m.rt.instances.Add(-1)
}

// Idle returns the number of idle instances in the pool (for tests and
// metrics).
func (m *Module) Idle() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.idle)
}

// call runs fn on inst with the module's time limit, st visible to the
// host functions. An error fails the request; when the instance is dead
// (trap, exit, time limit, host trap) call marks it broken, and put then
// closes it. The error is an *Error naming the module.
//
// No context, timer or goroutine is made here, by us or by wazero: the
// instance's callCtx is reused, and the runtime's watchdog enforces the
// deadline through the checks bound added to the guest (watchdog.go).
func (m *Module) call(ctx context.Context, inst *instance, fn api.Function, st *callState, what string, params ...uint64) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, &Error{Module: m.name, Status: http.StatusBadGateway, Reason: fmt.Sprintf("wasm module %s: the request ended before %s", m.name, what), Err: context.Cause(ctx)}
	}
	if err := m.rt.acquireCall(ctx, m.name); err != nil {
		return 0, err
	}
	inst.stderr.reset()
	stack := inst.stack[:max(len(params), 1)]
	copy(stack, params)
	var err error
	if m.rt.wd.begin(inst.cc, ctx, st, m.rt.cfg.CallTimeout) {
		err = fn.CallWithStack(inst.cc, stack)
	} else {
		err = inst.cc.Err() // cannot happen: a stopped instance is never reused
	}
	stopped := m.rt.wd.end(inst.cc)
	m.rt.releaseCall()
	if stopped {
		// Stopped by the watchdog, maybe just after the guest returned:
		// its result stands, but wazero may close the module any moment.
		inst.broken = true
	}
	if err == nil {
		return stack[0], nil
	}
	inst.broken = true
	return 0, m.describe(err, inst, what)
}

// describe turns a failed call into the error the request fails with.
func (m *Module) describe(err error, inst *instance, what string) *Error {
	var e *Error
	if errors.As(err, &e) { // a host function failed the request (a body over the cap)
		return e
	}
	var ee *sys.ExitError
	var ae *abiError
	var out *Error
	switch {
	case errors.As(err, &ee) && ee.ExitCode() == sys.ExitCodeDeadlineExceeded:
		out = failure(http.StatusBadGateway, m.name, "wasm module %s ran past its %s time limit in %s", m.name, m.rt.cfg.CallTimeout, what)
	case errors.As(err, &ee) && ee.ExitCode() == sys.ExitCodeContextCanceled:
		out = failure(http.StatusBadGateway, m.name, "wasm module %s: the request ended during %s", m.name, what)
	case errors.As(err, &ee):
		out = failure(http.StatusBadGateway, m.name, "wasm module %s exited with code %d in %s%s", m.name, ee.ExitCode(), what, inst.stderr.suffix())
	case errors.As(err, &ae):
		out = failure(http.StatusBadGateway, m.name, "wasm module %s broke the http-wasm ABI in %s: %s", m.name, what, ae.msg)
	default:
		msg, _, _ := strings.Cut(err.Error(), "\n")
		out = failure(http.StatusBadGateway, m.name, "wasm module %s trapped in %s: %s%s", m.name, what, msg, inst.stderr.suffix())
	}
	m.rt.cfg.Logger.Warn("wasm module failed; its instance is closed", "module", m.name, "reason", out.Reason, "err", err.Error())
	return out
}

// headBuffer keeps the first bytes a guest writes to stderr (a Go guest's
// panic message), for the failure's reason.
type headBuffer struct {
	mu sync.Mutex
	b  []byte
}

const stderrKeep = 256

func (h *headBuffer) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if room := stderrKeep - len(h.b); room > 0 {
		h.b = append(h.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (h *headBuffer) reset() {
	h.mu.Lock()
	h.b = h.b[:0]
	h.mu.Unlock()
}

// firstLine returns the first line of stderr, or "".
func (h *headBuffer) firstLine() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := strings.TrimSpace(string(h.b))
	s, _, _ = strings.Cut(s, "\n")
	return strings.ToValidUTF8(strings.TrimSpace(s), "?")
}

// suffix renders the first line of stderr as " (stderr: line)", or "".
func (h *headBuffer) suffix() string {
	s := h.firstLine()
	if s == "" {
		return ""
	}
	return " (stderr: " + s + ")"
}
