package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/appliance/localbox"
	"github.com/sandgate/sandgate/snapshot"
)

// sandboxCommand builds `sandgate sandbox run|exec|tar|fork|delete|list`,
// the local sandbox CLI with the verbs of Cloud Run's `sandbox`.
func sandboxCommand() *cli.Command {
	runFlags := []cli.Flag{
		&cli.BoolFlag{Name: "detach", Aliases: []string{"d"}, Usage: "return once the command started, printing ID; the sandbox runs on"},
		&cli.BoolFlag{Name: "write", Usage: "make the root writable (into the sandbox's own layer)"},
		&cli.StringFlag{Name: "import-tar", Usage: "layer `FILE` (tar, zstd or gzip) to start the writable layer from"},
		&cli.StringFlag{Name: "template", Usage: "start on template `NAME` (see 'sandbox template'), shared read-only beneath the sandbox's own layer (sandgate's own; not in Cloud Run's CLI)"},
		&cli.GenericFlag{Name: "env", Aliases: []string{"e"}, Value: &repeated{}, Usage: "`K=V` for the command (repeatable)"},
		&cli.StringFlag{Name: "workdir", Aliases: []string{"w"}, Usage: "working `DIR` inside the sandbox"},
		&cli.StringFlag{Name: "rootfs", Usage: "host `DIR` seen read-only as the sandbox's root, all of it (default: an image of the host's /usr and libraries with an /etc of the sandbox's own, nothing else of the host)"},
		&cli.GenericFlag{Name: "mask", Value: &repeated{}, Usage: "host `PATH` the sandbox must never see, hidden wherever the image shows it (repeatable; the state directory always is)"},
		&cli.StringFlag{Name: "userns", Value: "auto", Usage: "run the sandbox in a user namespace: `MODE` auto (where the kernel allows), on (or fail), off"},
		&cli.GenericFlag{Name: "mount", Value: &repeated{}, Usage: "bind-mount `SPEC`, type=bind,source=S,destination=D[,readonly] (repeatable)"},
		&cli.StringFlag{Name: "ca-cert", Usage: "PEM `FILE` of CA certificates the default image's /etc trusts beside the host's roots (its system bundle and " + localbox.TrustedCAFile + "; sandgate's own)"},
		&cli.BoolFlag{Name: "stdin", Value: true, Usage: "connect stdin without --detach (--stdin=false to leave it unconnected)"},
		&cli.BoolFlag{Name: "stdout", Value: true, Usage: "connect stdout without --detach (--stdout=false to leave it unconnected)"},
		&cli.BoolFlag{Name: "stderr", Value: true, Usage: "connect stderr without --detach (--stderr=false to leave it unconnected)"},
		&cli.StringFlag{Name: "memory", Usage: "memory limit: `BYTES` or a size like 512m, 2g (cgroup; none when empty)"},
		&cli.Int64Flag{Name: "pids", Usage: "process limit `N` (cgroup; 0 for none)"},
		&cli.StringFlag{Name: "cpus", Usage: "CPU limit: the `CORES`' worth of time its processes may use together, e.g. 0.5 or 2 (cgroup; past it they are throttled; none when empty or 0)"},
		&cli.IntFlag{Name: "cpu-weight", Usage: "its share `W` of the cores when sandboxes contend, 1 to 10000, 100 an equal share (cgroup cpu.weight; v1 cpu.shares scaled, 100 = 1024; 0 for the default)"},
		&cli.IntFlag{Name: "sandboxes-cpu-weight", Usage: "set the CPU weight `W` of all this state directory's sandboxes together against the processes beside them (their parent cgroup), 1 to 10000: 100 weighs as much as one of them (0 leaves it)"},
		&cli.StringFlag{Name: "disk", Usage: "disk quota: the `BYTES` (or a size like 10g) the writable layer may take on the host, on an ext4 file system of the sandbox's own; past it writes fail with ENOSPC (needs the loop driver and mke2fs; none when empty)"},
		&cli.StringFlag{Name: "tmp-size", Value: "512m", Usage: "size `BYTES` of the /tmp tmpfs (its pages count against --memory)"},
		&cli.StringFlag{Name: "shm-size", Value: "64m", Usage: "size `BYTES` of the /dev/shm tmpfs (its pages count against --memory)"},
	}
	cmd := &cli.Command{
		Name:  "sandbox",
		Usage: "run isolated sandboxes on this Linux host (the verbs of Cloud Run's sandbox CLI)",
		Description: `Exit status, the same for every verb, so that a program driving this CLI
learns what went wrong without reading the message:
   0    success
   1    any other failure (the message says what)
   2    bad input: a bad id, flag, mount or size; nothing was changed
 119    the sandbox is running (delete without --force)
 120    no such sandbox
 121    the sandbox already exists (run, fork)
 122    the sandbox is busy: another sandgate process is creating or deleting it
 123    the sandbox is not running (exec into a stopped or crashed one)
 143    run or exec gave up 10s after forwarding SIGTERM to a stalled sandbox
run without --detach and exec exit with CMD's own status once CMD ran
(128+signal for a signal), which may be any of these numbers too.`,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "state-dir", Value: localbox.DefaultStateDir, EnvVars: []string{"SANDGATE_STATE_DIR"}, Usage: "keep the sandboxes' state in `DIR`"},
		},
		Subcommands: []*cli.Command{{
			Name:      "run",
			Usage:     "create sandbox ID and run CMD in it",
			ArgsUsage: "ID [flags] -- CMD...",
			Description: `Without --detach, stdio is connected and sandgate exits with CMD's exit code
(128+signal for a signal). With --detach it prints ID and returns once CMD
started; the sandbox runs until CMD exits (then it is "stopped") or it is
deleted.`,
			Flags:        runFlags,
			OnUsageError: usageError,
			Action:       runSandboxRun,
		}, {
			Name:      "exec",
			Usage:     "run CMD in the running sandbox ID",
			ArgsUsage: "ID [flags] -- CMD...",
			Flags: []cli.Flag{
				&cli.GenericFlag{Name: "env", Aliases: []string{"e"}, Value: &repeated{}, Usage: "`K=V` for the command (repeatable)"},
				&cli.StringFlag{Name: "workdir", Aliases: []string{"w"}, Usage: "working `DIR` inside the sandbox"},
			},
			OnUsageError: usageError,
			Action:       runSandboxExec,
		}, {
			Name:      "tar",
			Usage:     "write sandbox ID's writable layer to --file",
			ArgsUsage: "ID --file=F",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "file", Aliases: []string{"f"}, Usage: "write the layer to `FILE` (required), - for standard output"},
				&cli.StringFlag{Name: "compression", Value: "none", Usage: "compress with `ALGORITHM`: none, zstd or gzip"},
			},
			OnUsageError: usageError,
			Action:       runSandboxTar,
		}, {
			Name:         "fork",
			Usage:        "create sandbox DST from SRC (a copy of its writable layer) and run SRC's command in it",
			ArgsUsage:    "SRC DST [--detach]",
			Flags:        []cli.Flag{&cli.BoolFlag{Name: "detach", Aliases: []string{"d"}, Usage: "return once the command started, printing DST"}},
			OnUsageError: usageError,
			Action:       runSandboxFork,
		}, {
			Name:         "delete",
			Usage:        "stop sandbox ID and remove everything of it",
			ArgsUsage:    "ID [--force]",
			Flags:        []cli.Flag{&cli.BoolFlag{Name: "force", Aliases: []string{"f"}, Usage: "also stop a running sandbox, and clean whatever a crash left"}},
			OnUsageError: usageError,
			Action:       runSandboxDelete,
		}, sandboxTemplateCommand(), {
			Name:         "list",
			Usage:        "list sandboxes: id, state, pid, created",
			Flags:        []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print JSON"}},
			OnUsageError: usageError,
			Action:       runSandboxList,
		}},
	}
	for _, sub := range cmd.Subcommands {
		action := sub.Action
		sub.Action = func(c *cli.Context) error { return sandboxErr(action(c)) }
	}
	return cmd
}

