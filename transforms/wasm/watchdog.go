package wasm

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetratelabs/wazero/api"
	"github.com/tetratelabs/wazero/sys"
)

// Why a watchdog and not context.WithTimeout per call: see README.md,
// "Cost". In short, a timer armed per call (two per request) wakes a
// sleeping thread of an idle proxy (netpoll break) and costs more than the
// call itself; the watchdog arms none. Nor does wazero start anything per
// call: the runtime does not use WithCloseOnContextDone, and a call is
// bounded by the checks bound.go adds to the guest's code instead. When
// the watchdog finds a call past its deadline (or its request ended), it
// records why in the instance's callCtx and sets the instance's stop
// global; the guest's next function or loop entry sees it and calls the
// host's yield, which fails the call with sys.ExitError
// (ExitCodeDeadlineExceeded or ExitCodeContextCanceled, as Err says). The
// watchdog never closes a running instance: the calling goroutine does,
// once the call has returned.

// callCtx is the context every call into one instance runs with. It has
// one per instance, so a call allocates no context, and no Done channel:
// wazero has nothing to watch. Value delegates to the current request's
// context (the host functions find their callState there).
type callCtx struct {
	// stop is the instance's stop global (bound): set to 1 by the
	// watchdog to stop the running call. It is written from the
	// watchdog's goroutine and read only by the guest's compiled code.
	stop api.MutableGlobal

	// st and vals belong to the calling goroutine (set before the call,
	// cleared after); the host functions read them during the call.
	st   *callState
	vals context.Context

	mu       sync.Mutex
	err      error           // why the instance was stopped; nil while it may run
	deadline int64           // monotonic nanoseconds (since the watchdog's epoch); 0 when no call runs
	started  int64           // when the running call began, in the same clock
	req      context.Context // the running call's request context
}

var _ context.Context = (*callCtx)(nil)

func newCallCtx(stop api.MutableGlobal) *callCtx { return &callCtx{stop: stop} }

// Deadline returns no deadline: the watchdog enforces it.
func (c *callCtx) Deadline() (time.Time, bool) { return time.Time{}, false }

// Done returns nil: nothing waits on a call's context; the watchdog stops
// a call through its stop global.
func (c *callCtx) Done() <-chan struct{} { return nil }

// Err says why the instance was stopped: context.DeadlineExceeded (the
// call ran past its time limit) or context.Canceled (its request ended);
// nil while it may run.
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

// stopLocked stops the instance with err; c.mu is held.
func (c *callCtx) stopLocked(err error) {
	if c.err == nil {
		c.err = err
		c.stop.Set(1)
	}
}

// exitCode is the exit code a call stopped for err fails with.
func exitCode(err error) uint32 {
	if errors.Is(err, context.Canceled) {
		return sys.ExitCodeContextCanceled
	}
	return sys.ExitCodeDeadlineExceeded
}

// yield is the host function the guest's checks call (bound.go): every
// yieldEvery function and loop entries, and at once when the watchdog set
// the stop global. It fails a stopped call; otherwise it just returns, and
// the return through Go is where the scheduler can preempt a guest that
// has held its thread for long.
func yield(ctx context.Context, _ api.Module, _ []uint64) {
	if c, ok := ctx.(*callCtx); ok {
		if err := c.Err(); err != nil {
			panic(sys.NewExitError(exitCode(err)))
		}
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

	// onLong (Config.LongCalls) is told the number of calls running for
	// more than a tick when it changes; long is the last number told.
	onLong func(n int)
	long   int

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

func newWatchdog(callTimeout time.Duration, onLong func(n int)) *watchdog {
	w := &watchdog{
		onLong: onLong,
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
		now := w.now()
		c.deadline, c.started, c.req = now+int64(d), now, req
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
	defer func() {
		if w.long != 0 { // the runtime closed under long calls
			w.onLong(0)
		}
	}()
	t := time.NewTimer(w.tick)
	defer t.Stop()
	last, idle := w.calls.Load(), time.Duration(0)
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		busy, long := w.scan()
		if long != w.long && w.onLong != nil {
			w.long = long
			w.onLong(long)
		}
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
// reports whether any call is running and how many have run for more than
// a tick.
func (w *watchdog) scan() (busy bool, long int) {
	now := w.now()
	w.mu.Lock()
	defer w.mu.Unlock()
	for c := range w.insts {
		c.mu.Lock()
		if c.deadline != 0 && c.err == nil {
			busy = true
			if now-c.started > int64(w.tick) {
				long++
			}
			switch {
			case now > c.deadline:
				c.stopLocked(context.DeadlineExceeded)
			case c.req.Err() != nil:
				c.stopLocked(context.Canceled)
			}
		}
		c.mu.Unlock()
	}
	return busy, long
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
