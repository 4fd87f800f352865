package appliance

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/transforms/wasm"
)

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

// settled waits (bounded) for the goroutines to come back to at most want
// (those ending a stopped sandbox's links end a moment after it), and
// returns the heap and goroutines then.
func settled(want int) (uint64, int) {
	heap, g := heapInUse()
	for i := 0; i < 100 && g > want; i++ {
		time.Sleep(50 * time.Millisecond)
		heap, g = heapInUse()
	}
	return heap, g
}

// leakSlack is what the live heap may grow by over all cycles: caches that
// fill once (a pool's slabs, the store's), not a leak. One sandbox's
// modules alone are a compiled module of megabytes; a leak of a few
// kilobytes per cycle is over it by the end.
const leakSlack = 1 << 20

// TestNoLeakAcrossLifecycles: a sandbox's modules, processes, rules and
// links go with it. 200 cycles of create → set modules → exec → destroy,
// and 200 suspend/resume cycles of a sandbox with modules, leave the
// runtime's module instances, the goroutines and the live heap where they
// were after the first cycle (counted, not guessed).
func TestNoLeakAcrossLifecycles(t *testing.T) {
	rt, err := wasm.NewRuntime(context.Background(), wasm.Config{CacheDir: gobuild.WasmCache(t), CallTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close(context.Background()) })
	bin, err := os.ReadFile(gobuild.Wasm(t, "github.com/sandgate/sandgate/wasm-examples/deny-path"))
	if err != nil {
		t.Fatal(err)
	}
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.Modules = rt })
	n := leakCycles(t)
	mods := []ModuleSource{{Name: "deny-path", Wasm: bin, Config: []byte("^/admin")}}

	// One cycle of each first: what fills once is filled.
	// One context for all: the rig's ctx() registers a cleanup per call.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	net := NetworkSpec{Policy: ptr(r.pol), BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}}
	create := func(id string) {
		t.Helper()
		if _, err := r.m.Create(ctx, id, CreateOptions{Network: net, Rules: r.rules(t).Rules()}); err != nil {
			t.Fatal(err)
		}
		if err := r.m.SetModules(ctx, id, mods); err != nil {
			t.Fatal(err)
		}
	}
	cycle := func(id string) {
		t.Helper()
		create(id)
		p, err := r.m.Exec(ctx, id, ExecRequest{Args: []string{"/bin/sh", "-c", "echo hi"}})
		if err != nil {
			t.Fatal(err)
		}
		if code, ok := p.Wait(ctx); !ok || code != 0 {
			t.Fatalf("exec: %d %v", code, ok)
		}
		if err := r.m.Destroy(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	cycle("warm")
	live0 := rt.Live()
	heap0, g0 := heapInUse()
	if live0 != (wasm.LiveCounts{}) {
		t.Fatalf("no sandbox left, the runtime holds %+v", live0)
	}
	for i := range n {
		cycle(fmt.Sprint("c", i))
	}
	heap1, g1 := settled(g0)
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

	create("sr")
	suspendResume := func() {
		t.Helper()
		if err := r.m.Suspend(ctx, "sr"); err != nil {
			t.Fatal(err)
		}
		if got := rt.Live(); got != (wasm.LiveCounts{}) {
			t.Fatalf("suspended, its modules still hold %+v", got)
		}
		if _, err := r.m.Resume(ctx, "sr", ResumeOptions{Rules: r.rules(t).Rules()}); err != nil {
			t.Fatal(err)
		}
	}
	suspendResume()
	live0 = rt.Live()
	heap0, g0 = heapInUse()
	if live0.Modules != 1 {
		t.Fatalf("resumed, the sandbox's module is not loaded: %+v", live0)
	}
	for range n {
		suspendResume()
	}
	heap1, g1 = settled(g0)
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
	if err := r.m.Destroy(ctx, "sr"); err != nil {
		t.Fatal(err)
	}
	if got := rt.Live(); got != (wasm.LiveCounts{}) {
		t.Errorf("every sandbox destroyed, the runtime holds %+v", got)
	}
}
