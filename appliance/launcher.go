// Package appliance runs sandboxes: the Launcher drives a sandbox CLI
// (Google's on Cloud Run, `sandgate sandbox` anywhere else) by argv, and a
// Sandbox is the service's handle on one running sandbox — its agent link,
// its identity in the egress proxy, its files, commands and layer.
package appliance

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/relay"
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
	// SandboxesCPUWeight is what all the sandboxes together weigh against
	// the processes beside them when the cores are contended (`sandgate
	// sandbox`: their parent cgroup's CPU weight), 1 to 10000: 100 is as
	// much as one process, DefaultSandboxesCPUWeight a quarter, so that the
	// service runs first when it has work. Zero leaves the kernel's.
	SandboxesCPUWeight int
	// Rootfs is the image a sandbox sees as / (`sandgate sandbox` only);
	// empty means its default image (the host's programs and libraries,
	// nothing else of the host).
	Rootfs string
	// Hide are host paths no sandbox may see: the service's state
	// directory, a local snapshot store, its own files. `sandgate sandbox`
	// masks each wherever the image shows it (and refuses an image inside
	// one); Google's CLI, whose sandboxes see the container's whole root
	// file system, gets an empty directory (or file) of the sandbox's own
	// bound over each, read-only.
	Hide []string
	// PrivateDir is where the launcher keeps what it binds over Hide for
	// Google's CLI (a directory the service owns; it should be one of
	// Hide). Empty means os.TempDir.
	PrivateDir string
	// UserNS is `sandgate sandbox`'s --userns: auto ("" too), on or off.
	UserNS string
	// Capture captures, in each sandbox, the connections of processes that
	// ignore the proxy variables: the agent's DNS responder gives every
	// name an address of netcapture.DefaultPrefix, and every connection
	// to one, on any port, is steered to the agent and served as CONNECT
	// name:port (relay.Proxy.ServeCaptured). It needs a link that passes
	// sockets (`sandgate sandbox`) and a host that can (root, Linux 5.9+);
	// elsewhere lookups in a sandbox fail at once (NXDOMAIN) and are
	// audited (on Google's CLI, Capture binds a resolv.conf naming the
	// agent over the image's so that they reach it; without Capture
	// nothing is bound there, and lookups fail as the image's resolv.conf
	// makes them, unaudited).
	Capture bool
	// TrustCA is the certificate (PEM) of the service's interception CA,
	// which every sandbox trusts: in its system bundle (the default image
	// of `sandgate sandbox`; on Google's CLI a bundle bound over the
	// image's) and through the agent's trust variables (SSL_CERT_FILE,
	// NODE_EXTRA_CA_CERTS, REQUESTS_CA_BUNDLE, GIT_SSL_CAINFO). Never a
	// key. Nil: none.
	TrustCA []byte
	// Logger receives what the launcher does. Nil discards.
	Logger *slog.Logger
}

