package agent

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

// fdCount is how many descriptors this process has open.
func fdCount(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents) - 1 // ReadDir's own
}

// waitFDs waits (up to 10s) for the process to have want descriptors
// open: descriptors are closed by goroutines on both ends of the link.
func waitFDs(t testing.TB, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := fdCount(t)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			ents, _ := os.ReadDir("/proc/self/fd")
			var list []string
			for _, e := range ents {
				dst, _ := os.Readlink("/proc/self/fd/" + e.Name())
				list = append(list, e.Name()+"→"+dst)
			}
			t.Fatalf("%d descriptors open after 10s, want %d (a leak): %s", got, want, strings.Join(list, " "))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// dupOf returns a close-on-exec duplicate of sc's descriptor.
func dupOf(t testing.TB, sc syscall.Conn) int {
	t.Helper()
	rc, err := sc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	var derr error
	if err := rc.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 3) }); err != nil {
		t.Fatal(err)
	}
	if derr != nil {
		t.Fatal(derr)
	}
	return fd
}

// fdRig is an in-process agent and client over a socketpair, with the
// client's log captured and the conns handed to Egress delivered to the
// test.
type fdRig struct {
	l      *link
	s      *server
	logs   *syncbuf.Buffer
	egress chan net.Conn
}

func newFDRig(t *testing.T) *fdRig {
	t.Helper()
	r := &fdRig{logs: &syncbuf.Buffer{}, egress: make(chan net.Conn, 16)}
	r.l = startLinkOver(t, socketPair, ClientOptions{
		Logger: slog.New(slog.NewJSONHandler(r.logs, nil)),
		Egress: func(c net.Conn, _ Peer) { r.egress <- c },
	}, func(s *server) { r.s = s })
	if !r.l.c.Info().FDPass {
		t.Fatal("Info().FDPass = false over a socketpair, want true")
	}
	return r
}

// waitLog waits (up to 10s) for the client's log to hold n lines with s.
func (r *fdRig) waitLog(t *testing.T, s string, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); strings.Count(r.logs.String(), s) < n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the client logged %q %d times within 10s, want %d; log:\n%s", s, strings.Count(r.logs.String(), s), n, r.logs.String())
		}
	}
}

// request sends an egress request naming socket seq, as a hostile agent
// may.
func (r *fdRig) request(t *testing.T, seq uint64) {
	t.Helper()
	st, err := r.s.session().OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	if err := newFramer(st).msg(request{Op: "egress", From: "hostile", FD: seq}); err != nil {
		t.Fatal(err)
	}
	st.Close()
}

func (r *fdRig) noEgress(t *testing.T) {
	t.Helper()
	select {
	case c := <-r.egress:
		c.Close()
		t.Fatalf("Egress got a %T from a refused socket", c)
	default:
	}
}

// TestFDPassHostile: an agent taken over by code in the sandbox can send
// any descriptor it holds; the service hands Egress only connected TCP
// sockets, refuses the rest and keeps no descriptor of what it refused.
func TestFDPassHostile(t *testing.T) {
	skipIfNotLinux(t)
	r := newFDRig(t)
	refusals := 0
	refuse := func(name string, sc syscall.Conn) {
		t.Helper()
		base := fdCount(t)
		r.s.passFD(dupOf(t, sc), name, "", nil)
		refusals++
		r.waitLog(t, "refused a socket the agent passed", refusals)
		waitFDs(t, base)
		r.noEgress(t)
	}

	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	refuse("a file", null)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	refuse("a listening socket", ln.(*net.TCPListener))

	ua, ub := unixPair(t)
	refuse("a unix socket", ua)
	ua.Close()
	ub.Close()

	udp, err := net.DialUDP("udp", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9})
	if err != nil {
		t.Fatal(err)
	}
	refuse("a connected UDP socket", udp)
	udp.Close()

	sfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	unconnected := os.NewFile(uintptr(sfd), "unconnected")
	refuse("an unconnected TCP socket", unconnected)
	unconnected.Close()

	// Requests naming sockets never sent, or already claimed.
	base := fdCount(t)
	r.request(t, 1) // the file above: claimed and refused already
	refusals++
	r.waitLog(t, "already claimed", 1)
	r.request(t, 1<<40)
	refusals++
	r.waitLog(t, "beyond any the agent could have sent", 1)
	r.waitLog(t, "refused a socket the agent passed", refusals)
	waitFDs(t, base)
	r.noEgress(t)

	// And a connected TCP socket is served: the very socket the sandbox
	// process holds the other end of.
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	r.s.passFD(dupOf(t, d.(*net.TCPConn)), "good", "", nil)
	d.Close()
	var c net.Conn
	select {
	case c = <-r.egress:
	case <-time.After(10 * time.Second):
		t.Fatalf("Egress got nothing for a connected TCP socket within 10s; log:\n%s", r.logs.String())
	}
	if _, ok := c.(*passedConn); !ok {
		t.Errorf("Egress got a %T, want *passedConn", c)
	}
	io.WriteString(c, "through the passed socket")
	c.Close()
	peer.SetDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(peer)
	if err != nil || string(b) != "through the passed socket" {
		t.Errorf("the other end read %q, %v", b, err)
	}
	peer.Close()
	waitFDs(t, base)
}

