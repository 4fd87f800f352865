// Package appliance runs sandboxes: the Launcher drives a sandbox CLI
// (Google's on Cloud Run, `sandgate sandbox` anywhere else) by argv, and a
// Sandbox is the service's handle on one running sandbox — its agent link,
// its identity in the egress proxy, its files, commands and layer.
package appliance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/localbox"
)

// GoogleCLI is where Cloud Run puts its sandbox command when sandboxes are
// enabled on a service.
const GoogleCLI = "/usr/local/gcp/bin/sandbox"

// AgentPath is where the launcher bind-mounts the sandgate binary inside
// every sandbox, read-only. It is the only program the launcher ever names
// on a sandbox CLI's command line.
const AgentPath = "/.sandgate/sandgate"

// LauncherConfig chooses and configures the sandbox CLI.
type LauncherConfig struct {
	// CLI is the sandbox command to drive. Empty means Google's at
	// GoogleCLI when it exists, else this binary's own `sandbox` verb.
	CLI string
	// StateDir is handed to `sandgate sandbox` (SANDGATE_STATE_DIR); empty
	// keeps its default. Google's CLI keeps its own state.
	StateDir string
	// AgentBinary is the host path of the sandgate binary bind-mounted into
	// every sandbox at AgentPath. Empty means this process's executable.
	AgentBinary string
	// Memory and Pids limit each sandbox (`sandgate sandbox` only; Cloud
	// Run limits the instance). Zero means no limit.
	Memory string
	Pids   int
	// Rootfs is the image a sandbox sees as / (`sandgate sandbox` only);
	// empty means the host's /.
	Rootfs string
	// Logger receives what the launcher does. Nil discards.
	Logger *slog.Logger
}

// Launcher drives a sandbox CLI by argv, never through a shell. It does not
// trust the CLI's exit status for a command's (Cloud Run's is 1 for every
// failure): commands run through the agent, which reports them exactly.
type Launcher struct {
	argv   []string // the CLI and any leading arguments before the verb
	env    []string // the CLI's whole environment: nothing of the service leaks
	google bool
	agent  string // host path of the binary mounted at AgentPath
	cfg    LauncherConfig
	log    *slog.Logger
}

// NewLauncher finds the sandbox CLI and the agent binary, or says which is
// missing.
func NewLauncher(cfg LauncherConfig) (*Launcher, error) {
	l := &Launcher{cfg: cfg, log: cfg.Logger}
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("launcher: finding this program's executable: %w", err)
	}
	l.agent = cfg.AgentBinary
	if l.agent == "" {
		l.agent = self
	}
	if l.agent, err = filepath.Abs(l.agent); err != nil {
		return nil, err
	}
	if fi, err := os.Stat(l.agent); err != nil || !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("launcher: agent binary %s is not a regular file (%v): set AgentBinary to the sandgate executable", l.agent, err)
	}
	switch {
	case cfg.CLI != "":
		l.argv = []string{cfg.CLI}
		l.google = filepath.Base(cfg.CLI) == "sandbox"
	case fileExists(GoogleCLI):
		l.argv, l.google = []string{GoogleCLI}, true
	default:
		l.argv = []string{self, "sandbox"}
	}
	if !l.google {
		if cfg.CLI != "" && filepath.Base(cfg.CLI) != "sandbox" {
			l.argv = append(l.argv, "sandbox") // a sandgate binary: its verb
		}
	}
	l.env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	if cfg.StateDir != "" {
		l.env = append(l.env, "SANDGATE_STATE_DIR="+cfg.StateDir)
	}
	return l, nil
}

// Google reports whether the launcher drives Cloud Run's sandbox CLI.
func (l *Launcher) Google() bool { return l.google }

// String names the CLI, for logs.
func (l *Launcher) String() string { return strings.Join(l.argv, " ") }

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

// CreateOptions are what a new sandbox starts from.
type CreateOptions struct {
	// ImportTar is a layer tar (compressed or not) to start the writable
	// layer from: a snapshot being resumed, or a template.
	ImportTar string
}

