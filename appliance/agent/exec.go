package agent

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"
)

// Output waiting after a command's own process exits.
const (
	// DefaultWaitDelay is how long the agent keeps reading a command's
	// stdout and stderr after the process itself exited, for what a
	// background process that inherited them still writes. After it, what
	// the pipes hold is sent and the exit is reported; the background
	// process keeps running (it is still in the command's process group,
	// so a signal to the command reaches it).
	DefaultWaitDelay = time.Second
	maxWaitDelay     = time.Hour
	// drainCap bounds what is read from a pipe once its wait delay is over.
	drainCap = 1 << 20
)

// command is what an exec request resolved to: the program, its
// arguments and environment, where it runs, and how long its output is
// still read after it exits.
type command struct {
	exe, dir  string
	args, env []string
	waitDelay time.Duration
}

// resolveCommand checks an exec request and resolves its program, its
// environment (the sandbox's, the base URLs, the command's own) and its
// working directory.
func resolveCommand(req request, cfg *resolved, relay string) (command, error) {
	if len(req.Args) == 0 || req.Args[0] == "" {
		return command{}, invalid("exec: no command: args must name a program")
	}
	for _, a := range req.Args {
		if strings.ContainsRune(a, 0) {
			return command{}, invalid("exec: an argument contains a NUL byte")
		}
	}
	if req.HasBaseURLs {
		c := *cfg
		c.baseURLs = map[string]string{}
		for k, v := range req.BaseURLs {
			if !validEnvName(k) || isProxyVar(k) || strings.EqualFold(k, "NO_PROXY") {
				return command{}, invalid("exec: base URL variable %q: not a base URL variable name", k)
			}
			c.baseURLs[k] = v
		}
		cfg = &c
	}
	env, err := cfg.commandEnv(relay, req.Env)
	if err != nil {
		return command{}, err
	}
	pathEnv := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathEnv = v
		}
	}
	exe, err := lookPath(req.Args[0], pathEnv)
	if err != nil {
		return command{}, err
	}
	dir := req.Dir
	if dir == "" {
		dir = cfg.home
		if _, err := os.Stat(dir); err != nil {
			dir = "/"
		}
	}
	if !path.IsAbs(dir) {
		return command{}, invalid("exec: working directory %q: want an absolute path", dir)
	}
	waitDelay := DefaultWaitDelay
	if req.WaitDelayMS > 0 {
		waitDelay = min(time.Duration(req.WaitDelayMS)*time.Millisecond, maxWaitDelay)
	}
	return command{exe: exe, dir: dir, args: req.Args, env: env, waitDelay: waitDelay}, nil
}

