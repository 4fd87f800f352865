package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Descriptor passing: when the link is a unix stream socket (the launcher
// gives `sandgate sandbox exec … -- sandgate agent` one end of a
// socketpair as both stdin and stdout), the agent hands each connection
// accepted on its relay listener to the service as a descriptor
// (SCM_RIGHTS) instead of copying its bytes over a yamux stream. The
// service then serves the sandbox's own TCP socket with relay.Proxy, as
// the standalone proxy serves its clients: no agent wake-up and no yamux
// frame per chunk of a download. README.md ("Descriptor passing") is the
// wire description.
//
// A descriptor rides, as ancillary data, on the next write of the yamux
// byte stream (a stream socket carries ancillary data only with at least
// one byte of normal data; no byte is ever added to the stream for it).
// Both sides number descriptors in the order they travel, from 1, and an
// egress request names its descriptor by that number.

// Limits of descriptor passing.
const (
	// maxFDsPerWrite is how many pending descriptors one link write
	// carries. Every egress connection causes several writes (the stream's
	// SYN, its request, its FIN), so descriptors never wait long.
	maxFDsPerWrite = 64
	// maxHeldFDs caps the descriptors the service holds for egress
	// requests not yet read; more are closed at once (and the egress
	// request naming one is refused).
	maxHeldFDs = 256
	// fdOOBBytes fits the kernel's most descriptors in one message
	// (SCM_MAX_FD, 253), so a message is never truncated, whatever a
	// hostile agent sends.
	fdOOBBytes = 2048
)

// isUnixStream reports whether fd is an AF_UNIX SOCK_STREAM socket.
func isUnixStream(fd int) bool {
	dom, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil || dom != unix.AF_UNIX {
		return false
	}
	typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	return err == nil && typ == unix.SOCK_STREAM
}

// unixStream reports whether uc is a stream socket (not a datagram or
// seqpacket one, which cannot carry a yamux session).
func unixStream(uc *net.UnixConn) bool {
	rc, err := uc.SyscallConn()
	if err != nil {
		return false
	}
	ok := false
	rc.Control(func(fd uintptr) { ok = isUnixStream(int(fd)) })
	return ok
}

// agentLink returns the link Serve speaks on and, when the link is a unix
// stream socket (a *net.UnixConn: see StdioLink), the sender that attaches
// descriptors to it.
func agentLink(conn io.ReadWriteCloser) (io.ReadWriteCloser, *fdSender) {
	uc, ok := conn.(*net.UnixConn)
	if !ok || !unixStream(uc) {
		return conn, nil
	}
	l := &fdSender{uc: uc}
	return l, l
}

// fdSender is the agent's link when it is a unix stream socket: it reads
// and writes the socket, and attaches pending descriptors to its writes.
type fdSender struct {
	uc *net.UnixConn

	wmu sync.Mutex // one write at a time: descriptors go out in order

	mu      sync.Mutex
	pending []int  // descriptors attached and not yet sent, in order
	seq     uint64 // the number of the last descriptor attached
	closed  bool
}

// attach queues fd to ride on the link's next write and returns its
// number. The sender owns fd from then on: it closes it once sent, or when
// the link closes. ok is false (and fd is closed) when the link is closed.
func (l *fdSender) attach(fd int) (seq uint64, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		unix.Close(fd)
		return 0, false
	}
	l.seq++
	l.pending = append(l.pending, fd)
	return l.seq, true
}

func (l *fdSender) take() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := min(len(l.pending), maxFDsPerWrite)
	if n == 0 {
		return nil
	}
	fds := append([]int(nil), l.pending[:n]...)
	l.pending = append(l.pending[:0], l.pending[n:]...)
	return fds
}

func (l *fdSender) Read(p []byte) (int, error) { return l.uc.Read(p) }

// Write writes p; pending descriptors ride on its first byte(s).
func (l *fdSender) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	fds := l.take()
	if len(fds) == 0 {
		return l.uc.Write(p)
	}
	n, _, err := l.uc.WriteMsgUnix(p, unix.UnixRights(fds...), nil)
	// Sent, or not sent and the link failing: either way this copy goes.
	for _, fd := range fds {
		unix.Close(fd)
	}
	if err != nil || n == len(p) {
		return n, err
	}
	m, err := l.uc.Write(p[n:])
	return n + m, err
}