// repeated is a repeatable flag whose values are kept whole: urfave/cli's
// string slices split at commas, which mount specs and environment values
// contain.
type repeated []string

func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }
func (r *repeated) String() string     { return strings.Join(*r, " ") }

func values(c *cli.Context, name string) []string {
	if r, ok := c.Generic(name).(*repeated); ok {
		return *r
	}
	return nil
}

func sandboxRuntime(c *cli.Context) (*localbox.Runtime, error) {
	return localbox.NewRuntime(c.String("state-dir"))
}

// sandboxErr gives an error of the sandbox runtime its exit status
// (localbox.ExitCode: 2 for bad input, 119-123 for the sandbox's state).
// Every verb's error passes through it; one that already carries a
// status (a command's, a usage error) keeps it.
func sandboxErr(err error) error {
	var ee *exitError
	if err == nil || errors.As(err, &ee) {
		return err
	}
	if code := localbox.ExitCode(err); code != localbox.ExitFailure {
		return &exitError{code: code, err: err}
	}
	return err
}

// stdioFiles connects the CLI's streams to a command as files: the
// process's own descriptors when the writers are files (so bytes never
// pass through sandgate), otherwise pipes copied into the writers (tests
// that run the CLI in-process). wait flushes those copies.
func stdioFiles(c *cli.Context, in, out, errOut bool) (localbox.Stdio, func(), error) {
	var s localbox.Stdio
	var waits []chan struct{}
	var closers []*os.File
	if in {
		s.Stdin = os.Stdin
	}
	set := func(w io.Writer, dst **os.File) error {
		if f, ok := w.(*os.File); ok {
			*dst = f
			return nil
		}
		r, pw, err := os.Pipe()
		if err != nil {
			return err
		}
		done := make(chan struct{})
		go func() { // ends at EOF: when the command and this process close pw
			defer close(done)
			io.Copy(w, r)
			r.Close()
		}()
		*dst = pw
		waits = append(waits, done)
		closers = append(closers, pw)
		return nil
	}
	if out {
		if err := set(c.App.Writer, &s.Stdout); err != nil {
			return s, nil, err
		}
	}
	if errOut {
		if err := set(c.App.ErrWriter, &s.Stderr); err != nil {
			return s, nil, err
		}
	}
	wait := func() {
		for _, f := range closers {
			f.Close()
		}
		for _, d := range waits {
			select {
			case <-d:
			case <-time.After(10 * time.Second): // a detached grandchild may hold the pipe
			}
		}
	}
	return s, wait, nil
}

