package agent

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

func TestRunOutputAndExitCode(t *testing.T) {
	for _, kind := range []transport{netPipe, osPipes} {
		l := startLinkOver(t, kind, ClientOptions{}, nil)
		var out, errOut syncbuf.Buffer
		st, err := l.c.Run(testCtx(t), Cmd{Args: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}, Stdout: &out, Stderr: &errOut})
		if err != nil {
			t.Fatal(err)
		}
		if st.Code != 3 || st.Signal != 0 || st.Success() {
			t.Errorf("status = %v, want exit status 3", st)
		}
		if out.String() != "out\n" || errOut.String() != "err\n" {
			t.Errorf("stdout %q stderr %q, want %q and %q", out.String(), errOut.String(), "out\n", "err\n")
		}
	}
}

func TestRunSignalled(t *testing.T) {
	l := startLink(t, ClientOptions{})
	st, err := l.c.Run(testCtx(t), Cmd{Args: []string{"sh", "-c", "kill -TERM $$"}})
	if err != nil {
		t.Fatal(err)
	}
	if st.Signal != syscall.SIGTERM || st.Code != -1 {
		t.Errorf("status = %+v, want signal SIGTERM and code -1", st)
	}
	if got := st.String(); got != "signal: terminated" {
		t.Errorf("String() = %q", got)
	}
}

func TestRunStdinAndDir(t *testing.T) {
	l := startLink(t, ClientOptions{})
	dir := t.TempDir()
	var out syncbuf.Buffer
	in := strings.Repeat("line of input\n", 10000) // several frames and windows
	st, err := l.c.Run(testCtx(t), Cmd{Args: []string{"sh", "-c", "pwd; wc -c"}, Dir: dir, Stdin: strings.NewReader(in), Stdout: &out})
	if err != nil || !st.Success() {
		t.Fatalf("status %v, err %v", st, err)
	}
	want := dir + "\n" + strconv.Itoa(len(in)) + "\n"
	if got := strings.ReplaceAll(out.String(), " ", ""); got != want {
		t.Errorf("output %q, want %q", got, want)
	}

	// Spawn with a stdin pipe: the command sees what we write, then EOF.
	lw := newLineWaiter()
	p, err := l.c.Spawn(testCtx(t), Cmd{Args: []string{"cat"}, StdinPipe: true, Stdout: lw})
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(p.Stdin, "hello\n")
	if got := lw.lines(t, 1); got[0] != "hello" {
		t.Errorf("cat echoed %q", got)
	}
	p.Stdin.Close()
	if st, err := p.Wait(testCtx(t)); err != nil || !st.Success() {
		t.Errorf("cat after EOF: %v %v", st, err)
	}
	// Without any stdin the command reads EOF at once.
	if st, err := l.c.Run(testCtx(t), Cmd{Args: []string{"cat"}}); err != nil || !st.Success() {
		t.Errorf("cat with empty stdin: %v %v", st, err)
	}
}

func TestRunErrors(t *testing.T) {
	l := startLink(t, ClientOptions{})
	_, err := l.c.Run(testCtx(t), Cmd{Args: []string{"no-such-program-sandgate"}})
	if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "not found in PATH=") {
		t.Errorf("missing program: %v, want fs.ErrNotExist naming PATH", err)
	}
	_, err = l.c.Run(testCtx(t), Cmd{})
	if !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("no args: %v, want fs.ErrInvalid", err)
	}
	_, err = l.c.Run(testCtx(t), Cmd{Args: []string{"true"}, Dir: "relative"})
	if !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("relative dir: %v", err)
	}
	_, err = l.c.Run(testCtx(t), Cmd{Args: []string{"true"}, Dir: "/no/such/dir"})
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing dir: %v, want fs.ErrNotExist", err)
	}
}

// TestRunContextKills: a Run whose context ends kills the command's group.
func TestRunContextKills(t *testing.T) {
	l := startLink(t, ClientOptions{})
	ctx, cancel := context.WithCancel(testCtx(t))
	lw := newLineWaiter()
	done := make(chan struct{})
	var st ExitStatus
	var err error
	go func() {
		defer close(done)
		st, err = l.c.Run(ctx, Cmd{Args: []string{"sh", "-c", "sleep 1000 & echo $!; wait"}, Stdout: lw})
	}()
	child := atoi(t, lw.lines(t, 1)[0])
	cancel()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return within 15s of its context ending")
	}
	if !errors.Is(err, context.Canceled) || st.Signal != syscall.SIGKILL {
		t.Errorf("Run = %v, %v; want context.Canceled and signal killed", st, err)
	}
	waitDead(t, child)
}