// Launcher drives a sandbox CLI by argv, never through a shell.
//
// What went wrong. A failed verb is a *CLIError (errors.As) carrying the
// CLI's output for messages. With `sandgate sandbox` it also matches the
// sentinel its exit status stands for (sandboxcli.ExitCode): errors.Is(err,
// ErrExists), ErrNotFound, ErrBusy, ErrNotRunning, ErrRunning, ErrBadInput,
// so a caller (an HTTP API: 409, 404) branches without parsing text. With
// Google's CLI it matches none of them: that CLI exits with one status for
// every failure (its reference says 1 for CLI errors and for any command's
// non-zero status), and its messages are not a documented interface, so
// the launcher does not guess from text. There the caller knows which ids
// exist from its own registry of the sandboxes it made; only ErrBadInput
// (an id or a layer the launcher refuses before running the CLI) is typed,
// and ErrNotFound where a second observation says it (Gone: a failed
// delete, or agent start, in a sandbox that cannot run anything either).
//
// A command's exit status never comes from the CLI's. The launcher never
// runs a user's command with the CLI: it runs one process per sandbox,
// `sandbox exec ID -- sandgate agent`, and every command goes over that
// agent's link, which reports its exit code and signal itself
// (agent.ExitStatus). The CLI's own status only says how that link
// process ended.
type Launcher struct {
	argv   []string // the CLI and any leading arguments before the verb
	env    []string // the CLI's whole environment: nothing of the service leaks
	google bool
	agent  string // host path of the binary mounted at AgentPath
	cfg    LauncherConfig
	log    *slog.Logger
	// files the launcher gives every sandbox (see sandboxFiles): host
	// paths, "" when there is none.
	caFile, bundleFile, resolvFile string
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
	l.google = cfg.Google()
	switch {
	case cfg.CLI != "":
		l.argv = []string{cfg.CLI}
	case l.google:
		l.argv = []string{GoogleCLI}
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
	if err := l.sandboxFiles(); err != nil {
		return nil, err
	}
	return l, nil
}

// sandboxFiles writes what the launcher gives every sandbox, in a
// directory of its own under PrivateDir: the interception CA's
// certificate (`sandgate sandbox` adds it to its default image's /etc);
// for Google's CLI, whose root is the service's image, read-only, a CA
// bundle (the image's and the CA) and a resolv.conf naming the agent's
// DNS responder, both bound over the image's.
func (l *Launcher) sandboxFiles() error {
	if len(l.cfg.TrustCA) == 0 && !(l.google && l.cfg.Capture) {
		return nil
	}
	var dir string
	if l.cfg.PrivateDir != "" {
		dir = filepath.Join(l.cfg.PrivateDir, "sandbox-files")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("launcher: %w", err)
		}
	} else {
		// One of its own: two launchers' files must never mix.
		var err error
		if dir, err = os.MkdirTemp("", "sandgate-sandbox-files-"); err != nil {
			return fmt.Errorf("launcher: %w", err)
		}
		os.Chmod(dir, 0o755)
	}
	put := func(name string, data []byte) (string, error) {
		p := filepath.Join(dir, name)
		tmp := p + ".new"
		if err := os.WriteFile(tmp, data, 0o644); err != nil {
			return "", fmt.Errorf("launcher: %w", err)
		}
		return p, os.Rename(tmp, p)
	}
	var err error
	if len(l.cfg.TrustCA) > 0 {
		if l.caFile, err = put("sandgate-ca.pem", l.cfg.TrustCA); err != nil {
			return err
		}
		if l.google {
			bundle, _ := os.ReadFile(SandboxTrustBundle) // the image's, which the sandbox sees
			if len(bundle) > 0 && bundle[len(bundle)-1] != '\n' {
				bundle = append(bundle, '\n')
			}
			if l.bundleFile, err = put("ca-certificates.crt", append(bundle, l.cfg.TrustCA...)); err != nil {
				return err
			}
		}
	}
	if l.google && l.cfg.Capture {
		if l.resolvFile, err = put("resolv.conf", []byte(sandboxResolvConf)); err != nil {
			return err
		}
	}
	return nil
}

// In a sandbox: the agent's DNS responder, the system CA bundle, the
// interception CA alone (the default image of `sandgate sandbox`), and the
// resolv.conf bound over Google's image's.
const (
	SandboxDNS         = "127.0.0.1:53"
	SandboxTrustBundle = "/etc/ssl/certs/ca-certificates.crt" // localbox.TrustBundle
	SandboxTrustCA     = relay.SandboxCAFile                  // localbox.TrustedCAFile
	sandboxResolvConf  = "nameserver 127.0.0.1\noptions attempts:1 timeout:1\n"
)

// AgentConfig completes an agent configuration with what the launcher's
// sandboxes have: the DNS responder, and the trust files of the
// interception CA. What cfg sets stays.
func (l *Launcher) AgentConfig(cfg agent.Config) agent.Config {
	if cfg.DNS == "" {
		cfg.DNS = SandboxDNS
	}
	if len(l.cfg.TrustCA) > 0 && cfg.TrustBundle == "" {
		cfg.TrustBundle = SandboxTrustBundle
		if !l.google && l.cfg.Rootfs == "" {
			cfg.TrustCA = SandboxTrustCA
		}
	}
	return cfg
}

// Capture reports whether the launcher's sandboxes are to capture the
// connections of processes that ignore the proxy (LauncherConfig.Capture).
func (l *Launcher) Capture() bool { return l.cfg.Capture }

