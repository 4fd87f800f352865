package localbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/signal"
	"path"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The monitor and the init are this binary re-executed with initEnv set:
// "0" for the monitor (on the host, the init's parent), "1" for the init's
// first stage (joins the cgroup namespace, then re-executes itself), "2"
// for the init proper.
const (
	initEnv = "_SANDGATE_LOCALBOX_INIT"
	dirEnv  = "_SANDGATE_LOCALBOX_DIR"
	// cfgEnv carries the init's initConfig (JSON): with a user namespace
	// the init cannot read the state directory, and it needs none of it.
	cfgEnv = "_SANDGATE_LOCALBOX_CONFIG"
	// Descriptors a stage hands the next. linkFD is a SOCK_SEQPACKET
	// link: creator ↔ monitor in the monitor, monitor ↔ init in the init
	// ("go" in, "ok" or an error out, then "stopped <code>" from the init
	// and "ok" back once stopped.json is written).
	linkFD     = 3
	listenerFD = 4 // the bound ctl.sock listener
)

// initConfig is what the init needs of the sandbox's Config.
type initConfig struct {
	ID      string `json:"id"`
	ShmSize int64  `json:"shmSize"`
	// UserNS: the init runs in a user namespace (so it cannot exempt
	// itself from the OOM killer; see commandOOMScoreAdj).
	UserNS bool `json:"userns,omitempty"`
}

// runtimeEnv keeps the Go runtime of the monitor and the init from opening
// the host's cgroup CPU files: since Go 1.25 it holds them open for the
// life of the process to track GOMAXPROCS, and a descriptor the init holds
// is one more host file a sandbox could reach.
const runtimeEnv = "GODEBUG=containermaxprocs=0,updatemaxprocs=0"

// IsInit reports whether this process is a sandbox's monitor or init,
// re-executed by Run or Fork. A program that uses this package must then
// call InitMain before doing anything else (before parsing its command
// line).
func IsInit() bool { return os.Getenv(initEnv) != "" }

// InitMain runs a sandbox's monitor or init and never returns. Call it
// only when IsInit is true.
func InitMain() {
	var err error
	switch os.Getenv(initEnv) {
	case "0":
		err = monitorMain()
	case "1":
		err = stage1()
	case "2":
		err = stage2()
	default:
		err = fmt.Errorf("%s=%q: not a sandbox init", initEnv, os.Getenv(initEnv))
	}
	msg := "error: " + err.Error()
	fmt.Fprintf(os.Stderr, "sandgate sandbox init: %v\n", err)
	_ = sendLink(linkFD, msg)
	os.Exit(1)
}

// sendLink writes one message on a link without raising SIGPIPE when the
// other side is gone.
func sendLink(fd int, msg string) error {
	return unix.Sendto(fd, []byte(msg), unix.MSG_NOSIGNAL, nil)
}

// readLink reads one message from a link, waiting at most timeout
// (negative: without bound).
func readLink(fd int, timeout time.Duration) (string, error) {
	if timeout >= 0 {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			n, err := unix.Poll(pfd, int(timeout.Milliseconds()))
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				return "", err
			}
			if n == 0 {
				return "", fmt.Errorf("no answer within %v", timeout)
			}
			break
		}
	}
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return "", err
		}
		if n == 0 {
			return "", io.EOF
		}
		return string(buf[:n]), nil
	}
}

// stage1 waits until the creating process has moved it into the sandbox's
// cgroups, then enters a new cgroup namespace rooted there and re-executes
// itself: unshare only changes the calling thread, and execve from that
// thread makes the whole new image start inside the namespace.
func stage1() error {
	runtime.LockOSThread()
	_ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
	keepOnlyOwnFDs(listenerFD)
	if msg, err := readLink(linkFD, -1); err != nil || msg != "go" {
		return fmt.Errorf("waiting for the go-ahead: %q, %v", msg, err)
	}
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("cgroup namespace: %w", err)
	}
	env := []string{initEnv + "=2", cfgEnv + "=" + os.Getenv(cfgEnv), runtimeEnv}
	return fmt.Errorf("re-exec: %w", syscall.Exec("/proc/self/exe", os.Args, env))
}

