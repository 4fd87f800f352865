package localbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The monitor is the sandbox's process on the host: the init's parent, in
// the host's namespaces, outside the sandbox's cgroup and invisible from
// inside it. It exists so that the init holds nothing of the host: the
// monitor (not the init) writes stopped.json when the init reports a stop,
// appends the init's output to init.log, and reaps the init. It ends when
// the init does.
//
//	creator → monitor: starts it with the creator link (fd 3) and ctl.sock (fd 4)
//	monitor → creator: "pid <init pid>"    (the creator moves it into the cgroup)
//	creator → monitor: "go"                 relayed to the init
//	init → monitor:    "ok" | "error: ..."  relayed to the creator
//	init → monitor:    "stopped <code>"     monitor writes stopped.json, answers "ok"

// maxInitLog bounds init.log: the monitor stops copying the init's output
// past it, so that nothing can fill the host's disk through it.
const maxInitLog = 1 << 20

func monitorMain() error {
	keepOnlyOwnFDs(listenerFD)
	dir := os.Getenv(dirEnv)
	if dir == "" {
		return errors.New("monitor: no sandbox directory")
	}
	var cfg Config
	if err := readJSON(filepath.Join(dir, configFile), &cfg); err != nil {
		return fmt.Errorf("monitor: %w", err)
	}
	var rs runState
	if err := readJSON(filepath.Join(dir, stateFile), &rs); err != nil {
		return fmt.Errorf("monitor: %w", err)
	}
	masks, err := planMasks(exposures(cfg.Rootfs), append([]string{filepath.Dir(dir)}, cfg.Masks...))
	if err != nil {
		return fmt.Errorf("monitor: %w", err)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("monitor: %w", err)
	}
	link, initEnd := pair[0], os.NewFile(uintptr(pair[1]), "link")
	logR, logW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("monitor: %w", err)
	}
	listener := os.NewFile(listenerFD, "ctl.sock")
	type started struct {
		cmd    *exec.Cmd
		userns bool
		err    error
	}
	done := make(chan started, 1)
	go func() {
		// Never unlocked: the thread, and the mount namespace it
		// unshares, end with this goroutine; the init keeps a copy.
		runtime.LockOSThread()
		cmd, userns, err := startInit(dir, &cfg, masks, rs.IDBase, initEnd, listener, logW)
		done <- started{cmd, userns, err}
	}()
	res := <-done
	initEnd.Close()
	logW.Close()
	listener.Close()
	if res.err != nil {
		return fmt.Errorf("start the sandbox's init: %w", res.err)
	}
	cmd := res.cmd
	initGone := make(chan struct{})
	go watchStarts(cmd.Process.Pid, initGone)
	logged := make(chan struct{})
	go func() { // ends when the init, the last writer, is gone
		defer close(logged)
		copyLog(os.Stderr, logR)
	}()
	fail := func(err error) error {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return err
	}
	hello := "pid " + strconv.Itoa(cmd.Process.Pid)
	if res.userns {
		hello += " userns"
	}
	if err := sendLink(linkFD, hello); err != nil {
		return fail(err)
	}
	if msg, err := readLink(linkFD, startTimeout); err != nil || msg != "go" {
		return fail(fmt.Errorf("waiting for the go-ahead: %q, %v", msg, err))
	}
	if err := sendLink(link, "go"); err != nil {
		return fail(err)
	}
	msg, err := readLink(link, startTimeout)
	if err != nil {
		msg = fmt.Sprintf("error: the init did not come up: %v (see %s)", err, filepath.Join(dir, logFile))
	}
	if err := sendLink(linkFD, msg); err != nil || msg != "ok" {
		_ = fail(nil)
		os.Exit(1)
	}
	unix.Close(linkFD)

	for {
		msg, err := readLink(link, -1)
		if err != nil {
			break // the init is gone
		}
		code, ok := strings.CutPrefix(msg, "stopped ")
		n, cerr := strconv.Atoi(code)
		if !ok || cerr != nil {
			continue
		}
		answer := "ok"
		if err := writeJSON(filepath.Join(dir, stoppedFile), &stopState{ExitCode: n, Time: time.Now().UTC()}); err != nil {
			answer = "error: " + err.Error()
		}
		_ = sendLink(link, answer)
	}
	_ = cmd.Wait()
	close(initGone)
	select {
	case <-logged:
	case <-time.After(2 * time.Second):
	}
	os.Exit(0)
	return nil
}

