package appliance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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
	// Key names the terminal for AttachTerminal (the Cloudflare bridge:
	// its session); "" gives it a random one (Terminal.ID). A key that
	// names a live terminal of the sandbox is ErrExists.
	Key string
	// Alive, when set, says whether this client is still there (a ping
	// of its connection), asked when another client wants the terminal.
	Alive func(context.Context) error
}

// Defaults of a terminal's reconnection (ManagerConfig.TerminalGrace).
const (
	// DefaultTerminalGrace is how long a terminal whose client went away
	// waits for one to come back before it is hung up: the reference
	// bridge's PTY waits 30 s for its client (its disconnectTimeout).
	DefaultTerminalGrace = 30 * time.Second
	// TerminalScrollback is how much of a terminal's output is kept for a
	// client that comes back (the reference's PTY buffer, 256 KiB).
	TerminalScrollback = 256 << 10
	// terminalAliveWait bounds the ping of the client attached when
	// another asks for the terminal.
	terminalAliveWait = 3 * time.Second
)

// Errors of a terminal's attachment.
var (
	// ErrTerminalTaken: another client attached to the terminal, and this
	// one no longer reads or writes it.
	ErrTerminalTaken error = terminalTaken("another client attached to this terminal")
	// ErrTerminalBusy: the terminal has a client that is still there (it
	// answered a ping): one client at a time.
	ErrTerminalBusy = fmt.Errorf("%w: another client is attached to this terminal and answers; close it first", ErrExists)
)

type terminalTaken string

func (e terminalTaken) Error() string { return string(e) }

// Is makes a terminal taken a conflict (ErrExists).
func (e terminalTaken) Is(target error) bool { return target == ErrExists }

// term is a running terminal of a sandbox, with its scrollback: the
// command on a terminal its agent allocated, which outlives a client that
// goes away (Terminal.Detach) for ManagerConfig.TerminalGrace, so that a
// client that comes back (Manager.AttachTerminal) gets what it missed.
// One client is attached at a time.
type term struct {
	key   string
	sb    *Sandbox
	ap    *agent.Process
	grace time.Duration
	log   func(msg string, args ...any)

	wmu     sync.Mutex
	in      io.Writer // the command's input, through the credential guard
	refused error     // the guard's refusal of the input, once one came

	mu     sync.Mutex
	cond   *sync.Cond
	buf    []byte // the scrollback, a ring: offset o is at buf[o%len(buf)]
	start  int64  // the oldest byte kept
	end    int64  // the bytes written so far
	eof    bool   // the command ended, its output all here
	client *Terminal
	timer  *time.Timer // the grace of a terminal with no client
	gone   bool        // hung up (or forgotten): no client attaches any more
	done   chan struct{}
}

// Terminal is a client's attachment to a command running on a terminal
// of its own in a sandbox (Manager.OpenTerminal, AttachTerminal): a
// pseudo-terminal the sandbox's agent allocated, the controlling terminal
// of a session of the command's own. It is a byte stream both ways (what
// the terminal shows, from the offset the client asked for; what is typed
// into it), a size, and an exit code; a front door carries it over a
// WebSocket. Read it to the end (io.EOF once the command ended): output
// that the attached client does not read holds the command back. A client
// that goes away Detaches: the terminal runs on, its output kept (the last
// TerminalScrollback bytes), until a client attaches again or its grace
// ends (then it is hung up). Close hangs it up at once.
type Terminal struct {
	t     *term
	cur   int64 // the next byte this client reads
	skip  int64 // bytes this client asked for that were no longer kept
	alive func(context.Context) error
	err   error // why this attachment ended (guarded by t.mu)
}

// ID names the terminal, for AttachTerminal.
func (c *Terminal) ID() string { return c.t.key }

// Offset is the offset of the next byte Read returns.
func (c *Terminal) Offset() int64 {
	c.t.mu.Lock()
	defer c.t.mu.Unlock()
	return c.cur
}