// signalAnswerTimeout bounds how long run and exec wait for the command's
// exit once they forwarded an interrupt to it: a sandbox whose init does
// not answer (stalled, or frozen) must not keep the CLI from ending.
var signalAnswerTimeout = 10 * time.Second

// follow waits for p and turns its exit code into the CLI's, passing an
// interrupt of the CLI on to the command as SIGTERM. If the sandbox does not
// report the command's exit within signalAnswerTimeout of that, follow
// gives up: it closes the link (the init, if it still serves, then kills
// the command) and returns 128+SIGTERM with a message.
func follow(c *cli.Context, p *localbox.Process, wait func()) error {
	type result struct {
		code int
		err  error
	}
	res := make(chan result, 1)
	go func() {
		code, err := p.Wait()
		res <- result{code, err}
	}()
	interrupted := c.Context.Done()
	var giveUp <-chan time.Time
	for {
		select {
		case <-interrupted:
			interrupted = nil
			_ = p.Signal(syscall.SIGTERM)
			t := time.NewTimer(signalAnswerTimeout)
			defer t.Stop()
			giveUp = t.C
		case <-giveUp:
			_ = p.Close()
			return &exitError{code: 128 + int(syscall.SIGTERM), err: fmt.Errorf("the sandbox did not report the command's exit within %v of forwarding SIGTERM to it; gave up waiting (the command may still run: see 'sandgate sandbox list', end it with 'sandgate sandbox delete --force ID')", signalAnswerTimeout)}
		case r := <-res:
			wait()
			if r.err != nil {
				return r.err
			}
			if r.code != 0 {
				return &exitError{code: r.code}
			}
			return nil
		}
	}
}

// userNSMode turns --userns's value into localbox's (auto is "").
func userNSMode(v string) string {
	if v == "auto" {
		return localbox.UserNSAuto
	}
	return v
}

func runSandboxRun(c *cli.Context) error {
	pos, cmd, err := splitArgs(c, 1)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return badInput("sandbox run takes an ID, then -- CMD...")
	}
	opts := localbox.RunOptions{
		Config: localbox.Config{
			ID: pos[0], Rootfs: c.String("rootfs"), Write: c.Bool("write"), Template: c.String("template"),
			Masks: values(c, "mask"), UserNS: userNSMode(c.String("userns")),
			Env: values(c, "env"), Dir: c.String("workdir"), Cmd: cmd, Pids: c.Int64("pids"),
			CPUWeight: c.Int("cpu-weight"), SandboxesCPUWeight: c.Int("sandboxes-cpu-weight"),
		},
		ImportTar: c.String("import-tar"),
	}
	if s := c.String("cpus"); s != "" {
		if opts.CPU, err = strconv.ParseFloat(s, 64); err != nil {
			return badInput("--cpus %q: give the cores' worth of time the sandbox may use, e.g. 0.5 or 2", s)
		}
	}
	if f := c.String("ca-cert"); f != "" {
		b, err := os.ReadFile(f)
		if err != nil {
			return badInput("--ca-cert: %v", err)
		}
		opts.TrustCA = b
	}
	for _, sz := range []struct {
		flag string
		dst  *int64
	}{{"memory", &opts.Memory}, {"tmp-size", &opts.TmpSize}, {"shm-size", &opts.ShmSize}, {"disk", &opts.Disk}} {
		if s := c.String(sz.flag); s != "" {
			if *sz.dst, err = localbox.ParseSize(s); err != nil {
				return sandboxErr(fmt.Errorf("--%s: %w", sz.flag, err))
			}
		}
	}
	for _, s := range values(c, "mount") {
		mt, err := localbox.ParseMount(s)
		if err != nil {
			return sandboxErr(err)
		}
		opts.Mounts = append(opts.Mounts, mt)
	}
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	return launch(c, pos[0], c.Bool("detach"), c.Bool("stdin"), c.Bool("stdout"), c.Bool("stderr"), func(stdio localbox.Stdio) (*localbox.Process, error) {
		opts.Stdio = stdio
		return m.Run(c.Context, opts)
	})
}

