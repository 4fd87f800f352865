package agent

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// sandgateBinary builds ./cmd/sandgate once per test run.
func sandgateBinary(t *testing.T) string {
	t.Helper()
	return gobuild.Sandgate(t)
}

// agentProcess is `sandgate agent` running as a process, its stdio the
// link, and the client connected to it.
type agentProcess struct {
	c      *Client
	cmd    *exec.Cmd
	stderr *syncbuf.Buffer
	exited chan error
}

func startAgentProcess(t *testing.T) *agentProcess {
	t.Helper()
	skipIfNotLinux(t)
	bin := sandgateBinary(t)
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	a := &agentProcess{stderr: &syncbuf.Buffer{}, exited: make(chan error, 1)}
	a.cmd = exec.Command(bin, "agent")
	a.cmd.Stdin, a.cmd.Stdout, a.cmd.Stderr = inR, outW, a.stderr
	a.cmd.Env = []string{"PATH=/usr/bin:/bin", "SECRET_OF_THE_AGENT=must-not-leak"}
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	inR.Close()
	outW.Close()
	go func() { a.exited <- a.cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-a.exited:
		case <-time.After(15 * time.Second):
			a.cmd.Process.Kill()
			t.Errorf("sandgate agent did not exit within 15s of its link closing; stderr:\n%s", a.stderr.String())
		}
	})
	c, err := NewClient(testCtx(t), rwc{outR, inW}, ClientOptions{Config: testConfig()})
	if err != nil {
		t.Fatalf("NewClient: %v; agent stderr:\n%s", err, a.stderr.String())
	}
	t.Cleanup(func() { c.Close() })
	a.c = c
	return a
}

// TestEndToEndProcess drives `sandgate agent` as a real process.
func TestEndToEndProcess(t *testing.T) {
	a := startAgentProcess(t)
	ctx := testCtx(t)
	if a.c.Info().PID != a.cmd.Process.Pid {
		t.Errorf("Info().PID = %d, want %d", a.c.Info().PID, a.cmd.Process.Pid)
	}
	var out, errOut syncbuf.Buffer
	st, err := a.c.Run(ctx, Cmd{Args: []string{"sh", "-c", "echo hi; echo oops >&2; env | grep -c SECRET_OF_THE_AGENT; exit 7"}, Stdout: &out, Stderr: &errOut})
	if err != nil || st.Code != 7 || out.String() != "hi\n0\n" || errOut.String() != "oops\n" {
		t.Errorf("Run = %v %v, stdout %q, stderr %q", st, err, out.String(), errOut.String())
	}

	p := filepath.Join(t.TempDir(), "dir", "file")
	if _, err := a.c.WriteFile(ctx, p, strings.NewReader("content"), WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	r, _, err := a.c.ReadFile(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r)
	r.Close()
	if string(b) != "content" {
		t.Errorf("read back %q", b)
	}
	if _, _, err := a.c.ReadFile(ctx, p+".missing"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	if strings.Contains(a.stderr.String(), `"severity":"ERROR"`) {
		t.Errorf("agent logged errors:\n%s", a.stderr.String())
	}
}

// TestKillAllProcess: kill-all (scoped to the agent's descendants) stops
// every command, their children, and orphans re-parented to the agent
// (a child subreaper), and reaps them.
func TestKillAllProcess(t *testing.T) {
	a := startAgentProcess(t)
	ctx := testCtx(t)
	agentPID := a.c.Info().PID
	var procs []*Process
	spawn := func(script string, lines int) []int {
		lw := newLineWaiter()
		p, err := a.c.Spawn(ctx, Cmd{Args: []string{"sh", "-c", script}, Stdout: lw})
		if err != nil {
			t.Fatal(err)
		}
		procs = append(procs, p)
		var pids []int
		if lines > 0 {
			for _, l := range lw.lines(t, lines) {
				pids = append(pids, atoi(t, l))
			}
		}
		return append(pids, p.PID)
	}
	var all []int
	all = append(all, spawn("exec sleep 1000", 0)...)
	all = append(all, spawn("sleep 1000 & echo $!; wait", 1)...)
	// An orphan: its shell exits at once, so it is re-parented.
	orphan := spawn("sleep 1000 & echo $!", 1)[0]
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", orphan)); err == nil {
			if pi, ok := parseStat(b); ok && pi.ppid == agentPID {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("orphan %d was not re-parented to the agent (%d): is it a child subreaper?", orphan, agentPID)
		}
	}
	all = append(all, orphan)
	n, err := a.c.KillAll(ctx)
	if err != nil || n < 4 {
		t.Errorf("KillAll = %d, %v; want at least 4 processes", n, err)
	}
	waitDead(t, all...)
	for _, p := range procs[:2] {
		if st, err := p.Wait(ctx); err != nil || st.Signal != syscall.SIGKILL {
			t.Errorf("command %d after kill-all: %v %v", p.ID, st, err)
		}
	}
	// The orphan is reaped by the agent, not left a zombie.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", orphan)); errors.Is(err, fs.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("orphan %d was never reaped", orphan)
		}
	}
	if dead(a.cmd.Process.Pid) {
		t.Fatal("kill-all killed the agent")
	}
	if _, err := a.c.Ping(ctx); err != nil {
		t.Errorf("Ping after kill-all: %v", err)
	}
}