// Close closes the link and every descriptor not yet sent.
func (l *fdSender) Close() error {
	l.mu.Lock()
	l.closed = true
	for _, fd := range l.pending {
		unix.Close(fd)
	}
	l.pending = nil
	l.mu.Unlock()
	return l.uc.Close()
}

// dupListener returns a close-on-exec duplicate of ln's descriptor.
func dupListener(ln *net.TCPListener) (int, error) {
	rc, err := ln.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(f uintptr) { fd, derr = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, err
	}
	return fd, derr
}

// dupConn returns a close-on-exec duplicate of c's descriptor.
func dupConn(c *net.TCPConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 3) }); err != nil {
		return -1, err
	}
	return fd, derr
}

// ---- service side ----

// fdReceiver is the service's link when it is a unix stream socket: it
// reads with recvmsg (MSG_CMSG_CLOEXEC, which net.UnixConn sets on Linux)
// and files every descriptor that arrives into its table before the bytes
// it rode on reach yamux, so an egress request always finds its
// descriptor already there.
type fdReceiver struct {
	uc  *net.UnixConn
	oob []byte // one reader at a time: yamux's receive loop
	tab *fdTable
}

func (l *fdReceiver) Read(p []byte) (int, error) {
	n, oobn, flags, _, err := l.uc.ReadMsgUnix(p, l.oob)
	n, oobn = max(n, 0), max(oobn, 0) // -1 on some errors
	if oobn > 0 || flags&unix.MSG_CTRUNC != 0 {
		l.tab.receive(l.oob[:oobn], flags&unix.MSG_CTRUNC != 0)
	}
	if n == 0 && err == nil && len(p) > 0 {
		err = io.EOF
	}
	return n, err
}

func (l *fdReceiver) Write(p []byte) (int, error) { return l.uc.Write(p) }

func (l *fdReceiver) Close() error {
	l.tab.close(ErrLinkDown)
	return l.uc.Close()
}

// fdTable holds the descriptors the agent sent until the egress request
// naming each claims it. It is bounded (maxHeldFDs; extras are closed)
// and every descriptor not claimed within ttl is closed.
type fdTable struct {
	log *slog.Logger
	ttl time.Duration
	max int

	mu      sync.Mutex
	recv    uint64 // descriptors received so far: the last one's number
	held    map[uint64]heldFD
	arrived chan struct{} // closed (and replaced) when descriptors arrive
	err     error         // set once numbering is lost or the link closed
}

type heldFD struct {
	fd int
	at time.Time
}

func newFDTable(log *slog.Logger, ttl time.Duration) *fdTable {
	return &fdTable{log: log, ttl: ttl, max: maxHeldFDs, held: map[uint64]heldFD{}, arrived: make(chan struct{})}
}

// receive files the descriptors of one message's ancillary data.
func (t *fdTable) receive(oob []byte, truncated bool) {
	var fds []int
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err == nil {
		for i := range msgs {
			if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
				continue
			}
			got, err := unix.ParseUnixRights(&msgs[i])
			if err == nil {
				fds = append(fds, got...)
			}
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if truncated || err != nil {
		// The kernel dropped descriptors: the numbering is lost for good.
		for _, fd := range fds {
			unix.Close(fd)
		}
		t.failLocked(errors.New("descriptors from the agent were truncated; the link no longer passes sockets"))
		t.log.Error("agent: ancillary data from the agent was truncated; refusing passed sockets on this link from now on")
		return
	}
	now := time.Now()
	dropped := 0
	for _, fd := range fds {
		t.recv++
		if t.err != nil || len(t.held) >= t.max {
			unix.Close(fd)
			dropped++
			continue
		}
		t.held[t.recv] = heldFD{fd: fd, at: now}
	}
	if dropped > 0 {
		t.log.Warn("agent: the agent sent more sockets than are awaiting their egress request; closed the extra ones",
			"dropped", dropped, "held", len(t.held), "cap", t.max)
	}
	close(t.arrived)
	t.arrived = make(chan struct{})
}

// claim takes descriptor seq out of the table, waiting up to wait for it
// to arrive.
func (t *fdTable) claim(seq uint64, wait time.Duration) (int, error) {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		t.mu.Lock()
		if h, ok := t.held[seq]; ok {
			delete(t.held, seq)
			t.mu.Unlock()
			return h.fd, nil
		}
		switch {
		case t.err != nil:
			err := t.err
			t.mu.Unlock()
			return -1, err
		case seq <= t.recv:
			t.mu.Unlock()
			return -1, fmt.Errorf("socket %d was already claimed, expired or dropped", seq)
		case seq > t.recv+uint64(t.max):
			recv := t.recv
			t.mu.Unlock()
			return -1, fmt.Errorf("socket %d is beyond any the agent could have sent (%d so far)", seq, recv)
		}
		ch := t.arrived
		t.mu.Unlock()
		select {
		case <-ch:
		case <-timer.C:
			return -1, fmt.Errorf("socket %d did not arrive within %s", seq, wait)
		}
	}
}

