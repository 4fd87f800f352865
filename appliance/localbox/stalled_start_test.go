package localbox

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A command could once freeze the init for good: the init
// forks each command with Go's ForkExec (CLONE_VFORK), and a SIGSTOP that
// a command sends to the new pid before its execve left the forker thread
// waiting in the kernel for that execve for ever (holding the lock the
// reaper needed, and a P of the Go runtime, so the next garbage collection
// waited too): no exec started, no command was reaped, and when run's
// command exited the sandbox never stopped.

// stopperEnv makes this test binary, run inside a sandbox, the attacker:
// it sends SIGSTOP to the pids that come next, in a tight loop.
const stopperEnv = "_SANDGATE_TEST_STOPPER"

func init() {
	if os.Getenv(stopperEnv) == "" {
		return
	}
	mine := map[int]bool{}
	time.Sleep(200 * time.Millisecond) // let the runtime start its threads
	es, _ := os.ReadDir("/proc/self/task")
	top := os.Getpid()
	for _, e := range es {
		n, _ := strconv.Atoi(e.Name())
		mine[n] = true
		top = max(top, n)
	}
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); {
		for p := top + 1; p < top+100; p++ {
			if !mine[p] {
				_ = syscall.Kill(p, syscall.SIGSTOP)
			}
		}
	}
	os.Exit(0)
}

// execTrue runs true in the sandbox and reports whether the request ended
// (started and finished, or refused) within d, and its error.
func execTrue(m *Runtime, id string, d time.Duration) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		p, err := m.Exec(ctx, id, ExecOptions{Cmd: []string{"true"}})
		if err == nil {
			_, err = p.Wait()
			p.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		return true, err
	case <-time.After(d):
		return false, nil
	}
}

// stoppedPreExecChild returns a child of the init that is stopped (traced
// or not) and still the init's image (it never reached execve), or 0.
func stoppedPreExecChild(initPid int) int {
	tasks, _ := os.ReadDir("/proc/" + strconv.Itoa(initPid) + "/task")
	for _, t := range tasks {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(initPid) + "/task/" + t.Name() + "/children")
		for _, c := range strings.Fields(string(b)) {
			st, _ := os.ReadFile("/proc/" + c + "/status")
			cmd, _ := os.ReadFile("/proc/" + c + "/cmdline")
			if (strings.Contains(string(st), "State:\tT") || strings.Contains(string(st), "State:\tt")) && strings.HasPrefix(string(cmd), "sandgate-sandbox-init") {
				n, _ := strconv.Atoi(c)
				return n
			}
		}
	}
	return 0
}

// zombieChildren counts the init's children that are zombies.
func zombieChildren(initPid int) int {
	n := 0
	tasks, _ := os.ReadDir("/proc/" + strconv.Itoa(initPid) + "/task")
	for _, t := range tasks {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(initPid) + "/task/" + t.Name() + "/children")
		for _, c := range strings.Fields(string(b)) {
			if st, _ := os.ReadFile("/proc/" + c + "/status"); strings.Contains(string(st), "State:\tZ") {
				n++
			}
		}
	}
	return n
}

// TestStoppedStartDoesNotWedgeInit: a command SIGSTOPs the pids the next
// commands will get; a command caught before its execve is killed by the
// monitor's watch, its exec fails with an error that says so, and the init
// serves on: later commands start, exited ones are reaped, and when run's
// command exits the sandbox stops.
func TestStoppedStartDoesNotWedgeInit(t *testing.T) {
	m := newRuntime(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	main, err := m.Run(testCtx(t), RunOptions{Config: Config{
		ID: "stall", Write: true, Cmd: []string{"sleep", "infinity"},
		Mounts: []Mount{{Source: filepath.Dir(exe), Destination: "/opt/attacker", ReadOnly: true}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer main.Close()
	infos, err := m.List()
	if err != nil {
		t.Fatal(err)
	}
	initPid := 0
	for _, in := range infos {
		if in.ID == "stall" {
			initPid = in.Pid
		}
	}
	attacker, err := m.Exec(testCtx(t), "stall", ExecOptions{
		Cmd: []string{"/opt/attacker/" + filepath.Base(exe)},
		Env: []string{stopperEnv + "=1"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer attacker.Close()
	time.Sleep(500 * time.Millisecond) // the attacker is looping
	caught := 0
	for i := 0; i < 40 && caught == 0; i++ {
		ended, err := execTrue(m, "stall", 4*startGrace)
		if !ended {
			// The attacker may have stopped true after its execve: a
			// command of the sandbox stopped by the sandbox, which is
			// its own business. A start held before its execve is not.
			if stuck := stoppedPreExecChild(initPid); stuck != 0 {
				time.Sleep(2 * startGrace)
				if stoppedPreExecChild(initPid) == stuck {
					t.Fatalf("pid %d, forked for a command, has been stopped by the sandbox before its execve for over %v and the init waits for it", stuck, 2*startGrace)
				}
			}
			continue
		}
		if err != nil {
			if !strings.Contains(err.Error(), "killed before it could start") {
				t.Fatalf("exec true under the attack: %v", err)
			}
			caught++
		}
	}
	if caught == 0 {
		t.Skip("no fork was caught before its execve in 40 tries (a race)")
	}
	// The attacker has done its part; end it from the host. The init must
	// still serve.
	_ = attacker.Signal(syscall.SIGKILL)
	gone := make(chan struct{})
	go func() { attacker.Wait(); close(gone) }()
	select {
	case <-gone: // no stop signal of its can reach the next start
	case <-time.After(time.Minute):
		t.Fatal("the attacker did not end within a minute of SIGKILL")
	}
	if ended, err := execTrue(m, "stall", 10*time.Second); !ended || err != nil {
		t.Errorf("after a start held stopped was killed, exec true: ended %v, %v (stuck child: %d)", ended, err, stoppedPreExecChild(initPid))
	}
	for i := 0; zombieChildren(initPid) > 0; i++ {
		if i == 1200 { // a minute: reaping takes milliseconds
			t.Errorf("the init leaves %d zombies", zombieChildren(initPid))
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	// run's command exits: the sandbox stops, and says so.
	if err := main.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if code, err := main.Wait(); err != nil || code != 128+int(syscall.SIGKILL) {
		t.Fatalf("run's command: %d, %v", code, err)
	}
	infos, _ = m.List()
	for _, in := range infos {
		if in.ID == "stall" && in.State != "stopped" {
			t.Errorf("after run's command exited the sandbox is %q, want stopped", in.State)
		}
	}
}
