package appliance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
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
// keeps (ManagerConfig.OutputBytes).
var ErrOutputDropped = errors.New("output dropped")

// Process is a command the manager started in a sandbox (Manager.Exec):
// the last OutputBytes of its output, in the order it came, for streams
// that start late or break and resume, and its exit code. It is known
// while its sandbox runs, and until ProcessRetention after it exits.
type Process struct {
	id    string
	agent *agent.Process // nil for a command that could not start

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
}

type outputChunk struct {
	channel int
	data    []byte
}

// follower is a stream attached to a process's output: while one is
// attached, the command is held back rather than output it has not sent
// being dropped.
type follower struct{ off int64 }

func newProcess(limit int) *Process {
	p := &Process{id: newProcessID(), limit: limit, followers: map[*follower]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	return p
}

// NewProcess returns a process with no command behind it, keeping the last
// limit bytes of its output: for a backend other than the manager (a test
// double, a forwarder) to give its callers what Exec gives. Write its
// output with Output, end it with Finish.
func NewProcess(limit int) *Process { return newProcess(limit) }

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
	defer p.mu.Unlock()
	// Backpressure while a stream is attached and behind by the limit.
	for p.behind() {
		p.cond.Wait()
	}
	p.chunks = append(p.chunks, outputChunk{channel: w.channel, data: slices.Clone(b)})
	p.end += int64(len(b))
	p.kept += len(b)
	for p.kept > p.limit && len(p.chunks) > 1 {
		p.kept -= len(p.chunks[0].data)
		p.start += int64(len(p.chunks[0].data))
		p.chunks = p.chunks[1:]
	}
	p.cond.Broadcast()
	return len(b), nil
}

// behind reports whether an attached stream lags the output by the limit.
func (p *Process) behind() bool {
	for f := range p.followers {
		if p.end-f.off >= int64(p.limit) {
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
	if p.agent == nil {
		return nil
	}
	if _, exited := p.Exit(); exited {
		return nil
	}
	err := p.agent.Signal(ctx, sig)
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

// Follow hands the process's output from offset off to emit, in the order
// it came (channel Stdout or Stderr), and calls flush whenever it has
// caught up; once the process has exited and everything was handed over,
// it returns its exit code. It returns early with ctx's error, or emit's.
// An offset older than what is kept is ErrOutputDropped.
func (p *Process) Follow(ctx context.Context, off int64, emit func(channel int, data []byte) error, flush func()) (int, error) {
	f := &follower{off: off}
	p.mu.Lock()
	if off < p.start {
		start := p.start
		p.mu.Unlock()
		return 0, fmt.Errorf("%w: bytes before %d are no longer kept (the last %d bytes of a process's output are)", ErrOutputDropped, start, p.limit)
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