// Google reports whether a launcher of this configuration drives Cloud
// Run's sandbox CLI: CLI is a program named sandbox, or CLI is unset and
// Google's is installed.
func (cfg LauncherConfig) Google() bool {
	if cfg.CLI != "" {
		return filepath.Base(cfg.CLI) == "sandbox"
	}
	return fileExists(GoogleCLI)
}

// Google reports whether the launcher drives Cloud Run's sandbox CLI.
func (l *Launcher) Google() bool { return l.google }

// String names the CLI, for logs.
func (l *Launcher) String() string { return strings.Join(l.argv, " ") }

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

// LaunchOptions are what the sandbox CLI starts a new sandbox from.
type LaunchOptions struct {
	// ImportTar is a layer tar to start the writable layer from: a
	// snapshot being resumed, or a template. `sandgate sandbox` takes it
	// bare, zstd or gzip; Google's CLI bare only (see BareImports).
	ImportTar string
	// Template is a template of `sandgate sandbox` (ImportTemplate)
	// mounted beneath the sandbox's own layer. Google's CLI has none.
	Template string
	// Limits are the sandbox's (`sandgate sandbox`; Cloud Run limits the
	// instance); a zero field means the launcher's own setting, if any.
	Limits Limits
}

// Create starts sandbox id, detached, with a writable root and the agent
// binary mounted at AgentPath. Its main process is `sandgate agent --idle`,
// which holds the sandbox open and reaps orphans; the service's agent is
// started with Agent.
func (l *Launcher) Create(ctx context.Context, id string, opts LaunchOptions) error {
	if err := sandboxcli.CheckID(id); err != nil {
		return err
	}
	args := []string{"run", id, "--detach", "--write",
		"--mount", "type=bind,source=" + l.agent + ",destination=" + AgentPath + ",readonly"}
	if opts.ImportTar != "" {
		if l.google {
			if err := checkBareTar(opts.ImportTar); err != nil {
				return err
			}
		}
		args = append(args, "--import-tar="+opts.ImportTar)
	}
	if opts.Template != "" {
		if l.google {
			return fmt.Errorf("%w: Google's sandbox CLI has no templates: import the template's layer (ImportTar)", sandboxcli.ErrBadInput)
		}
		args = append(args, "--template", opts.Template)
	}
	if !l.google {
		if opts.Limits.Memory > 0 {
			args = append(args, "--memory", fmt.Sprint(opts.Limits.Memory))
		} else if l.cfg.Memory != "" {
			args = append(args, "--memory", l.cfg.Memory)
		}
		if opts.Limits.Pids > 0 {
			args = append(args, "--pids", fmt.Sprint(opts.Limits.Pids))
		} else if l.cfg.Pids > 0 {
			args = append(args, "--pids", fmt.Sprint(l.cfg.Pids))
		}
		if opts.Limits.CPU > 0 {
			args = append(args, "--cpus", strconv.FormatFloat(opts.Limits.CPU, 'f', -1, 64))
		}
		if opts.Limits.CPUWeight > 0 {
			args = append(args, "--cpu-weight", strconv.Itoa(opts.Limits.CPUWeight))
		}
		if l.cfg.SandboxesCPUWeight > 0 {
			args = append(args, "--sandboxes-cpu-weight", strconv.Itoa(l.cfg.SandboxesCPUWeight))
		}
		if opts.Limits.Disk > 0 {
			args = append(args, "--disk", fmt.Sprint(opts.Limits.Disk))
		}
		if l.cfg.Rootfs != "" {
			args = append(args, "--rootfs", l.cfg.Rootfs)
		}
		for _, p := range l.cfg.Hide {
			args = append(args, "--mask", p)
		}
		if l.cfg.UserNS != "" {
			args = append(args, "--userns", l.cfg.UserNS)
		}
		if l.caFile != "" {
			args = append(args, "--ca-cert", l.caFile)
		}
	} else {
		covers, err := l.covers(id)
		if err != nil {
			return err
		}
		args = append(args, covers...)
		for _, b := range [][2]string{{l.bundleFile, SandboxTrustBundle}, {l.resolvFile, "/etc/resolv.conf"}} {
			if b[0] != "" {
				args = append(args, "--mount", "type=bind,source="+b[0]+",destination="+b[1]+",readonly")
			}
		}
	}
	args = append(args, "--stdin=false", "--", AgentPath, "agent", "--idle")
	return l.do(ctx, args...)
}

