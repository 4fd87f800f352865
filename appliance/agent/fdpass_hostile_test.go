package agent

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
)

// setBlocking clears O_NONBLOCK on c's open file description, as code in
// the sandbox may on its own copy of a socket it passed: a descriptor
// passed with SCM_RIGHTS shares its file status flags with the sender's.
func setBlocking(t *testing.T, c *net.TCPConn) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) {
		var fl int
		if fl, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0); ferr == nil {
			_, ferr = unix.FcntlInt(fd, unix.F_SETFL, fl&^unix.O_NONBLOCK)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if ferr != nil {
		t.Fatal(ferr)
	}
}

// tcpPair is a connected pair of loopback TCP sockets: the dialer's end,
// and the accepted end that the sandbox passes (it keeps its own copy).
func tcpPair(t *testing.T) (net.Conn, *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	pc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	return d, pc.(*net.TCPConn)
}

// proxyRig is a link over a socketpair whose egress a real relay.Proxy
// (configured by cfg, with a resolver that is never asked) serves through
// egress, under one sandbox.
func proxyRig(t *testing.T, cfg relay.Config, egress func(c net.Conn, serve func(net.Conn))) (*fdRig, *relay.Proxy) {
	t.Helper()
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{"127.0.0.1:9"}, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Close() })
	cfg.Decider = &netpolicy.Decider{Resolver: res}
	proxy, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	pol, err := netpolicy.ParsePolicy([]byte(`{"mode":"custom","allowedHosts":["api.example.com"]}`))
	if err != nil {
		t.Fatal(err)
	}
	tenant := relay.NewTenant("tenant-hostile", pol, nil)
	t.Cleanup(tenant.Close)
	serve := func(c net.Conn) { proxy.ServeConn(context.Background(), c, tenant) }
	r := &fdRig{logs: &syncbuf.Buffer{}}
	r.l = startLinkOver(t, socketPair, ClientOptions{
		Logger: slog.New(slog.NewJSONHandler(r.logs, nil)),
		Egress: func(c net.Conn, _ Peer) { egress(c, serve) },
	}, func(s *server) { r.s = s })
	return r, proxy
}

// TestPassedSocketMadeBlockingKeepsDeadlines: a hostile agent passes a connected TCP
// socket, keeps its own copy and clears O_NONBLOCK on it after the
// service made it non-blocking. The service's read then blocks in the
// kernel: its read deadline never fires, and Close (the link-down cut,
// Proxy.Close, a sandbox's destroy) waits for that read forever. Each
// such socket pins one OS thread of the service; past Go's 10000-thread
// limit the whole service dies.
func TestPassedSocketMadeBlockingKeepsDeadlines(t *testing.T) {
	skipIfNotLinux(t)
	r := newFDRig(t)
	d, peer := tcpPair(t) // peer: the sandbox's own copy of the accepted socket

	r.s.passFD(dupOf(t, peer), "hostile", "", nil)
	var c net.Conn
	select {
	case c = <-r.egress:
	case <-time.After(10 * time.Second):
		t.Fatalf("Egress got nothing within 10s; log:\n%s", r.logs.String())
	}
	// The service's FileConn set O_NONBLOCK on the shared description; the
	// sandbox takes it off again.
	setBlocking(t, peer)

	// The service reads its request under a deadline, as relay.Proxy does.
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	readDone := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 64))
		readDone <- err
	}()
	stuck := false
	select {
	case err := <-readDone:
		t.Logf("read returned: %v", err)
	case <-time.After(30 * time.Second):
		stuck = true
		t.Errorf("a read with a 200ms deadline on a passed socket had not returned after 30s: the sandbox made it blocking (it shares the open file description); the deadline cannot fire")
	}
	closeDone := make(chan struct{})
	go func() {
		c.Close()
		close(closeDone)
	}()
	if stuck {
		select {
		case <-closeDone:
		case <-time.After(2 * time.Second):
			t.Errorf("Close of that socket had not returned after 2s: it waits for the blocked read (the link-down cut and Proxy.Close hang too)")
		}
		// Unstick the service's thread so that the test ends.
		d.Write([]byte("x"))
		select {
		case <-readDone:
		case <-time.After(10 * time.Second):
			t.Fatal("the blocked read did not return after data arrived")
		}
	}
	select {
	case <-closeDone:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return within 10s")
	}
}

// TestPassedSocketMadeBlockingCannotHangProxy: the same attack on a real
// relay.Proxy. The sandbox sends part of a request line, so the proxy's
// next read of the headers is a blocking read(2): HeaderTimeout (200ms
// here) never fires, the sandbox's connection slot is never released, and
// Proxy.Close — the service's shutdown — does not return.
func TestPassedSocketMadeBlockingCannotHangProxy(t *testing.T) {
	skipIfNotLinux(t)
	served := make(chan struct{}, 1)
	finished := make(chan struct{}, 1)
	r, proxy := proxyRig(t, relay.Config{HeaderTimeout: 200 * time.Millisecond}, func(c net.Conn, serve func(net.Conn)) {
		served <- struct{}{}
		serve(c)
		finished <- struct{}{}
	})
	d, peer := tcpPair(t)
	r.s.passFD(dupOf(t, peer), "hostile", "", nil)
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatalf("Egress got nothing within 10s; log:\n%s", r.logs.String())
	}
	setBlocking(t, peer)
	io.WriteString(d, "CONNECT api.exam") // wakes the proxy's parked read; its next read blocks

	hung := false
	select {
	case <-finished:
		t.Log("the proxy gave up on the half-sent request (HeaderTimeout)")
	case <-time.After(30 * time.Second):
		hung = true
		t.Errorf("the proxy still served a connection 30s after its 200ms HeaderTimeout: the sandbox made the passed socket blocking")
	}
	closed := make(chan struct{})
	go func() {
		proxy.Close()
		close(closed)
	}()
	if hung {
		select {
		case <-closed:
		case <-time.After(2 * time.Second):
			t.Errorf("Proxy.Close had not returned after 2s: it waits for the blocked read")
		}
		d.Close() // EOF ends the blocked read, so that the test ends
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Proxy.Close did not return within 10s of the sandbox closing its end")
	}
}

