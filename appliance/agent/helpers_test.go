package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// TestMain doubles as the helper programs tests run as commands: the
// test binary, re-executed with AGENT_TEST_HELPER set.
func TestMain(m *testing.M) {
	switch os.Getenv("AGENT_TEST_HELPER") {
	case "":
	case "produce":
		produce()
		os.Exit(0)
	case "connect":
		connect()
		os.Exit(0)
	default:
		os.Exit(99)
	}
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// produce writes AGENT_TEST_BYTES bytes to stdout in 64 KiB writes and,
// after each write returns, records the total written so far in the file
// AGENT_TEST_COUNT (replaced atomically), so a test can see how far ahead
// of its reader the producer got.
func produce() {
	total, _ := strconv.ParseInt(os.Getenv("AGENT_TEST_BYTES"), 10, 64)
	countPath := os.Getenv("AGENT_TEST_COUNT")
	chunk := bytes.Repeat([]byte("0123456789abcdef"), 4096)
	var written int64
	for written < total {
		n, err := os.Stdout.Write(chunk[:min(int64(len(chunk)), total-written)])
		written += int64(n)
		if err != nil {
			os.Exit(3)
		}
		tmp := countPath + ".tmp"
		os.WriteFile(tmp, []byte(strconv.FormatInt(written, 10)), 0o644)
		os.Rename(tmp, countPath)
	}
}

// testConfig is the agent configuration tests use: a relay listener on a
// free port, a kill-all scope that can never reach beyond the test's own
// processes, and a HOME (a command's default directory) the test's user
// can enter: the default /root is not, when the tests run as another user.
func testConfig() Config {
	home := DefaultHome
	if os.Geteuid() != 0 {
		home = os.TempDir()
	}
	return Config{RelayAddr: "127.0.0.1:0", KillScope: KillDescendants, Home: home}
}

func skipIfNotLinux(t testing.TB) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("the agent runs commands with Linux process groups and /proc: Linux only")
	}
}

// link is an in-process agent and its client.
type link struct {
	c      *Client
	served chan error // Serve's result
	agent  io.Closer  // the agent's end of the transport
}

type transport int

const (
	netPipe transport = iota
	osPipes
	// socketPair is a unix stream socketpair, each end a *net.UnixConn:
	// the link `sandgate sandbox` gives, over which sockets are passed.
	socketPair
)

func (k transport) String() string {
	return [...]string{"net.Pipe", "os.Pipe", "socketpair"}[k]
}

// pipePair returns the two ends of a transport.
func pipePair(t testing.TB, kind transport) (io.ReadWriteCloser, io.ReadWriteCloser) {
	t.Helper()
	if kind == netPipe {
		a, b := net.Pipe()
		return a, b
	}
	if kind == socketPair {
		return unixPair(t)
	}
	r1, w1, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	r2, w2, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	return rwc{r1, w2}, rwc{r2, w1}
}

// unixPair returns the two ends of a unix stream socketpair.
func unixPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var ends [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		ends[i] = c.(*net.UnixConn)
	}
	return ends[0], ends[1]
}

// rwc joins a read and a write pipe.
type rwc struct {
	r *os.File
	w *os.File
}

func (p rwc) Read(b []byte) (int, error)  { return p.r.Read(b) }
func (p rwc) Write(b []byte) (int, error) { return p.w.Write(b) }
func (p rwc) Close() error {
	p.w.Close()
	return p.r.Close()
}

// startLink serves an agent in-process and connects a client to it.
func startLink(t *testing.T, opts ClientOptions) *link {
	t.Helper()
	return startLinkOver(t, netPipe, opts, nil)
}

func startLinkOver(t *testing.T, kind transport, opts ClientOptions, tweak func(*server)) *link {
	t.Helper()
	skipIfNotLinux(t)
	if opts.Config.RelayAddr == "" {
		opts.Config.RelayAddr = testConfig().RelayAddr
	}
	if opts.Config.KillScope == "" {
		opts.Config.KillScope = KillDescendants
	}
	if opts.Config.Home == "" {
		opts.Config.Home = testConfig().Home
	}
	svc, agentEnd := pipePair(t, kind)
	s := newServer(ServerOptions{})
	if tweak != nil {
		tweak(s)
	}
	l := &link{served: make(chan error, 1), agent: agentEnd}
	go func() { l.served <- s.serve(context.Background(), agentEnd) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := NewClient(ctx, svc, opts)
	if err != nil {
		agentEnd.Close()
		t.Fatalf("NewClient: %v", err)
	}
	l.c = c
	t.Cleanup(func() {
		c.Close()
		select {
		case err := <-l.served:
			if err != nil {
				t.Errorf("Serve returned %v after the client closed the link, want nil", err)
			}
		case <-time.After(15 * time.Second):
			t.Error("Serve did not return within 15s of the link closing")
		}
	})
	return l
}

// ctx returns a context bounded for one test step.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// lineWaiter collects output and lets a test wait (bounded) for lines.
type lineWaiter struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	moved chan struct{}
}

func newLineWaiter() *lineWaiter { return &lineWaiter{moved: make(chan struct{}, 1)} }

func (l *lineWaiter) Write(p []byte) (int, error) {
	l.mu.Lock()
	l.buf.Write(p)
	l.mu.Unlock()
	select {
	case l.moved <- struct{}{}:
	default:
	}
	return len(p), nil
}

// lines waits until at least n complete lines arrived, up to 10s.
func (l *lineWaiter) lines(t testing.TB, n int) []string {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		l.mu.Lock()
		s := l.buf.String()
		l.mu.Unlock()
		if strings.Count(s, "\n") >= n {
			return strings.Split(strings.TrimSuffix(s, "\n"), "\n")
		}
		select {
		case <-l.moved:
		case <-deadline:
			t.Fatalf("waited 10s for %d lines of output, have %q", n, s)
		}
	}
}

// dead reports whether pid no longer runs: gone, or a zombie.
func dead(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return true
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	pi, ok := parseStat(b)
	return ok && pi.state == 'Z'
}

// waitDead waits (up to 10s) for every pid to be dead.
func waitDead(t testing.TB, pids ...int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range pids {
		for !dead(pid) {
			if time.Now().After(deadline) {
				t.Fatalf("process %d still runs 10s after it was killed", pid)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

func atoi(t testing.TB, s string) int {
	t.Helper()
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		t.Fatalf("not a number: %q", s)
	}
	return n
}