// Create starts sandbox id, detached, with a writable root and the agent
// binary mounted at AgentPath. Its main process is `sandgate agent --idle`,
// which holds the sandbox open and reaps orphans; the service's agent is
// started with Agent.
func (l *Launcher) Create(ctx context.Context, id string, opts CreateOptions) error {
	if err := localbox.CheckID(id); err != nil {
		return err
	}
	args := []string{"run", id, "--detach", "--write",
		"--mount", "type=bind,source=" + l.agent + ",destination=" + AgentPath + ",readonly"}
	if opts.ImportTar != "" {
		args = append(args, "--import-tar="+opts.ImportTar)
	}
	if !l.google {
		if l.cfg.Memory != "" {
			args = append(args, "--memory", l.cfg.Memory)
		}
		if l.cfg.Pids > 0 {
			args = append(args, "--pids", fmt.Sprint(l.cfg.Pids))
		}
		if l.cfg.Rootfs != "" {
			args = append(args, "--rootfs", l.cfg.Rootfs)
		}
	}
	args = append(args, "--stdin=false", "--", AgentPath, "agent", "--idle")
	return l.do(ctx, args...)
}

// Tar writes the writable layer of sandbox id to file, as a layer tar.
func (l *Launcher) Tar(ctx context.Context, id, file string) error {
	return l.do(ctx, "tar", id, "--file="+file)
}

// Fork starts sandbox dst, detached, from a copy of src's writable layer.
func (l *Launcher) Fork(ctx context.Context, src, dst string) error {
	if err := localbox.CheckID(dst); err != nil {
		return err
	}
	return l.do(ctx, "fork", src, dst, "--detach")
}

// Delete stops every process of sandbox id and removes it.
func (l *Launcher) Delete(ctx context.Context, id string) error {
	return l.do(ctx, "delete", id, "--force")
}

// cliOutputMax bounds what is kept of a CLI's output for an error message.
const cliOutputMax = 4 << 10

// do runs one CLI verb to completion. Its output is kept (bounded) to
// explain a failure.
func (l *Launcher) do(ctx context.Context, args ...string) error {
	start := time.Now()
	cmd := l.command(ctx, args...)
	var out limitedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	l.log.Debug("sandbox cli", "args", args, "took", time.Since(start), "err", err)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("sandbox %s: %w", args[0], context.Cause(ctx))
		}
		msg := strings.TrimSpace(out.String())
		if msg == "" {
			msg = err.Error()
		}
		return &CLIError{Verb: args[0], Args: args[1:], Output: msg, Err: err}
	}
	return nil
}

func (l *Launcher) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, l.argv[0], append(l.argv[1:len(l.argv):len(l.argv)], args...)...)
	cmd.Env = l.env
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// CLIError is a sandbox CLI verb that failed, with what the CLI said.
type CLIError struct {
	Verb   string
	Args   []string
	Output string
	Err    error
}

func (e *CLIError) Error() string {
	return fmt.Sprintf("sandbox %s %s: %s", e.Verb, strings.Join(e.Args, " "), e.Output)
}

func (e *CLIError) Unwrap() error { return e.Err }

