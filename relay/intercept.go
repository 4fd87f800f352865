package relay

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"

	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
)

// Interception. A tunnel (CONNECT, or a connection captured in the
// sandbox) to a host the sandbox's policy intercepts is not spliced: the
// proxy completes the client's TLS handshake itself, with a certificate for
// that host signed by the service's CA (Config.CA), and carries each
// request inside as it carries a base-URL route — the policy asked again,
// the modules, the credential swap, a pinned and verified HTTPS connection
// to the host, the scrub — with one audit event per request (kind
// intercept) beside the connection's own. HTTP/2 and HTTP/1.1 are offered
// (ALPN); a WebSocket upgrade goes through the chain's request pass and is
// then carried as bytes.

// interception is what an intercepted connection was judged for.
type interception struct {
	rule string         // the policy's intercept rule
	host netpolicy.Host // canonical
	port int
}

var errSNIMismatch = errors.New("server name does not match")

// intercept terminates the client's TLS on cc and serves what comes inside,
// filling ev (the connection's event; the caller records it).
func (cc *clientConn) intercept(ctx context.Context, ev *audit.Event, dec netpolicy.Decision, start time.Time) {
	var hello atomic.Bool
	var sniWhy atomic.Pointer[string]
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2", "http/1.1"},
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			hello.Store(true)
			if why := checkSNI(dec.Host, h.ServerName); why != "" {
				sniWhy.Store(&why)
				return nil, errSNIMismatch
			}
			return nil, nil
		},
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return cc.p.cfg.CA.Leaf(dec.Host.Name)
		},
	}
	tc := tls.Server(&bufferedConn{Conn: cc.c, r: cc.br}, cfg)
	cc.c.SetDeadline(time.Now().Add(cc.p.cfg.HeaderTimeout))
	herr := tc.HandshakeContext(ctx)
	cc.c.SetDeadline(time.Time{})
	if herr != nil {
		ev.Duration = time.Since(start)
		switch why := sniWhy.Load(); {
		case !hello.Load() && isTimeout(herr):
			ev.Allow, ev.Code, ev.Reason = false, CodeLimit, fmt.Sprintf("no TLS ClientHello within %s", cc.p.cfg.HeaderTimeout)
		case !hello.Load():
			ev.Allow, ev.Code, ev.Reason = false, CodeNotTLS, "HTTPS only: "+errNotTLS.Error()
		case why != nil:
			ev.Allow, ev.Code, ev.Reason = false, CodeSNIMismatch, *why
		case isTimeout(herr):
			ev.Code, ev.Error = CodeLimit, fmt.Sprintf("TLS handshake with the client not finished within %s", cc.p.cfg.HeaderTimeout)
		case clientRefused(herr) && strings.HasPrefix(ev.InterceptRule, CredentialInterceptPrefix):
			ev.Code = audit.CodeInterceptRefused
			ev.Error = fmt.Sprintf("the client refused sandgate's certificate for %s (%v): it pins certificates or does not trust the sandbox's CA; %s is a host of this sandbox's credential rules (%s), carried only intercepted so that its answers are scrubbed: reach it through its base URL ($HTTPS_PROXY/https/%s/…), or make the client trust the CA (%s in a sandbox)", dec.Host, herr, dec.Host, strings.TrimPrefix(ev.InterceptRule, CredentialInterceptPrefix), dec.Host, SandboxCAFile)
		case clientRefused(herr):
			ev.Code = audit.CodeInterceptRefused
			ev.Error = fmt.Sprintf("the client refused sandgate's certificate for %s (%v): it pins certificates or does not trust the sandbox's CA; remove %s from the policy's intercept list, or make the client trust the CA (%s in a sandbox)", dec.Host, herr, ev.InterceptRule, SandboxCAFile)
		default:
			ev.Code, ev.Error = audit.CodeInterceptTLS, "TLS handshake with the client failed: "+herr.Error()
		}
		return
	}
	ic := &interception{rule: ev.InterceptRule, host: dec.Host, port: dec.Port}
	counted := &countedConn{Conn: tc}
	if tc.ConnectionState().NegotiatedProtocol == "h2" {
		cc.serveH2(counted, ic)
	} else {
		cc.serveH1(counted, ic)
	}
	tc.Close()
	ev.BytesIn, ev.BytesOut, ev.Duration = counted.in.Load(), counted.out.Load(), time.Since(start)
}