// TestLinkDropProcess: each side detects the other going away.
func TestLinkDropProcess(t *testing.T) {
	// The service goes away: the agent kills its commands and exits 0.
	a := startAgentProcess(t)
	p, err := a.c.Spawn(testCtx(t), Cmd{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	a.c.Close()
	select {
	case err := <-a.exited:
		a.exited <- err // for the cleanup
		if err != nil {
			t.Errorf("agent exited with %v, want status 0; stderr:\n%s", err, a.stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the agent did not exit within 15s of its link closing")
	}
	waitDead(t, p.PID)

	// The agent goes away: the client's Done fires.
	b := startAgentProcess(t)
	b.cmd.Process.Kill()
	select {
	case <-b.c.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the client did not notice the agent's death within 10s")
	}
	if !errors.Is(b.c.Err(), ErrLinkDown) {
		t.Errorf("Err = %v", b.c.Err())
	}
	if _, err := b.c.Run(testCtx(t), Cmd{Args: []string{"true"}}); !errors.Is(err, ErrLinkDown) {
		t.Errorf("Run on a dropped link = %v, want ErrLinkDown", err)
	}
}

// TestDeadlineProcess: the dead man's switch. A deadline renewed in time
// changes nothing; one that passes kills every command and refuses new
// ones until the service sets another.
func TestDeadlineProcess(t *testing.T) {
	a := startAgentProcess(t)
	ctx := testCtx(t)
	if err := a.c.SetDeadline(ctx, time.Hour); err != nil {
		t.Fatal(err)
	}
	p, err := a.c.Spawn(ctx, Cmd{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.c.SetDeadline(ctx, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if st, err := p.Wait(ctx); err != nil || st.Signal != syscall.SIGKILL {
		t.Fatalf("a command past the deadline: %v %v, want killed", st, err)
	}
	if _, err := a.c.Spawn(ctx, Cmd{Args: []string{"true"}}); !errors.Is(err, ErrExpired) {
		t.Fatalf("a command after the deadline passed: %v, want ErrExpired", err)
	}
	if err := a.c.SetDeadline(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if st, err := a.c.Run(ctx, Cmd{Args: []string{"true"}}); err != nil || !st.Success() {
		t.Fatalf("a command once the deadline is lifted: %v %v", st, err)
	}
	if err := a.c.SetDeadline(ctx, -time.Second); err == nil {
		t.Errorf("a negative deadline was taken")
	}
}

// TestPauseProcess: a pause stops every command until continued, and
// continues them by itself when its time passes.
func TestPauseProcess(t *testing.T) {
	a := startAgentProcess(t)
	ctx := testCtx(t)
	p, err := a.c.Spawn(ctx, Cmd{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	state := func() byte {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.PID))
		if err != nil {
			t.Fatal(err)
		}
		_, rest, _ := strings.Cut(string(b), ") ")
		return rest[0]
	}
	waitState := func(want byte) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); state() != want; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("command state %c, want %c", state(), want)
			}
		}
	}
	if n, err := a.c.Pause(ctx, time.Minute); err != nil || n < 1 {
		t.Fatalf("pause: %d %v", n, err)
	}
	waitState('T')
	if err := a.c.Continue(ctx); err != nil {
		t.Fatal(err)
	}
	waitState('S')
	// A pause nobody ends ends by itself.
	if _, err := a.c.Pause(ctx, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	waitState('S')
	p.Kill(ctx)
}
