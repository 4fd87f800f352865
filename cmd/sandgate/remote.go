package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/appliance/localbox"
)

// The client verbs: a sandgate service's sandboxes, driven through
// api/client. They mirror docker's and kubectl's habits (create, exec,
// cp, port-forward, ls/rm aliases) and live at the top level; `sandgate
// sandbox ...` remains the local sandbox CLI, and `policy check` the local
// policy judge, beside the remote `policy set`.

// remoteFlags are the flags of every client verb: which service, and how
// to authenticate to it.
func remoteFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "url", Usage: "the service's `URL`, such as https://sandgate-abc.a.run.app or http://127.0.0.1:8080", EnvVars: []string{"SANDGATE_URL"}},
		&cli.StringFlag{Name: "token", Usage: "the service `TOKEN` (the service's SANDBOX_SERVICE_TOKEN)", EnvVars: []string{"SANDBOX_SERVICE_TOKEN"}},
		&cli.StringFlag{Name: "auth", Usage: "identity token for Cloud Run's IAM: `SOURCE` gcloud (gcloud auth print-identity-token), metadata (the metadata server, on Google Cloud) or none (default: gcloud for *.run.app, else none)", EnvVars: []string{"SANDGATE_AUTH"}},
	}
}

// remoteCommand builds a client verb: its flags after the service's; its
// errors say what to do in this CLI's words.
func remoteCommand(cmd *cli.Command) *cli.Command {
	cmd.Flags = append(cmd.Flags, remoteFlags()...)
	cmd.OnUsageError = usageError
	cmd.Category = "client verbs (a sandgate service at --url)"
	if action := cmd.Action; action != nil {
		cmd.Action = func(c *cli.Context) error { return cliHint(action(c)) }
	}
	return cmd
}

// cliHint adds to an error of the client what to give this CLI: the
// client's own messages name what is missing, not which flag gives it.
func cliHint(err error) error {
	if err == nil || !errors.Is(err, client.ErrAuthentication) {
		return err
	}
	return fmt.Errorf("%w (sandgate: the service token with --token or SANDBOX_SERVICE_TOKEN; an identity token for Cloud Run's IAM with --auth gcloud, or --auth metadata on Google Cloud)", err)
}

// attachRemote is a session of sandbox name at the service --url names.
func attachRemote(c *cli.Context, name string) (*client.Session, error) {
	cl, err := newRemote(c)
	if err != nil {
		return nil, err
	}
	return cl.Attach(c.Context, name)
}

// newRemote makes the client of --url.
func newRemote(c *cli.Context) (*client.Client, error) {
	u := c.String("url")
	if u == "" {
		return nil, badInput("no service: give --url (or SANDGATE_URL), such as http://127.0.0.1:8080")
	}
	var opts []client.Option
	if t := c.String("token"); t != "" {
		opts = append(opts, client.WithToken(t))
	}
	switch a := c.String("auth"); a {
	case "":
	case "gcloud":
		opts = append(opts, client.WithIdentity(client.GcloudIdentity()))
	case "metadata":
		opts = append(opts, client.WithIdentity(client.MetadataIdentity("")))
	case "none":
		opts = append(opts, client.WithIdentity(nil))
	default:
		return nil, badInput("--auth %q: want gcloud, metadata or none", a)
	}
	cl, err := client.New(u, opts...)
	if err != nil {
		return nil, badInput("--url: %v", err)
	}
	return cl, nil
}

