package appliance

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/transforms"
)

// What the credential guard names when it refuses something bound for a
// sandbox.
const (
	whereCommand     = "the command"
	whereDir         = "the working directory"
	whereEnv         = "the command's environment (a variable's name or value)"
	whereStdin       = "the command's stdin"
	whereFilePath    = "the file's path"
	whereFileContent = "the file's content"
	whereTar         = "the workspace tar (a file's content, an entry's name or link target, or a PAX record)"
	whereTunnelHead  = "the tunnel's request (its line, a header or a trailer)"
	whereTunnelBody  = "the tunnel's request body"
)

// ErrNoProcess: no process of that id in the sandbox (processes are
// forgotten ManagerConfig.ProcessRetention after they exit). It matches
// ErrNotFound too.
var ErrNoProcess error = notFound("no such process")

// running returns sandbox id's live handle, marked in use (done ends
// that), or ErrNotRunning.
func (m *Manager) running(id string) (*Sandbox, func(), error) {
	sb, err := m.Sandbox(id)
	if err != nil {
		return nil, nil, err
	}
	return sb, sb.Use(), nil
}

// ExecRequest is a command for Manager.Exec.
type ExecRequest struct {
	// Args is the program and its arguments (protocol 1: /bin/sh -c CMD).
	Args []string
	// Env are the command's own variables, KEY=VALUE, on top of what the
	// agent gives every command (the sandbox's base URLs, routed,
	// included: a base URL variable set here is routed too).
	Env []string
	// Dir is the working directory; "" means the agent's default (HOME).
	Dir string
	// StdinHead is stdin already received: searched by the credential
	// guard before the command starts, so a secret in it refuses the start.
	// Stdin is the rest, streamed; nil means none after StdinHead.
	StdinHead []byte
	Stdin     io.Reader
	// MissingDirFails makes a working directory that does not exist fail
	// the command as a shell would (exit 2, said on its stderr) rather
	// than the start (protocol 1).
	MissingDirFails bool
	// Check, when set, is called after the credential guard passed and
	// before the command starts: its error refuses the start (a front
	// door's own checks, whose messages may quote what they refuse).
	Check func() error
	// Timeout, when positive, stops a command that runs longer: a line on
	// its stderr, SIGTERM to its process group, SIGKILL 5 s later, and
	// exit code TimeoutExitCode (see manager_timeout.go).
	Timeout time.Duration
	// Session, when set, runs the command in that session's shell
	// (manager_shell.go): Args is then the command's own argv, run by the
	// session's bash, Dir a directory for this command only ("": the
	// session's), and the session's directory and variables are kept
	// after it ends (for a session of the sandbox's, CreateSession; one
	// not created runs from nothing, and nothing of it is kept). Commands
	// of one session run one at a time: Exec waits (bounded by ctx) for
	// the one before to end, and calls Queued, when set, once if it has
	// to.
	Session string
	Queued  func()
}