// BareImports reports whether the CLI must be given a bare (uncompressed)
// tar to import. Google's reference calls the file of --import-tar a
// "tarball" and says nothing of compression, so its CLI is given nothing
// else; `sandgate sandbox` also takes zstd and gzip.
func (l *Launcher) BareImports() bool { return l.google }

// checkBareTar refuses a compressed layer for Google's CLI, before it runs.
func checkBareTar(file string) error {
	f, err := os.Open(file)
	if err != nil {
		return fmt.Errorf("%w: the layer to import: %v", sandboxcli.ErrBadInput, err)
	}
	defer f.Close()
	head := make([]byte, 4)
	n, _ := io.ReadFull(f, head)
	for _, magic := range [][]byte{{0x28, 0xb5, 0x2f, 0xfd}, {0x1f, 0x8b}} {
		if bytes.HasPrefix(head[:n], magic) {
			return fmt.Errorf("%w: %s is compressed; Google's sandbox CLI is given bare tars only: decompress it first (snapshot.Decompress)", sandboxcli.ErrBadInput, file)
		}
	}
	return nil
}

// Tar writes the writable layer of sandbox id to file, as a layer tar.
func (l *Launcher) Tar(ctx context.Context, id, file string) error {
	return l.do(ctx, "tar", id, "--file="+file)
}

// TarStream streams the writable layer of sandbox id as a layer tar: read
// it to EOF, then Close, which reports how the CLI ended (a stream cut
// short by a failing CLI can look like a shorter layer: trust nothing read
// until Close returned nil). `sandgate sandbox` writes it to a pipe;
// Google's CLI writes a file in dir, which the stream reads and removes:
// a path that does not exist yet, in a directory of its own, since its
// reference does not say whether `tar` overwrites a file.
func (l *Launcher) TarStream(ctx context.Context, id, dir string) (io.ReadCloser, error) {
	if l.google {
		d, err := os.MkdirTemp(dir, "layer-"+id+"-*")
		if err != nil {
			return nil, err
		}
		name := filepath.Join(d, "layer.tar")
		if err := l.Tar(ctx, id, name); err != nil {
			os.RemoveAll(d)
			return nil, err
		}
		r, err := os.Open(name)
		if err != nil {
			os.RemoveAll(d)
			return nil, err
		}
		return &layerFile{File: r, dir: d}, nil
	}
	args := []string{"tar", id, "--file=-"}
	cmd := l.command(ctx, args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	msgs := &limitedBuffer{}
	cmd.Stderr = msgs
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &layerPipe{ReadCloser: out, wait: func() error {
		err := cmd.Wait()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("sandbox tar: %w", context.Cause(ctx))
		}
		msg := strings.TrimSpace(msgs.String())
		if msg == "" {
			msg = err.Error()
		}
		return &CLIError{Verb: args[0], Args: args[1:], Output: msg, Err: err, Kind: l.kind(err)}
	}}, nil
}

// layerPipe is the CLI's standard output; Close waits for the CLI.
type layerPipe struct {
	io.ReadCloser
	wait func() error
}

func (p *layerPipe) Close() error {
	p.ReadCloser.Close()
	return p.wait()
}

// layerFile is a layer the CLI wrote to a file in a temporary directory,
// removed on Close.
type layerFile struct {
	*os.File
	dir string
}

func (f *layerFile) Close() error {
	f.File.Close()
	return os.RemoveAll(f.dir)
}

// Fork starts sandbox dst, detached, from a copy of src's writable layer.
func (l *Launcher) Fork(ctx context.Context, src, dst string) error {
	if err := sandboxcli.CheckID(dst); err != nil {
		return err
	}
	return l.do(ctx, "fork", src, dst, "--detach")
}

// Templates reports whether the CLI keeps templates (`sandgate sandbox`
// does; Google's imports one tar per sandbox instead).
func (l *Launcher) Templates() bool { return !l.google }

