package localbox

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/snapshot"
)

// RunOptions configures Run.
type RunOptions struct {
	Config
	// ImportTar, when set, is a layer (any compression the snapshot
	// package reads) applied as the sandbox's upper before it starts.
	ImportTar string
	// Stdio connects run's command; nil files mean /dev/null.
	Stdio Stdio
}

// startTimeout bounds how long the init may take to come up.
const startTimeout = 30 * time.Second

// Run creates the sandbox opts.ID and starts opts.Cmd in it. It returns
// once the init is up and the command started; the sandbox outlives the
// caller (call Detach on the Process to let go of the command, or Wait for
// its exit code). When the command exits the sandbox stops.
func (m *Runtime) Run(ctx context.Context, opts RunOptions) (*Process, error) {
	cfg := opts.Config
	cfg.Created = time.Now().UTC()
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if err := CheckImage(cfg.Rootfs, append([]string{m.dir}, cfg.Masks...)); err != nil {
		return nil, err
	}
	if err := m.checkMounts(&cfg); err != nil {
		return nil, err
	}
	if err := m.useTemplate(&cfg); err != nil {
		return nil, err
	}
	fill := func(upper string) error {
		if opts.ImportTar == "" {
			return os.Mkdir(upper, 0o755)
		}
		f, err := os.Open(opts.ImportTar)
		if err != nil {
			return fmt.Errorf("%w: --import-tar: %v", ErrBadInput, err)
		}
		defer f.Close()
		if _, err := snapshot.Unpack(ctx, f, upper, snapshot.ApplyOptions{Mode: snapshot.ModeUpper, Trusted: true}); err != nil {
			return fmt.Errorf("--import-tar %s: %w", opts.ImportTar, err)
		}
		return nil
	}
	return m.create(ctx, &cfg, fill, opts.Stdio)
}

// ExecOptions configures Exec.
type ExecOptions struct {
	Cmd   []string
	Env   []string // K=V, over the sandbox's own (run's -e)
	Dir   string   // "" means run's working directory
	Stdio Stdio
}

// Exec starts a command in the running sandbox id, in its namespaces,
// root, cgroup and containment, connected to opts.Stdio as file
// descriptors.
func (m *Runtime) Exec(ctx context.Context, id string, opts ExecOptions) (*Process, error) {
	if err := CheckID(id); err != nil {
		return nil, err
	}
	if len(opts.Cmd) == 0 || opts.Cmd[0] == "" {
		return nil, fmt.Errorf("%w: no command: put it after --", ErrBadInput)
	}
	if err := checkEnv(opts.Env); err != nil {
		return nil, err
	}
	if err := checkDir(opts.Dir); err != nil {
		return nil, err
	}
	inf, cfg, _, err := m.info(id)
	if err != nil {
		return nil, err
	}
	if inf.State == Creating { // or being deleted: the lock is held either way
		return nil, fmt.Errorf("%w: %q is being created or deleted", ErrBusy, id)
	}
	if inf.State != Running {
		return nil, fmt.Errorf("%w: %q is %s", ErrNotRunning, id, inf.State)
	}
	dir := opts.Dir
	if dir == "" {
		dir = cfg.Dir
	}
	return start(ctx, m.sandboxDir(id), request{Op: "exec", Argv: opts.Cmd, Env: mergeEnv(cfg.Env, opts.Env), Dir: dir}, opts.Stdio)
}

// Tar writes the sandbox's writable layer (its overlay upper) to w as a
// snapshot layer and returns its manifest. /tmp and the mount points of
// the sandbox are never in it. A running sandbox is frozen (cgroup
// freezer, where there is one) while the layer is read.
func (m *Runtime) Tar(ctx context.Context, id string, w io.Writer, opts snapshot.PackOptions) (*snapshot.Manifest, error) {
	if err := CheckID(id); err != nil {
		return nil, err
	}
	inf, cfg, rs, err := m.info(id)
	if err != nil {
		return nil, err
	}
	if inf.State == Creating {
		return nil, fmt.Errorf("%w: %q is being created", ErrBusy, id)
	}
	if cfg == nil {
		return nil, fmt.Errorf("%w: %q has no configuration (its creation failed); delete it", ErrNotFound, id)
	}
	if err := ensureLayer(m.sandboxDir(id), cfg); err != nil {
		return nil, err
	}
	if inf.State == Running && rs != nil {
		cg := &cgroups{dirs: rs.Cgroups, v2: rs.CgroupV2}
		thaw, _, err := cg.freeze(ctx)
		if err != nil {
			return nil, err
		}
		defer thaw()
	}
	if opts.SandboxID == "" {
		opts.SandboxID = id
	}
	return snapshot.Pack(ctx, filepath.Join(layerRoot(m.sandboxDir(id), cfg), upperDir), w, opts)
}

