package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/appliance/localbox"
)

// TestSandboxExecGivesUpOnStalledInit: `sandbox exec` once
// forwarded SIGTERM to a sandbox whose init did not answer and then waited
// for ever. It must give up after signalAnswerTimeout, exit 128+SIGTERM and
// say why.
func TestSandboxExecGivesUpOnStalledInit(t *testing.T) {
	t.Parallel() // a process of its own, waiting more than working
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	state := t.TempDir()
	t.Cleanup(func() { sandboxCLI(t, state, nil, "delete", "--force", "stalled") })
	if code, _, errOut := sandboxCLI(t, state, nil, "run", "stalled", "--detach", "--", "sleep", "infinity"); code != 0 {
		t.Fatalf("run --detach: %d %q", code, errOut)
	}
	_, out, _ := sandboxCLI(t, state, nil, "list", "--json")
	var infos []localbox.Info
	if err := json.Unmarshal([]byte(out), &infos); err != nil || len(infos) != 1 || infos[0].Pid <= 0 {
		t.Fatalf("list --json: %q, %v", out, err)
	}
	initPid := infos[0].Pid

	cmd := exec.Command(binary(t), "sandbox", "exec", "stalled", "--", "sleep", "infinity")
	cmd.Env = append(os.Environ(), "SANDGATE_STATE_DIR="+state)
	// A file, not a buffer: the exec'd command holds the CLI's stderr, so
	// a pipe would keep cmd.Wait waiting for it.
	errFile, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	if err != nil {
		t.Fatal(err)
	}
	defer errFile.Close()
	cmd.Stderr = errFile
	errOut := func() string { b, _ := os.ReadFile(errFile.Name()); return string(b) }
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Started once the init has forked sleep (a child of one of its threads).
	for i := 0; strings.Count(initChildrenNames(initPid), "sleep\n") < 2; i++ {
		if i == 1200 { // a minute: only a hang takes that long
			t.Fatalf("the exec'd sleep never appeared: %q", initChildrenNames(initPid))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Stall the init (SIGSTOP from the host's pid namespace stops even a
	// namespace's pid 1), then interrupt the CLI.
	if err := syscall.Kill(initPid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(initPid, syscall.SIGCONT)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 128+int(syscall.SIGTERM) || !strings.Contains(errOut(), "did not report the command's exit") {
			t.Errorf("exec with the init stalled, after SIGTERM: %v, stderr %q; want exit %d and a message", err, errOut(), 128+int(syscall.SIGTERM))
		}
	case <-time.After(3 * signalAnswerTimeout):
		_ = cmd.Process.Kill()
		<-done
		t.Errorf("exec did not end within %v of SIGTERM while the init was stalled", 3*signalAnswerTimeout)
	}
}

// initChildrenNames returns the command names of the children of every
// thread of process pid, one a line.
func initChildrenNames(pid int) string {
	var b strings.Builder
	task := "/proc/" + strconv.Itoa(pid) + "/task/"
	tids, _ := os.ReadDir(task)
	for _, t := range tids {
		cs, _ := os.ReadFile(task + t.Name() + "/children")
		for _, c := range strings.Fields(string(cs)) {
			comm, _ := os.ReadFile("/proc/" + c + "/comm")
			b.WriteString(strings.TrimSpace(string(comm)) + "\n")
		}
	}
	return b.String()
}