// SandboxCAFile is where a sandbox finds the interception CA's certificate
// (the agent's environment points clients at it).
const SandboxCAFile = "/etc/ssl/certs/sandgate-ca.pem"

// clientRefused reports a handshake the client broke off after the
// proxy's certificate: an alert from it (bad_certificate, unknown_ca, …),
// or the connection closed without one.
func clientRefused(err error) bool {
	var oe *net.OpError
	if errors.As(err, &oe) && oe.Op == "remote error" {
		return true
	}
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

// bufferedConn reads through r (a reader that already holds some of the
// connection's bytes) and does everything else on Conn.
type bufferedConn struct {
	net.Conn
	r io.Reader
}

func (b *bufferedConn) Read(p []byte) (int, error) { return b.r.Read(p) }

// CloseWrite half-closes the connection underneath, when it can.
func (b *bufferedConn) CloseWrite() error {
	if cw, ok := b.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return b.Conn.Close()
}

// countedConn counts the bytes read from and written to a connection.
type countedConn struct {
	net.Conn
	in, out atomic.Int64
}

func (c *countedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.in.Add(int64(n))
	return n, err
}

func (c *countedConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.out.Add(int64(n))
	return n, err
}

// CloseWrite sends the TLS close_notify and keeps reading.
func (c *countedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

// serveH1 serves the HTTP/1.1 requests inside an intercepted connection,
// each as a route to the intercepted host.
func (cc *clientConn) serveH1(c net.Conn, ic *interception) {
	icc := newClientConn(cc.p, cc.tenant, c)
	icc.icpt = ic
	icc.pid, icc.cmd = cc.pid, cc.cmd // the same process's requests
	defer icc.release()
	ctx := cc.serveCtx
	stop := context.AfterFunc(ctx, icc.stop)
	defer stop()
	stopSoft := context.AfterFunc(cc.p.soft, icc.stop)
	defer stopSoft()
	icc.serve(ctx)
}

// handleIntercepted answers one request inside an intercepted connection
// and reports whether the connection may carry another.
func (cc *clientConn) handleIntercepted(ctx context.Context, req *http.Request) bool {
	t, err := cc.icpt.target(req)
	if err != nil {
		cc.refuseIntercepted(cc, req, err)
		return false
	}
	if isUpgrade(req.Header) {
		cc.upgrade(ctx, req, t)
		return false
	}
	return cc.route(ctx, req, t)
}

// refuseIntercepted answers a request of an intercepted connection that
// cannot be carried, with its event.
func (cc *clientConn) refuseIntercepted(a answerer, req *http.Request, err error) {
	e := asError(err)
	ev := cc.event(audit.Intercept)
	ev.Host, ev.Port, ev.Method, ev.Path = cc.icpt.host.String(), cc.icpt.port, req.Method, pathOnly(req.URL.EscapedPath())
	ev.Code, ev.Reason, ev.Status, ev.InterceptRule = e.Code, e.Reason, e.Status, cc.icpt.rule
	cc.p.record(ev)
	a.writeError(e, true)
}

// target is the route a request inside the connection takes: the
// intercepted host, whatever the request says; a request naming another
// host (Host, :authority, an absolute URI) is refused (421), so that a
// connection judged for one host never carries a request for another.
func (ic *interception) target(req *http.Request) (target, error) {
	host := req.Host
	if host == "" && req.URL != nil {
		host = req.URL.Host
	}
	if err := ic.sameHost(host); err != nil {
		return target{}, err
	}
	rest := req.RequestURI
	if !strings.HasPrefix(rest, "/") {
		// An absolute URI (HTTP/1.1 allows one): its host must be the
		// connection's too.
		u, perr := url.ParseRequestURI(rest)
		if perr != nil || req.Method == http.MethodConnect || !strings.EqualFold(u.Scheme, "https") || u.Host == "" {
			return target{}, badRequest("request target %q: send an origin-form path such as /v1/models", truncate(rest, 100))
		}
		if err := ic.sameHost(u.Host); err != nil {
			return target{}, err
		}
		if rest = u.RequestURI(); !strings.HasPrefix(rest, "/") {
			return target{}, badRequest("request target %q: send an origin-form path such as /v1/models", truncate(req.RequestURI, 100))
		}
	}
	if strings.ContainsAny(rest, " \t\r\n\x00") {
		return target{}, badRequest("request path contains whitespace or control characters")
	}
	return target{kind: kindRoute, host: ic.host.String(), port: ic.port, rest: rest, icpt: ic}, nil
}

// sameHost refuses (421) a host[:port] other than the connection's.
func (ic *interception) sameHost(host string) error {
	h, port, err := netpolicy.SplitHostPort(host)
	if err == nil {
		var ch netpolicy.Host
		if ch, err = netpolicy.CanonicalHost(strings.Trim(h, "[]")); err == nil && (ch != ic.host || (port != 0 && port != ic.port)) {
			err = fmt.Errorf("names %s", truncate(host, 100))
		}
	}
	if err != nil || host == "" {
		return &Error{Status: http.StatusMisdirectedRequest, Code: audit.CodeMisdirected,
			Reason: fmt.Sprintf("this connection was opened for %s and carries requests for it only; the request %s", ic.host, whyHost(host, err))}
	}
	return nil
}

func whyHost(host string, err error) string {
	if host == "" {
		return "names no host"
	}
	if err != nil && strings.HasPrefix(err.Error(), "names ") {
		return err.Error()
	}
	return fmt.Sprintf("names an invalid host %q", truncate(host, 100))
}

// serveH2 serves an intercepted connection that chose HTTP/2. Each stream
// counts against the sandbox's connection cap while it runs, as a
// connection of its own would.
func (cc *clientConn) serveH2(c net.Conn, ic *interception) {
	h := &h2Handler{cc: cc, ic: ic, conn: c}
	ctx := cc.serveCtx
	stop := context.AfterFunc(ctx, h.stop)
	defer stop()
	stopSoft := context.AfterFunc(cc.p.soft, h.stop)
	defer stopSoft()
	srv := &http2.Server{IdleTimeout: cc.p.cfg.IdleTimeout, MaxConcurrentStreams: 64}
	srv.ServeConn(c, &http2.ServeConnOpts{
		Context: cc.p.hard, Handler: h,
		BaseConfig: &http.Server{ReadHeaderTimeout: cc.p.cfg.HeaderTimeout, MaxHeaderBytes: cc.p.cfg.MaxHeaderBytes},
	})
}

// h2Handler carries the streams of an intercepted HTTP/2 connection.
type h2Handler struct {
	cc   *clientConn
	ic   *interception
	conn net.Conn

	mu       sync.Mutex
	active   int
	stopping bool
}

// stop closes the connection once no stream is in progress (at once if
// none is): a graceful stop, as for HTTP/1.1.
func (h *h2Handler) stop() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stopping = true
	if h.active == 0 {
		h.conn.Close()
	}
}

func (h *h2Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	h.active++
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.active--
		if h.stopping && h.active == 0 {
			h.conn.Close()
		}
		h.mu.Unlock()
	}()
	cc := h.cc
	a := &h2Answer{w: w}
	ic := &clientConn{p: cc.p, tenant: cc.tenant, c: cc.c, icpt: h.ic}
	if !cc.tenant.acquire(cc.p.cfg.MaxConns) {
		ic.refuseIntercepted(a, r, limitError(fmt.Sprintf("sandbox %s already has %d connections open", cc.tenant.id, cc.p.cfg.MaxConns), time.Second))
		return
	}
	defer cc.tenant.release()
	t, err := h.ic.target(r)
	if err != nil {
		ic.refuseIntercepted(a, r, err)
		return
	}
	ic.carry(cc.p.hard, a, r, t, nil)
	if a.broken {
		panic(http.ErrAbortHandler) // resets the stream: the body was cut
	}
}