// Skipped is how many of the bytes asked for at attachment were no longer
// kept (older than the scrollback): they are not read.
func (c *Terminal) Skipped() int64 { return c.skip }

// terminalKillWait bounds the kill of a terminal's command by Close or a
// refused input.
const terminalKillWait = 10 * time.Second

// OpenTerminal starts a command on a terminal in running sandbox id. As for
// Exec, the command, its directory and its variables pass the credential
// guard first (a refusal is transforms.ErrCredential), and so does every
// byte typed into it: a held secret kills the command before any byte of
// the secret reaches it (Write returns the refusal). The sandbox is in use,
// never idle, until the command ends. The command outlives ctx; Close
// hangs it up, Detach leaves it for a client to come back to.
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
	key := req.Key
	if key == "" {
		var b [12]byte
		rand.Read(b[:])
		key = hex.EncodeToString(b[:])
	}
	t := &term{key: key, sb: sb, grace: m.cfg.TerminalGrace, buf: make([]byte, TerminalScrollback), done: make(chan struct{}),
		log: func(msg string, args ...any) { m.log.Info(msg, append(args, "sandbox", id)...) }}
	t.cond = sync.NewCond(&t.mu)
	if !sb.addTerminal(t) {
		done()
		return nil, fmt.Errorf("%w: sandbox %q has a terminal %q: attach to it", ErrExists, id, key)
	}
	pr, pw := io.Pipe()
	ap, err := sb.Spawn(sb.Context(), agent.Cmd{
		Args: req.Args, Env: req.Env, Dir: req.Dir, StdinPipe: true, Stdout: pw,
		TTY: &agent.WinSize{Rows: req.Size.Rows, Cols: req.Size.Cols},
	})
	if err != nil {
		sb.removeTerminal(t)
		done()
		return nil, err
	}
	t.ap, t.in = ap, ap.Stdin
	if !g.Empty() {
		t.in = g.Writer(ap.Stdin, whereStdin)
	}
	c := &Terminal{t: t, alive: req.Alive}
	t.client = c
	go t.pump(pr)
	go func() {
		<-ap.Done() // the agent handed on all its output before the exit
		pw.Close()
		done()
	}()
	m.met.execs.Inc()
	return c, nil
}

// AttachTerminal attaches a client to live terminal key of running sandbox
// id (one whose client went away, or still has one), reading from offset
// from: what the terminal showed from there on, as far as it is kept
// (Skipped says how much was not), then what it shows next. A client
// attached before that still answers (alive, asked within a few seconds)
// keeps the terminal: ErrTerminalBusy; one that does not is taken to be
// gone, and its reads and writes end (ErrTerminalTaken). A terminal that
// is not there (never, hung up, past its grace, or its sandbox stopped
// running) is ErrNotFound.
func (m *Manager) AttachTerminal(ctx context.Context, id, key string, from int64, alive func(context.Context) error) (*Terminal, error) {
	sb, err := m.Sandbox(id)
	if errors.Is(err, ErrNotRunning) {
		return nil, fmt.Errorf("%w: no terminal %q: sandbox %q is not running, and its terminals ended with it", ErrNotFound, key, id)
	}
	if err != nil {
		return nil, err
	}
	t := sb.terminal(key)
	if t == nil {
		return nil, fmt.Errorf("%w: no terminal %q in sandbox %q: it ended, was hung up, or its client was gone longer than %s", ErrNotFound, key, id, m.cfg.TerminalGrace)
	}
	return t.attach(ctx, from, alive)
}

