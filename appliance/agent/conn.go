package agent

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/sandgate/sandgate/internal/bulkcopy"
)

// yamuxConfig is the session configuration both ends use.
//
// Each stream's receive window stays yamux's 256 KiB: it is the most a
// stream buffers, so a slow reader slows its writer instead of growing
// memory. StreamCloseTimeout (5 minutes) bounds how long a half-closed
// stream may wait for its other direction before it is reset; operation
// streams close both directions together, so only port and egress streams
// that half-close meet it. Keep-alives detect a link that hangs without
// closing.
func yamuxConfig(logger *slog.Logger) *yamux.Config {
	cfg := yamux.DefaultConfig()
	cfg.EnableKeepAlive = true
	cfg.KeepAliveInterval = 15 * time.Second
	cfg.ConnectionWriteTimeout = 15 * time.Second
	// A stream closed on our side waits this long for the other side's
	// FIN before yamux forgets it. yamux does not stop that timer when the
	// session ends, so it holds the whole session (buffers, the agent
	// client) that long after a sandbox stops: its default, 5 minutes, was
	// megabytes held per few hundred sandboxes. The agent answers in
	// microseconds; one that does not is reset after this.
	cfg.StreamCloseTimeout = StreamCloseTimeout
	cfg.LogOutput = nil
	cfg.Logger = yamuxLogger{logger}
	return cfg
}

// StreamCloseTimeout bounds how long a link's stream closed on one side
// waits for the other's close, and so how long a link's memory outlives it.
const StreamCloseTimeout = 10 * time.Second

// yamuxLogger sends yamux's own messages to slog at debug level.
type yamuxLogger struct{ l *slog.Logger }

func (y yamuxLogger) Print(v ...any) { y.l.Debug("yamux", "detail", v) }
func (y yamuxLogger) Printf(format string, v ...any) {
	y.l.Debug("yamux", "detail", fmt.Sprintf(format, v...))
}
func (y yamuxLogger) Println(v ...any) { y.l.Debug("yamux", "detail", v) }

// Addr is the address of one end of a port or egress connection, as seen
// inside the sandbox.
type Addr struct{ S string }

// Network returns "sandbox": the address is inside the sandbox, reached
// over the agent's link.
func (a Addr) Network() string { return "sandbox" }

func (a Addr) String() string { return a.S }

// streamConn is a yamux stream as a net.Conn with TCP's half-close:
// CloseWrite sends EOF and keeps reading; Close ends both directions (reads
// in progress return net.ErrClosed).
type streamConn struct {
	*yamux.Stream
	local, remote net.Addr
	closed        atomic.Bool
	// rest holds bytes read past a header before the conn was handed out.
	rest []byte
}

func (c *streamConn) Read(p []byte) (int, error) {
	if c.closed.Load() {
		return 0, net.ErrClosed
	}
	if len(c.rest) > 0 {
		n := copy(p, c.rest)
		c.rest = c.rest[n:]
		return n, nil
	}
	n, err := c.Stream.Read(p)
	if err != nil && c.closed.Load() {
		err = net.ErrClosed
	}
	return n, err
}

func (c *streamConn) Write(p []byte) (int, error) {
	if c.closed.Load() {
		return 0, net.ErrClosed
	}
	return c.Stream.Write(p)
}

// CloseWrite half-closes the connection: the peer reads EOF.
func (c *streamConn) CloseWrite() error { return c.Stream.Close() }

// Close closes both directions.
func (c *streamConn) Close() error {
	if c.closed.Swap(true) {
		return nil
	}
	c.Stream.SetReadDeadline(time.Unix(1, 0))
	return c.Stream.Close()
}

func (c *streamConn) LocalAddr() net.Addr  { return c.local }
func (c *streamConn) RemoteAddr() net.Addr { return c.remote }

// halfCloser is a connection with TCP's half-close.
type halfCloser interface {
	net.Conn
	CloseWrite() error
}

// spliceCopier copies one direction of a spliced connection and passes its
// EOF on as a half-close. It is a named type so stack traces say what a
// goroutine is doing.
type spliceCopier struct {
	dst halfCloser
	src io.Reader
}

func (s *spliceCopier) run(errs chan<- error) {
	err := copyBulk(s.dst, s.src)
	if err == nil {
		s.dst.CloseWrite()
	}
	errs <- err
}

// copyBulk copies src to dst until src's EOF (nil) or an error, with a
// buffer that grows to 256 KiB for bulk data, so that a download over the
// link costs a write to its socket per yamux frame, not eight.
func copyBulk(dst io.Writer, src io.Reader) error {
	_, err := bulkcopy.Copy(dst, src, bulkcopy.Large256K, nil)
	return err
}

// splice copies a↔b until both directions have ended, then closes both.
// If one direction fails (a reset, not an EOF), both are closed at once so
// the other direction does not wait for a peer that will never finish.
func splice(a, b halfCloser) {
	errs := make(chan error, 2)
	go (&spliceCopier{dst: b, src: a}).run(errs)
	go (&spliceCopier{dst: a, src: b}).run(errs)
	for range 2 {
		if err := <-errs; err != nil {
			a.Close()
			b.Close()
		}
	}
	a.Close()
	b.Close()
}

// timeZero1 is a deadline long past: setting it cuts pending reads or
// writes at once. (The zero time would mean "no deadline".)
var timeZero1 = time.Unix(1, 0)
