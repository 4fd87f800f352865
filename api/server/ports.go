package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/http"
	"net/http/httputil"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/bulkcopy"
	"github.com/sandgate/sandgate/internal/wsconn"
	"github.com/sandgate/sandgate/transforms"
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

// tunnel carries an Upgrade request to 127.0.0.1:<port> in the sandbox
// (protocol 1 §5), through the sandbox's credential guard: its head is
// searched before anything is dialled, its body (by its own framing) as
// it streams. The server there answers; its answer reaches the caller
// without the service's headers (api.ServiceHeader). A 101 makes the
// connection raw both ways, the caller's bytes unsearched (a WebSocket
// client masks them); any other final answer ends the tunnel once it is
// written, so no second request passes unsearched nor a second answer
// unstripped.
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
	g, err := s.b.PortGuard(name)
	if err != nil {
		rawStatus(w, http.StatusNotFound)
		return
	}
	head := tunnelHead(r, port, sub, query)
	if err := g.Head(string(head)); err != nil {
		rawRefusal(w, err)
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
	t := &portTunnel{caller: conn, callerR: brw.Reader, sandbox: up, g: g, port: port, upgraded: make(chan struct{}), ended: make(chan struct{})}
	t.run(r, head)
}

// rawRefusal answers a tunnel's refused request on the raw connection: the
// status of err (400 for a credential) and its message as protocol 1's
// error body, then the connection is closed.
func rawRefusal(w http.ResponseWriter, err error) {
	conn, _, herr := http.NewResponseController(w).Hijack()
	if herr != nil {
		writeError(w, err)
		return
	}
	defer conn.Close()
	conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	writeRawError(conn, status(err), err)
}

// writeRawError writes an error answer, protocol 1's {"error"} body, on a
// raw connection that the caller then closes (it says Connection: close).
func writeRawError(w io.Writer, code int, err error) {
	body, _ := json.Marshal(api.Error{Error: err.Error()})
	fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		code, http.StatusText(code), len(body), body)
}

// maxAnswerHead bounds the head of an answer the server in a sandbox
// writes through the tunnel (its status line and headers).
const maxAnswerHead = 1 << 20

// portTunnel is one tunnelled request: the caller's connection and the
// sandbox's, the guard of what goes in, and how far the answer came.
type portTunnel struct {
	caller   net.Conn
	callerR  *bufio.Reader // may hold bytes already received after the head
	sandbox  net.Conn
	g        appliance.PortGuard
	port     int
	upgraded chan struct{} // closed on the sandbox's 101
	ended    chan struct{} // closed once the answer ended

	mu       sync.Mutex
	answered bool // bytes of an answer, or a refusal, reached the caller
	refused  bool // the guard refused the request
}

// run sends the head, then carries the request's body in and the answer
// out, until either side ends; then both are closed.
func (t *portTunnel) run(r *http.Request, head []byte) {
	var once sync.Once
	closeBoth := func() { once.Do(func() { t.caller.Close(); t.sandbox.Close() }) }
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer closeBoth()
		t.request(r, head)
	}()
	t.answer(r.Method)
	close(t.ended)
	closeBoth()
	<-done
}

// request writes the head and the guarded body to the sandbox; then, once
// the server there switched protocols, the caller's bytes raw.
func (t *portTunnel) request(r *http.Request, head []byte) {
	if _, err := t.sandbox.Write(head); err != nil {
		return
	}
	if err := t.body(r); err != nil {
		var refused *transforms.CredentialError
		if errors.As(err, &refused) {
			t.refuse(refused)
		}
		return
	}
	select {
	case <-t.upgraded:
	case <-t.ended:
		return
	}
	bulkcopy.Copy(t.sandbox, t.callerR, bulkcopy.Large1M, nil)
}

// body carries the request's body, as its head frames it, through the
// guard: Content-Length bytes, or a chunked body decoded, searched and
// chunked again, its trailer searched whole.
func (t *portTunnel) body(r *http.Request) error {
	switch {
	case len(r.TransferEncoding) > 0:
		cw := httputil.NewChunkedWriter(t.sandbox)
		if _, err := io.Copy(cw, t.g.Body(httputil.NewChunkedReader(t.callerR))); err != nil {
			return err
		}
		if err := cw.Close(); err != nil {
			return err
		}
		trailer, err := readTrailer(t.callerR)
		if err != nil {
			return err
		}
		if err := t.g.Head(trailer); err != nil {
			return err
		}
		_, err = io.WriteString(t.sandbox, trailer)
		return err
	case r.ContentLength > 0:
		_, err := io.Copy(t.sandbox, t.g.Body(io.LimitReader(t.callerR, r.ContentLength)))
		return err
	}
	return nil
}