// Fork creates sandbox dst like src (same rootfs, mounts, environment,
// limits and command) with a copy of src's upper, and starts it. src may
// be running: it is frozen while its upper is copied.
func (m *Runtime) Fork(ctx context.Context, src, dst string, stdio Stdio) (*Process, error) {
	if err := CheckID(src); err != nil {
		return nil, err
	}
	if err := CheckID(dst); err != nil {
		return nil, err
	}
	_, srcCfg, _, err := m.info(src)
	if err != nil {
		return nil, err
	}
	if srcCfg == nil {
		return nil, fmt.Errorf("%w: %q has no configuration (its creation failed); delete it", ErrNotFound, src)
	}
	cfg := *srcCfg
	cfg.ID = dst
	cfg.Created = time.Now().UTC()
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if err := CheckImage(cfg.Rootfs, append([]string{m.dir}, cfg.Masks...)); err != nil {
		return nil, err
	}
	if err := m.checkMounts(&cfg); err != nil {
		return nil, err
	}
	if err := m.useTemplate(&cfg); err != nil {
		return nil, err
	}
	fill := func(upper string) error {
		pr, pw := io.Pipe()
		packed := make(chan error, 1)
		go func() {
			_, err := m.Tar(ctx, src, pw, snapshot.PackOptions{Compression: snapshot.None})
			pw.CloseWithError(err)
			packed <- err
		}()
		_, err := snapshot.Unpack(ctx, pr, upper, snapshot.ApplyOptions{Mode: snapshot.ModeUpper, Trusted: true})
		pr.CloseWithError(errors.New("fork: copy ended"))
		if perr := <-packed; perr != nil {
			return fmt.Errorf("fork: read %q: %w", src, perr)
		}
		return err
	}
	return m.create(ctx, &cfg, fill, stdio)
}

