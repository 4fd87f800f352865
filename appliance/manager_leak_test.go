package appliance

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/wasmbin"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// passModule is the smallest module the runtime loads: a memory, and
// handle_request returning 1 (pass the request on). Its instances cost
// microseconds to start, so the cycles measure the sandbox's lifecycle.
var passModule = wasmbin.Pass()

// leakCycles is how many cycles each leak test runs: 200, or
// SANDGATE_LEAK_CYCLES (a longer hunt).
func leakCycles(t *testing.T) int {
	n := 200
	if v := os.Getenv("SANDGATE_LEAK_CYCLES"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			t.Fatalf("SANDGATE_LEAK_CYCLES=%q: want a positive number", v)
		}
	}
	return n
}

// heapInUse is the live heap after a full collection, and the number of
// goroutines.
func heapInUse() (uint64, int) {
	runtime.GC()
	runtime.GC() // sync.Pool's victims go in the second
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc, runtime.NumGoroutine()
}

// settled waits (bounded) for the goroutines to come back to at most
// want and the live heap to at most heap+leakSlack: a stopped sandbox's
// link ends a moment after it, and releases its memory within
// agent.StreamCloseTimeout. It returns the goroutines and heap then.
func settled(want int, heap uint64) (uint64, int) {
	deadline := time.Now().Add(agent.StreamCloseTimeout + 10*time.Second)
	h, g := heapInUse()
	for time.Now().Before(deadline) && (g > want || h > heap+leakSlack) {
		time.Sleep(100 * time.Millisecond)
		h, g = heapInUse()
	}
	return h, g
}

// leakSlack is what the live heap may grow by over all cycles: caches that
// fill once (a pool's slabs, the store's), not a leak. One sandbox's
// modules alone are a compiled module of megabytes; a leak of a few
// kilobytes per cycle is over it by the end.
const leakSlack = 256 << 10

// leakWorkers is how many cycles run at once: a cycle mostly waits on
// the sandbox CLI, and the leak is counted after all of them.
const leakWorkers = 4

