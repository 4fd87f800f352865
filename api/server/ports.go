package server

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/internal/bulkcopy"
	"github.com/sandgate/sandgate/internal/wsconn"
)

// tunnelTarget is protocol 1's pattern of a port tunnel's raw request
// target.
var tunnelTarget = regexp.MustCompile(`^/v1/sandboxes/([^/]+)/ports/(\d+)(/[^?]*)?(\?.*)?$`)

// strippedHeaders never reach the server in the sandbox: the caller's
// credentials and what the front end added.
var strippedHeaders = []string{
	"Authorization", "Forwarded", "Host", "X-Ai-Sdk-Sandbox-Token", "Traceparent",
	"X-Cloud-Trace-Context", "X-Forwarded-For", "X-Forwarded-Proto", "X-Serverless-Authorization",
}

// rawStatus answers a tunnel request on the raw connection: a bare status
// line, Connection: close, no body.
func rawStatus(w http.ResponseWriter, code int) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		w.Header().Set("Connection", "close")
		w.WriteHeader(code)
		return
	}
	defer conn.Close()
	conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", code, http.StatusText(code))
}

// tunnelHead is the request head the server in the sandbox gets: the
// method, the sub-path and query, Host 127.0.0.1:<port>, and the original
// headers but the stripped ones. (Go's server has already canonicalised
// the names and lost their order: they are written sorted.)
func tunnelHead(r *http.Request, port int, sub, query string) []byte {
	if sub == "" {
		sub = "/"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s%s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n", r.Method, sub, query, port)
	keys := make([]string, 0, len(r.Header))
	for k := range r.Header {
		if !slices.ContainsFunc(strippedHeaders, func(s string) bool { return strings.EqualFold(s, k) }) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		for _, v := range r.Header[k] {
			b.WriteString(k + ": " + v + "\r\n")
		}
	}
	// Go's server moved these out of the header of a chunked request; its
	// body follows as it was sent, so they go on too.
	if len(r.TransferEncoding) > 0 {
		b.WriteString("Transfer-Encoding: " + strings.Join(r.TransferEncoding, ", ") + "\r\n")
		if len(r.Trailer) > 0 {
			b.WriteString("Trailer: " + strings.Join(slices.Sorted(maps.Keys(r.Trailer)), ", ") + "\r\n")
		}
	}
	b.WriteString("\r\n")
	return []byte(b.String())
}

// parseTunnelTarget checks a tunnel's raw target: the sandbox, a port from
// 1 to 65535, the sub-path and query.
func parseTunnelTarget(target string) (name string, port int, sub, query string, ok bool) {
	m := tunnelTarget.FindStringSubmatch(target)
	if m == nil {
		return "", 0, "", "", false
	}
	port, err := strconv.Atoi(m[2])
	if err != nil || port < 1 || port > 65535 {
		return "", 0, "", "", false
	}
	return m[1], port, m[3], m[4], true
}

// tunnel carries an Upgrade request raw to 127.0.0.1:<port> in the sandbox
// (protocol 1 §5): the answer, a 101 or anything else, is what the server
// there writes; then bytes flow both ways until either side ends.
func (s *Server) tunnel(w http.ResponseWriter, r *http.Request) {
	name, port, sub, query, ok := parseTunnelTarget(r.RequestURI)
	if !ok {
		rawStatus(w, http.StatusNotFound)
		return
	}
	if err := s.awake(r.Context(), name); err != nil {
		rawStatus(w, status(err))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	up, err := s.b.DialPort(ctx, name, port)
	cancel()
	if err != nil {
		s.log.Info("port tunnel: nothing answers in the sandbox", "sandbox", name, "port", port, "err", err)
		code := status(err)
		if code == http.StatusInternalServerError {
			code = http.StatusBadGateway
		}
		rawStatus(w, code)
		return
	}
	defer up.Close()
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	conn.SetDeadline(time.Time{})
	if _, err := up.Write(tunnelHead(r, port, sub, query)); err != nil {
		return
	}
	splice(conn, brw.Reader, up)
}

// splice copies both ways between the caller's connection (whose reader
// may hold bytes already received) and the sandbox's, until either ends;
// then both are closed.
func splice(caller net.Conn, callerR *bufio.Reader, sandbox net.Conn) {
	var once sync.Once
	closeBoth := func() { once.Do(func() { caller.Close(); sandbox.Close() }) }
	done := make(chan struct{})
	go func() {
		bulkcopy.Copy(sandbox, callerR, bulkcopy.Large1M, nil)
		closeBoth()
		close(done)
	}()
	bulkcopy.Copy(caller, sandbox, bulkcopy.Large1M, nil)
	closeBoth()
	<-done
}

// isWebSocketRoute reports whether path is one of sandgate's own
// WebSocket routes (the TCP bridge, the terminal), which an Upgrade
// reaches as any route, not as protocol 1's port tunnel.
func isWebSocketRoute(path string) bool {
	rest, ok := strings.CutPrefix(path, "/v1/sandboxes/")
	if !ok {
		return false
	}
	parts := strings.Split(rest, "/")
	return (len(parts) == 3 && parts[1] == "tcp") || (len(parts) == 2 && parts[1] == "pty")
}

// tcpBridge carries raw TCP to 127.0.0.1:<port> in the sandbox over a
// WebSocket (binary messages), for services that do not speak HTTP.
func (s *Server) tcpBridge(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	port, err := strconv.Atoi(r.PathValue("port"))
	if err != nil || port < 1 || port > 65535 {
		return badRequest("port %q: want 1 to 65535", r.PathValue("port"))
	}
	if !isWebSocket(r) {
		return errorf(http.StatusUpgradeRequired, "the TCP bridge is a WebSocket: send a WebSocket handshake (Upgrade: websocket)")
	}
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	up, err := s.b.DialPort(ctx, name, port)
	cancel()
	if err != nil {
		if status(err) == http.StatusInternalServerError {
			err = errorf(http.StatusBadGateway, "nothing answers on port %d in sandbox %q: %v", port, name, err)
		}
		return err
	}
	defer up.Close()
	// No Origin check: no browser can call this service (a token, or
	// LocalOnly, stands in front); its clients are programs.
	ws, err := websocket.Accept(w, r, &websocket.AcceptOptions{InsecureSkipVerify: true})
	if err != nil {
		return nil // Accept wrote the refusal
	}
	ws.SetReadLimit(-1) // a message is raw bytes of a stream: any size
	conn := wsconn.New(ws)
	splice(conn, bufio.NewReader(conn), up)
	return nil
}