// create makes the sandbox's directory, fills its upper, starts its init
// and run's command. On failure it leaves nothing behind.
func (m *Runtime) create(ctx context.Context, cfg *Config, fill func(upper string) error, stdio Stdio) (_ *Process, err error) {
	dir := m.sandboxDir(cfg.ID)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("%w: %q (delete it first, or pick another id)", ErrExists, cfg.ID)
		}
		return nil, err
	}
	lock, err := lockSandbox(dir)
	if err != nil {
		os.Remove(dir)
		return nil, err
	}
	defer lock.Close()
	var cg *cgroups
	var monitor *os.Process
	initPidfd := -1
	defer func() {
		if initPidfd >= 0 {
			if err != nil {
				_ = unix.PidfdSendSignal(initPidfd, unix.SIGKILL, nil, 0)
			}
			unix.Close(initPidfd)
		}
		if err == nil {
			return
		}
		if monitor != nil {
			_ = monitor.Kill()
		}
		if cg != nil {
			_ = cg.remove(context.WithoutCancel(ctx))
		}
		_ = unmountLayer(dir)
		_ = os.RemoveAll(dir)
	}()
	if cfg.Disk > 0 {
		if err := m.makeLayer(ctx, dir, cfg.Disk); err != nil {
			return nil, err
		}
	}
	layer := layerRoot(dir, cfg)
	if err := fill(filepath.Join(layer, upperDir)); err != nil {
		return nil, noSpace(err, cfg, "the layer it starts from")
	}
	if err := os.Mkdir(filepath.Join(layer, workDir), 0o700); err != nil {
		return nil, noSpace(err, cfg, "its work directory")
	}
	for _, d := range []string{rootDir, scaffoldDir} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			return nil, err
		}
	}
	cgParent, cgName := m.cgroupNames(cfg.ID)
	if cg, err = newCgroups(cgParent, cgName, cfg.cgroupLimits()); err != nil {
		return nil, err
	}
	if err := writeJSON(filepath.Join(dir, configFile), cfg); err != nil {
		return nil, err
	}
	rs := runState{Cgroups: cg.dirs, CgroupV2: cg.v2}
	if cfg.UserNS != UserNSOff {
		if rs.IDBase, err = allocIDs(dir); err != nil {
			if cfg.UserNS == UserNSOn {
				return nil, err
			}
			rs.IDBase = 0
		} else {
			defer func() {
				if err != nil {
					releaseIDs(dir, rs.IDBase)
				}
			}()
		}
	}
	if err := writeJSON(filepath.Join(dir, stateFile), &rs); err != nil {
		return nil, err
	}
	lnFile, err := listen(dir)
	if err != nil {
		return nil, err
	}
	defer lnFile.Close()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	child := os.NewFile(uintptr(pair[1]), "link")
	parent := os.NewFile(uintptr(pair[0]), "link")
	link, err := net.FileConn(parent)
	parent.Close() // FileConn dup'ed it
	if err != nil {
		child.Close()
		return nil, err
	}
	defer link.Close()
	logf, err := os.OpenFile(filepath.Join(dir, logFile), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		child.Close()
		return nil, err
	}
	defer logf.Close()
	// The monitor: this binary again, on the host, in a session of its
	// own; it starts the init in the sandbox's namespaces (see monitor.go).
	cmd := &exec.Cmd{
		Path:        m.exe,
		Args:        []string{"sandgate-sandbox-monitor", cfg.ID},
		Env:         []string{initEnv + "=0", dirEnv + "=" + dir, runtimeEnv},
		Stdout:      logf,
		Stderr:      logf,
		ExtraFiles:  []*os.File{child, lnFile},
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	err = cmd.Start()
	child.Close()
	if err != nil {
		return nil, fmt.Errorf("start the sandbox's monitor: %w", err)
	}
	monitor = cmd.Process
	go cmd.Wait() // reaps the monitor if it ends while this process lives; ends with it
	ctx2, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	if dl, ok := ctx2.Deadline(); ok {
		link.SetDeadline(dl)
	}
	buf := make([]byte, 4096)
	n, err := link.Read(buf)
	if err != nil {
		return nil, fmt.Errorf("the sandbox's monitor did not start the init: %v (see %s)", err, filepath.Join(dir, logFile))
	}
	pidStr, ok := strings.CutPrefix(string(buf[:n]), "pid ")
	pidStr, userns := strings.CutSuffix(pidStr, " userns")
	initPid, perr := strconv.Atoi(pidStr)
	if !ok || perr != nil {
		return nil, fmt.Errorf("the sandbox's init failed: %s", strings.TrimPrefix(string(buf[:n]), "error: "))
	}
	// A pidfd pins the init for the cleanup below: its parent, the
	// monitor, may reap it (and its pid be reused) at any time.
	if initPidfd, err = unix.PidfdOpen(initPid, 0); err != nil {
		return nil, fmt.Errorf("the sandbox's init: %w", err)
	}
	if err := cg.add(initPid); err != nil {
		return nil, err
	}
	if _, err := link.Write([]byte("go")); err != nil {
		return nil, fmt.Errorf("start the sandbox's init: %w", err)
	}
	n, err = link.Read(buf)
	if err != nil {
		return nil, fmt.Errorf("the sandbox's init did not come up: %v (see %s)", err, filepath.Join(dir, logFile))
	}
	if msg := string(buf[:n]); msg != "ok" {
		return nil, fmt.Errorf("the sandbox's init failed: %s", strings.TrimPrefix(msg, "error: "))
	}
	st, _, err := procStartTime(initPid)
	if err != nil {
		return nil, err
	}
	mst, _, err := procStartTime(monitor.Pid)
	if err != nil {
		return nil, err
	}
	rs.Pid, rs.StartTime, rs.UserNS = initPid, st, userns
	rs.MonitorPid, rs.MonitorStartTime = monitor.Pid, mst
	if err := writeJSON(filepath.Join(dir, stateFile), &rs); err != nil {
		return nil, err
	}
	p, err := start(ctx, dir, request{Op: "exec", Argv: cfg.Cmd, Env: mergeEnv(cfg.Env, nil), Dir: cfg.Dir, Main: true}, stdio)
	if err != nil {
		return nil, err
	}
	return p, nil
}

