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
		Usage: "inspect network policies (check, here), or set a sandbox's (set, in a service)",
		Subcommands: []*cli.Command{{
			Name:      "check",
			Usage:     "say whether a sandbox may reach HOST[:PORT], resolving it as the proxy would",
			ArgsUsage: "HOST[:PORT]",
			Description: `Judges HOST as the proxy would: the rules first, then a lookup of a name they
allow, then every address it resolves to. Prints one line, and exits with
the status in front of it here:

  0  allow: <reason> (<address>)
  3  deny: <reason>
  4  allow by rule, but lookup failed: <error> (<reason>)

A failed lookup (no such host, no answer from the DNS servers) is not a
policy decision: the rules allowed the host, and the proxy would answer it
with 502. Bad input exits 2; any other failure exits 1.`,
			Flags:        egressFlags(),
			OnUsageError: usageError,
			Action:       runPolicyCheck,
		}, policySetCommand()},
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
	dec, err := eg.decider.Decide(ctx, netpolicy.DecideArgs{Policy: eg.policy, Host: host, Port: port})
	w := c.App.Writer
	switch {
	case err != nil && dec.Allow: // the rules allowed it; the lookup failed
		fmt.Fprintf(w, "allow by rule, but lookup failed: %v (%s)\n", err, dec.Reason)
		return &exitError{code: exitLookupFailed}
	case err != nil:
		return err
	case dec.Allow:
		fmt.Fprintf(w, "allow: %s (%s)\n", dec.Reason, dec.Addrs[0])
		return nil
	}
	fmt.Fprintf(w, "deny: %s\n", dec.Reason)
	return &exitError{code: exitDenied}
}
