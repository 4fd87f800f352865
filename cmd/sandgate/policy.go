package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/netpolicy"
)

func policyCommand() *cli.Command {
	return &cli.Command{
		Name:  "policy",
		Usage: "inspect network policies",
		Subcommands: []*cli.Command{{
			Name:      "check",
			Usage:     "say whether a sandbox may reach HOST[:PORT], resolving it as the proxy would",
			ArgsUsage: "HOST[:PORT]",
			Description: `Prints "allow: <reason> (<address>)" and exits 0, or "deny: <reason>" and
exits 3. Bad input exits 2.`,
			Flags:        egressFlags(),
			OnUsageError: usageError,
			Action:       runPolicyCheck,
		}},
	}
}

func runPolicyCheck(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return badInput("policy check takes one HOST[:PORT], got %d arguments", len(args))
	}
	host, port, err := netpolicy.SplitHostPort(args[0])
	if err != nil {
		return badInput("%v", err)
	}
	eg, err := newEgress(c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		return err
	}
	defer eg.Close()
	ctx, cancel := context.WithTimeoutCause(c.Context, 30*time.Second, errors.New("policy check timed out"))
	defer cancel()
	dec, _ := eg.decider.Decide(ctx, netpolicy.DecideArgs{Policy: eg.policy, Host: host, Port: port})
	w := c.App.Writer
	if dec.Allow {
		fmt.Fprintf(w, "allow: %s (%s)\n", dec.Reason, dec.Addrs[0])
		return nil
	}
	fmt.Fprintf(w, "deny: %s\n", dec.Reason)
	return &exitError{code: exitDenied}
}