// inParallel runs f(w, 0) … f(w, n-1) on leakWorkers goroutines, w the
// worker running it (a worker's own sandbox), and returns the first error.
func inParallel(n int, f func(w, i int) error) error {
	errs := make(chan error, leakWorkers)
	next := make(chan int)
	for w := range leakWorkers {
		go func() {
			var first error
			for i := range next {
				if err := f(w, i); err != nil && first == nil {
					first = err
				}
			}
			errs <- first
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	var first error
	for range leakWorkers {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// TestNoLeakAcrossLifecycles: a sandbox's modules, processes, rules and
// links go with it. 200 cycles of create → set modules → exec → destroy,
// and 200 suspend/resume cycles of sandboxes with modules, leave the
// runtime's module instances, the goroutines and the live heap where they
// were after the first cycle (counted, not guessed).
func TestNoLeakAcrossLifecycles(t *testing.T) {
	rt, err := wasm.NewRuntime(context.Background(), wasm.Config{CacheDir: gobuild.WasmCache(t), CallTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close(context.Background()) })
	// The log is discarded: the rig's keeps every line, and would grow.
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.Modules, c.Logger = rt, slog.New(slog.DiscardHandler) })
	n := leakCycles(t)
	mods := []ModuleSource{{Name: "pass", Wasm: passModule}, {Name: "pass-too", Wasm: passModule, Config: []byte("x")}}
	rules := r.rules(t).Rules()
	// One context for all: the rig's ctx() registers a cleanup per call.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	net := NetworkSpec{Policy: ptr(r.pol), BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}}
	create := func(id string) error {
		if _, err := r.m.Create(ctx, id, CreateOptions{Network: net, Rules: rules}); err != nil {
			return err
		}
		return r.m.SetModules(ctx, id, mods)
	}
	cycle := func(id string) error {
		if err := create(id); err != nil {
			return err
		}
		p, err := r.m.Exec(ctx, id, ExecRequest{Args: []string{"/bin/sh", "-c", "echo hi"}})
		if err != nil {
			return err
		}
		if code, ok := p.Wait(ctx); !ok || code != 0 {
			return fmt.Errorf("exec in %s: exit %d (ended: %v)", id, code, ok)
		}
		return r.m.Destroy(ctx, id)
	}

	// One round first: what fills once is filled.
	if err := inParallel(leakWorkers, func(_, i int) error { return cycle(fmt.Sprint("warm", i)) }); err != nil {
		t.Fatal(err)
	}
	live0 := rt.Live()
	heap0, g0 := heapInUse()
	if live0 != (wasm.LiveCounts{}) {
		t.Fatalf("no sandbox left, the runtime holds %+v", live0)
	}
	if err := inParallel(n, func(_, i int) error { return cycle(fmt.Sprint("c", i)) }); err != nil {
		t.Fatal(err)
	}
	heap1, g1 := settled(g0, heap0)
	if got := rt.Live(); got != live0 {
		t.Errorf("after %d create → modules → destroy cycles the runtime holds %+v, want %+v", n, got, live0)
	}
	if g1 > g0 {
		t.Errorf("after %d create → modules → destroy cycles %d goroutines, %d before", n, g1, g0)
	}
	if heap1 > heap0+leakSlack {
		t.Errorf("after %d create → modules → destroy cycles the live heap is %d bytes, %d before (+%d/cycle)", n, heap1, heap0, (heap1-heap0)/uint64(n))
	}
	t.Logf("create → modules → destroy ×%d: heap %d → %d bytes, goroutines %d → %d", n, heap0, heap1, g0, g1)

	// Suspended, a sandbox's modules are closed; resumed, loaded again.
	suspendResume := func(w, _ int) error {
		id := fmt.Sprint("sr", w)
		if err := r.m.Suspend(ctx, id); err != nil {
			return err
		}
		if in, err := r.m.Get(ctx, id); err != nil || len(in.Modules) != len(mods) {
			return fmt.Errorf("suspended %s lists modules %+v (%v), want %d", id, in.Modules, err, len(mods))
		}
		_, err := r.m.Resume(ctx, id, ResumeOptions{Rules: rules})
		return err
	}
	for i := range leakWorkers {
		if err := create(fmt.Sprint("sr", i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := inParallel(leakWorkers, suspendResume); err != nil {
		t.Fatal(err)
	}
	live0 = rt.Live()
	heap0, g0 = heapInUse()
	if live0.Modules != leakWorkers*len(mods) {
		t.Fatalf("resumed, the sandboxes' modules are not all loaded: %+v", live0)
	}
	if err := inParallel(n, suspendResume); err != nil {
		t.Fatal(err)
	}
	heap1, g1 = settled(g0, heap0)
	if got := rt.Live(); got.Modules != live0.Modules || got.Compiled != live0.Compiled || got.Instances > live0.Instances {
		t.Errorf("after %d suspend/resume cycles the runtime holds %+v, want %+v", n, got, live0)
	}
	if g1 > g0 {
		t.Errorf("after %d suspend/resume cycles %d goroutines, %d before", n, g1, g0)
	}
	if heap1 > heap0+leakSlack {
		t.Errorf("after %d suspend/resume cycles the live heap is %d bytes, %d before (+%d/cycle)", n, heap1, heap0, (heap1-heap0)/uint64(n))
	}
	t.Logf("suspend/resume ×%d: heap %d → %d bytes, goroutines %d → %d", n, heap0, heap1, g0, g1)
	for i := range leakWorkers {
		if err := r.m.Destroy(ctx, fmt.Sprint("sr", i)); err != nil {
			t.Fatal(err)
		}
	}
	if got := rt.Live(); got != (wasm.LiveCounts{}) {
		t.Errorf("every sandbox destroyed, the runtime holds %+v", got)
	}
}
