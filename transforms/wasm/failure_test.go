package wasm

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// Each failure fails its request closed (502 naming the module), the
// instance is closed, and the next request gets a fresh one and succeeds.
func TestFailuresReplaceTheInstance(t *testing.T) {
	r := newRuntime(t, Config{MemoryLimitPages: 512, CallTimeout: loopCallTimeout})
	tests := []struct {
		name, cmd, want string
	}{
		{"panic", "req if X-Fail panic", "trapped in handle_request: wasm error: unreachable (stderr: panic: probe was told to panic"},
		{"exit", "req if X-Fail exit 7", "exited with code 7 in handle_request"},
		{"loop", "req if X-Fail loop", "ran past its " + loopCallTimeout.String() + " time limit in handle_request"},
		{"memory", "req if X-Fail grow 64", "out of memory"},
		{"abi", "req if X-Fail read1 7 10", "broke the http-wasm ABI in handle_request: read_body: unknown body kind 7"},
		{"bounds", "req if X-Fail seturi-oob", ""},
	}
	for _, tt := range tests {
		if tt.want == "" {
			continue
		}
		t.Run(tt.name, func(t *testing.T) {
			m := probe(t, r, tt.cmd, "req calls")
			notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), m), "calls=1")
			x, err := run(t, outbound(t, "GET", "/", "", "X-Fail", "1"), m)
			x.Close()
			var we *Error
			if !errors.As(err, &we) || we.Status != http.StatusBadGateway || we.Module != "probe" || !strings.Contains(we.Error(), tt.want) {
				t.Fatalf("got %v, want a 502 naming probe and containing %q", err, tt.want)
			}
			if m.Idle() != 0 {
				t.Errorf("idle = %d: the failed instance must not return to the pool", m.Idle())
			}
			// A fresh instance: its call counter starts again.
			notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), m), "calls=1")
		})
	}
}

func TestHandwrittenTrapAndLoop(t *testing.T) {
	// Every call here traps or loops: a tight deadline is safe.
	r := newRuntime(t, Config{CallTimeout: 50 * time.Millisecond})
	for name, bin := range map[string][]byte{
		"trap": handler(cat(opUnreachable, opI64Const1)...).bytes(),
		"loop": handler(cat(opLoopForever, opI64Const1)...).bytes(),
	} {
		t.Run(name, func(t *testing.T) {
			m, err := r.Load(context.Background(), name, bin, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close(context.Background())
			for range 2 { // the second request runs on a fresh instance
				_, err := run(t, outbound(t, "GET", "/", ""), m)
				want := map[string]string{"trap": "trapped in handle_request: wasm error: unreachable", "loop": "ran past its 50ms time limit"}[name]
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("got %v, want %q", err, want)
				}
			}
		})
	}
}

// A module that loops forever costs only its own requests: others, on
// other instances and other modules, go on.
func TestLoopCostsOnlyItsOwnRequest(t *testing.T) {
	r := newRuntime(t, Config{CallTimeout: loopCallTimeout, PoolSize: 2})
	looper := probe(t, r, "req if X-Loop loop")
	other := probe(t, r, "req note ok")
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x, err := HandleRequest(context.Background(), outbound(t, "GET", "/", "", "X-Loop", "1"), info, NewChain(looper))
			x.Close()
			errs <- err
		}()
	}
	// While both of looper's instances spin, the other module serves.
	for range 5 {
		notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), other), "ok")
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err == nil || !strings.Contains(err.Error(), "time limit") {
			t.Errorf("looping request: %v", err)
		}
	}
	notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), looper, other), "ok")
}

// When every instance is busy, a request waits for one, bounded by its
// context and PoolWait.
func TestPoolWaitIsBounded(t *testing.T) {
	r := newRuntime(t, Config{PoolSize: 1, PoolWait: 50 * time.Millisecond})
	m := probe(t, r, "req note hi")
	x1, err := run(t, outbound(t, "GET", "/", ""), m) // holds the one instance until Close
	if err != nil {
		t.Fatal(err)
	}
	_, err = run(t, outbound(t, "GET", "/", ""), m)
	var we *Error
	if !errors.As(err, &we) || we.Status != http.StatusServiceUnavailable || !strings.Contains(we.Reason, "stayed busy") {
		t.Fatalf("got %v, want 503", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	x, err := HandleRequest(ctx, outbound(t, "GET", "/", ""), info, NewChain(m))
	x.Close()
	if !errors.As(err, &we) || !strings.Contains(we.Reason, "request ended") {
		t.Fatalf("got %v, want the request's end", err)
	}
	x1.Close()
	if _, err := run(t, outbound(t, "GET", "/", ""), m); err != nil {
		t.Fatal(err)
	}
}

// A Go guest keeps working over many calls on one instance with the real
// monotonic clock (with a fake one its heap would grow without bound).
func TestManyCallsOneInstance(t *testing.T) {
	r := newRuntime(t, Config{MemoryLimitPages: 256, PoolSize: 1})
	m := probe(t, r, "req copyheaders", "req write 0 "+strings.Repeat("z", 4096))
	for i := range 2000 {
		x, err := HandleRequest(context.Background(), outbound(t, "POST", "/", "", "Authorization", "Bearer x"), info, NewChain(m))
		x.Close()
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
}
