package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/internal/cloudlog"
)

func agentCommand() *cli.Command {
	return &cli.Command{
		Name:  "agent",
		Usage: "serve the service's link inside a sandbox, on standard input and output",
		Description: `Runs inside a sandbox, started by the service with
'sandbox exec <id> -- sandgate agent'. It speaks the agent protocol
(appliance/agent/README.md: a yamux session) on its stdin and stdout, and
logs JSON lines to stderr. It takes no arguments and no other flag: its
configuration, commands and environments come over the link, because sandbox
CLIs log command lines. It exits when the link closes, after killing every
command it started.

With --idle it serves nothing: it is a sandbox's main process, holding the
sandbox open and reaping orphans until SIGTERM.`,
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "idle", Usage: "hold the sandbox open and reap orphans; serve no link"},
		},
		OnUsageError: usageError,
		Action:       runAgent,
	}
}

func runAgent(c *cli.Context) error {
	if c.NArg() > 0 {
		return badInput("agent takes no arguments (got %q): its configuration comes over the link", c.Args().First())
	}
	if c.Bool("idle") {
		return agent.Idle(c.Context)
	}
	logger := cloudlog.New(c.App.ErrWriter, slog.LevelInfo)
	link, err := stdioLink(c.App.Reader, c.App.Writer)
	if err != nil {
		return err
	}
	if err := agent.Serve(c.Context, link, agent.ServerOptions{Logger: logger, Subreaper: true}); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	return nil
}

// stdioLink is the agent's link: its stdin and stdout. When stdout is the
// process's fd 1, the link moves to a private close-on-exec descriptor and
// fd 1 becomes stderr, so nothing that prints to standard output by mistake
// can corrupt the link.
func stdioLink(r io.Reader, w io.Writer) (io.ReadWriteCloser, error) {
	if r == nil {
		r = os.Stdin
	}
	if f, ok := w.(*os.File); ok && f.Fd() == 1 {
		fd, err := unix.FcntlInt(1, unix.F_DUPFD_CLOEXEC, 3)
		if err != nil {
			return nil, fmt.Errorf("agent: move the link off fd 1: %w", err)
		}
		if err := unix.Dup3(2, 1, 0); err != nil { // Dup3: linux/arm64 has no dup2
			unix.Close(fd)
			return nil, fmt.Errorf("agent: point fd 1 at stderr: %w", err)
		}
		w = os.NewFile(uintptr(fd), "agent-link")
	}
	return stdio{r, w}, nil
}

// stdio joins a reader and a writer into the link's ReadWriteCloser.
type stdio struct {
	io.Reader
	io.Writer
}

func (s stdio) Close() error {
	var errs []error
	if c, ok := s.Reader.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	if c, ok := s.Writer.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}
