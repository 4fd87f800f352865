package localbox

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
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
	keepOnlyOwnFDs()
	dir := os.Getenv(dirEnv)
	if dir == "" {
		return errors.New("monitor: no sandbox directory")
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
	cmd := &exec.Cmd{
		Path:       "/proc/self/exe",
		Args:       []string{"sandgate-sandbox-init", filepath.Base(dir)},
		Env:        []string{initEnv + "=1", dirEnv + "=" + dir, runtimeEnv},
		Stdout:     logW,
		Stderr:     logW,
		ExtraFiles: []*os.File{initEnd, listener},
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags: unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC,
			Setsid:     true,
		},
	}
	err = cmd.Start()
	initEnd.Close()
	logW.Close()
	listener.Close()
	if err != nil {
		return fmt.Errorf("start the sandbox's init: %w", err)
	}
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
	if err := sendLink(linkFD, "pid "+strconv.Itoa(cmd.Process.Pid)); err != nil {
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
	select {
	case <-logged:
	case <-time.After(2 * time.Second):
	}
	os.Exit(0)
	return nil
}

// copyLog copies r to w up to maxInitLog bytes, then drains r.
func copyLog(w io.Writer, r io.Reader) {
	n, _ := io.Copy(w, io.LimitReader(r, maxInitLog))
	if n == maxInitLog {
		fmt.Fprintf(w, "\nsandgate sandbox monitor: init.log reached %d bytes; the rest is dropped\n", maxInitLog)
	}
	_, _ = io.Copy(io.Discard, r)
}