// exec starts a command and streams it: the request, a response with its id
// and pid, then stdout and stderr frames, then an Exit message. The client
// sends stdin as data frames ended by an End message. A request with a
// terminal size (TTY) runs the command on a terminal instead (execPTY).
func (s *server) exec(st *yamux.Stream, f *framer, req request, cfg *resolved, relay string) {
	fail := func(err error) { f.msg(response{Error: toWire(err)}) }
	if s.deadlinePassed() {
		fail(&Error{Code: codeExpired, Message: "the service's deadline for this sandbox passed without renewal: it starts no command until the service renews it (the service may have lost the sandbox to another)"})
		return
	}
	cmd, err := resolveCommand(req, cfg, relay)
	if err != nil {
		fail(err)
		return
	}
	if req.TTY != nil {
		s.execPTY(st, f, cmd, *req.TTY)
		return
	}
	exe, dir, env, waitDelay := cmd.exe, cmd.dir, cmd.env, cmd.waitDelay

	var stdinR, stdinW *os.File
	if req.Stdin {
		stdinR, stdinW, err = os.Pipe()
	} else {
		stdinR, err = os.Open(os.DevNull)
	}
	if err != nil {
		fail(err)
		return
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		closeAll(stdinR, stdinW)
		fail(err)
		return
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		closeAll(stdinR, stdinW, outR, outW)
		fail(err)
		return
	}
	p, err := s.procs.start(exe, req.Args, &os.ProcAttr{
		Dir:   dir,
		Env:   env,
		Files: []*os.File{stdinR, outW, errW},
		Sys:   &syscall.SysProcAttr{Setpgid: true},
	})
	closeAll(stdinR, outW, errW) // the child has its own copies
	if err != nil {
		closeAll(stdinW, outR, errR)
		fail(fmt.Errorf("exec %s: %w", req.Args[0], err))
		return
	}
	defer s.procs.remove(p)
	if err := f.msg(response{ID: p.id, PID: p.pid}); err != nil {
		p.signal(syscall.SIGKILL)
	}

	// The client's half: stdin, then (after End) nothing until it closes
	// the stream. A stream that ends before the exit was sent means the
	// client gave the command up: its process group is killed, since
	// nobody could wait for it or read it any more.
	var stdinMu sync.Mutex
	closeStdin := func() {
		stdinMu.Lock()
		if stdinW != nil {
			stdinW.Close()
			stdinW = nil
		}
		stdinMu.Unlock()
	}
	var exitSent atomic.Bool
	go func() {
		defer closeStdin()
		var buf []byte
		for {
			kind, payload, err := readFrame(st, &buf)
			if err != nil {
				if !exitSent.Load() {
					p.signal(syscall.SIGKILL)
				}
				return
			}
			switch kind {
			case kindData:
				stdinMu.Lock()
				w := stdinW
				stdinMu.Unlock()
				if w != nil {
					if _, err := w.Write(payload); err != nil {
						closeStdin() // the command closed its stdin: drop the rest
					}
				}
			case kindMsg:
				closeStdin() // End: the command reads EOF
			}
		}
	}()

	var pumps sync.WaitGroup
	pumps.Add(2)
	go outputPump{r: outR, f: f, kind: kindData}.run(&pumps)
	go outputPump{r: errR, f: f, kind: kindStderr}.run(&pumps)

	ps, werr := p.p.Wait()
	p.exited.Store(true)
	deadline := time.Now().Add(waitDelay)
	outR.SetReadDeadline(deadline)
	errR.SetReadDeadline(deadline)
	pumps.Wait()
	closeAll(outR, errR)
	closeStdin()

	exitSent.Store(true) // from here on, the client closing is normal
	sendExit(f, req.Args[0], ps, werr)
}

// sendExit ends a command's stream with its Exit message (the signal that
// ended it, else its exit status), or with why it could not be waited for.
func sendExit(f *framer, name string, ps *os.ProcessState, werr error) {
	if werr != nil {
		f.msg(response{Error: toWire(fmt.Errorf("waiting for %s: %w", name, werr))})
		return
	}
	var exit wireExit
	if ws := ps.Sys().(syscall.WaitStatus); ws.Signaled() {
		exit.Code, exit.Signal = -1, int(ws.Signal())
	} else {
		exit.Code = ws.ExitStatus()
	}
	f.msg(response{Exit: &exit})
}