// h2Answer writes a response to an HTTP/2 stream.
type h2Answer struct {
	w      http.ResponseWriter
	broken bool // a body was cut after its head went out
}

func (a *h2Answer) continue100() {} // the HTTP/2 server sends it when the body is read

func (a *h2Answer) writeResponse(req *http.Request, resp *http.Response, _ bool) (int64, error) {
	h := resp.Header
	stripHop(h)
	dst := a.w.Header()
	for k, v := range h {
		dst[k] = v
	}
	bodyless := req.Method == http.MethodHead || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified
	switch {
	case !bodyless && resp.ContentLength >= 0:
		dst.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	case req.Method == http.MethodHead && resp.ContentLength >= 0:
		dst.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	default:
		dst.Del("Content-Length")
	}
	a.w.WriteHeader(resp.StatusCode)
	if bodyless {
		io.Copy(io.Discard, resp.Body)
		return 0, nil
	}
	rc := http.NewResponseController(a.w)
	bp := respBufs.Get().(*[]byte)
	defer respBufs.Put(bp)
	buf := *bp
	var n int64
	for {
		nr, rerr := resp.Body.Read(buf)
		if nr > 0 {
			if _, err := a.w.Write(buf[:nr]); err != nil {
				a.broken = true
				return n, err
			}
			n += int64(nr)
			if err := rc.Flush(); err != nil {
				a.broken = true
				return n, err
			}
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			// The head is out: reset the stream so the client sees a
			// truncated body, not a complete one.
			a.broken = true
			return n, fmt.Errorf("reading upstream body: %w", rerr)
		}
	}
}