// oomScoreAdj sets the OOM killer's adjustment of process pid ("self" for
// this one).
func oomScoreAdj(pid string, v int) error {
	if err := os.WriteFile("/proc/"+pid+"/oom_score_adj", []byte(strconv.Itoa(v)), 0); err != nil {
		return fmt.Errorf("oom_score_adj: %w", err)
	}
	return nil
}

// commandOOMScoreAdj makes the init exempt from the OOM killer where the
// host allows it and returns the oom_score_adj its commands get: 1000 above
// the init's own, at most 1000.
//
// In a user namespace the init's capabilities count only there, and the
// exemption needs CAP_SYS_RESOURCE on the host: it is not asked for.
func commandOOMScoreAdj(userns bool) (int, error) {
	if userns {
		// -1000 is refused; nothing to ask.
	} else if err := oomScoreAdj("self", -1000); err != nil {
		if !errors.Is(err, fs.ErrPermission) {
			return 0, err
		}
		fmt.Fprintln(os.Stderr, "sandgate sandbox init: no CAP_SYS_RESOURCE: the init cannot be exempt from the OOM killer; its commands run at oom_score_adj +1000 instead")
	}
	b, err := os.ReadFile("/proc/self/oom_score_adj")
	if err != nil {
		return 0, fmt.Errorf("oom_score_adj: %w", err)
	}
	own, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("oom_score_adj %q: %w", b, err)
	}
	return min(own+1000, 1000), nil
}

func stage2() error {
	// Not dumpable, before anything of the sandbox exists: the kernel then
	// refuses every process without CAP_SYS_PTRACE (all of the sandbox's)
	// ptrace, /proc/1/task/*/{fd,environ,mem,exe,root,...} of every
	// thread of the init, including the one dropped to the sandbox's
	// capabilities. It is per process and only execve resets it, which the
	// init never calls again; commands become dumpable at their own execve.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE): %w", err)
	}
	keepOnlyOwnFDs(listenerFD)
	unix.CloseOnExec(linkFD)
	unix.CloseOnExec(listenerFD)
	var ic initConfig
	if err := json.Unmarshal([]byte(os.Getenv(cfgEnv)), &ic); err != nil {
		return fmt.Errorf("the init's configuration: %w", err)
	}
	// The OOM killer picks the largest process of the sandbox's memory
	// cgroup, which is the init (a Go program) unless it is told not to.
	// The init asks to be exempt (-1000); that needs CAP_SYS_RESOURCE, which
	// some hosts withhold even from root. Either way each command runs
	// 1000 above the init (see release): 0 beside an exempt init, else
	// +1000, so that a command is always chosen before the init.
	cmdAdj, err := commandOOMScoreAdj(ic.UserNS)
	if err != nil {
		return err
	}
	// Signals from inside the sandbox reach pid 1 only when it handles
	// them: handle (and drop) the ones that would otherwise end it. Ignoring
	// them instead would be inherited by every command.
	quiet := make(chan os.Signal, 8)
	signal.Notify(quiet, unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE, unix.SIGALRM, unix.SIGTSTP, unix.SIGTTIN, unix.SIGTTOU)
	go func() {
		for range quiet {
		}
	}()
	sigchld := make(chan os.Signal, 1)
	signal.Notify(sigchld, unix.SIGCHLD)

	unix.Umask(0)
	// The monitor started the init in its root (see startInit).
	rootFD, err := unix.Open(".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("the sandbox's root: %w", err)
	}
	err = setupRoot(&ic, rootFD)
	unix.Close(rootFD)
	if err != nil {
		return err
	}
	unix.Umask(0o022)
	// fd 0 was the host's /dev/null: the sandbox's own replaces it. fds 1
	// and 2 are a pipe to the monitor, which appends to init.log: the init
	// holds no host file once its root is the sandbox's.
	if null, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0); err == nil {
		_ = unix.Dup3(null, 0, 0)
		unix.Close(null)
	}
	policy, _, err := SeccompPolicy(Capabilities)
	if err != nil {
		return fmt.Errorf("seccomp profile: %w", err)
	}
	s := &server{procs: map[int]*proc{}, spawn: make(chan *spawnReq), poke: make(chan struct{}, 1), oomAdj: cmdAdj}
	ready := make(chan error, 1)
	go s.forker(ready, func() error {
		if err := dropCapabilities(); err != nil {
			return err
		}
		return loadSeccomp(policy)
	})
	if err := <-ready; err != nil {
		return err
	}
	lf := os.NewFile(listenerFD, "ctl.sock")
	ln, err := net.FileListener(lf)
	lf.Close()
	if err != nil {
		return fmt.Errorf("control socket: %w", err)
	}
	go s.reap(sigchld)
	if err := sendLink(linkFD, "ok"); err != nil {
		return err
	}
	for {
		c, err := ln.(*net.UnixListener).AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				select {} // stopping: stop() exits the process
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		s.wg.Add(1)
		go s.handle(c)
	}
}

