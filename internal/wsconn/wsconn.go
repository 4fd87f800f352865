// Package wsconn makes a WebSocket a net.Conn carrying a byte stream in
// binary messages, whose Close ends the stream with a close frame: the TCP
// bridge's connection on both its ends (api/server and api/client).
package wsconn

import (
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"

	"github.com/coder/websocket"
)

// Conn is a WebSocket as a net.Conn. It lives until Close, whatever the
// context its WebSocket was dialled or accepted with.
type Conn struct {
	net.Conn
	ws     *websocket.Conn
	cancel context.CancelFunc
}

// New returns ws as a Conn of binary messages.
func New(ws *websocket.Conn) *Conn {
	ctx, cancel := context.WithCancel(context.Background())
	return &Conn{Conn: websocket.NetConn(ctx, ws, websocket.MessageBinary), ws: ws, cancel: cancel}
}

// Close sends the close frame before anything else. coder/websocket's own
// NetConn Close first cancels the context of a Read in progress (the other
// direction of a copy), and that cancellation may close the connection
// before the close frame is written: the peer then reads an EOF where the
// stream's end should be. Closing an already closed Conn returns nil.
func (c *Conn) Close() error {
	err := c.ws.Close(websocket.StatusNormalClosure, "")
	c.Conn.Close()
	c.cancel()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// Send writes what r yields to ws as binary messages of at most chunk
// bytes each, until r ends (io.EOF or another error: nil is returned) or a
// write fails (its error is returned: the peer is gone). A terminal's
// output goes to its caller this way.
func Send(ctx context.Context, ws *websocket.Conn, r io.Reader, chunk int) error {
	buf := make([]byte, chunk)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if err := ws.Write(ctx, websocket.MessageBinary, buf[:n]); err != nil {
				return err
			}
		}
		if rerr != nil {
			return nil
		}
	}
}

// Liveness says whether the client of a WebSocket is still there: it
// answers a ping (a client answers while it reads). A terminal asks it of
// its client when another wants the terminal. The zero value has no
// WebSocket yet, and says so.
type Liveness struct {
	ws atomic.Pointer[websocket.Conn]
}

// Set gives it the WebSocket, once accepted.
func (l *Liveness) Set(ws *websocket.Conn) { l.ws.Store(ws) }

// Alive pings the client, bounded by ctx: nil when it answered.
func (l *Liveness) Alive(ctx context.Context) error {
	ws := l.ws.Load()
	if ws == nil {
		return errors.New("not connected")
	}
	return ws.Ping(ctx)
}