func (a *h2Answer) writeError(e *Error, _ bool) {
	for k, v := range e.header(false) {
		a.w.Header()[k] = v
	}
	body := e.Error() + "\n"
	a.w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	a.w.WriteHeader(e.Status)
	io.WriteString(a.w, body)
}

// isUpgrade reports a request asking to switch protocols (a WebSocket).
func isUpgrade(h http.Header) bool {
	if h.Get("Upgrade") == "" {
		return false
	}
	for _, v := range h.Values("Connection") {
		for f := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), "upgrade") {
				return true
			}
		}
	}
	return false
}

// upgrade carries a request asking to switch protocols (a WebSocket)
// inside an intercepted HTTP/1.1 connection: the policy and the chain's
// request pass as for any request (a module may refuse it; the credential
// swap applies to its headers), then, once the upstream switched (101),
// bytes both ways until either side closes. What crosses after the switch
// is not transformed: so a switch to a host of the sandbox's credential
// rules is refused, since its messages could not be scrubbed.
func (cc *clientConn) upgrade(ctx context.Context, req *http.Request, t target) {
	start := time.Now()
	ev := cc.event(audit.Intercept)
	ev.Host, ev.Port, ev.Method, ev.Path, ev.InterceptRule = t.host, t.port, req.Method, pathOnly(t.rest), t.icpt.rule
	x, err := cc.switchProtocols(ctx, req, t, &ev)
	if x != nil {
		x.Close()
		a := x.Audit()
		ev.Transforms, ev.Notes, ev.NotesDropped = a.Transforms, a.Notes, a.NotesDropped
		if a.Module != "" {
			ev.Module = a.Module
		}
	}
	var refusal *Error
	if err != nil {
		refusal = asError(err)
		ev.Status = refusal.Status
		if ev.Allow {
			ev.Code, ev.Error = refusal.Code, refusal.Error()
		}
	}
	if x != nil {
		ev.Error = x.ScrubString(ev.Error)
	}
	ev.Duration = time.Since(start)
	cc.p.record(ev)
	if refusal != nil {
		cc.writeError(refusal, true)
	}
}

// CodeUpgrade refuses a protocol switch that could carry a credential
// back unscrubbed.
const CodeUpgrade = "upgrade_refused"

