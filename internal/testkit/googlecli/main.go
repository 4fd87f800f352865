// Command googlecli is a stand-in for Google's Cloud Run sandbox CLI
// (/usr/local/gcp/bin/sandbox), for tests: installed under the name
// `sandbox`, it makes appliance.Launcher drive it in "Google mode", and it
// behaves as Google's CLI is documented to, running `sandgate sandbox`
// (the executable named sandgate beside it) underneath. gobuild.GoogleCLI
// builds and installs it.
//
// What it copies from Google's CLI, and only that:
//
//   - The verbs the launcher uses in Google mode: run ID [flags] -- CMD,
//     exec ID [flags] -- CMD, tar ID --file=F, fork SRC DST [--detach],
//     delete ID [--force]. Any other verb is refused.
//   - Standard input, output and error relayed through pipes: the command
//     never receives this process's own descriptors (Google's CLI relays
//     stdio itself, so an agent on Cloud Run sees pipes, never the socket
//     its service holds). Bytes are copied both ways; the end of this
//     process's standard input closes the command's.
//   - One exit status for every failure, exitFailure (1), whatever went
//     wrong: a bad flag or id, no such sandbox, a taken id, or a command
//     that exited non-zero or was killed. `sandgate sandbox`'s distinct
//     statuses (120 not found, 121 exists, ...) never come through.
//   - Flags it does not know are refused (exit 1, "unknown flag"), as a
//     cobra/pflag command such as Google's does; flags follow pflag's
//     syntax (--name=value, --name value, --bool, --bool=false, -e value).
//
// The exit status. Google's reference (docs.cloud.google.com/run/docs/
// reference/sandbox-cli) says: "The sandbox CLI exits with status 0 when the
// command succeeds and 1 on CLI errors or any non-zero command exit
// status." Our issue text claimed 137 for some failures (a killed command,
// the usual 128+SIGKILL); no Google page we could find says so, so the shim
// exits 1 there too: a caller must not read a command's status, or a
// failure's kind, from this CLI's, and appliance.Launcher does not.
//
// The flags the launcher passes, checked against Google's reference:
//
//	--import-tar=F   confirmed (reference, `sandbox do`: "The tarball to import
//	                 rootfs-upper from"); that `run` takes it too, and what
//	                 compression it accepts, is not: the shim takes a bare
//	                 tar only, and the launcher gives Google's CLI no other.
//	--mount SPEC     confirmed (reference, `sandbox do`: "type=bind,source=SRC,
//	                 destination=DST"); the ",readonly" suffix the launcher
//	                 adds is not in the text we saw (only in third-party
//	                 programs that drive the CLI).
//	--rootfs DIR     confirmed (reference, `sandbox do`: "Run the command using
//	                 the root of the executing container as the root
//	                 directory of the sandbox"; `run --help` captured by a third
//	                 party: default "/"). The shim passes it on: its sandboxes
//	                 see this host's whole root, as Google's see the container's.
//	--allow-egress   confirmed (reference, `sandbox do`: "Allow outbound
//	                 network access"). The shim refuses it: sandboxes here
//	                 have no network of their own, and the launcher does not
//	                 pass it.
//	--stdin=false    confirmed (reference, top: "Pass --stdin=false when
//	                 running non-interactively without standard input").
//	--detach         not confirmed in the reference text we could read (only
//	                 the `do` section and the top of the page); used with
//	                 `run` by third-party programs that drive the CLI.
//	--write          not confirmed in the reference text; used with `run` and
//	                 `do` by third-party programs.
//	tar --file=F     not confirmed (third-party programs use it); the layer
//	                 format (whiteouts) of Google's tar is not confirmed.
//	delete --force   not confirmed (third-party programs use it).
//	fork SRC DST     not confirmed anywhere we could search.
//
// Ids follow the reference's rule, ^[a-zA-Z0-9][a-zA-Z0-9-]*$.
//
// Where the reference is silent the stand-in is the stricter of the
// readings, so that the launcher does not come to rely on the kinder one:
// `delete --force` of a sandbox that is not there fails (one third-party
// program that probed Google's CLI found it succeeds; the launcher copes
// either way), and a compressed --import-tar is refused. That same probe
// found that `exec` may fail for a moment right after `run --detach`
// returned; the stand-in does so too when asked (a file named
// SANDGATE_STATE_DIR + ".slow-start" holding a duration, e.g. 500ms): for
// that long after a detached run or fork, exec into the new sandbox fails.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// exitFailure is the status for every failure: of the CLI itself and of the
// command it ran (Google's reference: "1 on CLI errors or any non-zero
// command exit status"; the 137 our issue text claims is not confirmed).
const exitFailure = 1

