package main

import (
	"fmt"
	"log/slog"

	"github.com/urfave/cli/v2"

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
	link, err := agent.StdioLink(c.App.Reader, c.App.Writer)
	if err != nil {
		return err
	}
	if err := agent.Serve(c.Context, link, agent.ServerOptions{Logger: logger, Subreaper: true}); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	return nil
}