// remoteCommands are the client verbs.
func remoteCommands() []*cli.Command {
	network := []cli.Flag{
		&cli.GenericFlag{Name: "allow", Value: &repeated{}, Usage: "let the sandbox reach `HOST` over HTTPS, on top of the service's hosts (* every host, *.example.com its subdomains); repeatable"},
		&cli.GenericFlag{Name: "base-url", Value: &repeated{}, Usage: "give commands the base URL variable `NAME=URL`, routed through the egress proxy; repeatable"},
	}
	return []*cli.Command{
		remoteCommand(&cli.Command{
			Name:      "create",
			Usage:     "create a sandbox in the service and print its name",
			ArgsUsage: "[NAME]",
			Description: `Without NAME the sandbox is named ai-sdk-<8 hex>. A name that exists, running
or suspended, is refused: create never resumes. --cpus, --cpu-weight,
--memory, --pids, --disk, --lifetime and --keep-suspended are its own
limits, kept with it for its whole life; each left out is the service's.`,
			Flags: append(slices.Clone(network),
				&cli.StringFlag{Name: "template", Usage: "start from template `ID` (see 'sandgate template ls')"},
				&cli.GenericFlag{Name: "setup", Value: &repeated{}, Usage: "run shell `COMMAND` in the new sandbox, in order; one that fails destroys it; repeatable"},
				&cli.StringFlag{Name: "policy", Usage: "network policy JSON `FILE` (allow-all, deny-all, or custom with hosts and CIDRs) instead of --allow"},
				&cli.Float64Flag{Name: "cpus", Usage: "let it use `CORES`' worth of CPU time at most, e.g. 0.5 or 2 (past it, it is throttled)", DefaultText: "the service's"},
				&cli.IntFlag{Name: "cpu-weight", Usage: "its share `W` of the cores when sandboxes contend, 1 to 10000, 100 an equal share", DefaultText: "the service's"},
				&cli.StringFlag{Name: "memory", Usage: "let its processes, /tmp and /dev/shm hold `SIZE` at most, e.g. 512m, 2g", DefaultText: "the service's"},
				&cli.IntFlag{Name: "pids", Usage: "let it have `N` processes and threads at most", DefaultText: "the service's"},
				&cli.StringFlag{Name: "disk", Usage: "let its writable layer allocate `SIZE` at most, e.g. 10g", DefaultText: "the service's"},
				&cli.DurationFlag{Name: "lifetime", Usage: "destroy it `DURATION` after its creation, running or suspended, e.g. 24h", DefaultText: "the service's"},
				&cli.DurationFlag{Name: "keep-suspended", Usage: "destroy it once suspended for `DURATION`, e.g. 720h", DefaultText: "the service's"},
			),
			Action: runCreate,
		}),
		remoteCommand(&cli.Command{
			Name:      "resume",
			Usage:     "resume a suspended sandbox (with the network given, else its last one)",
			ArgsUsage: "NAME",
			Description: `A running sandbox keeps running and gets the network given; a suspended one
is started from its snapshot with it (its request transformations are
gone: set them again). Given no network (no --allow, --policy or
--base-url), a sandbox keeps its last one, and standard error says which.
On a terminal, a progress bar shows the snapshot's fetch.`,
			Flags: append(slices.Clone(network),
				&cli.StringFlag{Name: "policy", Usage: "network policy JSON `FILE` (allow-all, deny-all, or custom with hosts and CIDRs) instead of --allow"},
			),
			Action: runResume,
		}),
		remoteCommand(&cli.Command{
			Name:      "suspend",
			Aliases:   []string{"stop"},
			Usage:     "save sandboxes' files and stop them: nothing runs until resume",
			ArgsUsage: "NAME...",
			Description: `A name that is neither running nor suspended fails (exit 1), as docker stop
does, unless --force; one already suspended is done. On a terminal, a
progress bar shows each save.`,
			Flags:  []cli.Flag{forceFlag()},
			Action: runSuspend,
		}),
		remoteCommand(&cli.Command{
			Name:      "destroy",
			Aliases:   []string{"rm"},
			Usage:     "remove sandboxes, running or suspended, and their snapshots",
			ArgsUsage: "NAME...",
			Description: `A name that is neither running nor suspended fails (exit 1), as docker rm
does, unless --force.`,
			Flags:  []cli.Flag{forceFlag()},
			Action: runDestroy,
		}),
		remoteCommand(&cli.Command{
			Name:      "inspect",
			Usage:     "print everything the service knows of a sandbox, as JSON",
			ArgsUsage: "NAME",
			Description: `Prints the sandbox as the service describes it (GET /v1/sandboxes/NAME):
name, state, created, lastActive, layerBytes, template, ports, policy,
baseUrls, modules, home, workingDirectory, limits, and what a running one
uses now (usage: cpuSeconds, memoryBytes, memoryPeakBytes, diskBytes,
diskQuotaBytes, processes). Never a credential.`,
			Action: runInspect,
		}),
		remoteCommand(&cli.Command{
			Name:      "fork",
			Usage:     "copy a sandbox under a new name",
			ArgsUsage: "SRC DST",
			Description: `A running SRC is copied as its files are now and the copy DST runs, with
SRC's network but none of its request transformations (credentials stay
with SRC). A suspended SRC's snapshot is copied and DST is suspended, to be
resumed. Prints DST and its state.`,
			Action: runFork,
		}),
		remoteCommand(&cli.Command{
			Name:    "list",
			Aliases: []string{"ls"},
			Usage:   "list the service's sandboxes, running and suspended",
			Flags:   []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print JSON"}},
			Action:  runList,
		}),
		remoteCommand(&cli.Command{
			Name:      "exec",
			Usage:     "run a command in a running sandbox, streaming its output; exit with its exit code",
			ArgsUsage: "NAME [flags] -- CMD [ARG...]",
			Description: `CMD and its arguments are quoted for /bin/sh, as docker exec passes argv:
for a pipeline, write sh -c '...'. Standard input is passed through when it
is not a terminal, or with -i; the command's end closes it.

With -t the command runs on a terminal of its own in the sandbox (a PTY),
as docker exec -t: its output and errors are the terminal's, TERM is this
terminal's, and the terminal follows this window's size. With -i too
(-it), what is typed here goes to it, this terminal in raw mode (Ctrl-C
reaches the command, not sandgate): sandgate exec -it box -- bash.`,
			UseShortOptionHandling: true,
			Flags: []cli.Flag{
				&cli.GenericFlag{Name: "env", Aliases: []string{"e"}, Value: &repeated{}, Usage: "`K=V` for the command (repeatable)"},
				&cli.StringFlag{Name: "workdir", Aliases: []string{"w"}, Usage: "working `DIR` (default the sandbox's)"},
				&cli.BoolFlag{Name: "interactive", Aliases: []string{"i", "stdin"}, Usage: "pass standard input even from a terminal"},
				&cli.BoolFlag{Name: "tty", Aliases: []string{"t"}, Usage: "run the command on a terminal (a PTY in the sandbox)"},
			},
			Action: runExec,
		}),
		remoteCommand(&cli.Command{
			Name:      "cp",
			Usage:     "copy files and directories between this machine and a sandbox",
			ArgsUsage: "SRC DST",
			Description: `One of SRC and DST is NAME:PATH, a path in sandbox NAME (relative to its
working directory); write a local path with a colon as ./a:b. As docker cp:
a directory copied onto an existing directory goes inside it, else it
becomes DST; a file copied onto a directory goes inside it. "-" as SRC
reads a tar from standard input into the sandbox directory DST; as DST,
writes SRC as a tar to standard output. Directories are carried by tar in
the sandbox; what comes out is unpacked here without following a link out
of DST, and without setuid bits or devices.`,
			Action: runCp,
		}),
		remoteCommand(&cli.Command{
			Name:      "port-forward",
			Usage:     "forward local ports to ports of a sandbox, through the service's TCP bridge",
			ArgsUsage: "NAME [LOCAL:]PORT...",
			Description: `As kubectl port-forward: LOCAL:PORT listens on LOCAL here and connects each
connection to 127.0.0.1:PORT in the sandbox; PORT alone uses the same port
here; LOCAL 0 picks a free one. Runs until interrupted.`,
			Flags:  []cli.Flag{&cli.StringFlag{Name: "address", Value: "127.0.0.1", Usage: "listen on `ADDR`"}},
			Action: runPortForward,
		}),
		remoteCommand(&cli.Command{
			Name:      "audit",
			Usage:     "print a sandbox's egress decisions, running or suspended: what it reached, what it was refused, and which command",
			ArgsUsage: "NAME",
			Description: `One line per CONNECT tunnel, routed request or refused request, oldest
first: time, decision, kind, destination, status, the command in the
sandbox that made it, and for a denial why. The service keeps them with
the sandbox (they survive suspend, resume and restarts, and go when it is
destroyed). --json prints each event as the service keeps it, the line of
its audit log. TIME is an RFC 3339 time, a date (2025-06-01, local time),
or a duration back from now (24h).`,
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "since", Usage: "only events at or after `TIME`"},
				&cli.StringFlag{Name: "until", Usage: "only events before `TIME`"},
				&cli.StringFlag{Name: "decision", Usage: "only `allow` or only deny"},
				&cli.StringFlag{Name: "host", Usage: "only events of `HOST` (*.example.com: its subdomains)"},
				&cli.BoolFlag{Name: "json", Usage: "print the events as JSON lines, as the service keeps them"},
				&cli.BoolFlag{Name: "follow", Aliases: []string{"f"}, Usage: "then print new ones as they happen, across suspends (waiting for a suspended sandbox to resume), until interrupted"},
			},
			Action: runAudit,
		}),
		transformationsCommand(),
		modulesCommand(),
		{
			Name:     "template",
			Usage:    "the service's templates",
			Category: "client verbs (a sandgate service at --url)",
			Subcommands: []*cli.Command{
				remoteCommand(&cli.Command{
					Name:    "ls",
					Aliases: []string{"list"},
					Usage:   "list the templates of the service's namespace",
					Flags:   []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print JSON"}},
					Action:  runTemplateLs,
				}),
				remoteCommand(&cli.Command{
					Name:      "save",
					Usage:     "save a running sandbox's files as a template",
					ArgsUsage: "NAME ID",
					Description: `Saves sandbox NAME's files, as they are now, as template ID of the service's
namespace (replacing one of that ID); NAME keeps running. 'sandgate create
--template ID' starts from it. On a terminal, a progress bar shows the save.`,
					Action: runTemplateSave,
				}),
				remoteCommand(&cli.Command{
					Name:        "rm",
					Usage:       "delete templates (sandboxes made from them keep what they need)",
					ArgsUsage:   "ID...",
					Description: `A template that does not exist fails (exit 1) unless --force.`,
					Flags:       []cli.Flag{forceFlag()},
					Action:      runTemplateRm,
				}),
			},
		},
		remoteCommand(&cli.Command{
			Name:  "preflight",
			Usage: "check that the service can be used: protocol 1, credentials required, every route the client uses",
			Description: `Exits 0 when the service answers protocol 1, refuses a call without
credentials and takes these, and documents every route the client calls;
else 1, saying what is wrong. A service that lets a call without
credentials through is refused (unless it is on loopback and no
credentials were given: a local service).`,
			Action: runPreflight,
		}),
	}
}

