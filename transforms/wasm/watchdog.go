package wasm

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Why a watchdog and not context.WithTimeout per call: see README.md,
// "Cost". In short, a timer armed per call (two per request) wakes a
// sleeping thread of an idle proxy (netpoll break) and costs more than the
// call itself; the watchdog arms none. wazero's WithCloseOnContextDone
// still starts one goroutine per call, unconditionally in v1.12.0 (see
// callEngine.callWithStack), and that goroutine is what stops a guest:
// when the watchdog closes an instance's callCtx.done, wazero's goroutine
// closes the module without releasing its resources (those are released
// by the calling goroutine, in FailIfClosed, once the guest has left its
// code), the guest's next loop back-edge sees it closed, and the call
// returns sys.ExitError with ExitCodeDeadlineExceeded or
// ExitCodeContextCanceled, as Err says. The watchdog never calls
// api.Module.Close on a running instance itself: that would release the
// WASI file table under a guest still using it.

// callCtx is the context every call into one instance runs with: its
// Done channel is closed by the watchdog when the current call runs past
// its deadline or its request ends, after which the instance is dead and
// never reused. It has one per instance, so a call allocates no context.
// Value delegates to the current request's context (the host functions
// find their callState there).
type callCtx struct {
	done chan struct{}

	// st and vals belong to the calling goroutine (set before the call,
	// cleared after); the host functions read them during the call.
	st   *callState
	vals context.Context

	mu       sync.Mutex
	err      error           // why done was closed; nil while open
	deadline int64           // monotonic nanoseconds (since the watchdog's epoch); 0 when no call runs
	req      context.Context // the running call's request context
}

var _ context.Context = (*callCtx)(nil)

func newCallCtx() *callCtx { return &callCtx{done: make(chan struct{})} }

// Deadline returns no deadline: the watchdog enforces it, so that wazero
// arms no timer of its own.
func (c *callCtx) Deadline() (time.Time, bool) { return time.Time{}, false }

// Done is closed when the instance must stop.
func (c *callCtx) Done() <-chan struct{} { return c.done }