// limitedBuffer keeps the first cliOutputMax bytes written to it.
type limitedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *limitedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if room := cliOutputMax - w.b.Len(); room > 0 {
		w.b.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func (w *limitedBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// link is one `sandbox exec <id> -- sandgate agent`: the agent's link, as
// an io.ReadWriteCloser, and the process that runs it. With `sandgate
// sandbox` the link is a unix socket (sock) whose other end is the
// agent's stdin and stdout; with Google's CLI it is the CLI's stdin and
// stdout pipes.
type link struct {
	cmd    *exec.Cmd
	sock   *net.UnixConn  // the socketpair end (our CLI), or nil
	stdin  io.WriteCloser // the pipes (Google's CLI), or nil
	stdout io.ReadCloser
	stderr *limitedBuffer
	done   chan struct{}
	err    error
	once   sync.Once
}

func (k *link) Read(p []byte) (int, error) {
	if k.sock != nil {
		return k.sock.Read(p)
	}
	return k.stdout.Read(p)
}

func (k *link) Write(p []byte) (int, error) {
	if k.sock != nil {
		return k.sock.Write(p)
	}
	return k.stdin.Write(p)
}

// transport is what the agent client speaks on: the socket itself when
// there is one, so that the client can receive the sockets the agent
// passes (agent.Info.FDPass), else the pipes. Closing it ends the agent as
// Close does, without waiting for the process; Close still reaps it.
func (k *link) transport() io.ReadWriteCloser {
	if k.sock != nil {
		return k.sock
	}
	return k
}

// Close ends the link: the agent sees EOF on its stdin and exits; if it
// does not within a few seconds the CLI process is killed.
func (k *link) Close() error {
	k.once.Do(func() {
		if k.sock != nil {
			k.sock.Close()
		} else {
			k.stdin.Close()
		}
		select {
		case <-k.done:
		case <-time.After(5 * time.Second):
			k.cmd.Process.Kill()
			<-k.done
		}
		if k.stdout != nil {
			k.stdout.Close()
		}
	})
	return nil
}

// startAgent runs `sandbox exec <id> -- AgentPath agent` with its stdio as
// the returned link. The process lives until the link is closed or the
// agent exits.
//
// Our CLI hands its own stdio descriptors to the command (SCM_RIGHTS, no
// copy), so for it the link is one end of a unix socketpair given as both
// stdin and stdout: the agent can then pass each egress connection's
// socket to the service instead of copying its bytes. Google's CLI relays
// its stdio itself, so it gets pipes (a socket would gain nothing).
func (l *Launcher) startAgent(id string) (*link, error) {
	cmd := l.command(context.Background(), "exec", id, "--", AgentPath, "agent")
	k := &link{cmd: cmd, stderr: &limitedBuffer{}, done: make(chan struct{})}
	var child *os.File // the agent's end, closed here once the CLI has it
	if l.google {
		var err error
		if k.stdin, err = cmd.StdinPipe(); err != nil {
			return nil, err
		}
		if k.stdout, err = cmd.StdoutPipe(); err != nil {
			return nil, err
		}
		// Egress bytes cross these pipes: a large buffer lets a whole
		// yamux frame go in at once (agent.GrowPipe).
		for _, p := range []any{k.stdin, k.stdout} {
			if c, ok := p.(syscall.Conn); ok {
				agent.GrowPipe(c)
			}
		}
	} else {
		var err error
		if k.sock, child, err = socketpair(); err != nil {
			return nil, fmt.Errorf("starting the agent in sandbox %s: %w", id, err)
		}
		cmd.Stdin, cmd.Stdout = child, child
	}
	cmd.Stderr = k.stderr
	err := cmd.Start()
	if child != nil {
		child.Close() // the CLI has its copy; ours would hide the agent's exit (no EOF)
	}
	if err != nil {
		if k.sock != nil {
			k.sock.Close()
		}
		return nil, fmt.Errorf("starting the agent in sandbox %s: %w", id, err)
	}
	go func() {
		k.err = cmd.Wait()
		close(k.done)
	}()
	return k, nil
}

// socketpair returns the two ends of a new unix stream socketpair: ours as
// a *net.UnixConn, the other as a file for a child's stdio. Both are
// close-on-exec here; os/exec gives the child its own copy.
func socketpair() (*net.UnixConn, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	ours := os.NewFile(uintptr(fds[0]), "agent-link")
	c, err := net.FileConn(ours)
	ours.Close() // FileConn made its own duplicate
	if err != nil {
		unix.Close(fds[1])
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	return c.(*net.UnixConn), os.NewFile(uintptr(fds[1]), "agent-stdio"), nil
}

// exitReason explains why a link's process ended, for logs and errors.
func (k *link) exitReason() string {
	select {
	case <-k.done:
	default:
		return "running"
	}
	msg := strings.TrimSpace(k.stderr.String())
	if k.err != nil {
		if msg != "" {
			return fmt.Sprintf("%v: %s", k.err, msg)
		}
		return k.err.Error()
	}
	if msg != "" {
		return "exited: " + msg
	}
	return "exited"
}

var errDestroyed = errors.New("sandbox destroyed")