// TestFDPassCap: sockets that no request claims are held at most
// maxHeldFDs at a time (the rest closed at once) and closed after the TTL.
func TestFDPassCap(t *testing.T) {
	skipIfNotLinux(t)
	r := newFDRig(t)
	base := fdCount(t)
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	const sent = maxHeldFDs + 44
	for range sent {
		if _, ok := r.s.sender().attach(dupOf(t, null)); !ok {
			t.Fatal("attach refused on a live link")
		}
	}
	null.Close()
	// The sockets ride on the link's next writes: make some.
	tab := r.l.c.fds
	for deadline := time.Now().Add(10 * time.Second); ; {
		tab.mu.Lock()
		recv := tab.recv
		tab.mu.Unlock()
		if recv == sent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the client received %d of %d sockets within 10s", recv, sent)
		}
		if _, err := r.l.c.Ping(testCtx(t)); err != nil {
			t.Fatal(err)
		}
	}
	if n := tab.size(); n != maxHeldFDs {
		t.Errorf("the client holds %d sockets, want the cap %d", n, maxHeldFDs)
	}
	r.waitLog(t, "closed the extra ones", 1)
	waitFDs(t, base+maxHeldFDs)
	tab.sweep(time.Now().Add(tab.ttl + time.Second))
	if n := tab.size(); n != 0 {
		t.Errorf("the client holds %d sockets past their TTL, want 0", n)
	}
	waitFDs(t, base)
	r.waitLog(t, "no egress request claimed", 1)
}

// TestFDTableClaimWaits: a claim waits (bounded) for its socket, which
// may arrive after the request naming it, and gives up after the wait.
func TestFDTableClaimWaits(t *testing.T) {
	skipIfNotLinux(t)
	tab := newFDTable(slog.New(slog.DiscardHandler), time.Minute)
	defer tab.close(ErrLinkDown)
	if _, err := tab.claim(1, 50*time.Millisecond); err == nil || !strings.Contains(err.Error(), "did not arrive") {
		t.Errorf("claim of a socket that never comes: %v", err)
	}
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	got := make(chan error, 1)
	go func() {
		fd, err := tab.claim(1, 10*time.Second)
		if err == nil {
			unix.Close(fd)
		}
		got <- err
	}()
	tab.receive(unix.UnixRights(dupOf(t, null)), false)
	if err := <-got; err != nil {
		t.Errorf("claim of a socket that arrives while it waits: %v", err)
	}
	// A truncated message loses the numbering: everything is refused.
	tab.receive(unix.UnixRights(dupOf(t, null)), true)
	if _, err := tab.claim(2, time.Second); err == nil || !strings.Contains(err.Error(), "truncated") {
		t.Errorf("claim after truncation: %v", err)
	}
}

// TestFDPassProcess: `sandgate agent` as a real process whose stdin and
// stdout are one end of a socketpair (as `sandgate sandbox exec` gives
// it) detects the socket, passes egress connections as sockets, and
// exits when the service closes its end.
func TestFDPassProcess(t *testing.T) {
	skipIfNotLinux(t)
	bin := sandgateBinary(t)
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	child := os.NewFile(uintptr(fds[1]), "agent-stdio")
	ours := os.NewFile(uintptr(fds[0]), "agent-link")
	c, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &syncbuf.Buffer{}
	cmd := exec.Command(bin, "agent")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = child, child, stderr
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	child.Close()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			cmd.Process.Kill()
			t.Errorf("sandgate agent did not exit within 15s of its link closing; stderr:\n%s", stderr.String())
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl, err := NewClient(ctx, c, ClientOptions{Config: testConfig(), Egress: func(c net.Conn, _ Peer) {
		fmt.Fprintf(c, "served a %T", c)
		c.Close()
	}})
	if err != nil {
		t.Fatalf("NewClient: %v; agent stderr:\n%s", err, stderr.String())
	}
	defer cl.Close()
	if !cl.Info().FDPass {
		t.Errorf("Info().FDPass = false with the agent's stdio a socketpair, want true; agent stderr:\n%s", stderr.String())
	}
	conn, err := net.DialTimeout("tcp", cl.Info().RelayAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(conn)
	if err != nil || string(b) != "served a *agent.passedConn" {
		t.Errorf("through the relay listener: %q, %v; want the passed socket served", b, err)
	}
	// Commands still work over the taken-over link.
	var out syncbuf.Buffer
	if st, err := cl.Run(ctx, Cmd{Args: []string{"echo", "hi"}, Stdout: &out}); err != nil || !st.Success() || out.String() != "hi\n" {
		t.Errorf("echo over the socket link: %v %v %q", st, err, out.String())
	}
	cl.Close()
}