// Err says why Done was closed: context.DeadlineExceeded (the call ran past
// CallTimeout) or context.Canceled (its request ended). wazero turns it
// into the matching sys exit code.
func (c *callCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Value returns the call's state for stateKey, else the request context's
// value.
func (c *callCtx) Value(key any) any {
	if _, ok := key.(stateKey); ok {
		return c.st
	}
	if c.vals != nil {
		return c.vals.Value(key)
	}
	return nil
}

// stopLocked closes done with err; c.mu is held.
func (c *callCtx) stopLocked(err error) {
	if c.err == nil {
		c.err = err
		close(c.done)
	}
}

// watchdog enforces every call's deadline, and stops a call whose request
// ended, for all instances of a Runtime. It ticks while calls happen and
// parks after a second without any, so an idle proxy has no timer running;
// the first call after that wakes it (one goroutine wake per idle period,
// not per call).
type watchdog struct {
	tick      time.Duration
	parkAfter time.Duration
	epoch     time.Time

	mu    sync.Mutex
	insts map[*callCtx]struct{} // every live instance's context

	calls  atomic.Uint64 // calls started, so that a tick sees short calls
	parked atomic.Bool
	wake   chan struct{} // capacity 1
	stop   chan struct{}
	done   chan struct{}
	once   sync.Once
}

// parkAfter is how long a watchdog keeps ticking without calls; tests
// shorten it before making a Runtime.
var parkAfter = time.Second

func newWatchdog(callTimeout time.Duration) *watchdog {
	w := &watchdog{
		// The tick bounds how late a deadline is enforced: a tenth of the
		// time limit, between 1 ms and 10 ms.
		tick:      min(max(callTimeout/10, time.Millisecond), 10*time.Millisecond),
		parkAfter: parkAfter,
		epoch:     time.Now(),
		insts:     map[*callCtx]struct{}{},
		wake:      make(chan struct{}, 1),
		stop:      make(chan struct{}),
		done:      make(chan struct{}),
	}
	go w.run()
	return w
}

// now returns monotonic nanoseconds since the epoch, never 0.
func (w *watchdog) now() int64 { return int64(time.Since(w.epoch)) + 1 }

// add and remove register a live instance's context.
func (w *watchdog) add(c *callCtx) {
	w.mu.Lock()
	w.insts[c] = struct{}{}
	w.mu.Unlock()
}

func (w *watchdog) remove(c *callCtx) {
	w.mu.Lock()
	delete(w.insts, c)
	w.mu.Unlock()
}

// begin arms c for a call of req with timeout d. It returns false, arming
// nothing, when c was already stopped (its instance is dead).
func (w *watchdog) begin(c *callCtx, req context.Context, st *callState, d time.Duration) bool {
	c.st, c.vals = st, req
	c.mu.Lock()
	ok := c.err == nil
	if ok {
		c.deadline, c.req = w.now()+int64(d), req
	}
	c.mu.Unlock()
	w.calls.Add(1)
	if w.parked.Load() && w.parked.CompareAndSwap(true, false) {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
	return ok
}

// end disarms c after a call and reports whether the watchdog stopped it
// (then the instance must not be reused, even if the guest returned).
func (w *watchdog) end(c *callCtx) (stopped bool) {
	c.mu.Lock()
	c.deadline, c.req = 0, nil
	stopped = c.err != nil
	c.mu.Unlock()
	c.st, c.vals = nil, nil
	return stopped
}

// close stops the watchdog and waits for it.
func (w *watchdog) close() {
	w.once.Do(func() { close(w.stop) })
	<-w.done
}

func (w *watchdog) run() {
	defer close(w.done)
	t := time.NewTimer(w.tick)
	defer t.Stop()
	last, idle := w.calls.Load(), time.Duration(0)
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		busy := w.scan()
		if n := w.calls.Load(); n != last || busy {
			last, idle = n, 0
		} else if idle += w.tick; idle >= w.parkAfter {
			w.parked.Store(true)
			// A call that started before the store saw parked false and
			// sent no wake; its count tells.
			if w.calls.Load() == last || !w.parked.CompareAndSwap(true, false) {
				select {
				case <-w.stop:
					return
				case <-w.wake:
				}
			}
			last, idle = w.calls.Load(), 0
		}
		t.Reset(w.tick)
	}
}

// scan stops every call past its deadline or whose request ended, and
// reports whether any call is running.
func (w *watchdog) scan() (busy bool) {
	now := w.now()
	w.mu.Lock()
	defer w.mu.Unlock()
	for c := range w.insts {
		c.mu.Lock()
		if c.deadline != 0 && c.err == nil {
			busy = true
			switch {
			case now > c.deadline:
				c.stopLocked(context.DeadlineExceeded)
			case c.req.Err() != nil:
				c.stopLocked(context.Canceled)
			}
		}
		c.mu.Unlock()
	}
	return busy
}

// acquireCall takes one of the runtime's MaxConcurrentCalls slots, waiting
// (bounded by ctx and PoolWait) while all are taken. Release it with
// releaseCall.
func (r *Runtime) acquireCall(ctx context.Context, name string) error {
	select {
	case r.callSlots <- struct{}{}:
		return nil
	default:
	}
	t := time.NewTimer(r.cfg.PoolWait)
	defer t.Stop()
	select {
	case r.callSlots <- struct{}{}:
		return nil
	case <-ctx.Done():
		return &Error{Module: name, Status: http.StatusServiceUnavailable, Reason: "wasm module " + name + ": the request ended while waiting for a free call slot (MaxConcurrentCalls)", Err: context.Cause(ctx)}
	case <-t.C:
		return failure(http.StatusServiceUnavailable, name, "wasm module %s: all %d call slots (MaxConcurrentCalls) stayed busy for %s", name, cap(r.callSlots), r.cfg.PoolWait)
	}
}

func (r *Runtime) releaseCall() { <-r.callSlots }