// listen binds the sandbox's control socket and returns it as a file for
// the init.
func listen(dir string) (*os.File, error) {
	addr, done, err := sockAddr(dir)
	if err != nil {
		return nil, err
	}
	defer done()
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: addr, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	defer ln.Close()
	return ln.File()
}

// Delete stops the sandbox id (every process of it), removes its cgroups
// and its directory. Without force it refuses a running sandbox. With
// force it always cleans, whatever state a crash left.
func (m *Runtime) Delete(ctx context.Context, id string, force bool) error {
	if err := CheckID(id); err != nil {
		return err
	}
	dir := m.sandboxDir(id)
	if _, err := os.Stat(dir); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		return err
	}
	lock, err := lockSandbox(dir)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			return fmt.Errorf("%w: %q", ErrNotFound, id)
		}
		if !force {
			return err
		}
		// A lock file the state directory lost, or a stuck creator: force
		// goes on without it.
	} else {
		defer lock.Close()
	}
	var rs runState
	_ = readJSON(filepath.Join(dir, stateFile), &rs)
	_, statErr := os.Stat(filepath.Join(dir, stoppedFile))
	if rs.alive() {
		if statErr != nil && !force {
			return fmt.Errorf("%w: %q (delete --force stops it)", ErrRunning, id)
		}
		if err := killInit(ctx, &rs); err != nil {
			return err
		}
	}
	if err := endMonitor(ctx, &rs); err != nil {
		return err
	}
	var errs []error
	cg := &cgroups{dirs: rs.Cgroups, v2: rs.CgroupV2}
	if err := cg.remove(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := unmountUnder(dir); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, err)
	} else {
		releaseIDs(dir, rs.IDBase)
	}
	return errors.Join(errs...)
}

// killInit kills a sandbox's init, which takes every process of its pid
// namespace with it, and waits until it is gone.
func killInit(ctx context.Context, rs *runState) error {
	pfd, err := unix.PidfdOpen(rs.Pid, 0)
	if err == nil {
		defer unix.Close(pfd)
		if rs.alive() { // still ours after the pidfd pinned it
			if err := unix.PidfdSendSignal(pfd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("kill the sandbox's init: %w", err)
			}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for delay := 100 * time.Microsecond; rs.alive(); delay = min(2*delay, 20*time.Millisecond) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the sandbox's init (pid %d) did not die: %w", rs.Pid, context.Cause(ctx))
		case <-time.After(delay):
		}
	}
	return nil
}

// monitorGrace is how long Delete lets a monitor end by itself once its
// init is gone (it only writes what is left of the log).
const monitorGrace = 2 * time.Second

// endMonitor waits for the monitor of a sandbox whose init is gone to exit,
// and kills it if it does not within monitorGrace, so that delete leaves no
// process behind.
func endMonitor(ctx context.Context, rs *runState) error {
	if !rs.monitorAlive() {
		return nil
	}
	pfd, err := unix.PidfdOpen(rs.MonitorPid, 0)
	if err != nil {
		return nil // gone meanwhile
	}
	defer unix.Close(pfd)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	killed := false
	grace := time.Now().Add(monitorGrace)
	for delay := 100 * time.Microsecond; rs.monitorAlive(); delay = min(2*delay, 20*time.Millisecond) {
		if !killed && time.Now().After(grace) {
			killed = true
			if err := unix.PidfdSendSignal(pfd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("kill the sandbox's monitor: %w", err)
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the sandbox's monitor (pid %d) did not end: %w", rs.MonitorPid, context.Cause(ctx))
		case <-time.After(delay):
		}
	}
	return nil
}

// unmountUnder detaches any mount left under dir in this mount namespace.
// Sandboxes mount only in their own namespace, so this finds nothing
// unless someone mounted there by hand.
func unmountUnder(dir string) error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 {
			if p := unescapeMount(fields[4]); strings.HasPrefix(p, dir+"/") {
				points = append(points, p)
			}
		}
	}
	var errs []error
	for i := len(points) - 1; i >= 0; i-- {
		if err := unix.Unmount(points[i], unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", points[i], err))
		}
	}
	return errors.Join(errs...)
}