// sweep closes descriptors held longer than ttl.
func (t *fdTable) sweep(now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for seq, h := range t.held {
		if now.Sub(h.at) > t.ttl {
			unix.Close(h.fd)
			delete(t.held, seq)
			n++
		}
	}
	if n > 0 {
		t.log.Warn("agent: closed sockets the agent passed that no egress request claimed", "closed", n, "after", t.ttl.String())
	}
}

// janitor sweeps the table until done is closed.
func (t *fdTable) janitor(done <-chan struct{}) {
	tick := time.NewTicker(max(t.ttl/4, 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-done:
			t.close(ErrLinkDown)
			return
		case now := <-tick.C:
			t.sweep(now)
		}
	}
}

// close closes every held descriptor and refuses the ones still to come.
func (t *fdTable) close(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.failLocked(err)
}

func (t *fdTable) failLocked(err error) {
	for seq, h := range t.held {
		unix.Close(h.fd)
		delete(t.held, seq)
	}
	if t.err == nil {
		t.err = err
		close(t.arrived)
		t.arrived = make(chan struct{})
	}
}

// size reports how many descriptors wait for their egress request.
func (t *fdTable) size() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.held)
}

// egressConn checks that fd, passed by the agent, is a connected TCP
// socket and returns it as a passedConn. The agent is untrusted (code in
// the sandbox may have taken it over) and may send any descriptor it
// holds: a file, a listening socket, a unix socket or a datagram socket is
// refused. fd is consumed either way.
func egressConn(fd int) (net.Conn, error) {
	fail := func(format string, a ...any) (net.Conn, error) {
		unix.Close(fd)
		return nil, fmt.Errorf(format, a...)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fail("fstat: %v", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return fail("not a socket (file mode %#o)", st.Mode&unix.S_IFMT)
	}
	opt := func(o int) int {
		v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, o)
		if err != nil {
			return -1
		}
		return v
	}
	if d := opt(unix.SO_DOMAIN); d != unix.AF_INET && d != unix.AF_INET6 {
		return fail("socket of address family %d, want AF_INET or AF_INET6", d)
	}
	if ty := opt(unix.SO_TYPE); ty != unix.SOCK_STREAM {
		return fail("socket of type %d, want SOCK_STREAM", ty)
	}
	if p := opt(unix.SO_PROTOCOL); p != unix.IPPROTO_TCP {
		return fail("socket of protocol %d, want TCP", p)
	}
	if opt(unix.SO_ACCEPTCONN) != 0 {
		return fail("a listening socket")
	}
	if _, err := unix.Getpeername(fd); err != nil {
		return fail("not connected: %v", err)
	}
	f := os.NewFile(uintptr(fd), "egress")
	c, err := net.FileConn(f)
	f.Close() // FileConn made its own duplicate
	if err != nil {
		return nil, err
	}
	tc, ok := c.(*net.TCPConn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("became a %T, want a TCP connection", c)
	}
	pc, err := newPassedConn(tc)
	if err != nil {
		tc.Close()
		return nil, err
	}
	return pc, nil
}

// linkContext returns a context that ends, with cause ErrLinkDown, when
// done (the yamux session's CloseChan) is closed.
func linkContext(done <-chan struct{}) context.Context {
	ctx, cancel := context.WithCancelCause(context.Background())
	go func() {
		<-done
		cancel(ErrLinkDown)
	}()
	return ctx
}
