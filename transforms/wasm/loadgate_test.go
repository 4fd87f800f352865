package wasm

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/wasmbin"
)

// Six concurrent module uploads of 64 MiB pushed serve's heap to 1.2 GB:
// every upload compiled at once. Loads take a bounded number of slots, a
// bounded queue waits for them (as long as its context allows), and a load
// that finds the queue full is refused at once.
func TestModuleLoadsBoundedAndQueueFullIsBusy(t *testing.T) {
	r := newRuntime(t, Config{MaxConcurrentLoads: 1, MaxLoadQueue: 1})
	bin := guest(t, "noop")
	release, err := r.acquireLoad(context.Background(), "holder")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	queued := make(chan error, 1)
	go func() {
		_, err := r.LoadReader(ctx, "queued", bytes.NewReader(bin), nil)
		queued <- err
	}()
	for i := 0; r.loadWaiting.Load() != 1; i++ {
		if i == 10000 {
			t.Fatal("the second load never queued")
		}
		time.Sleep(time.Millisecond)
	}
	_, err = r.Load(context.Background(), "third", bin, nil)
	if !errors.Is(err, ErrLoadBusy) {
		t.Fatalf("a load past the queue: %v, want ErrLoadBusy", err)
	}
	cancel()
	if err := <-queued; !errors.Is(err, context.Canceled) {
		t.Errorf("a queued load whose context ended: %v, want context.Canceled", err)
	}
	release()
	m, err := r.Load(context.Background(), "after", bin, nil)
	if err != nil {
		t.Fatalf("a load once the slot is free: %v", err)
	}
	defer m.Close(context.Background())
	if got := r.Live().Modules; got != 1 {
		t.Errorf("%d modules loaded, want 1 (the refused and cancelled ones hold nothing)", got)
	}
}

// A module over MaxModuleBytes is refused before it is compiled, and
// LoadReader reads no more of it than one byte past the cap.
func TestModuleOverMaxBytesRefused(t *testing.T) {
	bin := guest(t, "noop")
	r := newRuntime(t, Config{MaxModuleBytes: len(bin) - 1})
	if _, err := r.Load(context.Background(), "big", bin, nil); !errors.Is(err, ErrModuleTooLarge) {
		t.Errorf("Load over the cap: %v, want ErrModuleTooLarge", err)
	}
	src := bytes.NewReader(append(bin, make([]byte, 1<<20)...))
	if _, err := r.LoadReader(context.Background(), "big", src, nil); !errors.Is(err, ErrModuleTooLarge) {
		t.Errorf("LoadReader over the cap: %v, want ErrModuleTooLarge", err)
	}
	if read := src.Size() - int64(src.Len()); read > int64(len(bin)) {
		t.Errorf("LoadReader read %d bytes of a module capped at %d", read, len(bin)-1)
	}
	if got := r.Live().Compiled; got != 0 {
		t.Errorf("%d modules compiled", got)
	}
}

// Two loads of the same bytes at once compile them once, and neither
// holds the runtime's lock while the other compiles.
func TestSameModuleLoadedTwiceAtOnceSharesItsCode(t *testing.T) {
	r := newRuntime(t, Config{MaxConcurrentLoads: 2})
	bin := guest(t, "noop")
	errs := make(chan error, 2)
	mods := make(chan *Module, 2)
	for range 2 {
		go func() {
			m, err := r.Load(context.Background(), "same", bin, nil)
			errs <- err
			mods <- m
		}()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
		defer (<-mods).Close(context.Background())
	}
	if got := r.Live().Compiled; got != 1 {
		t.Errorf("%d compiled forms of one module", got)
	}
}

func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// Twenty uploads of large modules kept serve's heap hundreds of MB above
// what it runs: wazero kept every custom section of every compiled module
// (for DWARF stack traces). A loaded module holds its code, not its
// custom sections.
func TestLoadedModuleKeepsNoCustomSection(t *testing.T) {
	r := newRuntime(t, Config{})
	bin := wasmbin.Pass() // what it holds is its section's or not
	before := liveHeap()
	var mods []*Module
	for i := range 4 {
		m, err := r.Load(context.Background(), "padded", wasmbin.Padded(bin, 8<<20, i), nil)
		if err != nil {
			t.Fatal(err)
		}
		mods = append(mods, m)
	}
	grew := liveHeap() - before
	for _, m := range mods {
		m.Close(context.Background())
	}
	// Four modules of their code (KiB) and no 8 MiB section each.
	if grew > 8<<20 {
		t.Errorf("four loaded modules with 8 MiB custom sections hold %d MiB of heap", grew>>20)
	}
}