// Exec starts a command in running sandbox id and returns it: its output
// is kept (the last ManagerConfig.OutputBytes, within the service's
// OutputBudget) for Process.Follow, its
// exit code for Process.Wait; the command outlives ctx. Nothing of the
// sandbox's credentials goes in: the command, its directory, its
// variables and its stdin are searched for them first (a refusal is
// transforms.ErrCredential), and a secret arriving on stdin once the
// command runs kills it (exit 137, said on its stderr) before any byte of
// the secret reaches it.
func (m *Manager) Exec(ctx context.Context, id string, req ExecRequest) (*Process, error) {
	sb, done, err := m.running(id)
	if err != nil {
		return nil, err
	}
	defer done()
	g := sb.relay.Transforms().Guard()
	if err := g.Check(whereCommand, req.Args...); err != nil {
		return nil, err
	}
	if err := g.Check(whereDir, req.Dir); err != nil {
		return nil, err
	}
	if err := g.Check(whereEnv, req.Env...); err != nil {
		return nil, err
	}
	if len(req.StdinHead) > 0 {
		if _, err := g.Scanner(whereStdin).Write(req.StdinHead); err != nil {
			return nil, err
		}
	}
	if req.Check != nil {
		if err := req.Check(); err != nil {
			return nil, err
		}
	}
	args, dir := req.Args, req.Dir
	var sess *sessionRun
	if req.Session != "" {
		m.mu.Lock()
		b := m.boxes[id]
		m.mu.Unlock()
		if b == nil {
			return nil, fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
		}
		if sess, err = m.startSession(ctx, b, sb, req); err != nil {
			return nil, err
		}
		args, dir = sess.args, ""
		defer func() {
			if sess != nil {
				sess.release() // the command did not start
			}
		}()
	}
	var stdin io.Reader
	switch {
	case req.Stdin != nil && len(req.StdinHead) > 0:
		stdin = io.MultiReader(bytesReader(req.StdinHead), req.Stdin)
	case req.Stdin != nil:
		stdin = req.Stdin
	case len(req.StdinHead) > 0:
		stdin = bytesReader(req.StdinHead)
	}
	p := newProcess(m.cfg.OutputBytes, m.output)
	var gs *guardedStdin
	if stdin != nil && !g.Empty() {
		gs = &guardedStdin{r: g.Reader(stdin, whereStdin), proc: make(chan *agent.Process, 1)}
		stdin = gs
	}
	ap, err := sb.Spawn(sb.Context(), agent.Cmd{
		Args: args, Env: req.Env, Dir: dir, Stdin: stdin,
		Stdout: processOutput{p, Stdout}, Stderr: processOutput{p, Stderr},
	})
	switch {
	case err != nil && req.MissingDirFails && dir != "" && errors.Is(err, fs.ErrNotExist) && missingDir(ctx, sb, dir):
		processOutput{p, Stderr}.Write([]byte(fmt.Sprintf("sandgate: working directory %s: no such directory\n", dir)))
		p.finish(2)
	case err != nil:
		return nil, err
	default:
		run := sess
		sess = nil // its turn is the command's now
		p.agent.Store(ap)
		if gs != nil {
			gs.proc <- ap
		}
		timer := startTimer(p, ap, req.Timeout)
		go func() {
			status, err := ap.Wait(context.WithoutCancel(ctx))
			code := exitCode(status)
			if timer.stop() {
				code = TimeoutExitCode
			}
			if err != nil {
				code = 255
				processOutput{p, Stderr}.Write([]byte("sandgate: " + err.Error() + "\n"))
			}
			if refused := gs.refused(); refused != nil {
				processOutput{p, Stderr}.Write([]byte("sandgate: the command was killed and its stdin cut short: " + refused.Error() + "\n"))
			}
			p.agent.Store(nil) // what is kept of it is its output and exit code
			p.finish(code)
			if run != nil {
				run.finish()
			}
		}()
	}
	sb.addProcess(p)
	m.met.execs.Inc()
	return p, nil
}

// bytesReader reads b (a named type would be bytes.Reader; this keeps
// StdinHead from being copied).
func bytesReader(b []byte) io.Reader { return &sliceReader{b: b} }

type sliceReader struct{ b []byte }

func (r *sliceReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// missingDir reports whether dir is certainly not a directory of the
// sandbox (the cause of a start that failed as not found).
func missingDir(ctx context.Context, sb *Sandbox, dir string) bool {
	fi, err := sb.Stat(ctx, dir)
	return errors.Is(err, fs.ErrNotExist) || (err == nil && !fi.IsDir())
}

// guardedStdin is a command's stdin through the credential guard, for the
// bytes that arrive once it runs. When a held secret comes, nothing of it
// goes in: the command is killed first, so that it cannot take the bytes
// before the secret for the whole of its input and act on them, and only
// then does its stdin end.
type guardedStdin struct {
	r    io.Reader           // the guard's reader over the stdin
	proc chan *agent.Process // the command, once Spawn returned it

	mu  sync.Mutex
	err error // the refusal, once a secret came
}

// stdinKillWait bounds how long a refused stdin waits for its command to
// be known and killed.
const stdinKillWait = 10 * time.Second

func (s *guardedStdin) Read(b []byte) (int, error) {
	n, err := s.r.Read(b)
	if errors.Is(err, transforms.ErrCredential) {
		s.mu.Lock()
		s.err = err
		s.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), stdinKillWait)
		defer cancel()
		select {
		case ap := <-s.proc: // the copier runs only once Spawn has it
			ap.Kill(ctx)
		case <-ctx.Done():
		}
	}
	return n, err
}