func main() {
	// The child (sandgate sandbox) dies with this process (Pdeathsig is
	// tied to the thread that started it).
	runtime.LockOSThread()
	os.Exit(run(os.Args[1:]))
}

// usageError is a mistake on the command line: the message, then exit 1.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

func run(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "Error: a command is required: run, exec, tar, fork or delete (this is a test stand-in for Google's sandbox CLI)")
		return exitFailure
	}
	verb, rest := args[0], args[1:]
	v, ok := verbs[verb]
	if !ok {
		if verb == "-h" || verb == "--help" || verb == "help" {
			fmt.Println("sandbox (test stand-in for Cloud Run's sandbox CLI): run, exec, tar, fork, delete")
			return 0
		}
		fmt.Fprintf(os.Stderr, "Error: unknown command %q for \"sandbox\"\n", verb)
		return exitFailure
	}
	p, err := parse(v.flags, rest)
	if err != nil {
		fmt.Fprintf(os.Stderr, "Error: %v\n", err)
		return exitFailure
	}
	if p.help {
		fmt.Printf("Usage: sandbox %s %s\n", verb, v.usage)
		return 0
	}
	if err := v.run(p); err != nil {
		var q *quiet
		if !errors.As(err, &q) {
			fmt.Fprintf(os.Stderr, "Error: %v\n", err)
		}
		return exitFailure
	}
	return 0
}

type flagKind int

const (
	boolFlag flagKind = iota
	stringFlag
	repeatedFlag
)

type flagSpec struct {
	name, short string
	kind        flagKind
	def         string // a bool's default ("true" or "")
}

type verb struct {
	usage string
	flags []flagSpec
	run   func(*parsed) error
}

var verbs = map[string]verb{
	"run": {
		usage: "ID [flags] -- CMD...",
		flags: []flagSpec{
			{name: "detach", kind: boolFlag},
			{name: "write", kind: boolFlag},
			{name: "import-tar", kind: stringFlag},
			{name: "mount", kind: repeatedFlag},
			{name: "rootfs", kind: stringFlag, def: "/"},
			{name: "stdin", kind: boolFlag, def: "true"},
			{name: "allow-egress", kind: boolFlag},
			{name: "env", short: "e", kind: repeatedFlag},
			{name: "workdir", kind: stringFlag},
		},
		run: runVerb,
	},
	"exec": {
		usage: "ID [flags] -- CMD...",
		flags: []flagSpec{
			{name: "env", short: "e", kind: repeatedFlag},
			{name: "workdir", kind: stringFlag},
			{name: "stdin", kind: boolFlag, def: "true"},
		},
		run: execVerb,
	},
	"tar": {
		usage: "ID --file=F",
		flags: []flagSpec{{name: "file", kind: stringFlag}},
		run:   tarVerb,
	},
	"fork": {
		usage: "SRC DST [--detach]",
		flags: []flagSpec{{name: "detach", kind: boolFlag}},
		run:   forkVerb,
	},
	"delete": {
		usage: "ID [--force]",
		flags: []flagSpec{{name: "force", kind: boolFlag}},
		run:   deleteVerb,
	},
}

// parsed is a verb's command line: positional arguments, flag values, and
// the command after "--".
type parsed struct {
	pos   []string
	cmd   []string
	dash  bool // "--" was given
	help  bool
	str   map[string]string
	bools map[string]bool
	multi map[string][]string
}

