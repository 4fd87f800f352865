package relay

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/relay/audit"
)

// clientConn is one connection from a sandbox, served request by request.
type clientConn struct {
	p      *Proxy
	tenant *Tenant
	c      net.Conn
	br     *bufio.Reader
	bw     *bufio.Writer
	// stateMu guards busy and stopping. busy is set while a request is
	// read or served; a connection that is not busy is closed when its
	// Serve context ends (stopping), one that is finishes its request first.
	stateMu  sync.Mutex
	busy     bool
	stopping bool
	// linger asks for a lingering close: the last response was sent while
	// the sandbox was still sending its request body.
	linger bool
	// serveCtx is the context serve runs under (its end is a graceful
	// stop), for the connections served inside this one (interception).
	serveCtx context.Context
	// icpt is set on the connection inside an intercepted one: every
	// request goes to the host it was judged for.
	icpt *interception
	// pid and cmd name the process that opened the connection, for its
	// audit events (see Proxy.ServePeer).
	pid int
	cmd string
}

func newClientConn(p *Proxy, tenant *Tenant, c net.Conn) *clientConn {
	cc := &clientConn{p: p, tenant: tenant, c: c}
	if r, ok := p.readers.Get().(*bufio.Reader); ok {
		r.Reset(c)
		cc.br = r
	} else {
		cc.br = bufio.NewReaderSize(c, p.cfg.MaxHeaderBytes)
	}
	if w, ok := p.writers.Get().(*bufio.Writer); ok {
		w.Reset(c)
		cc.bw = w
	} else {
		cc.bw = bufio.NewWriterSize(c, 16<<10)
	}
	return cc
}

// release returns the connection's buffers to the proxy's pools.
func (cc *clientConn) release() {
	cc.br.Reset(nil)
	cc.bw.Reset(nil)
	cc.p.readers.Put(cc.br)
	cc.p.writers.Put(cc.bw)
}

var errHeaderTooLarge = errors.New("request header too large")

// serve reads and answers requests until the connection should close.
func (cc *clientConn) serve(ctx context.Context) {
	cc.serveCtx = ctx
	for first := true; ctx.Err() == nil; first = false {
		// Between requests the connection is idle; once a request starts
		// its header must arrive within HeaderTimeout.
		wait := cc.p.cfg.IdleTimeout
		if first {
			wait = cc.p.cfg.HeaderTimeout
		}
		if !cc.setBusy(false) {
			return
		}
		cc.c.SetReadDeadline(time.Now().Add(wait))
		if _, err := cc.br.Peek(1); err != nil {
			return // closed or idle: nothing to answer
		}
		if !cc.setBusy(true) {
			return // stopped while the request was arriving
		}
		cc.c.SetReadDeadline(time.Now().Add(cc.p.cfg.HeaderTimeout))
		req, err := cc.readRequest()
		if err != nil {
			cc.refuse(err, nil)
			return
		}
		cc.c.SetReadDeadline(time.Time{})
		if !cc.handle(cc.p.hard, req) {
			if cc.linger {
				cc.lingerClose()
			}
			return
		}
	}
}

// lingerMax and lingerBytes bound how long and how much of an unread
// request body is drained before a connection is closed.
const (
	lingerMax   = 2 * time.Second
	lingerBytes = 4 << 20
)

// lingerClose half-closes the connection and drains what the sandbox is
// still sending, for a bounded time, so that the kernel does not answer
// those bytes with a reset that destroys the response in flight.
func (cc *clientConn) lingerClose() {
	cw, ok := cc.c.(interface{ CloseWrite() error })
	if !ok || cw.CloseWrite() != nil {
		return
	}
	cc.c.SetReadDeadline(time.Now().Add(lingerMax))
	io.CopyN(io.Discard, cc.c, lingerBytes)
}

// setBusy marks the connection busy or idle and reports whether it may go
// on (false once its Serve context ended).
func (cc *clientConn) setBusy(b bool) bool {
	cc.stateMu.Lock()
	defer cc.stateMu.Unlock()
	cc.busy = b
	return !cc.stopping
}

// stop is called when the Serve context ends: an idle connection is closed
// now, a busy one when its request is done.
func (cc *clientConn) stop() {
	cc.stateMu.Lock()
	defer cc.stateMu.Unlock()
	cc.stopping = true
	if !cc.busy {
		cc.c.Close()
	}
}

func (s *Tenant) acquire(max int) bool {
	s.seen.Store(time.Now().UnixNano())
	if s.open.Add(1) > int64(max) {
		s.open.Add(-1)
		return false
	}
	return true
}

func (s *Tenant) release() {
	s.seen.Store(time.Now().UnixNano())
	if s.open.Add(-1) == 0 {
		s.dmu.Lock()
		if s.drained != nil && s.open.Load() <= 0 {
			close(s.drained)
			s.drained = nil
		}
		s.dmu.Unlock()
	}
}

// event starts an audit event of the connection: its sandbox, its process,
// and kind.
func (cc *clientConn) event(kind audit.Kind) audit.Event {
	return audit.Event{Sandbox: cc.tenant.id, Kind: kind, PID: cc.pid, Cmd: cc.cmd}
}

// handle answers one request and reports whether the connection may carry
// another.
func (cc *clientConn) handle(ctx context.Context, req *http.Request) bool {
	if cc.icpt != nil {
		return cc.handleIntercepted(ctx, req)
	}
	t, err := parseTarget(req.Method, req.RequestURI)
	if err != nil {
		cc.refuse(err, req)
		return false
	}
	switch t.kind {
	case kindConnect:
		cc.connect(ctx, req, t)
		return false
	case kindRoute:
		return cc.route(ctx, req, t)
	}
	return false
}