// ImportTemplate makes layer file (a layer tar, any compression) template
// name of `sandgate sandbox`.
func (l *Launcher) ImportTemplate(ctx context.Context, name, file string) error {
	if l.google {
		return fmt.Errorf("%w: Google's sandbox CLI has no templates", sandboxcli.ErrBadInput)
	}
	return l.do(ctx, "template", "import", name, "--file="+file)
}

// RemoveTemplate removes template name of `sandgate sandbox`.
func (l *Launcher) RemoveTemplate(ctx context.Context, name string) error {
	if l.google {
		return nil
	}
	return l.do(ctx, "template", "rm", name)
}

// ListTemplates lists the templates of `sandgate sandbox` (none for
// Google's CLI).
func (l *Launcher) ListTemplates(ctx context.Context) ([]string, error) {
	if l.google {
		return nil, nil
	}
	out, err := l.output(ctx, "template", "ls")
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(out)), nil
}

// List lists the sandboxes the CLI knows, with their state, for a service
// that restarts to find what it left (`sandgate sandbox list --json`).
// Google's CLI keeps no sandbox beyond its instance: nil there.
func (l *Launcher) List(ctx context.Context) ([]sandboxcli.Info, error) {
	if l.google {
		return nil, nil
	}
	out, err := l.output(ctx, "list", "--json")
	if err != nil {
		return nil, err
	}
	var infos []sandboxcli.Info
	if err := json.Unmarshal(out, &infos); err != nil {
		return nil, fmt.Errorf("sandbox list --json: %w", err)
	}
	return infos, nil
}

// Delete stops every process of sandbox id and removes it. A sandbox that
// is not there is ErrNotFound: from the exit status of `sandgate sandbox`;
// with Google's CLI, whose every failure exits 1, when the delete failed
// and the sandbox cannot run anything either (see Gone).
func (l *Launcher) Delete(ctx context.Context, id string) error {
	err := l.do(ctx, "delete", id, "--force")
	var ce *CLIError
	if l.google && errors.As(err, &ce) && ce.Kind == nil && l.Gone(ctx, id) {
		ce.Kind = ErrNotFound
	}
	if l.google && (err == nil || errors.Is(err, ErrNotFound)) {
		l.removeCovers(id)
	}
	return err
}

// coverDir holds the empty directories and files bound over Hide in
// sandbox id (Google's CLI).
func (l *Launcher) coverDir(id string) string {
	return filepath.Join(cmp.Or(l.cfg.PrivateDir, os.TempDir()), "covers", id)
}

// covers makes sandbox id's covers of Hide and returns the CLI's
// --mount flags binding them over it, read-only. A path of Hide that does
// not exist needs none. Each sandbox has covers of its own, so that, were
// a bind writable after all (the reference does not document
// ",readonly"), nothing written there reaches another sandbox.
func (l *Launcher) covers(id string) ([]string, error) {
	var args []string
	dir := l.coverDir(id)
	for i, p := range l.cfg.Hide {
		fi, err := os.Stat(p)
		if err != nil {
			continue
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("launcher: covers of %s: %w", p, err)
		}
		src := filepath.Join(dir, strconv.Itoa(i))
		if fi.IsDir() {
			err = os.Mkdir(src, 0o555)
		} else {
			err = os.WriteFile(src, nil, 0o444)
		}
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("launcher: covers of %s: %w", p, err)
		}
		args = append(args, "--mount", "type=bind,source="+src+",destination="+p+",readonly")
	}
	return args, nil
}

// removeCovers removes what covers made for sandbox id.
func (l *Launcher) removeCovers(id string) {
	_ = os.RemoveAll(l.coverDir(id))
}

// Gone reports whether sandbox id can be taken as not there (or not
// running) after one of its verbs failed with Google's CLI, which exits 1
// for every failure and whose messages are no interface: the CLI cannot
// run even `sandgate version` (the binary mounted in every sandbox the
// launcher starts) in it. A second observation, never a status: the
// caller may then stop restarting its agent, or forget it. With
// `sandgate sandbox`, whose statuses say it, Gone is always false.
func (l *Launcher) Gone(ctx context.Context, id string) bool {
	if !l.google || ctx.Err() != nil {
		return false
	}
	_, err := l.run(ctx, nil, "exec", id, "--", AgentPath, "version")
	var ce *CLIError
	return errors.As(err, &ce)
}