// launch starts sandbox id and its command with start, connected to the
// CLI's stdio (the streams in, out and errOut say which) unless detach, then
// follows the command to its end or detaches from it and prints id, as
// "docker run -d" prints the container's.
func launch(c *cli.Context, id string, detach, in, out, errOut bool, start func(localbox.Stdio) (*localbox.Process, error)) error {
	var stdio localbox.Stdio
	wait := func() {}
	if !detach {
		var err error
		if stdio, wait, err = stdioFiles(c, in, out, errOut); err != nil {
			return err
		}
	}
	p, err := start(stdio)
	if err != nil {
		wait()
		return sandboxErr(err)
	}
	if detach {
		if err := p.Detach(); err != nil {
			return err
		}
		_, err := fmt.Fprintln(c.App.Writer, id)
		return err
	}
	return follow(c, p, wait)
}

func runSandboxExec(c *cli.Context) error {
	pos, cmd, err := splitArgs(c, 1)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return badInput("sandbox exec takes an ID, then -- CMD...")
	}
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	stdio, wait, err := stdioFiles(c, true, true, true)
	if err != nil {
		return err
	}
	p, err := m.Exec(c.Context, pos[0], localbox.ExecOptions{Cmd: cmd, Env: values(c, "env"), Dir: c.String("workdir"), Stdio: stdio})
	if err != nil {
		wait()
		return sandboxErr(err)
	}
	return follow(c, p, wait)
}

func runSandboxTar(c *cli.Context) error {
	pos, rest, err := splitArgs(c, 1)
	if err != nil {
		return err
	}
	if len(pos) != 1 || len(rest) > 0 {
		return badInput("sandbox tar takes one ID and --file=F")
	}
	file := c.String("file")
	if file == "" {
		return badInput("sandbox tar: --file=F is required")
	}
	comp, err := snapshot.ParseCompression(c.String("compression"))
	if err != nil {
		return badInput("--compression: %v", err)
	}
	if err := localbox.CheckID(pos[0]); err != nil {
		return sandboxErr(err)
	}
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	if file == "-" {
		// Streamed: whoever reads it must check this command's status,
		// since a stream cut short can look like a shorter layer.
		_, err := m.Tar(c.Context, pos[0], c.App.Writer, snapshot.PackOptions{Compression: comp})
		return sandboxErr(err)
	}
	tmp := file + ".tmp-sandgate"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = m.Tar(c.Context, pos[0], f, snapshot.PackOptions{Compression: comp})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, file)
	}
	if err != nil {
		os.Remove(tmp)
		return sandboxErr(err)
	}
	return nil
}

func runSandboxFork(c *cli.Context) error {
	pos, rest, err := splitArgs(c, 2)
	if err != nil {
		return err
	}
	if len(pos) != 2 || len(rest) > 0 {
		return badInput("sandbox fork takes SRC and DST")
	}
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	return launch(c, pos[1], c.Bool("detach"), true, true, true, func(stdio localbox.Stdio) (*localbox.Process, error) {
		return m.Fork(c.Context, pos[0], pos[1], stdio)
	})
}

func runSandboxDelete(c *cli.Context) error {
	pos, rest, err := splitArgs(c, 1)
	if err != nil {
		return err
	}
	if len(pos) != 1 || len(rest) > 0 {
		return badInput("sandbox delete takes one ID")
	}
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	return sandboxErr(m.Delete(c.Context, pos[0], c.Bool("force")))
}

func runSandboxList(c *cli.Context) error {
	if err := noArgs(c, "sandbox list"); err != nil {
		return err
	}
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	infos, err := m.List()
	if err != nil {
		return err
	}
	return printList(c, infos, "ID\tSTATE\tPID\tCREATED", func(in localbox.Info) []string {
		pid := "-"
		if in.Pid > 0 {
			pid = fmt.Sprint(in.Pid)
		}
		state := string(in.State)
		if in.ExitCode != nil {
			state = fmt.Sprintf("%s (%d)", state, *in.ExitCode)
		}
		return []string{in.ID, state, pid, in.Created.Format(time.RFC3339)}
	})
}