// forceFlag is -f/--force of the verbs that remove: a missing name is no
// failure.
func forceFlag() cli.Flag {
	return &cli.BoolFlag{Name: "force", Aliases: []string{"f"}, Usage: "a name that does not exist is no failure"}
}

// policySetCommand is `policy set`, beside the local `policy check`.
func policySetCommand() *cli.Command {
	return remoteCommand(&cli.Command{
		Name:      "set",
		Usage:     "replace the network policy of a running sandbox of the service",
		ArgsUsage: "NAME [allow-all|deny-all]",
		Description: `allow-all and deny-all are the presets; otherwise the policy is custom:
--allow hosts, --allow-cidr ranges, --deny-cidr ranges (which win), or the
whole policy from --file (the JSON of 'sandgate proxy --policy'). It
replaces the service's own hosts for this sandbox and applies to every new
connection at once.`,
		Flags: []cli.Flag{
			&cli.GenericFlag{Name: "allow", Value: &repeated{}, Usage: "allow `HOST` (*.example.com for its subdomains); repeatable"},
			&cli.GenericFlag{Name: "allow-cidr", Value: &repeated{}, Usage: "allow addresses in `CIDR`; repeatable"},
			&cli.GenericFlag{Name: "deny-cidr", Value: &repeated{}, Usage: "deny addresses in `CIDR`, whatever else allows them; repeatable"},
			&cli.StringFlag{Name: "file", Usage: "the whole policy, JSON `FILE`"},
		},
		Action: runPolicySet,
	})
}

