package appliance

import (
	"container/list"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
)

// Output channels of a Process (protocol 1's frame channels).
const (
	Stdout = 1
	Stderr = 2
)

// ErrOutputDropped: a stream asked for output older than what a process
// keeps: its own window (ManagerConfig.OutputBytes) moved on, or the
// service's budget (ManagerConfig.OutputBudget) dropped it. The error's
// text says which, and what is still kept.
var ErrOutputDropped = errors.New("output dropped")

// Process is a command the manager started in a sandbox (Manager.Exec):
// the last OutputBytes of its output, in the order it came, for streams
// that start late or break and resume, and its exit code. It is known
// while its sandbox runs, and until ProcessRetention after it exits; its
// output may be dropped sooner, oldest finished command first, to keep the
// service within its output budget (outputBudget).
type Process struct {
	id string
	// agent is the command while it runs: nil for one that could not
	// start, and once it exited (its stream's buffers go with it: a
	// finished process is kept ProcessRetention).
	agent  atomic.Pointer[agent.Process]
	budget *outputBudget // nil: only limit bounds it

	mu        sync.Mutex
	cond      *sync.Cond
	chunks    []outputChunk // kept output, oldest first
	start     int64         // output offset of chunks[0]
	end       int64         // output bytes so far
	kept      int           // bytes in chunks
	limit     int
	followers map[*follower]struct{}
	exit      *int
	exited    time.Time
	// why is what last moved start on (dropWindow, dropBudget).
	why dropCause
	// elem is the process's place in its budget's list of finished
	// processes (nil while it runs, once it is released, or without a
	// budget); guarded by budget.mu. gone marks a released process:
	// nothing of its output is kept from then on.
	elem *list.Element
	live bool // counted in budget.live; guarded by budget.mu
	gone bool
}

// dropCause is why the start of a process's kept output moved on.
type dropCause int

const (
	dropNone   dropCause = iota
	dropWindow           // its own window (OutputBytes)
	dropBudget           // the service's output budget
	dropGone             // its sandbox stopped, or it was forgotten
)

type outputChunk struct {
	channel int
	data    []byte
}

// chunkBytes is the most one chunk of kept output grows to: output comes
// in writes of any size (a chatty command writes a line at a time), and is
// appended to the last chunk of its channel up to this, so that what a
// process keeps costs its bytes, not a slice per write.
const chunkBytes = 32 << 10

// follower is a stream attached to a process's output: while one is
// attached, the command is held back rather than output it has not sent
// being dropped.
type follower struct{ off int64 }

