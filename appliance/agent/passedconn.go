package agent

import (
	"io"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// passedConn is a TCP socket the agent passed to the service. The sandbox
// keeps its own copy, and a descriptor passed with SCM_RIGHTS shares its
// open file description — O_NONBLOCK included — with the sender's: code in
// the sandbox can make the socket blocking again after net.FileConn made it
// non-blocking, and every plain read or write would then sit in the kernel,
// past its deadline, holding a thread and the Close that waits for it. So
// every read and write here asks for MSG_DONTWAIT itself and waits in the
// netpoller (deadlines and Close work whatever the shared flag says),
// and Close turns lingering off first (the sandbox may have set SO_LINGER).
// It offers no ReadFrom/WriteTo, so nothing splices on it.
type passedConn struct {
	tc *net.TCPConn
	rc syscall.RawConn
}

func newPassedConn(tc *net.TCPConn) (*passedConn, error) {
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil, err
	}
	return &passedConn{tc: tc, rc: rc}, nil
}

func (c *passedConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	var err error
	if rerr := c.rc.Read(func(fd uintptr) bool {
		n, _, err = unix.Recvfrom(int(fd), p, unix.MSG_DONTWAIT)
		return err != unix.EAGAIN
	}); rerr != nil {
		return 0, c.opError("read", rerr)
	}
	switch {
	case err != nil:
		return 0, c.opError("read", err)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

func (c *passedConn) Write(p []byte) (int, error) {
	total := 0
	for total < len(p) {
		var n int
		var err error
		if werr := c.rc.Write(func(fd uintptr) bool {
			n, err = unix.SendmsgN(int(fd), p[total:], nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
			return err != unix.EAGAIN
		}); werr != nil {
			return total, c.opError("write", werr)
		}
		if err != nil {
			return total, c.opError("write", err)
		}
		total += n
	}
	return total, nil
}

func (c *passedConn) opError(op string, err error) error {
	return &net.OpError{Op: op, Net: "tcp", Source: c.tc.LocalAddr(), Addr: c.tc.RemoteAddr(), Err: err}
}

// Close closes the service's copy without lingering: with SO_LINGER set,
// a close that drops the last reference waits for unsent data.
func (c *passedConn) Close() error {
	c.rc.Control(func(fd uintptr) {
		unix.SetsockoptLinger(int(fd), unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{})
	})
	return c.tc.Close()
}

// CloseWrite shuts down the sending side (a relayed half-close).
func (c *passedConn) CloseWrite() error { return c.tc.CloseWrite() }

// CloseRead shuts down the receiving side.
func (c *passedConn) CloseRead() error { return c.tc.CloseRead() }

func (c *passedConn) LocalAddr() net.Addr                { return c.tc.LocalAddr() }
func (c *passedConn) RemoteAddr() net.Addr               { return c.tc.RemoteAddr() }
func (c *passedConn) SetDeadline(t time.Time) error      { return c.tc.SetDeadline(t) }
func (c *passedConn) SetReadDeadline(t time.Time) error  { return c.tc.SetReadDeadline(t) }
func (c *passedConn) SetWriteDeadline(t time.Time) error { return c.tc.SetWriteDeadline(t) }

// linkBoundConn is a passed socket that the link going down closes (see
// Client.DialPort); closing it first releases that hook.
type linkBoundConn struct {
	net.Conn
	stop func() bool
}

func (c *linkBoundConn) Close() error {
	c.stop()
	return c.Conn.Close()
}

func (c *linkBoundConn) CloseWrite() error {
	return c.Conn.(interface{ CloseWrite() error }).CloseWrite()
}
