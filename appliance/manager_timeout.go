package appliance

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
)

// TimeoutExitCode is the exit code of a command stopped by its
// ExecRequest.Timeout: timeout(1)'s.
const TimeoutExitCode = 124

// timeoutKillGrace is how long a timed-out command has between SIGTERM
// and SIGKILL.
const timeoutKillGrace = 5 * time.Second

// commandTimer stops a command that runs past its timeout: a line on its
// stderr, SIGTERM to its process group, SIGKILL after timeoutKillGrace.
type commandTimer struct {
	fired atomic.Bool
	done  chan struct{} // closed when the command ended
	gone  chan struct{} // closed when the timer's goroutine returned
}

// startTimer starts the timer of command ap (output to p); a zero or
// negative d starts none (nil).
func startTimer(p *Process, ap *agent.Process, d time.Duration) *commandTimer {
	if d <= 0 {
		return nil
	}
	t := &commandTimer{done: make(chan struct{}), gone: make(chan struct{})}
	go t.run(p, ap, d)
	return t
}

func (t *commandTimer) run(p *Process, ap *agent.Process, d time.Duration) {
	defer close(t.gone)
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-t.done:
		return
	case <-timer.C:
	}
	t.fired.Store(true)
	processOutput{p, Stderr}.Write(fmt.Appendf(nil, "sandgate: command timed out after %dms\n", d.Milliseconds()))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ap.Signal(ctx, syscall.SIGTERM)
	timer.Reset(timeoutKillGrace)
	select {
	case <-t.done:
		return
	case <-timer.C:
	}
	ap.Kill(ctx)
}

// stop is called once the command ended: it reports whether the timer
// stopped it (nil: no timer).
func (t *commandTimer) stop() bool {
	if t == nil {
		return false
	}
	close(t.done)
	<-t.gone
	return t.fired.Load()
}