// TestKillProcessTree: a signal to a spawned command takes its whole
// process group, grandchildren included.
func TestKillProcessTree(t *testing.T) {
	l := startLink(t, ClientOptions{})
	lw := newLineWaiter()
	script := `sleep 1000 & echo $!; sh -c 'sleep 1000 & echo $!; wait' & wait`
	p, err := l.c.Spawn(testCtx(t), Cmd{Args: []string{"sh", "-c", script}, Stdout: lw})
	if err != nil {
		t.Fatal(err)
	}
	lines := lw.lines(t, 2)
	pids := []int{p.PID, atoi(t, lines[0]), atoi(t, lines[1])}
	for _, pid := range pids {
		if dead(pid) {
			t.Fatalf("process %d is not running before the kill", pid)
		}
	}
	if err := p.Kill(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	st, err := p.Wait(testCtx(t))
	if err != nil || st.Signal != syscall.SIGKILL {
		t.Errorf("Wait = %v, %v; want signal killed", st, err)
	}
	waitDead(t, pids...)
	if err := p.Signal(testCtx(t), syscall.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("Signal after the end = %v, want os.ErrProcessDone", err)
	}
}

// TestBackgroundHolderDoesNotHang: a background process that keeps the
// command's stdout open delays the exit report by WaitDelay, no more, and
// what the command wrote before exiting still arrives.
func TestBackgroundHolderDoesNotHang(t *testing.T) {
	l := startLink(t, ClientOptions{})
	var out syncbuf.Buffer
	lw := newLineWaiter()
	st, err := l.c.Run(testCtx(t), Cmd{
		Args:   []string{"sh", "-c", "sleep 1000 & echo $! >&2; echo done"},
		Stdout: &out,
		Stderr: lw,
		// What the command wrote before exiting must be read within it,
		// on a loaded machine too.
		WaitDelay: 2 * time.Second,
	})
	if err != nil || !st.Success() || out.String() != "done\n" {
		t.Errorf("Run = %v, %v, %q", st, err, out.String())
	}
	bg := atoi(t, lw.lines(t, 1)[0])
	syscall.Kill(bg, syscall.SIGKILL)
	waitDead(t, bg)
}

// TestBackpressure: a command writing far more than any window, read
// slowly, is held back by its reader: at every read, what the command has
// written is within a fixed bound of what the reader has taken. Without
// backpressure the producer would run ahead to the full 64 MiB.
func TestBackpressure(t *testing.T) {
	l := startLink(t, ClientOptions{})
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	const total = 64 << 20
	const bound = 2 << 20 // window (256 KiB) + pipe + frames, with room to spare
	count := filepath.Join(t.TempDir(), "count")
	sink := &boundedSink{t: t, countPath: count, bound: bound}
	st, err := l.c.Run(testCtx(t), Cmd{
		Args:   []string{exe},
		Env:    []string{"AGENT_TEST_HELPER=produce", "AGENT_TEST_BYTES=" + strconv.Itoa(total), "AGENT_TEST_COUNT=" + count},
		Stdout: sink,
	})
	if err != nil || !st.Success() {
		t.Fatalf("producer: %v %v", st, err)
	}
	if sink.received != total {
		t.Errorf("received %d bytes, want %d", sink.received, total)
	}
	t.Logf("producer was at most %d bytes ahead of the reader", sink.maxAhead)
}

// boundedSink is a slow reader that checks, at every write, how far the
// producer is ahead of it. At its first write it waits until the producer
// stops moving (blocked by backpressure, or finished without it).
type boundedSink struct {
	t         *testing.T
	countPath string
	bound     int64
	received  int64
	maxAhead  int64
	paused    bool
}

func (s *boundedSink) produced() int64 {
	b, err := os.ReadFile(s.countPath)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(string(b), 10, 64)
	return n
}

func (s *boundedSink) Write(p []byte) (int, error) {
	if !s.paused {
		s.paused = true
		last, stable := int64(-1), 0
		for deadline := time.Now().Add(10 * time.Second); stable < 40 && time.Now().Before(deadline); {
			if n := s.produced(); n == last {
				stable++
			} else {
				last, stable = n, 0
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	ahead := s.produced() - s.received
	s.maxAhead = max(s.maxAhead, ahead)
	if ahead > s.bound {
		s.t.Errorf("the producer is %d bytes ahead of its reader (bound %d): output is buffered without bound", ahead, s.bound)
		return 0, errors.New("unbounded")
	}
	s.received += int64(len(p))
	return len(p), nil
}

func TestSpawnWaitContextLeavesCommandRunning(t *testing.T) {
	l := startLink(t, ClientOptions{})
	p, err := l.c.Spawn(testCtx(t), Cmd{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := p.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Wait with a cancelled context = %v", err)
	}
	if dead(p.PID) {
		t.Error("the command died when a Wait's context ended")
	}
	p.Kill(testCtx(t))
	if st, _ := p.Wait(testCtx(t)); st.Signal != syscall.SIGKILL {
		t.Errorf("after Kill: %v", st)
	}
}

func TestConcurrentCommands(t *testing.T) {
	l := startLink(t, ClientOptions{})
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var out syncbuf.Buffer
			st, err := l.c.Run(testCtx(t), Cmd{Args: []string{"sh", "-c", "echo $0; exit $0", strconv.Itoa(i)}, Stdout: &out})
			if err != nil || st.Code != i || out.String() != strconv.Itoa(i)+"\n" {
				t.Errorf("command %d: %v %v %q", i, st, err, out.String())
			}
		}()
	}
	wg.Wait()
}