// refused is the guard's refusal of the command's stdin, or nil (also for
// a nil guardedStdin: no guard).
func (s *guardedStdin) refused() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Process returns process pid of running sandbox id: ErrNotRunning, or
// ErrNoProcess. No process outlives its sandbox's suspend, and the errors
// say so.
func (m *Manager) Process(id, pid string) (*Process, error) {
	sb, err := m.Sandbox(id)
	if errors.Is(err, ErrNotRunning) {
		return nil, fmt.Errorf("%w: sandbox %q is not running, so process %q is not either (a process ends when its sandbox is suspended, and none comes back with a resume)", ErrNotRunning, id, pid)
	}
	if err != nil {
		return nil, err
	}
	p := sb.process(pid)
	if p == nil {
		return nil, fmt.Errorf("%w: %q in sandbox %q (processes are forgotten %s after they exit, and none outlives a suspend: this sandbox has been running since %s)",
			ErrNoProcess, pid, id, m.cfg.ProcessRetention, sb.started.UTC().Format(time.RFC3339))
	}
	return p, nil
}

// KillAll stops every process of running sandbox id but its agent.
func (m *Manager) KillAll(ctx context.Context, id string) error {
	sb, done, err := m.running(id)
	if err != nil {
		return err
	}
	defer done()
	_, err = sb.KillAll(ctx)
	return err
}

// ReadFile opens file path of running sandbox id (no size cap, no shell).
// Its path is searched by the credential guard (a path quoted in an error
// must hold no secret).
func (m *Manager) ReadFile(ctx context.Context, id, path string) (io.ReadCloser, fs.FileInfo, error) {
	sb, done, err := m.running(id)
	if err != nil {
		return nil, nil, err
	}
	if err := sb.relay.Transforms().Guard().Check(whereFilePath, path); err != nil {
		done()
		return nil, nil, err
	}
	rc, fi, err := sb.ReadFile(ctx, path)
	if err != nil {
		done()
		return nil, nil, err
	}
	return &doneCloser{ReadCloser: rc, done: done}, fi, nil
}

// doneCloser ends a use of the sandbox when the stream is closed.
type doneCloser struct {
	io.ReadCloser
	done func()
}

func (d *doneCloser) Close() error {
	err := d.ReadCloser.Close()
	d.done()
	return err
}

// Stat describes file path of running sandbox id.
func (m *Manager) Stat(ctx context.Context, id, path string) (fs.FileInfo, error) {
	sb, done, err := m.running(id)
	if err != nil {
		return nil, err
	}
	defer done()
	if err := sb.relay.Transforms().Guard().Check(whereFilePath, path); err != nil {
		return nil, err
	}
	return sb.Stat(ctx, path)
}

// WriteFile streams r into file path of running sandbox id (parents made),
// replacing it only once the whole of r arrived. The path and the content
// pass the credential guard on their way: a refused write leaves the path
// as it was, and no byte of the secret reaches the sandbox.
func (m *Manager) WriteFile(ctx context.Context, id, path string, r io.Reader) (int64, error) {
	sb, done, err := m.running(id)
	if err != nil {
		return 0, err
	}
	defer done()
	g := sb.relay.Transforms().Guard()
	if err := g.Check(whereFilePath, path); err != nil {
		return 0, err
	}
	n, err := sb.WriteFile(ctx, path, g.Reader(r, whereFileContent), agent.WriteOptions{})
	return n, credentialFirst(err)
}