// parse reads args as pflag does: flags and positional arguments mixed,
// everything after "--" the command.
func parse(specs []flagSpec, args []string) (*parsed, error) {
	p := &parsed{str: map[string]string{}, bools: map[string]bool{}, multi: map[string][]string{}}
	for _, s := range specs {
		switch s.kind {
		case boolFlag:
			p.bools[s.name] = s.def == "true"
		case stringFlag:
			if s.def != "" {
				p.str[s.name] = s.def
			}
		}
	}
	find := func(name string, short bool) *flagSpec {
		for i := range specs {
			if (!short && specs[i].name == name) || (short && specs[i].short != "" && specs[i].short == name) {
				return &specs[i]
			}
		}
		return nil
	}
	set := func(s *flagSpec, val string, hasVal bool, next func() (string, bool)) error {
		switch s.kind {
		case boolFlag:
			if !hasVal {
				p.bools[s.name] = true
				return nil
			}
			b, err := strconv.ParseBool(val)
			if err != nil {
				return usagef("invalid argument %q for \"--%s\" flag: %v", val, s.name, err)
			}
			p.bools[s.name] = b
		default:
			if !hasVal {
				v, ok := next()
				if !ok {
					return usagef("flag needs an argument: --%s", s.name)
				}
				val = v
			}
			if s.kind == stringFlag {
				p.str[s.name] = val
			} else {
				p.multi[s.name] = append(p.multi[s.name], val)
			}
		}
		return nil
	}
	for i := 0; i < len(args); i++ {
		a := args[i]
		next := func() (string, bool) {
			if i+1 >= len(args) {
				return "", false
			}
			i++
			return args[i], true
		}
		switch {
		case a == "--":
			p.dash, p.cmd = true, args[i+1:]
			return p, nil
		case a == "-h" || a == "--help":
			p.help = true
		case strings.HasPrefix(a, "--"):
			name, val, hasVal := strings.Cut(a[2:], "=")
			s := find(name, false)
			if s == nil {
				return nil, usagef("unknown flag: --%s", name)
			}
			if err := set(s, val, hasVal, next); err != nil {
				return nil, err
			}
		case strings.HasPrefix(a, "-") && len(a) > 1:
			name, val := a[1:2], a[2:]
			s := find(name, true)
			if s == nil {
				return nil, usagef("unknown shorthand flag: %q in %s", name, a)
			}
			val, hasVal := strings.CutPrefix(val, "=")
			if err := set(s, val, hasVal || val != "", next); err != nil {
				return nil, err
			}
		default:
			p.pos = append(p.pos, a)
		}
	}
	return p, nil
}