// maxTrailer bounds a chunked request's trailer.
const maxTrailer = 64 << 10

// readTrailer reads a chunked body's trailer: its lines up to and with
// the blank one that ends it.
func readTrailer(br *bufio.Reader) (string, error) {
	var b strings.Builder
	for b.Len() <= maxTrailer {
		line, err := br.ReadString('\n')
		if err != nil {
			return "", fmt.Errorf("reading the request's trailer: %w", err)
		}
		b.WriteString(line)
		if line == "\r\n" || line == "\n" {
			return b.String(), nil
		}
	}
	return "", fmt.Errorf("the request's trailer is longer than %d bytes", maxTrailer)
}

// refuse answers the caller with the guard's refusal, unless an answer
// has begun (then the caller sees the tunnel end), and cuts the request
// off. (Nothing more goes in: the refused request was the only writer.)
func (t *portTunnel) refuse(err error) {
	defer t.sandbox.Close() // ends the answer, and with it the tunnel
	t.mu.Lock()
	answered := t.answered
	t.refused, t.answered = true, true
	t.mu.Unlock()
	if !answered {
		t.caller.SetWriteDeadline(time.Now().Add(10 * time.Second))
		writeRawError(t.caller, http.StatusBadRequest, err)
	}
}

// Write passes bytes of the answer to the caller, unless the request was
// refused.
func (t *portTunnel) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.refused {
		return 0, net.ErrClosed
	}
	t.answered = true
	return t.caller.Write(p)
}

// answer reads the answers of the server in the sandbox and writes them to
// the caller without the service's headers: informational ones, then a
// 101 and the raw bytes that follow it, or a final answer and its body,
// which ends the tunnel. What is not an HTTP answer ends it too, with a
// 502 when nothing was answered yet.
func (t *portTunnel) answer(method string) {
	lr := &io.LimitedReader{R: t.sandbox, N: maxAnswerHead}
	br := bufio.NewReader(lr)
	for {
		lr.N = maxAnswerHead
		resp, err := http.ReadResponse(br, &http.Request{Method: method})
		if err != nil {
			t.mu.Lock()
			answered := t.answered
			t.mu.Unlock()
			if !answered {
				t.badAnswer(err)
			}
			return
		}
		lr.N = math.MaxInt64
		switch api.StripAnswer(resp); {
		case resp.StatusCode == http.StatusSwitchingProtocols:
			if writeAnswerHead(t, resp) != nil {
				return
			}
			close(t.upgraded)
			bulkcopy.Copy(t, br, bulkcopy.Large1M, nil)
			return
		case resp.StatusCode/100 == 1:
			if writeAnswerHead(t, resp) != nil {
				return
			}
		default:
			resp.Header.Del("Connection")
			resp.Header.Del("Keep-Alive")
			resp.Close = true // one request per tunnel: it ends here
			resp.Write(t)
			resp.Body.Close()
			return
		}
	}
}

// badAnswer answers 502 when the server in the sandbox ended the
// connection, or wrote what is not an HTTP answer, before answering.
func (t *portTunnel) badAnswer(err error) {
	msg := fmt.Errorf("the server on port %d in the sandbox sent no HTTP answer: %v", t.port, err)
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		msg = fmt.Errorf("the server on port %d in the sandbox closed the connection without an answer", t.port)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.answered && !t.refused {
		t.answered = true
		t.caller.SetWriteDeadline(time.Now().Add(10 * time.Second))
		writeRawError(t.caller, http.StatusBadGateway, msg)
	}
}

// writeAnswerHead writes the status line and headers of an answer that
// has no body of its own (1xx).
func writeAnswerHead(w io.Writer, resp *http.Response) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "HTTP/%d.%d %s\r\n", resp.ProtoMajor, resp.ProtoMinor, resp.Status)
	resp.Header.Write(&b)
	b.WriteString("\r\n")
	_, err := w.Write(b.Bytes())
	return err
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
