package client

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/internal/wsconn"
)

// DialPort connects to 127.0.0.1:port inside the sandbox through the
// service's TCP bridge (a WebSocket carrying the raw bytes), for any
// protocol: a database, a language server, an HTTP server. Unlike
// PortEndpoint it is not limited to Ports: it is the platform's own
// tool, not a harness's. Nothing listening there is a *ServiceError with
// status 502. ctx bounds the dial only; Close the connection.
func (s *Session) DialPort(ctx context.Context, port int) (net.Conn, error) {
	if err := checkPorts([]int{port}); err != nil {
		return nil, err
	}
	c := s.r.sb.c
	cl := call{route: routeTCP, args: []string{s.ID(), strconv.Itoa(port)}}
	_, p := cl.path()
	sh := c.target(s.ID())
	u := *sh.base
	u.Scheme = map[string]string{"http": "ws", "https": "wss"}[u.Scheme]
	h := http.Header{}
	if err := c.authorizeFor(ctx, sh, h); err != nil {
		return nil, err
	}
	ws, resp, err := websocket.Dial(ctx, u.String()+p, &websocket.DialOptions{HTTPClient: c.hc, HTTPHeader: h})
	if err != nil {
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols {
			// coder/websocket keeps a little of the refusal's body.
			if resp.Body == nil {
				resp.Body = io.NopCloser(strings.NewReader(""))
			}
			err = c.errorOf(cl, resp)
			return nil, s.notRunning(err)
		}
		return nil, fmt.Errorf("%s: %w", cl, err)
	}
	ws.SetReadLimit(-1) // a message is a slice of a byte stream: any size
	// The connection outlives ctx, which bounds the dial: it ends when
	// closed.
	return wsconn.New(ws), nil
}