func (cc *clientConn) switchProtocols(ctx context.Context, req *http.Request, t target, ev *audit.Event) (*transforms.Exchange, error) {
	dec, err := cc.p.cfg.Decider.Decide(ctx, netpolicy.DecideArgs{Policy: cc.tenant.Policy(), Host: t.host, Port: t.port})
	fillDecision(ev, dec)
	if err != nil {
		return nil, err
	}
	if !dec.Allow {
		return nil, denied(dec)
	}
	if req.ContentLength != 0 {
		return nil, badRequest("a request that switches protocols carries no body")
	}
	proto := req.Header.Get("Upgrade")
	out, err := outboundRequest(req, dec, t, nil)
	if err != nil {
		return nil, err
	}
	chain := transforms.Chain{Modules: cc.tenant.modulesWith(cc.p.cfg.Modules), Rules: cc.tenant.transforms}
	info := transforms.RequestInfo{Sandbox: cc.tenant.id, Proto: req.Proto}
	if chain.Modules.Len() > 0 {
		if a := cc.c.RemoteAddr(); a != nil {
			info.SourceAddr = a.String()
		}
	}
	x, err := chain.Request(ctx, out, info)
	if err != nil {
		sealedRefusal(ev, err)
		return x, err
	}
	if ans := x.Answer(); ans != nil {
		_, err := answer(ctx, cc, req, x, ans, ev)
		return x, err
	}
	if x.Scrubs() {
		ev.Allow, ev.Code = false, CodeUpgrade
		ev.Reason = fmt.Sprintf("switching protocols (%s) with %s is refused: a credential rule targets it, and what the new protocol carries back could not be scrubbed of the credential", truncate(proto, 40), dec.Host)
		return x, &Error{Status: http.StatusForbidden, Code: CodeUpgrade, Reason: ev.Reason}
	}
	out.Header.Set("Connection", "Upgrade")
	out.Header.Set("Upgrade", proto)
	uc, err := cc.tenant.upstream(cc.p).dial(ctx, upstreamDest{host: dec.Host.String(), port: dec.Port}, &dec)
	if err != nil {
		return x, err
	}
	ev.Addr = netip.AddrPortFrom(uc.addr, uint16(dec.Port)).String()
	switched := false
	defer func() {
		if !switched {
			uc.c.Close()
		}
	}()
	uc.c.SetDeadline(time.Now().Add(cc.p.cfg.ResponseHeaderTimeout))
	werr := out.Write(uc.bw)
	if werr == nil {
		werr = uc.bw.Flush()
	}
	if werr != nil {
		return x, werr
	}
	var resp *http.Response
	for resp == nil {
		r, err := http.ReadResponse(uc.br, out)
		if err != nil {
			if isTimeout(err) || isStale(err) {
				return x, err
			}
			return x, &protocolError{err}
		}
		if r.StatusCode >= 200 || r.StatusCode == http.StatusSwitchingProtocols {
			resp = r
		}
	}
	uc.c.SetDeadline(time.Time{})
	if resp.StatusCode != http.StatusSwitchingProtocols {
		// An ordinary answer (401, 426): the response pass, then the
		// connection closes.
		defer resp.Body.Close()
		if err := x.Response(ctx, resp); err != nil {
			return x, responseError(err)
		}
		ev.Status = resp.StatusCode
		n, werr := cc.writeResponse(req, resp, true)
		ev.BytesOut = n
		if werr != nil {
			ev.Error = werr.Error()
		}
		return x, nil
	}
	upProto := resp.Header.Get("Upgrade")
	stripHop(resp.Header)
	if err := x.Response(ctx, resp); err != nil {
		return x, responseError(err)
	}
	resp.Header.Set("Connection", "Upgrade")
	resp.Header.Set("Upgrade", upProto)
	io.WriteString(cc.bw, "HTTP/1.1 101 Switching Protocols\r\n")
	resp.Header.Write(cc.bw)
	io.WriteString(cc.bw, "\r\n")
	if err := cc.bw.Flush(); err != nil {
		ev.Error = "client went away before the switch"
		return x, nil
	}
	ev.Status = http.StatusSwitchingProtocols
	switched = true
	client := &bufferedConn{Conn: cc.c, r: cc.br}
	upstream := &bufferedConn{Conn: uc.c, r: uc.br}
	in, n, serr := splice(client, upstream, nil, cc.p.cfg.IdleTimeout)
	ev.BytesIn, ev.BytesOut = in, n
	if serr != nil {
		ev.Error = serr.Error()
	}
	return x, nil
}