// oneName takes the NAME argument (flags may follow it).
func oneName(c *cli.Context, verb string) (string, error) {
	args, err := interspersed(c)
	if err != nil {
		return "", err
	}
	if len(args) != 1 {
		return "", badInput("%s takes one sandbox NAME, got %d arguments", verb, len(args))
	}
	return args[0], nil
}

// splitPairs reads NAME=VALUE flags.
func splitPairs(flag string, vals []string) (map[string]string, error) {
	if len(vals) == 0 {
		return nil, nil
	}
	m := map[string]string{}
	for _, v := range vals {
		k, val, ok := strings.Cut(v, "=")
		if !ok || k == "" {
			return nil, badInput("--%s %q: want NAME=VALUE", flag, v)
		}
		m[k] = val
	}
	return m, nil
}

func runCreate(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) > 1 {
		return badInput("create takes at most one NAME, got %d arguments", len(args))
	}
	opts := client.CreateOptions{AllowedHosts: values(c, "allow"), TemplateID: c.String("template"), Setup: values(c, "setup")}
	if len(args) == 1 {
		opts.ID = args[0]
	}
	if opts.BaseURLs, err = splitPairs("base-url", values(c, "base-url")); err != nil {
		return err
	}
	if f := c.String("policy"); f != "" {
		p, err := readPolicyFile(f)
		if err != nil {
			return err
		}
		opts.NetworkPolicy = &p
	}
	if opts.Limits, err = createLimits(c); err != nil {
		return err
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	s, err := cl.Create(c.Context, opts)
	if err != nil {
		return err
	}
	fmt.Fprintln(c.App.Writer, s.ID())
	return nil
}

// createLimits are create's limit flags; the service checks their
// values (and names the field it refuses).
func createLimits(c *cli.Context) (client.Limits, error) {
	l := client.Limits{CPU: c.Float64("cpus"), CPUWeight: c.Int("cpu-weight"), Pids: c.Int("pids"),
		Lifetime: c.Duration("lifetime"), KeepSuspended: c.Duration("keep-suspended")}
	for _, sz := range []struct {
		flag string
		dst  *int64
	}{{"memory", &l.Memory}, {"disk", &l.Disk}} {
		if v := c.String(sz.flag); v != "" {
			n, err := localbox.ParseSize(v)
			if err != nil {
				return l, badInput("--%s: %v", sz.flag, err)
			}
			*sz.dst = n
		}
	}
	return l, nil
}

