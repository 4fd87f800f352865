package wasm

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A call whose request ends is stopped by the watchdog well before its
// deadline, and its instance is replaced.
func TestLoopStoppedWhenRequestEnds(t *testing.T) {
	r := newRuntime(t, Config{CallTimeout: time.Minute})
	looper := probe(t, r, "req if X-Loop loop")
	ctx, cancel := context.WithCancel(context.Background())
	req := outbound(t, "GET", "/", "", "X-Loop", "1")
	done := make(chan error, 1)
	go func() {
		x, err := HandleRequest(ctx, req, info, NewChain(looper))
		x.Close()
		done <- err
	}()
	waitCallRunning(t, r)
	cancel()
	select {
	case err := <-done:
		var e *Error
		if !errors.As(err, &e) || e.Status != http.StatusBadGateway || !strings.Contains(e.Reason, "the request ended during handle_request") {
			t.Fatalf("got %v, want a 502 saying the request ended during handle_request", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a looping call whose request was canceled still ran after 30s (its deadline is 1 minute)")
	}
	if n := looper.Idle(); n != 0 {
		t.Errorf("the stopped instance went back to the pool: %d idle, want 0", n)
	}
	mustRun(t, outbound(t, "GET", "/", ""), looper) // a fresh instance serves
}

// After an idle period the watchdog parks; the next call wakes it, and a
// loop is still stopped at its deadline.
func TestWatchdogWakesAfterIdle(t *testing.T) {
	old := parkAfter
	parkAfter = 20 * time.Millisecond
	t.Cleanup(func() { parkAfter = old })
	r := newRuntime(t, Config{CallTimeout: 50 * time.Millisecond})
	looper := probe(t, r, "req if X-Loop loop")
	deadline := time.Now().Add(10 * time.Second)
	for !r.wd.parked.Load() {
		if time.Now().After(deadline) {
			t.Fatal("the watchdog did not park within 10s of idleness")
		}
		time.Sleep(5 * time.Millisecond)
	}
	_, err := run(t, outbound(t, "GET", "/", "", "X-Loop", "1"), looper)
	if err == nil || !strings.Contains(err.Error(), "ran past its 50ms time limit") {
		t.Fatalf("got %v, want the time limit", err)
	}
}

// MaxConcurrentCalls bounds the calls running at once: with one slot,
// held by a looping call, another call waits (bounded by its context),
// gets a 503, and its healthy instance stays in the pool. The looping call
// holds its slot until its request is canceled, whatever the machine's
// load, so the wait cannot end any other way.
func TestMaxConcurrentCalls(t *testing.T) {
	r := newRuntime(t, Config{MaxConcurrentCalls: 1})
	looper := probe(t, r, "req if X-Loop loop")
	other := probe(t, r, "req note ok")
	req := outbound(t, "GET", "/", "", "X-Loop", "1")
	loopCtx, stopLoop := context.WithCancel(context.Background())
	defer stopLoop()
	looping := make(chan error, 1)
	go func() {
		x, err := HandleRequest(loopCtx, req, info, NewChain(looper))
		x.Close()
		looping <- err
	}()
	waitCallRunning(t, r)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	x, err := HandleRequest(ctx, outbound(t, "GET", "/", ""), info, NewChain(other))
	x.Close()
	var e *Error
	if !errors.As(err, &e) || e.Status != http.StatusServiceUnavailable || !strings.Contains(e.Reason, "free call slot") {
		t.Fatalf("got %v, want a 503 naming the call slots", err)
	}
	if n := other.Idle(); n != 1 {
		t.Errorf("the waiting module's healthy instance: %d idle, want 1", n)
	}
	stopLoop()
	select {
	case err := <-looping:
		if err == nil || !strings.Contains(err.Error(), "the request ended") {
			t.Errorf("looping request: got %v, want it stopped as its request ended", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the looping call was not stopped within 30s of its request's end")
	}
	notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), other), "ok")
}

// waitCallRunning waits until a call into a guest holds a call slot.
func waitCallRunning(t *testing.T, r *Runtime) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for len(r.callSlots) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no call started within 30s")
		}
		time.Sleep(time.Millisecond)
	}
}

// Config.LongCalls hears of a looping call while it runs, and of none once
// it was stopped.
func TestLongCallsReported(t *testing.T) {
	reports := make(chan int, 64)
	r := newRuntime(t, Config{CallTimeout: 200 * time.Millisecond, LongCalls: func(n int) {
		select {
		case reports <- n:
		default:
		}
	}})
	looper := probe(t, r, "req if X-Loop loop")
	_, err := run(t, outbound(t, "GET", "/", "", "X-Loop", "1"), looper)
	if err == nil || !strings.Contains(err.Error(), "ran past its 200ms time limit") {
		t.Fatalf("got %v, want the time limit", err)
	}
	var seen []int
	timeout := time.After(time.Minute)
	for len(seen) == 0 || seen[len(seen)-1] != 0 {
		select {
		case n := <-reports:
			seen = append(seen, n)
		case <-timeout:
			t.Fatalf("LongCalls heard %v in a minute, want 1 then 0", seen)
		}
	}
	if len(seen) != 2 || seen[0] != 1 {
		t.Fatalf("LongCalls heard %v, want [1 0]", seen)
	}
}