// readRequest reads one request, refusing before parsing what net/http
// would silently normalise: a header over MaxHeaderBytes (429, a limit) and
// a request carrying both Content-Length and Transfer-Encoding (a smuggling
// attempt).
func (cc *clientConn) readRequest() (*http.Request, error) {
	head, err := cc.peekHead()
	if err != nil {
		if errors.Is(err, errHeaderTooLarge) {
			return nil, limitError(fmt.Sprintf("request header exceeds %d bytes", cc.p.cfg.MaxHeaderBytes), time.Second)
		}
		if isTimeout(err) {
			return nil, limitError(fmt.Sprintf("request header not received within %s", cc.p.cfg.HeaderTimeout), time.Second)
		}
		return nil, badRequest("reading request: %v", err)
	}
	if err := checkFraming(head); err != nil {
		return nil, err
	}
	req, err := http.ReadRequest(cc.br)
	if err != nil {
		return nil, badRequest("malformed request: %v", err)
	}
	return req, nil
}

// peekHead returns the buffered request line and headers, without consuming
// them, waiting for more bytes until the blank line that ends them arrives
// or MaxHeaderBytes is reached.
func (cc *clientConn) peekHead() ([]byte, error) {
	scanned := 0
	for {
		buf, _ := cc.br.Peek(cc.br.Buffered())
		if i := headEnd(buf, scanned); i >= 0 {
			return buf[:i], nil
		}
		if len(buf) >= cc.p.cfg.MaxHeaderBytes {
			return nil, errHeaderTooLarge
		}
		scanned = max(0, len(buf)-3)
		// Block until at least one more byte is buffered. An error means no
		// new byte came: the head is incomplete for good.
		if _, err := cc.br.Peek(len(buf) + 1); err != nil {
			if errors.Is(err, bufio.ErrBufferFull) {
				return nil, errHeaderTooLarge
			}
			return nil, err
		}
	}
}

// headEnd returns the index just past the blank line ending a header block
// in b, searching from `from`, or -1.
func headEnd(b []byte, from int) int {
	for i := from; i < len(b); i++ {
		if b[i] != '\n' {
			continue
		}
		if i+1 < len(b) && b[i+1] == '\n' {
			return i + 2
		}
		if i+2 < len(b) && b[i+1] == '\r' && b[i+2] == '\n' {
			return i + 3
		}
	}
	return -1
}

// checkFraming refuses a request head that names both Content-Length and
// Transfer-Encoding, however spelled: such a message means different things
// to different parsers (request smuggling).
func checkFraming(head []byte) error {
	var cl, te bool
	for len(head) > 0 {
		line := head
		if i := bytes.IndexByte(head, '\n'); i >= 0 {
			line, head = head[:i], head[i+1:]
		} else {
			head = nil
		}
		name, _, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		name = bytes.TrimSpace(name)
		switch {
		case bytes.EqualFold(name, []byte("content-length")):
			cl = true
		case bytes.EqualFold(name, []byte("transfer-encoding")):
			te = true
		}
	}
	if cl && te {
		return &Error{Status: http.StatusBadRequest, Code: CodeSmuggling,
			Reason: "request has both Content-Length and Transfer-Encoding; send one framing header"}
	}
	return nil
}

// refuse answers with err's status and closes the connection. A request
// refused before it had a destination still gets an audit event.
func (cc *clientConn) refuse(err error, req *http.Request) {
	e := asError(err)
	ev := cc.event(audit.Refused)
	ev.Code, ev.Reason, ev.Status = e.Code, e.Reason, e.Status
	switch {
	case cc.icpt != nil:
		ev.Host, ev.Port, ev.InterceptRule = cc.icpt.host.String(), cc.icpt.port, cc.icpt.rule
		if req != nil {
			ev.Method = req.Method
		}
	case req != nil:
		ev.Method = req.Method
		if t, terr := parseTarget(req.Method, req.RequestURI); terr == nil {
			ev.Host, ev.Port, ev.Path = t.host, t.port, pathOnly(t.rest)
		} else if u, uerr := url.Parse(req.RequestURI); uerr == nil && u.IsAbs() {
			// An absolute http:// (or https://) target names its
			// destination: say which, though it was refused unread.
			ev.Host, ev.Path = u.Hostname(), u.EscapedPath()
			if port, perr := strconv.Atoi(u.Port()); perr == nil {
				ev.Port = port
			} else if u.Scheme == "http" {
				ev.Port = 80
			} else if u.Scheme == "https" {
				ev.Port = 443
			}
		}
	}
	if e.Err != nil {
		ev.Error = e.Err.Error()
	}
	cc.p.record(ev)
	cc.writeError(e, true)
}

// writeError writes an error response: status, X-Sandgate-Error, and the
// reason as a plain-text body, "sandgate: <reason> (<code>)", which curl
// prints for a route. Clients of a refused CONNECT never show its body, so
// the status line says it too ("403 Forbidden (sandgate: …)"): Python's
// and Go's clients (pip, go get) print that line, curl -v shows it.
func (cc *clientConn) writeError(e *Error, closing bool) {
	body := e.Body()
	resp := &http.Response{
		Status:        e.statusLine(),
		StatusCode:    e.Status,
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        e.header(closing),
		ContentLength: int64(len(body)),
		Body:          io.NopCloser(strings.NewReader(body)),
		Close:         closing,
	}
	cc.c.SetWriteDeadline(time.Now().Add(cc.p.cfg.ErrorWriteTimeout))
	resp.Write(cc.bw)
	cc.bw.Flush()
	cc.c.SetWriteDeadline(time.Time{})
}