// keepOnlyOwnFDs marks every descriptor above last, the last one passed
// on purpose, close-on-exec: a descriptor the creating process leaked to
// the monitor or the init (anything it had open without O_CLOEXEC) must
// never reach a command.
func keepOnlyOwnFDs(last int) {
	if err := unix.CloseRange(uint(last+1), ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		for fd := last + 1; fd < 1024; fd++ {
			unix.CloseOnExec(fd)
		}
	}
}

// escapeOverlay escapes an overlayfs option value.
func escapeOverlay(p string) string {
	return strings.NewReplacer(`\`, `\\`, `,`, `\,`, `:`, `\:`).Replace(p)
}

// rootFS opens paths beneath the new root without following any symlink,
// so that a symlink planted in the rootfs or an imported layer can never
// redirect a mount.
type rootFS struct {
	path string
	fd   int
}

func (r *rootFS) open(rel string, flags int) (int, error) {
	rel = strings.TrimPrefix(path.Clean("/"+rel), "/")
	if rel == "" {
		rel = "."
	}
	fd, err := unix.Openat2(r.fd, rel, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC),
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return -1, &fs.PathError{Op: "open in sandbox root", Path: "/" + rel, Err: err}
	}
	return fd, nil
}

func fdPath(fd int) string { return "/proc/self/fd/" + strconv.Itoa(fd) }

// mount mounts onto rel beneath the root.
func (r *rootFS) mount(source, rel, fstype string, flags uintptr, data string) error {
	fd, err := r.open(rel, unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Mount(source, fdPath(fd), fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", fstype+source, rel, err)
	}
	return nil
}

// setAttr sets mount attributes on the mount at rel (and, recursively,
// those below it).
func (r *rootFS) setAttr(rel string, attr uint64) error {
	fd, err := r.open(rel, unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	err = unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &unix.MountAttr{Attr_set: attr})
	if errors.Is(err, unix.ENOSYS) {
		flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT)
		for a, f := range map[uint64]uintptr{unix.MOUNT_ATTR_RDONLY: unix.MS_RDONLY, unix.MOUNT_ATTR_NOSUID: unix.MS_NOSUID, unix.MOUNT_ATTR_NODEV: unix.MS_NODEV, unix.MOUNT_ATTR_NOEXEC: unix.MS_NOEXEC} {
			if attr&a != 0 {
				flags |= f
			}
		}
		err = unix.Mount("", fdPath(fd), "", flags, "")
	}
	if err != nil {
		return fmt.Errorf("mount attributes of %s: %w", rel, err)
	}
	return nil
}

// bind bind-mounts source (a path the init can see) onto rel.
func (r *rootFS) bind(source, rel string, attr uint64) error {
	if err := r.mount(source, rel, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return err
	}
	return r.setAttr(rel, attr)
}

// Docker's masked and read-only paths (moby oci/defaults.go).
var (
	maskedPaths = []string{
		"/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys",
		"/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
		"/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
	}
	readonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
)

// setupRoot finishes the root the monitor assembled (rootFD, see
// prepareRoot) with what only the init can mount, from inside the
// sandbox's namespaces — proc (its pid namespace), sysfs (its network
// namespace), a private devpts, /dev/shm — masks and read-only paths of
// Docker's over them, and pivots into it.
func setupRoot(ic *initConfig, assembled int) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	// The mounts the monitor made came into this namespace locked (with
	// a user namespace: no process here may unmount one to see beneath
	// it), and pivot_root refuses a locked new root. A recursive copy of
	// the tree, attached over it, has an unlocked root and keeps every
	// mount below it locked.
	rootFD, err := unix.OpenTree(assembled, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE|unix.AT_EMPTY_PATH)
	if err != nil {
		return fmt.Errorf("copy the sandbox's root: %w", err)
	}
	defer unix.Close(rootFD)
	if err := unix.MoveMount(rootFD, "", assembled, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the sandbox's root: %w", err)
	}
	r := &rootFS{path: "/", fd: rootFD}
	if err := r.mount("proc", "proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := r.mount("devpts", "dev/pts", "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"); err != nil {
		return err
	}
	if err := r.mount("tmpfs", "dev/shm", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=1777,size="+strconv.FormatInt(ic.ShmSize, 10)); err != nil {
		return err
	}
	if err := r.mount("sysfs", "sys", "sysfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	// Ports below 1024 are for CAP_NET_BIND_SERVICE in the network
	// namespace's owner: with a user namespace, that is not the sandbox's
	// root, whose capability counts in its own. Its network is loopback
	// only, so every port is its own to bind.
	if fd, err := r.open("proc/sys/net/ipv4/ip_unprivileged_port_start", unix.O_WRONLY); err == nil {
		_, _ = unix.Write(fd, []byte("0"))
		unix.Close(fd)
	}
	nullFD, err := r.open("dev/null", unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(nullFD)
	for _, p := range maskedPaths {
		fd, err := r.open(p, unix.O_PATH)
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return err
		}
		var st unix.Stat_t
		err = unix.Fstat(fd, &st)
		unix.Close(fd)
		if err != nil {
			return err
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			err = r.mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0,size=4k")
		} else {
			err = r.mount(fdPath(nullFD), p, "", unix.MS_BIND, "")
		}
		if err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range readonlyPaths {
		fd, err := r.open(p, unix.O_PATH)
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return err
		}
		err = unix.Mount(fdPath(fd), fdPath(fd), "", unix.MS_BIND|unix.MS_REC, "")
		unix.Close(fd)
		if err == nil {
			err = r.setAttr(p, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
		}
		if err != nil {
			return fmt.Errorf("read-only %s: %w", p, err)
		}
	}
	if err := unix.Sethostname([]byte(ic.ID)); err != nil {
		return fmt.Errorf("hostname: %w", err)
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	// pivot_root(".", ".") stacks the old root on the new one; detaching
	// it leaves only the sandbox's mounts, with no directory for the old
	// root in the layer.
	if err := unix.Fchdir(rootFD); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Mount("", ".", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return err
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the host root: %w", err)
	}
	return unix.Chdir("/")
}

// loopbackUp brings lo up in the new network namespace, the only
// interface it has.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loopback: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	return nil
}

// server is the init's side of the control protocol.
type server struct {
	spawn chan *spawnReq
	wg    sync.WaitGroup // connection handlers

	// mu guards the fields below. It is never held across a blocking
	// call: the forker takes it only to look at or update them, so that
	// neither the reaper nor stop ever waits behind a fork.
	mu       sync.Mutex
	procs    map[int]*proc
	stopping bool
	// pending is the command the forker is releasing from its start-up
	// trace (0: none): the reaper leaves its exit to release.
	pending int

	// poke wakes the reaper after each fork: an exit it had to leave to
	// release (or hidden behind a command's start-up stop) is then collected.
	poke chan struct{}

	oomAdj int // every command's oom_score_adj (see commandOOMScoreAdj)
}

type proc struct {
	main   bool
	exited chan int // buffered: the reaper never blocks
}

type spawnReq struct {
	path, dir string
	argv, env []string
	files     []uintptr
	p         *proc
	pid       int
	err       error
	// early is set when the command died before it could be released
	// (killed between its execve and the init's first look at it); code
	// is then its exit code, and it is not in procs.
	early bool
	code  int
	done  chan struct{}
}

// errKilledBeforeStart is the exec error of a command killed between its
// fork and its execve: only SIGKILL ends a child traced from its start
// without a stop first, and it comes from the monitor's watchdog (see
// watchStarts) or from a process of the sandbox.
var errKilledBeforeStart = fmt.Errorf("the command was killed before it could start: something in this sandbox stopped it between its fork and its execve (a start held stopped for %v is killed) or killed it; try again, and stop whatever signals new processes in the sandbox", startGrace)

// forker owns the OS thread every command is forked from: it locks
// itself to it, drops that thread to the sandbox's containment, then forks
// on request. The thread is never unlocked, so it dies with its state
// instead of returning to the Go scheduler.
//
// Each command starts traced (PTRACE_TRACEME just before its execve), so
// it stops at its first instruction; the forker, its tracer, sets its
// oom_score_adj to 0 (it inherited the init's -1000) and lets it go. No
// code of the command ever runs exempt from the OOM killer, so nothing it
// forks can inherit the exemption.
//
// A fork can be held up by the sandbox itself: a process that sends
// SIGSTOP to the next pids stops a child before its execve, and Go's
// ForkExec (CLONE_VFORK) then waits for that execve for ever, on a thread
// that keeps its P, so that the init's next garbage collection (which
// stops the world) waits too. No goroutine of the init can be relied on
// then: the monitor, a process of its own, kills such a child (see
// watchStarts); the exec fails with errKilledBeforeStart and the forker
// serves the next request.
func (s *server) forker(ready chan<- error, contain func() error) {
	runtime.LockOSThread()
	if err := contain(); err != nil {
		ready <- err
		return
	}
	ready <- nil
	for req := range s.spawn {
		s.mu.Lock()
		stopping := s.stopping
		s.mu.Unlock()
		if stopping {
			req.err = errors.New("the sandbox is stopping")
			close(req.done)
			continue
		}
		req.pid, req.err = syscall.ForkExec(req.path, req.argv, &syscall.ProcAttr{
			Dir: req.dir, Env: req.env, Files: req.files,
			Sys: &syscall.SysProcAttr{Setsid: true, Ptrace: true},
		})
		if req.err == nil {
			s.mu.Lock()
			s.pending = req.pid
			s.mu.Unlock()
			early, code, err := release(req.pid, s.oomAdj)
			s.mu.Lock()
			s.pending = 0
			switch {
			case err != nil:
				req.err = err
			case early:
				req.early, req.code = true, code
			default:
				s.procs[req.pid] = req.p
			}
			s.mu.Unlock()
		}
		s.pokeReaper()
		close(req.done)
	}
}

func (s *server) pokeReaper() {
	select {
	case s.poke <- struct{}{}:
	default:
	}
}

// maxStartStops bounds how many signal stops release passes on to a
// command before its exec stop: past it, the command is let go anyway.
const maxStartStops = 16

// release waits for a command forked with PTRACE_TRACEME to stop after its
// execve, sets its oom_score_adj to adj and detaches from it. Signals that
// reach it first are delivered to it (PTRACE_CONT with the signal). It
// returns early=true with the exit code if the command died meanwhile.
// It runs on the forker thread (the tracer). Its waits are bounded: once
// past its execve a command stops at once (the exec stop), and each signal
// that stops it first counts against maxStartStops; before its execve, the
// monitor kills a command held stopped (watchStarts).
func release(pid, adj int) (early bool, code int, err error) {
	adjusted := false
	for stops := 0; ; stops++ {
		var ws unix.WaitStatus
		_, err := unix.Wait4(pid, &ws, unix.WALL, nil)
		if errors.Is(err, unix.EINTR) {
			stops--
			continue
		}
		if errors.Is(err, unix.ECHILD) {
			// The reaper collected it before release could look: it
			// died before its exec stop, which only SIGKILL does.
			return false, 0, errKilledBeforeStart
		}
		if err != nil {
			_ = unix.Kill(pid, unix.SIGKILL)
			return false, 0, fmt.Errorf("waiting for the command to start: %w", err)
		}
		if ws.Signaled() && !adjusted {
			return false, 0, errKilledBeforeStart
		}
		if ws.Exited() || ws.Signaled() {
			return true, exitCode(ws), nil
		}
		if !ws.Stopped() {
			continue
		}
		if !adjusted {
			// Written from another thread of the init, one that kept
			// CAP_SYS_RESOURCE where the host grants it: the kernel then
			// also raises the command's oom_score_adj_min, so that it
			// cannot lower itself back to the init's exemption. (A
			// goroutine that is not locked never runs on this thread.)
			werr := make(chan error, 1)
			go func() { werr <- oomScoreAdj(strconv.Itoa(pid), adj) }()
			if err := <-werr; err != nil {
				_ = unix.Kill(pid, unix.SIGKILL)
				for {
					if _, werr := unix.Wait4(pid, &ws, unix.WALL, nil); !errors.Is(werr, unix.EINTR) {
						break
					}
				}
				return false, 0, err
			}
			adjusted = true
		}
		sig := ws.StopSignal()
		if sig == unix.SIGTRAP || stops >= maxStartStops {
			// The exec stop: detach without delivering the SIGTRAP.
			if err := unix.PtraceDetach(pid); err != nil {
				// It died meanwhile (ESRCH): the reaper collects it.
				_ = unix.Kill(pid, unix.SIGKILL)
			}
			return false, 0, nil
		}
		if err := unix.PtraceCont(pid, int(sig)); err != nil {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
}

// lookPath finds file in the PATH of env, as a shell would.
func lookPath(file string, env []string) (string, error) {
	if strings.Contains(file, "/") {
		return file, nil
	}
	pathVar := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathVar = v
		}
	}
	for _, d := range filepath.SplitList(pathVar) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, file)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%q: executable file not found in $PATH", file)
}

func exitCode(ws unix.WaitStatus) int {
	if ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}

func (s *server) write(c *net.UnixConn, r reply) {
	b, _ := json.Marshal(r)
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _ = c.Write(b)
}

// handle serves one client: one exec, then signals, detach, and the exit.
func (s *server) handle(c *net.UnixConn) {
	defer s.wg.Done()
	defer c.Close()
	buf := make([]byte, 1<<20)
	oob := make([]byte, unix.CmsgSpace(4*4))
	// MSG_CMSG_CLOEXEC: a command forked meanwhile must not inherit
	// another command's descriptors.
	var n, oobn int
	rc, err := c.SyscallConn()
	if err != nil {
		return
	}
	var rerr error
	err = rc.Read(func(fd uintptr) bool {
		n, oobn, _, _, rerr = unix.Recvmsg(int(fd), buf, oob, unix.MSG_CMSG_CLOEXEC)
		return rerr != unix.EAGAIN
	})
	if err != nil || rerr != nil {
		return
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, m := range msgs {
			if rights, err := unix.ParseUnixRights(&m); err == nil {
				fds = append(fds, rights...)
			}
		}
	}
	closeFDs := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
		fds = nil
	}
	defer closeFDs()
	var req request
	if err := json.Unmarshal(buf[:n], &req); err != nil || req.Op != "exec" || len(req.Argv) == 0 || len(fds) != 3 {
		s.write(c, reply{Error: "bad request: want an exec with argv and 3 descriptors"})
		return
	}
	p := &proc{main: req.Main, exited: make(chan int, 1)}
	dir := req.Dir
	if dir == "" {
		dir = "/"
	}
	exe, err := lookPath(req.Argv[0], req.Env)
	if err != nil {
		s.write(c, reply{Error: "exec: " + err.Error()})
		return
	}
	sr := &spawnReq{path: exe, dir: dir, argv: req.Argv, env: req.Env, p: p, done: make(chan struct{})}
	for _, fd := range fds {
		sr.files = append(sr.files, uintptr(fd))
	}
	s.spawn <- sr
	<-sr.done
	closeFDs()
	if sr.err != nil {
		s.write(c, reply{Error: fmt.Sprintf("exec %q: %v", req.Argv[0], sr.err)})
		if req.Main {
			s.stop(127)
		}
		return
	}
	pid := sr.pid
	s.write(c, reply{Pid: pid})
	if sr.early {
		if req.Main {
			s.stop(sr.code)
		}
		s.write(c, reply{Exited: true, Code: sr.code})
		return
	}

	msgs := make(chan request)
	go func() { // ends when c is closed
		defer close(msgs)
		b := make([]byte, 4096)
		for {
			n, err := c.Read(b)
			if err != nil || n == 0 {
				return
			}
			var r request
			if json.Unmarshal(b[:n], &r) == nil {
				msgs <- r
			}
		}
	}()
	detached := false
	for {
		select {
		case code := <-p.exited:
			if !detached {
				s.write(c, reply{Exited: true, Code: code})
			}
			return
		case r, ok := <-msgs:
			if !ok {
				if !detached {
					_ = unix.Kill(-pid, unix.SIGKILL)
				}
				return
			}
			switch r.Op {
			case "signal":
				if r.Signal > 0 && r.Signal < 65 {
					_ = unix.Kill(-pid, syscall.Signal(r.Signal))
				}
			case "detach":
				detached = true
			}
		}
	}
}

// reap collects every child (commands and the orphans they leave to pid
// 1) and hands exit codes to their handlers. It never waits for the
// forker: it looks at an exit first (WNOWAIT, which also leaves a
// command's start-up ptrace stops to release) and collects it unless it is
// the command the forker is releasing, whose exit is release's.
func (s *server) reap(sigchld <-chan os.Signal) {
	for {
		select {
		case <-sigchld:
		case <-s.poke:
		}
		s.reapExited()
	}
}

// Values of siginfo's si_code for SIGCHLD (asm-generic/siginfo.h).
const (
	cldExited = 1
	cldKilled = 2
	cldDumped = 3
)

// reapExited collects every exited child it may, then returns.
func (s *server) reapExited() {
	for {
		var si unix.Siginfo
		err := unix.Waitid(unix.P_ALL, 0, &si, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT|unix.WALL, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		// si_pid is the first field of siginfo's union, after signo,
		// errno, code and padding.
		pid := int(*(*int32)(unsafe.Pointer(uintptr(unsafe.Pointer(&si)) + 16)))
		if err != nil || pid <= 0 {
			return
		}
		if c := si.Code; c != cldExited && c != cldKilled && c != cldDumped {
			// A command stopped at its start, waiting for release,
			// which pokes the reaper once done.
			return
		}
		s.mu.Lock()
		if pid == s.pending {
			s.mu.Unlock()
			return // release collects it, then pokes the reaper
		}
		p := s.procs[pid]
		delete(s.procs, pid)
		s.mu.Unlock()
		var ws unix.WaitStatus
		if got, err := unix.Wait4(pid, &ws, unix.WNOHANG|unix.WALL, nil); got != pid || err != nil {
			continue
		}
		if p == nil {
			continue
		}
		code := exitCode(ws)
		if p.main {
			s.stop(code)
		}
		p.exited <- code
	}
}

// stopAckTimeout bounds how long the init waits for the monitor to record
// the stop.
const stopAckTimeout = 5 * time.Second

// stop ends the sandbox when run's command has exited: every other
// process is killed, the monitor records the exit code (stopped.json) and
// the init exits (its mount namespace, and every mount in it, go with it).
// The init writes nothing on the host itself: it has no way to.
func (s *server) stop(code int) {
	s.mu.Lock()
	s.stopping = true
	s.mu.Unlock()
	_ = unix.Kill(-1, unix.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.ECHILD) {
			break
		}
		if pid <= 0 {
			time.Sleep(time.Millisecond)
			continue
		}
		s.mu.Lock()
		p := s.procs[pid]
		delete(s.procs, pid)
		s.mu.Unlock()
		if p != nil {
			p.exited <- exitCode(ws)
		}
	}
	// Recorded before run's client hears the exit code, so that whoever
	// waited for it finds the sandbox stopped.
	if err := sendLink(linkFD, "stopped "+strconv.Itoa(code)); err == nil {
		if msg, err := readLink(linkFD, stopAckTimeout); err != nil || msg != "ok" {
			fmt.Fprintf(os.Stderr, "sandgate sandbox init: the monitor did not record the stop: %q, %v\n", msg, err)
		}
	} else {
		fmt.Fprintf(os.Stderr, "sandgate sandbox init: the monitor is gone, the stop is not recorded: %v\n", err)
	}
	go func() {
		done := make(chan struct{})
		go func() { s.wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
		}
		os.Exit(0)
	}()
}