// TestRefusalBeyondCapNotPinnedByBlockingSocket: the relay's per-sandbox cap does not
// bound the threads a sandbox can pin. With the sandbox at its cap, a
// further passed socket is refused with a short error response — but the
// sandbox has filled that socket's send queue (writing on its own copy of
// the very socket) and made it blocking, so the refusal's write blocks
// past its write deadline (1s here, 10s by default). Nothing on the link bounds how many
// passed sockets reach Egress at once (the 64 pending slots are released
// before Egress), so every further socket is one more pinned thread of
// the service, up to Go's 10000-thread limit, which kills the process.
// The test's Egress waits for the sandbox's move before serving: a real
// attacker races the service for it, and each race it wins is a thread.
func TestRefusalBeyondCapNotPinnedByBlockingSocket(t *testing.T) {
	skipIfNotLinux(t)
	served := make(chan struct{}, 2)
	goOn := make(chan struct{}, 2)
	finished := make(chan struct{}, 2)
	r, proxy := proxyRig(t, relay.Config{MaxConns: 1, ErrorWriteTimeout: time.Second}, func(c net.Conn, serve func(net.Conn)) {
		served <- struct{}{}
		<-goOn
		serve(c)
		finished <- struct{}{}
	})
	defer proxy.Close()
	// The first connection takes the sandbox's one slot and idles.
	_, p1 := tcpPair(t)
	r.s.passFD(dupOf(t, p1), "slot", "", nil)
	<-served
	goOn <- struct{}{}

	d2, p2 := tcpPair(t)
	r.s.passFD(dupOf(t, p2), "hostile", "", nil)
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatalf("Egress got nothing within 10s; log:\n%s", r.logs.String())
	}
	// Fill the socket's send queue from the sandbox's copy (d2 never reads).
	// Large writes first, then ever smaller ones, until not one byte fits.
	filled := 0
	for _, size := range []int{64 << 10, 1 << 10, 1} {
		chunk := make([]byte, size)
		for i := 0; i < 4096; i++ { // bounded: loopback queues hold a few MiB
			p2.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
			n, err := p2.Write(chunk)
			filled += n
			if err != nil {
				break
			}
		}
	}
	t.Logf("the sandbox queued %d bytes on the socket", filled)
	setBlocking(t, p2)
	goOn <- struct{}{}
	hung := false
	select {
	case <-finished:
		t.Log("the refusal returned")
	case <-time.After(15 * time.Second):
		hung = true
		t.Errorf("refusing a connection beyond the sandbox's cap had not returned after 15s (its write deadline is 1s): the thread is pinned")
	}
	if hung {
		d2.Close() // unblocks the write (EPIPE/RST), so that the test ends
		select {
		case <-finished:
		case <-time.After(10 * time.Second):
			t.Fatal("the refusal did not return within 10s of the sandbox closing its end")
		}
	}
}

// TestTinyWritesFullOfFDsLeakNothing: a hostile agent sends a yamux ping one
// byte per sendmsg, each byte carrying the kernel's most descriptors (253).
// The service keeps at most maxHeldFDs of them, closes the rest at once,
// still answers on the link, and leaks none once they expire.
func TestTinyWritesFullOfFDsLeakNothing(t *testing.T) {
	skipIfNotLinux(t)
	r := newFDRig(t)
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	base := fdCount(t)
	// A yamux ping (SYN, stream 0, opaque 7): valid bytes on the link.
	ping := []byte{0, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7}
	const perWrite = 253
	r.s.sender().wmu.Lock() // the agent's own writes wait: no interleaving
	for _, b := range ping {
		fds := make([]int, perWrite)
		for i := range fds {
			fds[i] = dupOf(t, null)
		}
		_, _, err := r.s.sender().uc.WriteMsgUnix([]byte{b}, unix.UnixRights(fds...), nil)
		for _, fd := range fds {
			unix.Close(fd)
		}
		if err != nil {
			r.s.sender().wmu.Unlock()
			t.Fatal(err)
		}
	}
	r.s.sender().wmu.Unlock()
	tab := r.l.c.fds
	sent := uint64(len(ping) * perWrite)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		tab.mu.Lock()
		recv := tab.recv
		tab.mu.Unlock()
		if recv == sent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the service received %d of %d descriptors within 10s", recv, sent)
		}
	}
	if n := tab.size(); n > maxHeldFDs {
		t.Errorf("the service holds %d descriptors, over the cap %d", n, maxHeldFDs)
	}
	if _, err := r.l.c.Ping(testCtx(t)); err != nil {
		t.Errorf("the link after the flood: %v", err)
	}
	waitFDs(t, base+tab.size())
	tab.sweep(time.Now().Add(tab.ttl + time.Second))
	waitFDs(t, base)
}
