package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/urfave/cli/v2"
)

// Exit codes shared by every verb.
const (
	exitOK       = 0
	exitFailure  = 1
	exitBadInput = 2
	exitDenied   = 3
	// exitLookupFailed is policy check's: the rules allowed the host but
	// its lookup failed, which is not a policy decision.
	exitLookupFailed = 4
)

// exitError carries an exit code out of a verb; main turns it into the
// process status. Verbs never call os.Exit themselves.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("exit status %d", e.code)
	}
	return e.err.Error()
}
func (e *exitError) Unwrap() error { return e.err }

// badInput marks err as the caller's mistake (exit 2).
func badInput(format string, args ...any) error {
	return &exitError{code: exitBadInput, err: fmt.Errorf(format, args...)}
}

// newApp builds the command tree. It takes its writers so tests can run
// verbs in-process and read what they print.
func newApp(stdout, stderr io.Writer) *cli.App {
	app := &cli.App{
		Name:      "sandgate",
		Usage:     "egress-controlled sandboxes for AI agents",
		Writer:    stdout,
		ErrWriter: stderr,
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "version", Usage: "print the version, the Go version and the VCS commit, and exit"},
		},
		Commands: append([]*cli.Command{
			serveCommand(),
			proxyCommand(),
			policyCommand(),
			snapshotCommand(),
			sandboxCommand(),
			agentCommand(),
			wasmCommand(),
			versionCommand(),
		}, remoteCommands()...),
		Action:         runApp,
		OnUsageError:   usageError,
		ExitErrHandler: func(*cli.Context, error) {}, // run() reports errors
	}
	return app
}

// runApp runs when no command was named: --version, or help on standard
// error and exit 2 (a bare "sandgate" did nothing and exited 0).
func runApp(c *cli.Context) error {
	if c.Bool("version") {
		return printVersion(c.App.Writer)
	}
	if c.NArg() > 0 {
		return badInput("%q is not a sandgate command (see 'sandgate --help')", c.Args().First())
	}
	cli.HelpPrinter(c.App.ErrWriter, cli.AppHelpTemplate, c.App)
	return &exitError{code: exitBadInput}
}

// run executes the CLI with args and returns the process exit status.
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return execute(ctx, newApp(stdout, stderr), args)
}

// execute runs app with args and returns the process exit status,
// reporting an error on the app's standard error.
func execute(ctx context.Context, app *cli.App, args []string) int {
	stderr := app.ErrWriter
	err := app.RunContext(ctx, args)
	if err == nil {
		return exitOK
	}
	var ee *exitError
	if errors.As(err, &ee) && ee.err == nil {
		return ee.code // the verb already said everything
	}
	fmt.Fprintf(stderr, "sandgate: %v\n", err)
	if ee != nil {
		return ee.code
	}
	if isUsageError(err) { // before ExitCoder: "help NOPE" would exit 3, denied
		return exitBadInput
	}
	var ce cli.ExitCoder
	if errors.As(err, &ce) {
		return ce.ExitCode()
	}
	return exitFailure
}

// usageError turns a flag-parsing failure into bad input (exit 2).
func usageError(c *cli.Context, err error, _ bool) error {
	return badInput("%v (see '%s --help')", err, c.Command.HelpName)
}

// isUsageError recognises the errors urfave/cli returns for bad command
// lines it handles itself (unknown commands).
func isUsageError(err error) bool {
	return strings.HasPrefix(err.Error(), "flag provided but not defined") ||
		strings.Contains(err.Error(), "No help topic for")
}

// noArgs applies the flags among c's arguments and refuses any other
// argument of verb.
func noArgs(c *cli.Context, verb string) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) > 0 {
		return badInput("%s takes no arguments", verb)
	}
	return nil
}

// printList writes what a list verb found: with --json an indented JSON
// array ([] when empty), else a table with header's columns
// (tab-separated) and row's for each item.
func printList[T any](c *cli.Context, list []T, header string, row func(T) []string) error {
	if c.Bool("json") {
		if list == nil {
			list = []T{}
		}
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(list)
	}
	tw := tabwriter.NewWriter(c.App.Writer, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, it := range list {
		fmt.Fprintln(tw, strings.Join(row(it), "\t"))
	}
	return tw.Flush()
}

// findFlag is c's flag of that name, or nil.
func findFlag(c *cli.Context, name string) cli.Flag {
	for _, f := range c.Command.Flags {
		if slices.Contains(f.Names(), name) {
			return f
		}
	}
	return nil
}

// combinedShorts reads "it" as the switches -i and -t: every letter must
// be a boolean flag's one-letter name.
func combinedShorts(c *cli.Context, letters string) ([]cli.Flag, bool) {
	var out []cli.Flag
	for _, r := range letters {
		f := findFlag(c, string(r))
		if _, isBool := f.(*cli.BoolFlag); !isBool {
			return nil, false
		}
		out = append(out, f)
	}
	return out, true
}

// interspersed applies flags written after the positional arguments
// ("unpack FILE --into DIR"), which urfave/cli v2 leaves in Args, and
// returns the positional arguments (with everything after "--").
func interspersed(c *cli.Context) ([]string, error) {
	pos, rest, err := splitArgs(c, -1)
	return append(pos, rest...), err
}

// splitArgs applies the flags among c's arguments and returns the first
// nPos positional arguments and the rest: what follows "--", or from the
// first positional argument past nPos on (a command and its own flags).
// nPos < 0 takes every positional argument.
func splitArgs(c *cli.Context, nPos int) (pos, rest []string, err error) {
	hint := ""
	if nPos >= 0 {
		hint = "put the command after --; "
	}
	args := c.Args().Slice()
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return pos, args[i+1:], nil
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			if len(pos) == nPos {
				return pos, args[i:], nil
			}
			pos = append(pos, a)
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		flag := findFlag(c, name)
		if flag == nil && !hasValue && !strings.HasPrefix(a, "--") && len(name) > 1 {
			// Single-letter switches written together, as docker's -it.
			if shorts, ok := combinedShorts(c, name); ok {
				for _, f := range shorts {
					if err := c.Set(f.Names()[0], "true"); err != nil {
						return nil, nil, badInput("%s: %v", a, err)
					}
				}
				continue
			}
		}
		if flag == nil {
			return nil, nil, badInput("flag provided but not defined: %s (%ssee '%s --help')", a, hint, c.Command.HelpName)
		}
		if _, isBool := flag.(*cli.BoolFlag); isBool && !hasValue {
			value, hasValue = "true", true
		}
		if !hasValue {
			if i+1 >= len(args) {
				return nil, nil, badInput("flag needs an argument: %s", a)
			}
			i++
			value = args[i]
		}
		if err := c.Set(name, value); err != nil {
			return nil, nil, badInput("%s: %v", a, err)
		}
	}
	return pos, nil, nil
}