// cliOutputMax bounds what is kept of a CLI's output for an error message.
const cliOutputMax = 4 << 10

// do runs one CLI verb to completion. Its output is kept (bounded) to
// explain a failure.
func (l *Launcher) do(ctx context.Context, args ...string) error {
	_, err := l.run(ctx, nil, args...)
	return err
}

// output runs one CLI verb and returns what it printed on its standard
// output; its standard error explains a failure.
func (l *Launcher) output(ctx context.Context, args ...string) ([]byte, error) {
	var out bytes.Buffer
	return l.run(ctx, &out, args...)
}

// run runs one CLI verb to completion, its standard output into stdout
// (nil: kept with its standard error, bounded, to explain a failure).
func (l *Launcher) run(ctx context.Context, stdout *bytes.Buffer, args ...string) ([]byte, error) {
	start := time.Now()
	cmd := l.command(ctx, args...)
	var msgs limitedBuffer
	cmd.Stdout, cmd.Stderr = &msgs, &msgs
	if stdout != nil {
		cmd.Stdout = stdout
	}
	err := cmd.Run()
	l.log.Debug("sandbox cli", "args", args, "took", time.Since(start), "err", err)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("sandbox %s: %w", args[0], context.Cause(ctx))
		}
		msg := strings.TrimSpace(msgs.String())
		if msg == "" {
			msg = err.Error()
		}
		return nil, &CLIError{Verb: args[0], Args: args[1:], Output: msg, Err: err, Kind: l.kind(err)}
	}
	if stdout == nil {
		return nil, nil
	}
	return stdout.Bytes(), nil
}

// kind is the sentinel a CLI process's exit stands for: the table of
// `sandgate sandbox` (sandboxcli.ExitCode), nothing for Google's CLI.
func (l *Launcher) kind(err error) error {
	var ee *exec.ExitError
	if l.google || !errors.As(err, &ee) {
		return nil
	}
	return sandboxcli.ErrorForExit(ee.ExitCode())
}

func (l *Launcher) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, l.argv[0], append(l.argv[1:len(l.argv):len(l.argv)], args...)...)
	cmd.Env = l.env
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// Errors a Launcher or a Sandbox reports, to branch on with errors.Is.
// They are the sentinels of `sandgate sandbox` (package localbox) itself,
// one value under two names: a failure typed by the runtime in process and
// one typed from the CLI's exit status match the same target.
var (
	// ErrBadInput: the caller's mistake (a bad id, mount, size or option);
	// nothing was changed.
	ErrBadInput = sandboxcli.ErrBadInput
	// ErrNotFound: no sandbox has that id.
	ErrNotFound = sandboxcli.ErrNotFound
	// ErrExists: create or fork named an id that is already taken.
	ErrExists = sandboxcli.ErrExists
	// ErrBusy: the sandbox is being created or deleted by another process.
	ErrBusy = sandboxcli.ErrBusy
	// ErrNotRunning: the sandbox stopped or crashed (its agent cannot start).
	ErrNotRunning = sandboxcli.ErrNotRunning
	// ErrRunning: the sandbox still runs (a delete without force).
	ErrRunning = sandboxcli.ErrRunning
)

// CLIError is a sandbox CLI verb that failed, with what the CLI said.
type CLIError struct {
	Verb   string
	Args   []string
	Output string // what the CLI printed (bounded), for messages
	Err    error  // how the process ended (*exec.ExitError)
	// Kind is what the failure means (ErrNotFound, ErrExists, ...), from
	// the exit status of `sandgate sandbox`; nil when unknown (any other
	// failure, and every failure of Google's CLI).
	Kind error
}

func (e *CLIError) Error() string {
	return fmt.Sprintf("sandbox %s %s: %s", e.Verb, strings.Join(e.Args, " "), e.Output)
}

// Unwrap makes errors.Is see both how the process ended and what it means.
func (e *CLIError) Unwrap() []error {
	if e.Kind == nil {
		return []error{e.Err}
	}
	return []error{e.Err, e.Kind}
}

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
