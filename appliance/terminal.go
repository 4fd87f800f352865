package appliance

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/transforms"
)

// TermSize is a terminal's size in character cells. Zero leaves the size
// the kernel gives a new terminal (which programs read as 80x24).
type TermSize struct {
	Rows, Cols uint16
}

// TerminalRequest is a command for Manager.OpenTerminal.
type TerminalRequest struct {
	// Args is the program and its arguments (/bin/sh -c CMD for a command
	// line).
	Args []string
	// Env are the command's own variables, KEY=VALUE, on top of what every
	// command gets (as ExecRequest.Env; TERM is the caller's to give).
	Env []string
	// Dir is the working directory; "" means the agent's default (HOME).
	Dir string
	// Size is the terminal's size at the start.
	Size TermSize
}

// Terminal is a command running on a terminal of its own in a sandbox
// (Manager.OpenTerminal): a pseudo-terminal the sandbox's agent allocated,
// the controlling terminal of a session of the command's own. It is a byte
// stream both ways (what the terminal shows, what is typed into it), a
// size, and an exit code; a front door carries it over whatever it speaks
// (the /v1 pty route over a WebSocket). The caller reads its output to the
// end (io.EOF once the command ended) and closes it: output that is not
// read holds the command back.
type Terminal struct {
	ap   *agent.Process
	out  *io.PipeReader
	done chan struct{} // closed once the command ended and its output was handed on

	wmu     sync.Mutex
	in      io.Writer // the command's input, through the credential guard
	refused error     // the guard's refusal of the input, once one came

	closeOnce sync.Once
}

// terminalKillWait bounds the kill of a terminal's command by Close or a
// refused input.
const terminalKillWait = 10 * time.Second

// OpenTerminal starts a command on a terminal in running sandbox id. As for
// Exec, the command, its directory and its variables pass the credential
// guard first (a refusal is transforms.ErrCredential), and so does every
// byte typed into it: a held secret kills the command before any byte of
// the secret reaches it (Write returns the refusal). The sandbox is in use,
// never idle, until the command ends. The command outlives ctx; Close
// hangs it up.
func (m *Manager) OpenTerminal(ctx context.Context, id string, req TerminalRequest) (*Terminal, error) {
	sb, done, err := m.running(id)
	if err != nil {
		return nil, err
	}
	g := sb.relay.Transforms().Guard()
	for _, c := range []struct {
		where  string
		values []string
	}{{whereCommand, req.Args}, {whereDir, []string{req.Dir}}, {whereEnv, req.Env}} {
		if err := g.Check(c.where, c.values...); err != nil {
			done()
			return nil, err
		}
	}
	pr, pw := io.Pipe()
	ap, err := sb.Spawn(sb.Context(), agent.Cmd{
		Args: req.Args, Env: req.Env, Dir: req.Dir, StdinPipe: true, Stdout: pw,
		TTY: &agent.WinSize{Rows: req.Size.Rows, Cols: req.Size.Cols},
	})
	if err != nil {
		done()
		return nil, err
	}
	t := &Terminal{ap: ap, out: pr, done: make(chan struct{})}
	t.in = ap.Stdin
	if !g.Empty() {
		t.in = g.Writer(ap.Stdin, whereStdin)
	}
	go func() {
		<-ap.Done() // the agent handed on all its output before the exit
		pw.Close()
		done()
		close(t.done)
	}()
	m.met.execs.Inc()
	return t, nil
}

// PID is the command's pid in the sandbox.
func (t *Terminal) PID() int { return t.ap.PID }

// Read reads what the terminal shows; io.EOF once the command ended and
// everything it wrote was read.
func (t *Terminal) Read(p []byte) (int, error) { return t.out.Read(p) }

// Write types p into the terminal. A held credential of the sandbox's
// transformations in what is typed (across writes) kills the command
// before any byte of it goes in, and is returned (transforms.ErrCredential);
// a keystroke that could begin one waits for the next. Writes after the
// command ended fail.
func (t *Terminal) Write(p []byte) (int, error) {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	if t.refused != nil {
		return 0, t.refused
	}
	n, err := t.in.Write(p)
	if errors.Is(err, transforms.ErrCredential) {
		t.refused = err
		ctx, cancel := context.WithTimeout(context.Background(), terminalKillWait)
		defer cancel()
		t.ap.Kill(ctx)
	}
	return n, err
}

// Resize changes the terminal's size (the command gets SIGWINCH).
func (t *Terminal) Resize(size TermSize) error {
	return t.ap.Resize(agent.WinSize{Rows: size.Rows, Cols: size.Cols})
}

// Wait waits for the command's end and returns its exit code (128+N for a
// signal N). The error says when the end is not the command's own: its
// input was refused (the command was killed: 137), or its end could not
// be known (the sandbox stopped: 255). If ctx ends first, Wait returns
// its cause and the command keeps running.
func (t *Terminal) Wait(ctx context.Context) (int, error) {
	select {
	case <-t.done:
	case <-ctx.Done():
		return -1, context.Cause(ctx)
	}
	st, err := t.ap.Wait(ctx)
	t.wmu.Lock()
	refused := t.refused
	t.wmu.Unlock()
	switch {
	case refused != nil:
		return exitCode(st), fmt.Errorf("the command was killed: %w", refused)
	case err != nil:
		return 255, err
	}
	return exitCode(st), nil
}

// Close hangs the terminal up: a command still running is killed (its
// whole session's process group), and output not yet read is dropped.
func (t *Terminal) Close() error {
	t.closeOnce.Do(func() {
		select {
		case <-t.done:
		default:
			ctx, cancel := context.WithTimeout(context.Background(), terminalKillWait)
			t.ap.Kill(ctx)
			cancel()
		}
		t.ap.Stdin.Close()
		t.out.CloseWithError(io.ErrClosedPipe) // unblocks the agent's delivery of what nobody reads
	})
	return nil
}

var _ io.ReadWriteCloser = (*Terminal)(nil)