func (t *term) attach(ctx context.Context, from int64, alive func(context.Context) error) (*Terminal, error) {
	t.mu.Lock()
	old := t.client
	t.mu.Unlock()
	if old != nil && old.alive != nil {
		actx, cancel := context.WithTimeout(ctx, terminalAliveWait)
		err := old.alive(actx)
		cancel()
		if err == nil {
			return nil, ErrTerminalBusy
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.gone {
		return nil, fmt.Errorf("%w: terminal %q was hung up", ErrNotFound, t.key)
	}
	if from > t.end || from < 0 {
		return nil, fmt.Errorf("%w: offset %d: terminal %q has shown %d bytes", ErrBadInput, from, t.key, t.end)
	}
	if t.client != nil {
		t.client.err = ErrTerminalTaken
		t.log("a terminal's client was taken to be gone: another attached", "terminal", t.key)
	}
	c := &Terminal{t: t, cur: from, alive: alive}
	if from < t.start {
		c.skip, c.cur = t.start-from, t.start
	}
	t.client = c
	if t.timer != nil {
		t.timer.Stop()
		t.timer = nil
	}
	t.cond.Broadcast()
	return c, nil
}

// pump keeps the command's output in the scrollback, holding the command
// back while the attached client has a whole scrollback unread.
func (t *term) pump(r *io.PipeReader) {
	defer close(t.done)
	chunk := make([]byte, 32<<10)
	for {
		n, err := r.Read(chunk)
		t.mu.Lock()
		for n > 0 && t.client != nil && t.client.err == nil && t.end+int64(n)-t.client.cur > int64(len(t.buf)) && !t.gone {
			t.cond.Wait()
		}
		for i := range n {
			t.buf[(t.end+int64(i))%int64(len(t.buf))] = chunk[i]
		}
		t.end += int64(n)
		t.start = max(t.start, t.end-int64(len(t.buf)))
		if err != nil {
			t.eof = true
		}
		t.cond.Broadcast()
		idle := t.eof && t.client == nil
		t.mu.Unlock()
		if idle {
			t.forgetLater() // the end is kept for a client that comes back
		}
		if err != nil {
			return
		}
	}
}

// Read reads what the terminal shows: io.EOF once the command ended and
// everything was read; ErrTerminalTaken once another client attached.
func (c *Terminal) Read(p []byte) (int, error) {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	for {
		if c.err != nil {
			return 0, c.err
		}
		if c.cur < t.start { // the pump ran on while this client was away
			c.skip, c.cur = c.skip+t.start-c.cur, t.start
		}
		if c.cur < t.end {
			n := t.copyOut(p, c.cur)
			c.cur += int64(n)
			t.cond.Broadcast()
			return n, nil
		}
		if t.eof {
			return 0, io.EOF
		}
		t.cond.Wait()
	}
}

// copyOut copies the kept bytes from offset off into p (t.mu held).
func (t *term) copyOut(p []byte, off int64) int {
	n := int(min(int64(len(p)), t.end-off))
	size := int64(len(t.buf))
	for i := 0; i < n; {
		at := (off + int64(i)) % size
		i += copy(p[i:n], t.buf[at:min(size, at+int64(n-i))])
	}
	return n
}

// Replay returns what the terminal showed from this client's offset up to
// now, and moves the client past it: a client that comes back gets it in
// one piece (the Cloudflare bridge's replay) before what comes next.
func (c *Terminal) Replay() []byte {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if c.err != nil || c.cur >= t.end {
		return nil
	}
	c.cur = max(c.cur, t.start)
	p := make([]byte, t.end-c.cur)
	c.cur += int64(t.copyOut(p, c.cur))
	t.cond.Broadcast()
	return p
}

// Write types p into the terminal. A held credential of the sandbox's
// transformations in what is typed (across writes) kills the command
// before any byte of it goes in, and is returned (transforms.ErrCredential);
// a keystroke that could begin one waits for the next. Writes after the
// command ended, or once another client attached, fail.
func (c *Terminal) Write(p []byte) (int, error) {
	if err := c.taken(); err != nil {
		return 0, err
	}
	t := c.t
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

// taken is ErrTerminalTaken once another client attached.
func (c *Terminal) taken() error {
	c.t.mu.Lock()
	defer c.t.mu.Unlock()
	if errors.Is(c.err, ErrTerminalTaken) {
		return c.err
	}
	return nil
}

// Taken says whether another client attached to the terminal since this
// one did.
func (c *Terminal) Taken() bool { return c.taken() != nil }

// Resize changes the terminal's size (the command gets SIGWINCH).
func (c *Terminal) Resize(size TermSize) error {
	if err := c.taken(); err != nil {
		return err
	}
	return c.t.ap.Resize(agent.WinSize{Rows: size.Rows, Cols: size.Cols})
}

// PID is the command's pid in the sandbox.
func (c *Terminal) PID() int { return c.t.ap.PID }

// Wait waits for the command's end and returns its exit code (128+N for a
// signal N). The error says when the end is not the command's own: its
// input was refused (the command was killed: 137), or its end could not
// be known (the sandbox stopped: 255). If ctx ends first, Wait returns
// its cause and the command keeps running.
func (c *Terminal) Wait(ctx context.Context) (int, error) {
	t := c.t
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

// Finish ends a terminal whose output this client read to its end: it
// waits (a few seconds at most) for the command's exit code, as Wait, and
// forgets the terminal before the caller says it ended, so that no client
// told so can attach to it again.
func (c *Terminal) Finish(ctx context.Context) (int, error) {
	wctx, cancel := context.WithTimeout(ctx, terminalKillWait)
	defer cancel()
	code, err := c.Wait(wctx)
	c.Close()
	return code, err
}

// Close hangs the terminal up: a command still running is killed (its
// whole session's process group), and output not yet read is dropped. A
// client another has taken the terminal from only lets go of it.
func (c *Terminal) Close() error {
	if c.taken() != nil {
		return nil
	}
	c.t.hangUp()
	return nil
}

// Detach lets go of the terminal without hanging it up: its client went
// away. The command runs on, its output kept, until a client attaches
// again (AttachTerminal) or ManagerConfig.TerminalGrace passes (then it is
// hung up). One whose command ended and whose client read it all is gone
// at once.
func (c *Terminal) Detach() {
	t := c.t
	t.mu.Lock()
	if t.client != c {
		t.mu.Unlock()
		return
	}
	t.client = nil
	c.err = io.ErrClosedPipe
	t.cond.Broadcast()
	finished := t.eof && c.cur >= t.end
	t.mu.Unlock()
	if finished || t.grace < 0 {
		t.hangUp()
		return
	}
	t.forgetLater()
}

// forgetLater hangs the terminal up once its grace passes with no client.
func (t *term) forgetLater() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.gone || t.client != nil || t.timer != nil {
		return
	}
	t.timer = time.AfterFunc(max(t.grace, 0), func() {
		t.mu.Lock()
		stale := t.client != nil || t.timer == nil
		t.mu.Unlock()
		if !stale {
			t.log("a terminal's client did not come back within its grace: hung up", "terminal", t.key, "grace", t.grace.String())
			t.hangUp()
		}
	})
}

// hangUp kills the terminal's command (if it runs), drops its output and
// forgets it.
func (t *term) hangUp() {
	t.mu.Lock()
	if t.gone {
		t.mu.Unlock()
		return
	}
	t.gone = true
	if t.timer != nil {
		t.timer.Stop()
		t.timer = nil
	}
	if t.client != nil && t.client.err == nil {
		t.client.err = io.ErrClosedPipe
	}
	t.cond.Broadcast()
	t.mu.Unlock()
	t.sb.removeTerminal(t) // a client that comes for it now gets a new one
	select {
	case <-t.done:
	default:
		if t.sb.Context().Err() == nil {
			ctx, cancel := context.WithTimeout(context.Background(), terminalKillWait)
			t.ap.Kill(ctx)
			cancel()
		}
	}
	t.ap.Stdin.Close()
}

var _ io.ReadWriteCloser = (*Terminal)(nil)