func newProcess(limit int, b *outputBudget) *Process {
	p := &Process{id: newProcessID(), limit: limit, budget: b, followers: map[*follower]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	b.started(p)
	return p
}

// NewProcess returns a process with no command behind it, keeping the last
// limit bytes of its output: for a backend other than the manager (a test
// double, a forwarder) to give its callers what Exec gives. Write its
// output with Output, end it with Finish.
func NewProcess(limit int) *Process { return newProcess(limit, nil) }

// Output is the writer of the process's channel (Stdout or Stderr).
func (p *Process) Output(channel int) io.Writer { return processOutput{p, channel} }

// Finish records the process's exit code.
func (p *Process) Finish(code int) { p.finish(code) }

// newProcessID is a random UUID, as protocol 1's reference gives.
func newProcessID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// ID is the process's id (an opaque string, a UUID).
func (p *Process) ID() string { return p.id }

// processOutput is a process's stdout or stderr.
type processOutput struct {
	p       *Process
	channel int
}

func (w processOutput) Write(b []byte) (int, error) {
	p := w.p
	p.mu.Lock()
	// Backpressure while a stream is attached and behind by the window.
	for p.behind() {
		p.cond.Wait()
	}
	p.end += int64(len(b))
	if p.gone {
		p.start = p.end
		p.cond.Broadcast()
		p.mu.Unlock()
		return len(b), nil
	}
	p.appendLocked(w.channel, b)
	why, window := dropWindow, p.windowLocked()
	if window < p.limit {
		why = dropBudget // its share of the budget is less than its window
	}
	freed := p.trimLocked(window, why)
	p.cond.Broadcast()
	p.mu.Unlock()
	p.budget.add(int64(len(b) - freed))
	p.budget.enforce()
	return len(b), nil
}

// appendLocked keeps b, appended to the last chunk when it is of the same
// channel and has room.
func (p *Process) appendLocked(channel int, b []byte) {
	p.kept += len(b)
	if n := len(p.chunks); n > 0 {
		last := &p.chunks[n-1]
		if last.channel == channel && len(last.data)+len(b) <= chunkBytes {
			last.data = append(last.data, b...)
			return
		}
	}
	data := make([]byte, len(b), max(len(b), min(4*len(b), chunkBytes)))
	copy(data, b)
	p.chunks = append(p.chunks, outputChunk{channel: channel, data: data})
}

// trimLocked drops the oldest kept output until at most keep bytes are
// kept, but never what an attached stream has still to read; it returns
// the bytes dropped.
func (p *Process) trimLocked(keep int, why dropCause) int {
	floor := p.end
	for f := range p.followers {
		floor = min(floor, f.off)
	}
	freed := 0
	for p.kept > keep && len(p.chunks) > 0 && p.start < floor {
		c := &p.chunks[0]
		n := min(len(c.data), p.kept-keep, int(floor-p.start))
		if n == len(c.data) {
			c.data = nil
			p.chunks = p.chunks[1:]
		} else {
			c.data = c.data[n:]
		}
		p.kept -= n
		p.start += int64(n)
		freed += n
	}
	if len(p.chunks) == 0 {
		p.chunks = nil // let the array go
	}
	if freed > 0 {
		p.why = why
	}
	return freed
}

// windowLocked is how much of its output the process keeps now: its
// limit, or less while it runs and the service's budget is shared among
// more running commands.
func (p *Process) windowLocked() int {
	if p.exit != nil {
		return p.limit
	}
	return min(p.limit, p.budget.share())
}

// behind reports whether an attached stream lags the output by the window.
func (p *Process) behind() bool {
	w := int64(p.windowLocked())
	for f := range p.followers {
		if p.end-f.off >= w {
			return true
		}
	}
	return false
}

func (p *Process) finish(code int) {
	p.mu.Lock()
	p.exit = &code
	p.exited = time.Now()
	p.cond.Broadcast()
	p.mu.Unlock()
	p.budget.finished(p)
	p.budget.enforce()
}

// release drops everything the process keeps, for good: it was forgotten,
// or its sandbox stopped. A stream still following it ends with
// ErrOutputDropped.
func (p *Process) release() {
	p.mu.Lock()
	p.gone = true
	freed := p.kept
	p.chunks, p.kept, p.start = nil, 0, p.end
	if freed > 0 {
		p.why = dropGone
	}
	p.cond.Broadcast()
	p.mu.Unlock()
	p.budget.released(p, int64(freed))
}

// Exit returns the exit code (128+n for a signal), or ok false while the
// process runs.
func (p *Process) Exit() (code int, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exit == nil {
		return 0, false
	}
	return *p.exit, true
}

// Wait waits until the process exits or ctx ends; ok is false when it
// still runs.
func (p *Process) Wait(ctx context.Context) (code int, ok bool) {
	stop := context.AfterFunc(ctx, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	defer stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.exit == nil && ctx.Err() == nil {
		p.cond.Wait()
	}
	if p.exit == nil {
		return 0, false
	}
	return *p.exit, true
}

// Signal sends sig to the process and everything it started (its process
// group). One that has exited, or never started, is left alone.
func (p *Process) Signal(ctx context.Context, sig syscall.Signal) error {
	ap := p.agent.Load()
	if ap == nil {
		return nil
	}
	if _, exited := p.Exit(); exited {
		return nil
	}
	err := ap.Signal(ctx, sig)
	if _, exited := p.Exit(); exited {
		return nil
	}
	return err
}

// Range returns the offsets of the output kept: from start to end.
func (p *Process) Range() (start, end int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.start, p.end
}

// forgettable reports whether the process exited more than retention ago
// and no stream follows it.
func (p *Process) forgettable(retention time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exit != nil && time.Since(p.exited) > retention && len(p.followers) == 0
}

// Available reports whether output from offset off is still kept: nil,
// or ErrOutputDropped saying what was dropped, why, and what is still
// kept (the text a client whose stream resumes there is given).
func (p *Process) Available(off int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if off >= p.start {
		return nil
	}
	return p.droppedLocked(off)
}

func (p *Process) droppedLocked(off int64) error {
	var why string
	switch p.why {
	case dropBudget:
		why = fmt.Sprintf("to keep the service within its output budget (%d bytes for every command's output together, the oldest finished command's dropped first)", p.budget.limit)
	case dropGone:
		why = "as its sandbox stopped running"
	default:
		why = fmt.Sprintf("as a command keeps only the last %d bytes of its output", p.limit)
	}
	var left string
	switch {
	case p.start < p.end:
		left = fmt.Sprintf("bytes %d to %d are still kept: resume from offset %d", p.start, p.end, p.start)
	case p.exit != nil:
		left = fmt.Sprintf("none of it is kept any more; the process exited with code %d", *p.exit)
	default:
		left = fmt.Sprintf("none of it is kept now; what it writes next will be, from offset %d", p.end)
	}
	return fmt.Errorf("%w: bytes %d to %d of process %s's output were dropped %s; %s", ErrOutputDropped, off, p.start, p.id, why, left)
}

// Follow hands the process's output from offset off to emit, in the order
// it came (channel Stdout or Stderr), and calls flush whenever it has
// caught up; once the process has exited and everything was handed over,
// it returns its exit code. It returns early with ctx's error, or emit's.
// An offset older than what is kept is ErrOutputDropped (see Available).
func (p *Process) Follow(ctx context.Context, off int64, emit func(channel int, data []byte) error, flush func()) (int, error) {
	f := &follower{off: off}
	p.mu.Lock()
	if off < p.start {
		err := p.droppedLocked(off)
		p.mu.Unlock()
		return 0, err
	}
	p.followers[f] = struct{}{}
	p.mu.Unlock()
	stop := context.AfterFunc(ctx, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	defer stop()
	defer func() {
		p.mu.Lock()
		delete(p.followers, f)
		p.cond.Broadcast()
		p.mu.Unlock()
	}()
	for {
		p.mu.Lock()
		for f.off >= p.end && p.exit == nil && ctx.Err() == nil {
			p.cond.Wait()
		}
		if ctx.Err() != nil {
			p.mu.Unlock()
			return 0, ctx.Err()
		}
		if f.off < p.start { // released under it
			err := p.droppedLocked(f.off)
			p.mu.Unlock()
			return 0, err
		}
		var out []outputChunk
		pos := p.start
		for _, c := range p.chunks {
			if next := pos + int64(len(c.data)); next > f.off {
				skip := max(0, f.off-pos)
				out = append(out, outputChunk{channel: c.channel, data: c.data[skip:]})
			}
			pos += int64(len(c.data))
		}
		end, exit := p.end, p.exit
		p.mu.Unlock()
		for _, c := range out {
			if err := emit(c.channel, c.data); err != nil {
				return 0, err
			}
		}
		p.mu.Lock()
		f.off = end
		p.cond.Broadcast() // a writer held back may go on
		p.mu.Unlock()
		flush()
		if exit != nil && f.off >= end {
			return *exit, nil
		}
	}
}

// exitCode is a status as protocol 1 reports it: 128+n for a signal.
func exitCode(st agent.ExitStatus) int {
	if st.Signal != 0 {
		return 128 + int(st.Signal)
	}
	return st.Code
}