// idPattern is the reference's rule for a sandbox id.
var idPattern = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9-]*$`)

func checkIDs(ids ...string) error {
	for _, id := range ids {
		if !idPattern.MatchString(id) {
			return usagef("invalid sandbox id %q: it must match ^[a-zA-Z0-9][a-zA-Z0-9-]*$", id)
		}
	}
	return nil
}

func (p *parsed) onePos(verb string, n int, what string) error {
	if len(p.pos) != n {
		return usagef("sandbox %s takes %s, got %d arguments", verb, what, len(p.pos))
	}
	return checkIDs(p.pos...)
}

func runVerb(p *parsed) error {
	if err := p.onePos("run", 1, "one sandbox id"); err != nil {
		return err
	}
	if !p.dash || len(p.cmd) == 0 {
		return usagef("sandbox run: put the command after --")
	}
	if p.bools["allow-egress"] {
		return usagef("--allow-egress: this test stand-in cannot give a sandbox a network of its own")
	}
	args := []string{"run", p.pos[0]}
	if p.bools["detach"] {
		args = append(args, "--detach")
	}
	if p.bools["write"] {
		args = append(args, "--write")
	}
	if f := p.str["import-tar"]; f != "" {
		if err := checkBareTar(f); err != nil {
			return err
		}
		args = append(args, "--import-tar="+f)
	}
	for _, m := range p.multi["mount"] {
		args = append(args, "--mount", m)
	}
	// Google's sandboxes see the container's root file system, all of it
	// (reference: "mounts the host container's root file system as
	// read-only at /"), unless --rootfs names another directory.
	args = append(args, "--rootfs", p.str["rootfs"])
	for _, e := range p.multi["env"] {
		args = append(args, "--env", e)
	}
	if d := p.str["workdir"]; d != "" {
		args = append(args, "--workdir", d)
	}
	if !p.bools["stdin"] {
		args = append(args, "--stdin=false")
	}
	args = append(append(args, "--"), p.cmd...)
	if err := sandgate(args, p.bools["stdin"] && !p.bools["detach"]); err != nil {
		return err
	}
	if p.bools["detach"] {
		markStarting(p.pos[0])
	}
	return nil
}

func execVerb(p *parsed) error {
	if err := p.onePos("exec", 1, "one sandbox id"); err != nil {
		return err
	}
	if !p.dash || len(p.cmd) == 0 {
		return usagef("sandbox exec: put the command after --")
	}
	if stillStarting(p.pos[0]) {
		return usagef("sandbox %s is not running yet", p.pos[0])
	}
	args := []string{"exec", p.pos[0]}
	for _, e := range p.multi["env"] {
		args = append(args, "--env", e)
	}
	if d := p.str["workdir"]; d != "" {
		args = append(args, "--workdir", d)
	}
	args = append(append(args, "--"), p.cmd...)
	return sandgate(args, p.bools["stdin"])
}

func tarVerb(p *parsed) error {
	if err := p.onePos("tar", 1, "one sandbox id"); err != nil {
		return err
	}
	f := p.str["file"]
	if f == "" || f == "-" {
		return usagef("sandbox tar: --file=F (a file) is required")
	}
	return sandgate([]string{"tar", p.pos[0], "--file=" + f}, false)
}

func forkVerb(p *parsed) error {
	if err := p.onePos("fork", 2, "a source and a destination sandbox id"); err != nil {
		return err
	}
	args := []string{"fork", p.pos[0], p.pos[1]}
	if p.bools["detach"] {
		args = append(args, "--detach")
	}
	if err := sandgate(args, false); err != nil {
		return err
	}
	if p.bools["detach"] {
		markStarting(p.pos[1])
	}
	return nil
}

// slowStart is how long exec into a sandbox fails after a detached run or
// fork returned (what SANDGATE_STATE_DIR + ".slow-start" says, else 0),
// and the directory recording until when, per sandbox.
func slowStart() (time.Duration, string) {
	state := os.Getenv("SANDGATE_STATE_DIR")
	if state == "" {
		return 0, ""
	}
	b, err := os.ReadFile(state + ".slow-start")
	if err != nil {
		return 0, ""
	}
	d, err := time.ParseDuration(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, ""
	}
	return d, state + ".starting"
}

// markStarting records until when exec into sandbox id fails.
func markStarting(id string) {
	d, dir := slowStart()
	if d <= 0 {
		return
	}
	os.MkdirAll(dir, 0o700)
	os.WriteFile(filepath.Join(dir, id), []byte(strconv.FormatInt(time.Now().Add(d).UnixNano(), 10)), 0o600)
}

// stillStarting reports whether exec into sandbox id fails for now.
func stillStarting(id string) bool {
	_, dir := slowStart()
	if dir == "" {
		return false
	}
	b, err := os.ReadFile(filepath.Join(dir, id))
	if err != nil {
		return false
	}
	until, err := strconv.ParseInt(string(b), 10, 64)
	return err == nil && time.Now().UnixNano() < until
}

func deleteVerb(p *parsed) error {
	if err := p.onePos("delete", 1, "one sandbox id"); err != nil {
		return err
	}
	args := []string{"delete", p.pos[0]}
	if p.bools["force"] {
		args = append(args, "--force")
	}
	return sandgate(args, false)
}

// checkBareTar refuses a compressed layer: Google's reference calls the
// import a "tarball" and says nothing of compression, so the launcher gives
// Google's CLI bare tars only, and this stand-in holds it to that.
func checkBareTar(file string) error {
	f, err := os.Open(file)
	if err != nil {
		return fmt.Errorf("--import-tar: %w", err)
	}
	defer f.Close()
	head := make([]byte, 4)
	n, _ := io.ReadFull(bufio.NewReader(f), head)
	head = head[:n]
	for _, m := range [][]byte{{0x28, 0xb5, 0x2f, 0xfd}, {0x1f, 0x8b}} {
		if bytes.HasPrefix(head, m) {
			return usagef("--import-tar %s is compressed: this stand-in (like the launcher's use of Google's CLI) takes a bare tar only", file)
		}
	}
	return nil
}

// sandgate runs `sandgate sandbox ARGS` with this process's stdio relayed
// through pipes (stdin only when withStdin), and reports any failure as
// one error: its status is never passed on.
func sandgate(args []string, withStdin bool) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	bin := filepath.Join(filepath.Dir(exe), "sandgate")
	cmd := exec.Command(bin, append([]string{"sandbox"}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	// Pipes, never our own descriptors: os/exec hands an *os.File to the
	// child as it is, so every stream goes through a copier.
	var stdin io.WriteCloser
	if withStdin {
		if stdin, err = cmd.StdinPipe(); err != nil {
			return err
		}
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", bin, err)
	}
	go func() {
		for s := range sigs {
			cmd.Process.Signal(s)
		}
	}()
	if stdin != nil {
		go func() {
			io.Copy(stdin, os.Stdin)
			stdin.Close()
		}()
	}
	var wg sync.WaitGroup
	wg.Go(func() { io.Copy(os.Stdout, stdout) })
	wg.Go(func() { io.Copy(os.Stderr, stderr) })
	wg.Wait()
	err = cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		// Said already on stderr (by sandgate, or by the command).
		return &quiet{err}
	}
	return err
}

// quiet is a failure already reported on standard error.
type quiet struct{ error }