// startInit assembles the sandbox's root (prepareRoot) in a mount
// namespace of this thread's own and starts the init from this thread, in
// new namespaces: a user namespace mapping the sandbox's ids to idBase...
// where that can be had (userns reports whether it was), and mount, pid,
// network, UTS and IPC namespaces. The caller has locked the thread and
// never unlocks it.
func startInit(dir string, cfg *Config, masks []mask, idBase int, link, listener, logW *os.File) (cmd *exec.Cmd, userns bool, err error) {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return nil, false, fmt.Errorf("mount namespace: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return nil, false, fmt.Errorf("make mounts private: %w", err)
	}
	// Modes are set as asked (device nodes 0666, /tmp 1777): the umask is
	// this thread's own since it unshared its file system information.
	unix.Umask(0)
	rootFD := -1
	userns = idBase != 0 && cfg.UserNS != UserNSOff
	if userns {
		rootFD, err = prepareRoot(dir, cfg, masks, idBase)
		var uerr *usernsError
		switch {
		case err == nil:
		case !errors.As(err, &uerr):
			return nil, false, err
		case cfg.UserNS == UserNSOn:
			return nil, false, fmt.Errorf("a user namespace was required (--userns=on): %w", err)
		default:
			fmt.Fprintln(os.Stderr, "sandgate sandbox monitor: "+userNSNote(err))
			userns = false
		}
	}
	if !userns {
		if rootFD, err = prepareRoot(dir, cfg, masks, 0); err != nil {
			return nil, false, err
		}
	}
	// The init starts in the root: a descriptor would name the mount of
	// this namespace, where the init cannot mount anything, but a new
	// mount namespace moves the working directory (and root) of the
	// process made with it onto their copies. This thread's working
	// directory is its own (unsharing the mount namespace unshared it).
	err = unix.Fchdir(rootFD)
	unix.Close(rootFD)
	if err != nil {
		return nil, false, fmt.Errorf("enter the sandbox's root: %w", err)
	}
	ic, err := json.Marshal(initConfig{ID: cfg.ID, ShmSize: cfg.shmSize(), UserNS: userns})
	if err != nil {
		return nil, false, err
	}
	attr := &syscall.SysProcAttr{
		Cloneflags: unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC,
		Setsid:     true,
	}
	if userns {
		attr.Cloneflags |= unix.CLONE_NEWUSER
		attr.UidMappings, attr.GidMappings = idMappings(idBase), idMappings(idBase)
		attr.GidMappingsEnableSetgroups = true
		// The child starts as host root, which the namespace does not
		// map: it becomes the namespace's root (host id idBase).
		attr.Credential = &syscall.Credential{Uid: 0, Gid: 0}
	}
	cmd = &exec.Cmd{
		Path:        "/proc/self/exe",
		Args:        []string{"sandgate-sandbox-init", filepath.Base(dir)},
		Env:         []string{initEnv + "=1", cfgEnv + "=" + string(ic), runtimeEnv},
		Stdout:      logW,
		Stderr:      logW,
		ExtraFiles:  []*os.File{link, listener},
		SysProcAttr: attr,
	}
	if err := cmd.Start(); err != nil {
		return nil, false, err
	}
	return cmd, userns, nil
}

// copyLog copies r to w up to maxInitLog bytes, then drains r.
func copyLog(w io.Writer, r io.Reader) {
	n, _ := io.Copy(w, io.LimitReader(r, maxInitLog))
	if n == maxInitLog {
		fmt.Fprintf(w, "\nsandgate sandbox monitor: init.log reached %d bytes; the rest is dropped\n", maxInitLog)
	}
	_, _ = io.Copy(io.Discard, r)
}

// startGrace is how long a command may be held stopped between its fork
// and its execve before the monitor kills it.
const startGrace = 2 * time.Second

// kcmpVM is KCMP_VM of linux/kcmp.h: kcmp reports whether two processes
// share one address space.
const kcmpVM = 1

// watchStarts kills any child of the init that has been stopped for
// startGrace before its execve, until done is closed. Such a child was
// stopped by a process of the sandbox (SIGSTOP sent to the pids that come
// next): the init forks with CLONE_VFORK, so its forker thread waits for
// the child's execve, and while it waits that thread keeps a P of the Go
// runtime, so the init's next garbage collection waits as well. That is
// why the watch is here, in another process, rather than in the init.
//
// A child that has not reached its execve still shares the init's address
// space (kcmp KCMP_VM), which no started command does; whether traced or
// not (PTRACE_TRACEME comes just before the execve), the forker only
// resumes when it is gone. The exec then fails with errKilledBeforeStart.
func watchStarts(initPid int, done <-chan struct{}) {
	tick := time.NewTicker(startGrace / 4)
	defer tick.Stop()
	seen := map[int]time.Time{} // stopped before its execve since
	for {
		select {
		case <-done:
			return
		case <-tick.C:
		}
		now := time.Now()
		still := map[int]time.Time{}
		for _, pid := range initChildren(initPid) {
			if !stoppedPreExec(initPid, pid) {
				continue
			}
			since, ok := seen[pid]
			if !ok {
				since = now
			}
			if now.Sub(since) < startGrace {
				still[pid] = since
				continue
			}
			_ = unix.Kill(pid, unix.SIGKILL)
			fmt.Fprintf(os.Stderr, "sandgate sandbox monitor: a command (host pid %d) was held stopped before its execve for %v: killed it, so that the init can serve on\n", pid, startGrace)
		}
		seen = still
	}
}

// initChildren lists the children of every thread of process pid.
func initChildren(pid int) []int {
	task := "/proc/" + strconv.Itoa(pid) + "/task/"
	tids, _ := os.ReadDir(task)
	var out []int
	for _, t := range tids {
		b, _ := os.ReadFile(task + t.Name() + "/children")
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				out = append(out, n)
			}
		}
	}
	return out
}

// stoppedPreExec reports whether child, a child of process parent, is in
// a stop (group or ptrace stop) and still shares parent's address space.
func stoppedPreExec(parent, child int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(child) + "/stat")
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 >= len(b) || (b[i+2] != 'T' && b[i+2] != 't') {
		return false
	}
	r, _, errno := unix.RawSyscall6(unix.SYS_KCMP, uintptr(parent), uintptr(child), kcmpVM, 0, 0, 0)
	if errno != unix.ENOSYS {
		return errno == 0 && r == 0
	}
	// A kernel without kcmp: still the init's executable. (A command that
	// runs the sandgate binary itself and is held stopped is taken too.)
	var own, its unix.Stat_t
	if unix.Stat("/proc/"+strconv.Itoa(parent)+"/exe", &own) != nil || unix.Stat("/proc/"+strconv.Itoa(child)+"/exe", &its) != nil {
		return false
	}
	return own.Dev == its.Dev && own.Ino == its.Ino
}