// TarIn unpacks a tar (bare, gzip or zstd) into directory dir of running
// sandbox id, through the agent's safe extraction, all or nothing. A
// sandbox that holds credentials gets it through the credential guard:
// the tar is decompressed here and passed on an entry at a time, each
// header only once its name, link target and PAX records passed, so no
// byte of a secret goes in; the refused stream is cut before its end, and
// nothing is applied.
func (m *Manager) TarIn(ctx context.Context, id, dir string, r io.Reader) error {
	sb, done, err := m.running(id)
	if err != nil {
		return err
	}
	defer done()
	src := r
	var se *sourceErr
	if g := sb.relay.Transforms().Guard(); !g.Empty() {
		dec, err := snapshot.Decompress(bufio.NewReader(r))
		if err != nil {
			return fmt.Errorf("%w: the workspace tar: %v", ErrBadInput, err)
		}
		defer dec.Close()
		se = &sourceErr{r: g.TarReader(dec, whereTar)}
		src = se
	}
	if err := sb.TarIn(ctx, dir, src, agent.TarOptions{}); err != nil {
		if se != nil && se.err != nil && !errors.Is(se.err, transforms.ErrCredential) {
			// The service's own reading of the tar (its decompression,
			// its parser) refused it: bad input.
			return fmt.Errorf("%w: the workspace tar: %v (nothing was applied)", ErrBadInput, se.err)
		}
		return credentialFirst(err)
	}
	return nil
}

// sourceErr notes how its reader failed, to tell the caller's bytes
// refused from the agent failing.
type sourceErr struct {
	r   io.Reader
	err error
}

func (s *sourceErr) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		s.err = err
	}
	return n, err
}

// credentialFirst is the guard's own error when err (the agent's, wrapping
// what the source said) is a refused credential: its message then starts
// with the phrase a client looks for.
func credentialFirst(err error) error {
	var ce *transforms.CredentialError
	if errors.As(err, &ce) {
		return ce
	}
	return err
}

// TarOut writes directory dir of running sandbox id to w as a tar.
func (m *Manager) TarOut(ctx context.Context, id, dir string, w io.Writer) error {
	sb, done, err := m.running(id)
	if err != nil {
		return err
	}
	defer done()
	return sb.TarOut(ctx, dir, w)
}

// DialPort connects to 127.0.0.1:port inside running sandbox id; the
// sandbox is not idle, and the port is listed among its open ones, while
// the connection is open.
func (m *Manager) DialPort(ctx context.Context, id string, port int) (net.Conn, error) {
	sb, done, err := m.running(id)
	if err != nil {
		return nil, err
	}
	defer done()
	return sb.DialPort(ctx, port)
}

// PortGuard is the credential guard of running sandbox id for what a port
// tunnel carries in from a caller, as stdin goes in: the guard of the
// sandbox's rules when the tunnel opens.
func (m *Manager) PortGuard(id string) (PortGuard, error) {
	sb, err := m.Sandbox(id)
	if err != nil {
		return PortGuard{}, err
	}
	return PortGuard{g: sb.relay.Transforms().Guard()}, nil
}

// PortGuard searches a request bound for a server in a sandbox (a port
// tunnel's) for the sandbox's credentials: its line and headers whole
// before any of it is sent, its body as it streams. A refusal is a
// *transforms.CredentialError naming the place. The zero PortGuard finds
// nothing.
type PortGuard struct{ g *transforms.Guard }

// Head returns a refusal when the request's line, headers or trailer (all
// of them, as sent) hold a credential.
func (p PortGuard) Head(head string) error { return p.g.Check(whereTunnelHead, head) }

// Body returns r's bytes once they cannot be part of a credential (only
// bytes that could begin one are held back, until what follows settles
// it); a credential is a refusal, and none of it is returned.
func (p PortGuard) Body(r io.Reader) io.Reader { return p.g.Reader(r, whereTunnelBody) }