func readPolicyFile(name string) (client.NetworkPolicy, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return client.NetworkPolicy{}, badInput("--policy: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	var p client.NetworkPolicy
	if err := dec.Decode(&p); err != nil {
		return client.NetworkPolicy{}, badInput("policy %s: %v (want {\"mode\": \"custom\", \"allowedHosts\": [...], \"allowedCIDRs\": [...], \"deniedCIDRs\": [...]})", name, err)
	}
	return p, nil
}

func runResume(c *cli.Context) error {
	name, err := oneName(c, "resume")
	if err != nil {
		return err
	}
	opts := client.ResumeOptions{AllowedHosts: values(c, "allow")}
	if opts.BaseURLs, err = splitPairs("base-url", values(c, "base-url")); err != nil {
		return err
	}
	if f := c.String("policy"); f != "" {
		if len(opts.AllowedHosts) > 0 {
			return badInput("resume: give --allow or --policy, not both (a policy lists its hosts in its own allowedHosts)")
		}
		p, err := readPolicyFile(f)
		if err != nil {
			return err
		}
		opts.NetworkPolicy = &p
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	bar := newServiceBar(c, "resume "+name)
	s, err := cl.Resume(bar.context(c.Context), name, opts)
	bar.finish()
	if err != nil {
		return err
	}
	fmt.Fprintln(c.App.Writer, s.ID())
	if k := s.KeptNetwork(); k != nil {
		fmt.Fprintln(c.App.ErrWriter, keptNetworkLine(s.ID(), k))
	}
	return nil
}

// keptNetworkLine says which network a resume without one kept.
func keptNetworkLine(name string, k *client.KeptNetwork) string {
	what := "its last network"
	if !k.Kept {
		what = "the service's network (none was kept with it; give --allow or --policy for more)"
	}
	line := name + ": resumed with " + what
	if p := k.Policy; p != nil {
		switch {
		case p.Mode != client.ModeCustom:
			line += ": " + p.Mode
		case len(p.AllowedHosts)+len(p.AllowedCIDRs) == 0:
			line += ": no host allowed"
		default:
			line += ": allows " + strings.Join(append(slices.Clone(p.AllowedHosts), p.AllowedCIDRs...), ", ")
		}
	}
	return line
}

// errMissing is a name a removing verb was given that does not exist:
// a failure unless --force.
var errMissing = errors.New("missing")

// eachName applies a verb to every NAME, printing each done, and fails
// (after trying all) if any failed. A name do reports errMissing fails
// with what, unless --force.
func eachName(c *cli.Context, verb, thing, args string, do func(cl *client.Client, name string) error) error {
	names, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(names) == 0 {
		return badInput("%s takes one or more %s", verb, args)
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	failed := 0
	for _, n := range names {
		err := cliHint(do(cl, n))
		if errors.Is(err, errMissing) {
			if c.Bool("force") {
				continue
			}
			err = fmt.Errorf("no such %s (--force ignores a missing one)", thing)
		}
		if err != nil {
			fmt.Fprintf(c.App.ErrWriter, "sandgate: %s %s: %v\n", verb, n, err)
			failed++
			continue
		}
		fmt.Fprintln(c.App.Writer, n)
	}
	if failed > 0 {
		return &exitError{code: exitFailure}
	}
	return nil
}

// exists says whether sandbox name is there, running or suspended, and
// in which state.
func exists(ctx context.Context, cl *client.Client, name string) (string, error) {
	in, err := cl.Info(ctx, name)
	if errors.Is(err, client.ErrSandboxNotFound) {
		return "", errMissing
	}
	return in.State, err
}

func runSuspend(c *cli.Context) error {
	return eachName(c, "suspend", "sandbox", "sandbox NAMEs", func(cl *client.Client, name string) error {
		state, err := exists(c.Context, cl, name)
		if err != nil || state == "suspended" {
			return err
		}
		bar := newServiceBar(c, "suspend "+name)
		err = cl.Suspend(bar.context(c.Context), name)
		bar.finish()
		return err
	})
}

func runDestroy(c *cli.Context) error {
	return eachName(c, "destroy", "sandbox", "sandbox NAMEs", func(cl *client.Client, name string) error {
		if _, err := exists(c.Context, cl, name); err != nil {
			return err
		}
		return cl.Destroy(c.Context, name)
	})
}

func runInspect(c *cli.Context) error {
	name, err := oneName(c, "inspect")
	if err != nil {
		return err
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	in, err := cl.Info(c.Context, name)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(c.App.Writer)
	enc.SetIndent("", "  ")
	return enc.Encode(in)
}

func runFork(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 2 {
		return badInput("fork takes SRC and DST, two sandbox names")
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	state, err := cl.Fork(c.Context, args[0], args[1])
	if err != nil {
		return err
	}
	fmt.Fprintf(c.App.Writer, "%s\t%s\n", args[1], state)
	return nil
}

func runList(c *cli.Context) error {
	if err := noArgs(c, "list"); err != nil {
		return err
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	infos, err := cl.List(c.Context)
	if err != nil {
		return err
	}
	return printList(c, infos, "NAME\tSTATE\tCREATED\tLAST ACTIVE\tTEMPLATE\tSNAPSHOT\tCPU\tMEMORY\tDISK\tPIDS", func(in client.SandboxInfo) []string {
		last, size, tmpl := "-", "-", "-"
		if !in.LastActive.IsZero() {
			last = ago(in.LastActive)
		}
		if in.LayerBytes > 0 {
			size = human(in.LayerBytes)
		}
		if in.Template != "" {
			tmpl = in.Template
		}
		return append([]string{in.Name, string(in.State), ago(in.Created), last, tmpl, size}, usageColumns(in.Usage)...)
	})
}

// usageColumns are ls's columns of what a sandbox uses now: CPU seconds,
// memory, disk (of its quota, if any) and processes; "-" for what is not
// known (a suspended sandbox, Google's sandbox CLI).
func usageColumns(u *client.Usage) []string {
	cols := []string{"-", "-", "-", "-"}
	if u == nil {
		return cols
	}
	if u.CPUSeconds > 0 {
		cols[0] = fmt.Sprintf("%.1fs", u.CPUSeconds)
	}
	if u.MemoryBytes > 0 {
		cols[1] = human(u.MemoryBytes)
	}
	if u.DiskBytes > 0 {
		cols[2] = human(u.DiskBytes)
		if u.DiskQuotaBytes > 0 {
			cols[2] += " of " + human(u.DiskQuotaBytes)
		}
	}
	if u.Processes > 0 {
		cols[3] = fmt.Sprint(u.Processes)
	}
	return cols
}

// ago is a time as "3m ago".
func ago(t time.Time) string {
	d := time.Since(t)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d.Hours()))
	}
	return t.Local().Format("2006-01-02")
}

// shellQuote quotes an argument for /bin/sh.
func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func runExec(c *cli.Context) error {
	pos, argv, err := splitArgs(c, 1)
	if err != nil {
		return err
	}
	if len(pos) != 1 || len(argv) == 0 {
		return badInput("exec takes a sandbox NAME, then -- CMD [ARG...]")
	}
	env, err := splitPairs("env", values(c, "env"))
	if err != nil {
		return err
	}
	quoted := make([]string, len(argv))
	for i, a := range argv {
		quoted[i] = shellQuote(a)
	}
	s, err := attachRemote(c, pos[0])
	if err != nil {
		return err
	}
	if c.Bool("tty") {
		return execTTY(c, s, strings.Join(quoted, " "), env)
	}
	cmd := client.Command{Command: strings.Join(quoted, " "), WorkingDirectory: c.String("workdir"), Env: env,
		Stdout: c.App.Writer, Stderr: c.App.ErrWriter}
	if c.Bool("interactive") || !isTerminal(c.App.Reader) {
		cmd.Stdin = c.App.Reader
	}
	p, err := s.Spawn(c.Context, cmd)
	if err != nil {
		return err
	}
	code, err := p.Wait(context.WithoutCancel(c.Context)) // an interrupt kills the command: wait for its end
	if err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	if code != 0 {
		return &exitError{code: code}
	}
	return nil
}

func isTerminal(r io.Reader) bool {
	f, ok := r.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

func runTemplateLs(c *cli.Context) error {
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	list, err := cl.Templates(c.Context)
	if err != nil {
		return err
	}
	return printList(c, list, "ID\tCREATED\tSIZE", func(t client.TemplateInfo) []string {
		return []string{t.ID, ago(t.Created), human(t.LayerBytes)}
	})
}

func runTemplateRm(c *cli.Context) error {
	return eachName(c, "template rm", "template", "template IDs", func(cl *client.Client, id string) error {
		ok, err := cl.TemplateExists(c.Context, id)
		switch {
		case err != nil:
			return err
		case !ok:
			return errMissing
		}
		return cl.DeleteTemplate(c.Context, id)
	})
}

func runTemplateSave(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 2 {
		return badInput("template save takes a sandbox NAME and a template ID")
	}
	s, err := attachRemote(c, args[0])
	if err != nil {
		return err
	}
	bar := newServiceBar(c, "template save "+args[1])
	err = s.SaveTemplate(bar.context(c.Context), args[1])
	bar.finish()
	if err != nil {
		return err
	}
	fmt.Fprintln(c.App.Writer, args[1])
	return nil
}

func runPolicySet(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) < 1 || len(args) > 2 {
		return badInput("policy set takes a sandbox NAME and, optionally, allow-all or deny-all")
	}
	custom := len(values(c, "allow"))+len(values(c, "allow-cidr"))+len(values(c, "deny-cidr")) > 0
	var p client.NetworkPolicy
	switch {
	case len(args) == 2 && (custom || c.String("file") != ""):
		return badInput("policy set: %s takes no --allow, --allow-cidr, --deny-cidr or --file", args[1])
	case len(args) == 2 && (args[1] == client.ModeAllowAll || args[1] == client.ModeDenyAll):
		p = client.NetworkPolicy{Mode: args[1]}
	case len(args) == 2:
		return badInput("policy set: %q: want allow-all or deny-all, or --allow/--allow-cidr/--deny-cidr for a custom policy", args[1])
	case c.String("file") != "":
		if custom {
			return badInput("policy set: give --file or --allow/--allow-cidr/--deny-cidr, not both")
		}
		if p, err = readPolicyFile(c.String("file")); err != nil {
			return err
		}
	case custom:
		p = client.NetworkPolicy{Mode: client.ModeCustom, AllowedHosts: values(c, "allow"), AllowedCIDRs: values(c, "allow-cidr"), DeniedCIDRs: values(c, "deny-cidr")}
	default:
		return badInput("policy set: say what the sandbox may reach: allow-all, deny-all, --allow HOST, --allow-cidr CIDR, --deny-cidr CIDR or --file FILE")
	}
	s, err := attachRemote(c, args[0])
	if err != nil {
		return err
	}
	return s.SetNetworkPolicy(c.Context, p)
}

func runAudit(c *cli.Context) error {
	name, err := oneName(c, "audit")
	if err != nil {
		return err
	}
	q := client.AuditQuery{Decision: c.String("decision"), Host: c.String("host")}
	now := time.Now()
	if q.Since, err = parseWhen(c.String("since"), now); err != nil {
		return badInput("--since: %v", err)
	}
	if q.Until, err = parseWhen(c.String("until"), now); err != nil {
		return badInput("--until: %v", err)
	}
	if d := q.Decision; d != "" && d != "allow" && d != "deny" {
		return badInput("--decision %q: want allow or deny", d)
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	show := func(e client.AuditEvent) error {
		if c.Bool("json") {
			_, err := c.App.Writer.Write(append(e.JSON(), '\n'))
			return err
		}
		_, err := io.WriteString(c.App.Writer, auditText(e))
		return err
	}
	events := cl.AuditAll(c.Context, name, q)
	if c.Bool("follow") {
		if in, err := cl.Info(c.Context, name); err == nil && in.State == "suspended" {
			fmt.Fprintf(c.App.ErrWriter, "sandgate: %s is suspended: its events so far, then waiting for it to resume (interrupt to stop)\n", name)
		}
		events = cl.FollowAudit(c.Context, name, q)
	}
	var last time.Time
	for e, err := range events {
		if err != nil {
			return err
		}
		if err := show(e); err != nil {
			return err
		}
		last = e.Time
	}
	if !c.Bool("follow") || c.Context.Err() != nil {
		return nil
	}
	// The service ended the stream: the sandbox was destroyed, or the
	// service is stopping. Either way the reader is told, not left with a
	// silent exit.
	if _, err := cl.Info(c.Context, name); errors.Is(err, client.ErrSandboxNotFound) {
		fmt.Fprintf(c.App.ErrWriter, "sandgate: %s was destroyed: its audit went with it\n", name)
		return nil
	}
	again := "sandgate audit -f " + name
	for _, f := range []string{"until", "decision", "host"} {
		if v := c.String(f); v != "" {
			again += " --" + f + " " + shellQuote(v)
		}
	}
	if c.Bool("json") {
		again += " --json"
	}
	if since := c.String("since"); !last.IsZero() {
		again += " --since " + last.UTC().Format(time.RFC3339Nano) + " (which prints the last event again)"
	} else if since != "" {
		again += " --since " + shellQuote(since)
	}
	return fmt.Errorf("the service ended the audit stream of %s (it is stopping or restarting); to go on: %s", name, again)
}

// parseWhen reads a --since or --until TIME: an RFC 3339 time, a date or
// a date and time without a zone (local time), or a duration back from
// now; "" is no bound.
func parseWhen(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	for _, layout := range []string{"2006-01-02", "2006-01-02T15:04", "2006-01-02 15:04", "2006-01-02T15:04:05", "2006-01-02 15:04:05"} {
		if t, err := time.ParseInLocation(layout, s, time.Local); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%q: want an RFC 3339 time (2025-06-01T09:00:00Z), a date (2025-06-01), or a duration back from now (24h)", s)
}

// auditText is an event as one line for a person: local time, decision,
// kind, destination, status, the command that made it, and a denial's
// reason. What the sandbox wrote (its command line, a path) is shown
// without control characters.
func auditText(e client.AuditEvent) string {
	dest := e.Host
	if e.Port != 0 && e.Port != 443 {
		dest += ":" + strconv.Itoa(e.Port)
	}
	if e.Method != "" && e.Kind != "connect" {
		dest = e.Method + " " + dest + e.Path
	}
	if dest == "" {
		dest = "-"
	}
	status := "-"
	if e.Status != 0 {
		status = strconv.Itoa(e.Status)
	}
	line := fmt.Sprintf("%s  %-5s  %-7s  %s  %s  %s", e.Time.Local().Format("2006-01-02 15:04:05"), e.Decision, e.Kind, printable(dest), status, printable(e.Cmd))
	if !e.Allow() {
		line += "  (" + e.Code + ": " + printable(e.Reason) + ")"
	} else if e.Error != "" {
		line += "  (" + e.Code + ": " + printable(e.Error) + ")"
	}
	return line + "\n"
}

// printable replaces control characters, so a hostile string cannot move
// a terminal's cursor or recolour it.
func printable(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) || unicode.In(r, unicode.Bidi_Control) || r == utf8.RuneError {
			return '?'
		}
		return r
	}, s)
}

func runPreflight(c *cli.Context) error {
	if err := noArgs(c, "preflight"); err != nil {
		return err
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	rep, err := cl.Preflight(c.Context)
	w := c.App.Writer
	fmt.Fprintf(w, "service     %s\n", rep.URL)
	if rep.Protocol != 0 {
		fmt.Fprintf(w, "version     %s, protocol %d\n", rep.Version, rep.Protocol)
	}
	if err != nil {
		return err
	}
	switch rep.Refused {
	case "":
		fmt.Fprintln(w, "credentials none: a local service on loopback without a token")
	default:
		fmt.Fprintf(w, "credentials required (a call without them is refused by the %s)\n", rep.Refused)
	}
	fmt.Fprintf(w, "routes      all %d the client calls are documented\n", rep.Routes)
	fmt.Fprintln(w, "ok")
	return nil
}

// forwardSpec is one LOCAL:PORT of port-forward.
type forwardSpec struct{ local, remote int }

func parseForward(s string) (forwardSpec, error) {
	l, r, ok := strings.Cut(s, ":")
	if !ok {
		l, r = s, s
	}
	lp, err1 := strconv.Atoi(l)
	rp, err2 := strconv.Atoi(r)
	if err1 != nil || err2 != nil || lp < 0 || lp > 65535 || rp < 1 || rp > 65535 {
		return forwardSpec{}, badInput("port-forward %q: want [LOCAL:]PORT, ports 1 to 65535 (LOCAL 0: any free one)", s)
	}
	return forwardSpec{lp, rp}, nil
}

func runPortForward(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) < 2 {
		return badInput("port-forward takes a sandbox NAME and one or more [LOCAL:]PORT")
	}
	var specs []forwardSpec
	for _, a := range args[1:] {
		sp, err := parseForward(a)
		if err != nil {
			return err
		}
		specs = append(specs, sp)
	}
	s, err := attachRemote(c, args[0])
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(c.Context)
	defer cancel()
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	for _, sp := range specs {
		ln, err := net.Listen("tcp", net.JoinHostPort(c.String("address"), strconv.Itoa(sp.local)))
		if err != nil {
			return badInput("port-forward: %v", err)
		}
		lns = append(lns, ln)
		fmt.Fprintf(c.App.Writer, "Forwarding from %s -> %d\n", ln.Addr(), sp.remote)
	}
	var wg sync.WaitGroup
	for i, ln := range lns {
		f := &forwarder{s: s, remote: specs[i].remote, log: c.App.ErrWriter}
		wg.Go(func() { f.serve(ctx, ln) })
	}
	<-ctx.Done()
	for _, ln := range lns {
		ln.Close()
	}
	wg.Wait()
	return nil
}

// forwarder carries a local listener's connections to a port of a
// sandbox, each over its own TCP bridge connection.
type forwarder struct {
	s      *client.Session
	remote int
	log    io.Writer
	mu     sync.Mutex
}

func (f *forwarder) serve(ctx context.Context, ln net.Listener) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		conn, err := ln.Accept()
		if err != nil {
			return // closed
		}
		wg.Go(func() { f.carry(ctx, conn) })
	}
}

func (f *forwarder) carry(ctx context.Context, local net.Conn) {
	defer local.Close()
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	remote, err := f.s.DialPort(dctx, f.remote)
	cancel()
	if err != nil {
		f.mu.Lock()
		fmt.Fprintf(f.log, "sandgate: port-forward to %d: %v\n", f.remote, err)
		f.mu.Unlock()
		return
	}
	defer remote.Close()
	stop := context.AfterFunc(ctx, func() { local.Close(); remote.Close() })
	defer stop()
	done := make(chan struct{})
	go func() {
		io.Copy(remote, local)
		remote.Close()
		close(done)
	}()
	io.Copy(local, remote)
	local.Close()
	<-done
}