func closeAll(fs ...*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// outputPump sends one of a command's output pipes as frames. A frame write
// blocks while the client's window is full, so a slow reader stops the pump,
// the pipe fills and the command blocks on its next write: nothing is
// buffered without bound.
type outputPump struct {
	r    *os.File
	f    *framer
	kind byte
}

func (o outputPump) run(wg *sync.WaitGroup) {
	defer wg.Done()
	buf := make([]byte, dataChunk)
	for {
		n, err := o.r.Read(buf)
		if n > 0 {
			if o.f.frame(o.kind, buf[:n]) != nil {
				return // the client is gone; closing r gives the command EPIPE
			}
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			o.drain(buf)
			return
		}
		if err != nil {
			return
		}
	}
}

// drain sends what the pipe already holds, without waiting for more: the
// wait delay is over, and a background process may keep the pipe open.
func (o outputPump) drain(buf []byte) {
	o.r.SetReadDeadline(time.Time{})
	rc, err := o.r.SyscallConn()
	if err != nil {
		return
	}
	for total := 0; total < drainCap; {
		var n int
		var rerr error
		if err := rc.Read(func(fd uintptr) bool {
			n, rerr = unix.Read(int(fd), buf)
			return true
		}); err != nil {
			return
		}
		if n <= 0 || rerr != nil {
			return
		}
		if o.f.frame(o.kind, buf[:n]) != nil {
			return
		}
		total += n
	}
}

// signal sends a signal to a command's whole process group.
func (s *server) signal(f *framer, req request) {
	if req.Signal < 0 || req.Signal > 64 {
		f.msg(response{Error: toWire(invalid("signal %d: want 0-64", req.Signal))})
		return
	}
	p := s.procs.get(req.ID)
	if p == nil {
		f.msg(response{Error: &wireError{Code: codeDone, Message: fmt.Sprintf("process %d is not running", req.ID)}})
		return
	}
	if err := p.signal(syscall.Signal(req.Signal)); err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	f.msg(response{})
}

// killAll stops every process in the configured scope.
func (s *server) killAll(f *framer, req request, cfg *resolved) {
	n, err := killScope(s.ctx, cfg.killScope)
	if err != nil {
		f.msg(response{Error: toWire(err), Killed: n})
		return
	}
	f.msg(response{Killed: n})
}

// ---- the process table ----

// proc is a command the agent started.
type proc struct {
	id     uint64
	pid    int
	p      *os.Process
	exited atomic.Bool // the leader was reaped: its pid may be reused
	// session: it leads a session of its own (a terminal's), whose every
	// process a SIGKILL reaches, background jobs included.
	session bool
}

// signal signals the process group. Once the leader has been reaped, the
// group id may belong to someone else, so the signal is refused.
func (p *proc) signal(sig syscall.Signal) error {
	if p.exited.Load() {
		return &Error{Code: codeDone, Message: fmt.Sprintf("process %d has exited", p.id)}
	}
	if err := syscall.Kill(-p.pid, sig); err != nil {
		if errors.Is(err, syscall.ESRCH) {
			return &Error{Code: codeDone, Message: fmt.Sprintf("process %d has exited", p.id)}
		}
		return fmt.Errorf("signal %d to process group %d: %w", sig, p.pid, err)
	}
	if p.session && sig == syscall.SIGKILL {
		killSession(p.pid)
	}
	return nil
}

// procTable holds the commands the agent started. Its lock is held across
// starting a process and recording it, and by the orphan reaper while it
// chooses what to reap, so the reaper never takes a command's exit status
// from the goroutine waiting for it.
type procTable struct {
	mu    sync.Mutex
	next  uint64
	byID  map[uint64]*proc
	byPID map[int]*proc
}

func newProcTable() *procTable {
	return &procTable{byID: map[uint64]*proc{}, byPID: map[int]*proc{}}
}

func (t *procTable) start(exe string, args []string, attr *os.ProcAttr) (*proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	op, err := os.StartProcess(exe, args, attr)
	if err != nil {
		return nil, err
	}
	t.next++
	p := &proc{id: t.next, pid: op.Pid, p: op, session: attr.Sys != nil && attr.Sys.Setsid}
	t.byID[p.id] = p
	t.byPID[p.pid] = p
	return p, nil
}

func (t *procTable) remove(p *proc) {
	t.mu.Lock()
	delete(t.byID, p.id)
	if t.byPID[p.pid] == p {
		delete(t.byPID, p.pid)
	}
	t.mu.Unlock()
}

func (t *procTable) get(id uint64) *proc {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.byID[id]
}

// killAllStarted kills the process group of every command still running.
func (t *procTable) killAllStarted() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range t.byID {
		p.signal(syscall.SIGKILL)
	}
}

// ours reports whether pid is a command the agent is waiting for. Called
// with t.mu held.
func (t *procTable) ours(pid int) bool {
	_, ok := t.byPID[pid]
	return ok
}

var _ io.Writer = dataWriter{}
