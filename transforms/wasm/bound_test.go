package wasm

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tetratelabs/wazero"
)

// A looping guest is preempted by the Go scheduler at its yields: with a
// single P, held by a call that loops under a deadline it will never reach,
// other goroutines still run (here: another module's requests, then the
// cancellation that stops the loop). Without the yields this test hangs.
func TestLoopingGuestIsPreempted(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	r := newRuntime(t, Config{CallTimeout: time.Hour})
	looper := probe(t, r, "req if X-Loop loop")
	other := probe(t, r, "req note ok")
	ctx, cancel := context.WithCancel(context.Background())
	looping := make(chan error, 1)
	go func() {
		x, err := HandleRequest(ctx, outbound(t, "GET", "/", "", "X-Loop", "1"), info, NewChain(looper))
		x.Close()
		looping <- err
	}()
	for len(r.callSlots) == 0 { // the loop holds a call slot once it runs
		runtime.Gosched()
	}
	for range 3 {
		notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), other), "ok")
	}
	cancel()
	select {
	case err := <-looping:
		if err == nil || !strings.Contains(err.Error(), "the request ended during handle_request") {
			t.Fatalf("looping request: got %v, want it stopped as its request ended", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the looping call was not stopped within a minute of its request ending")
	}
}

// A loop with no function call and no memory access in it, in a function
// the guest calls itself, is stopped at its deadline: the check at the
// loop head is read on every iteration.
func TestTightLoopInCalleeStopped(t *testing.T) {
	r := newRuntime(t, Config{CallTimeout: 50 * time.Millisecond})
	mod := wmodule{
		types: [][2][]byte{{nil, {tI64}}, {{tI32, tI32}, nil}, {nil, nil}},
		funcs: []wfunc{
			{0, cat([]byte{0x10, 0x02}, opI64Const1)}, // handle_request: call $spin
			{1, nil},
			{2, []byte{0x03, 0x40, 0x0c, 0x00, 0x0b}}, // $spin: loop br 0 end
		},
		memory:  1,
		exports: [][3]any{{"memory", 2, 0}, {"handle_request", 0, 0}, {"handle_response", 0, 1}},
	}
	m, err := r.Load(context.Background(), "spin", mod.bytes(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close(context.Background())
	if _, err := run(t, outbound(t, "GET", "/", ""), m); err == nil || !strings.Contains(err.Error(), "ran past its 50ms time limit") {
		t.Fatalf("got %v, want the time limit", err)
	}
}

// Recursion without a loop (each call makes two more: far more calls than
// the deadline allows) is stopped too: every function entry is checked.
func TestLooplessRecursionStopped(t *testing.T) {
	r := newRuntime(t, Config{CallTimeout: 50 * time.Millisecond})
	// $fan(d): if d != 0 { $fan(d-1); $fan(d-1) }
	fan := []byte{0x20, 0x00, 0x04, 0x40, // local.get 0; if
		0x20, 0x00, 0x41, 0x01, 0x6b, 0x10, 0x02, // $fan(d-1)
		0x20, 0x00, 0x41, 0x01, 0x6b, 0x10, 0x02, // $fan(d-1)
		0x0b}
	mod := wmodule{
		types: [][2][]byte{{nil, {tI64}}, {{tI32, tI32}, nil}, {{tI32}, nil}},
		funcs: []wfunc{
			{0, cat([]byte{0x41, 60, 0x10, 0x02}, opI64Const1)}, // handle_request: $fan(60)
			{1, nil},
			{2, fan},
		},
		memory:  1,
		exports: [][3]any{{"memory", 2, 0}, {"handle_request", 0, 0}, {"handle_response", 0, 1}},
	}
	m, err := r.Load(context.Background(), "fan", mod.bytes(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close(context.Background())
	if _, err := run(t, outbound(t, "GET", "/", ""), m); err == nil || !strings.Contains(err.Error(), "ran past its 50ms time limit") {
		t.Fatalf("got %v, want the time limit", err)
	}
}

// A start section that loops is stopped at the start limit, like a looping
// _initialize.
func TestLoopingStartSectionStopped(t *testing.T) {
	r := newRuntime(t, Config{StartTimeout: 50 * time.Millisecond})
	mod := handler(opI64Const1...)
	mod.types = append(mod.types, [2][]byte{nil, nil})
	mod.funcs = append(mod.funcs, wfunc{2, opLoopForever})
	b := mod.bytes()
	// The start section (8) goes before the code section (10).
	at := sectionOffset(t, b, 10)
	b = cat(b[:at], section(8, uleb(2)), b[at:])
	_, err := r.Load(context.Background(), "start", b, nil)
	var we *Error
	if !errors.As(err, &we) || !strings.Contains(err.Error(), "ran past the 50ms start limit") {
		t.Fatalf("got %v, want the start limit", err)
	}
}

// sectionOffset returns where the section with id starts in module b.
func sectionOffset(t *testing.T, b []byte, id byte) int {
	t.Helper()
	r := &wreader{b: b, pos: 8}
	for !r.done() {
		at := r.pos
		if r.byte1() == id {
			return at
		}
		r.take(int(r.u32()))
	}
	t.Fatalf("no section %d", id)
	return 0
}

// bound keeps a module valid and its behaviour the same: every guest the
// tests build still compiles once rewritten, and the rewrite renumbers what
// refers to functions.
func TestBoundRewritesValidModules(t *testing.T) {
	// The runtime's own wazero runtime, with the compilation cache the
	// other tests fill: compiling a Go guest afresh takes seconds under
	// the race detector.
	rt := newRuntime(t, Config{}).wr
	for _, name := range []string{"noop", "probe"} {
		b, err := bound(guest(t, name))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := rt.CompileModule(context.Background(), b.bin); err != nil {
			t.Fatalf("%s rewritten does not compile: %v", name, err)
		}
	}
	// Reserved names are refused.
	bad := handler(opI64Const1...)
	bad.exports = append(bad.exports, [3]any{"sandgate:stop", 0, 0})
	if _, err := bound(bad.bytes()); err == nil || !strings.Contains(err.Error(), "reserves") {
		t.Fatalf("got %v, want a reserved-name refusal", err)
	}
}

// A module that still runs normally after the rewrite: many calls on one
// instance, past several yields.
func TestBoundGuestRunsAcrossYields(t *testing.T) {
	r := newRuntime(t, Config{PoolSize: 1})
	m := probe(t, r, "req note ok")
	for range 50 {
		notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), m), "ok")
	}
}

// FuzzBound: bound never panics on any input, and whatever it accepts
// still compiles rewritten exactly when wazero compiles it as it was. (Inputs bound
// refuses are not given to wazero, whose decoder sizes tables from the
// counts it reads: Load never gives it those either.)
func FuzzBound(f *testing.F) {
	f.Add(handler(opI64Const1...).bytes())
	f.Add(handler(cat(opLoopForever, opI64Const1)...).bytes())
	f.Add(handler(0x02, 0x40, 0x03, 0x7e, 0x42, 0x01, 0x0b, 0x1a, 0x0b, 0x42, 0x01).bytes()) // block (loop (result i64) …) drop
	f.Add([]byte("\x00asm\x01\x00\x00\x00"))
	rt := wazero.NewRuntime(context.Background())
	defer rt.Close(context.Background())
	f.Fuzz(func(t *testing.T, bin []byte) {
		b, err := bound(bin)
		if err != nil {
			var be *boundError
			if !errors.As(err, &be) {
				t.Fatalf("bound failed with %T %v", err, err)
			}
			return
		}
		cm, err := rt.CompileModule(context.Background(), bin)
		bcm, berr := rt.CompileModule(context.Background(), b.bin)
		if berr == nil {
			bcm.Close(context.Background())
		}
		if err != nil {
			// An invalid guest stays invalid: one the rewrite made valid
			// could reach the checks' globals (TestGuestCannotReachTheChecksGlobals).
			if berr == nil {
				t.Fatalf("invalid (%v), but compiles once bound", err)
			}
			return
		}
		cm.Close(context.Background())
		if berr != nil {
			t.Fatalf("compiles, but not once bound: %v", berr)
		}
	})
}

// The checks' own globals and the yield's type take indices just past the
// guest's. A guest that names those indices is invalid as written, but
// would be valid once rewritten: a loop that clears $stop and $tick on
// every turn would never be stopped. Such guests are refused at load.
func TestGuestCannotReachTheChecksGlobals(t *testing.T) {
	r := newRuntime(t, Config{CallTimeout: 50 * time.Millisecond})
	clear := []byte{0x41, 0x00, 0x24, 0x00, 0x41, 0x00, 0x24, 0x01} // i32.const 0 global.set 0, i32.const 0 global.set 1
	for name, body := range map[string][]byte{
		"global.set of $stop and $tick": cat([]byte{0x03, 0x40}, clear, []byte{0x0c, 0x00, 0x0b}, opI64Const1),
		"global.get past the guest's":   cat([]byte{0x23, 0x00, 0x1a}, opI64Const1),
		"block of the yield's type":     cat([]byte{0x02, 0x02, 0x0b}, opI64Const1),
		"call_indirect of its type":     cat([]byte{0x41, 0x00, 0x11, 0x02, 0x00}, opI64Const1),
	} {
		b := handler(body...).bytes()
		if _, err := bound(b); err == nil {
			t.Errorf("%s: bound accepted it", name)
		}
		if _, err := r.Load(context.Background(), "escape", b, nil); err == nil {
			t.Errorf("%s: loaded", name)
		}
	}
	exp := handler(opI64Const1...)
	exp.exports = append(exp.exports, [3]any{"g", 3, 0})
	if _, err := bound(exp.bytes()); err == nil {
		t.Error("an export of global 0 of a module without globals: bound accepted it")
	}
}
