package relay

import (
	"bytes"
	"context"
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
	"time"

	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
)

// route forwards a base-URL request (/https/<host>/<path>?<query>) over
// HTTPS to host, after the policy allowed it and the transformation chain
// rewrote it; the response streams back through the chain's response pass
// (the scrub, then the modules). It reports whether the connection may
// carry another request.
func (cc *clientConn) route(ctx context.Context, req *http.Request, t target) bool {
	keep, linger := cc.carry(ctx, cc, req, t, cc.c)
	if linger {
		cc.linger = true
	}
	return keep
}

// answerer writes what goes back to the sandbox for one request: the
// connection itself for HTTP/1.1 (clientConn), a stream's ResponseWriter
// for HTTP/2 (intercepted connections).
type answerer interface {
	// continue100 answers "Expect: 100-continue" before the body is read
	// (HTTP/1.1; an HTTP/2 server does it itself).
	continue100()
	writeResponse(req *http.Request, resp *http.Response, closing bool) (int64, error)
	writeError(e *Error, closing bool)
}

// carry is route's work, for any answerer: one request through the
// policy, the chain and the upstream, and its audit event. conn, when not
// nil, is the connection whose read deadline paces the request body
// (HTTP/1.1). It reports whether the connection may carry another request
// and whether the sandbox was still sending a body nobody read (the
// connection should close lingering).
func (cc *clientConn) carry(ctx context.Context, a answerer, req *http.Request, t target, conn net.Conn) (keep, linger bool) {
	start := time.Now()
	ev := cc.event(audit.Route)
	ev.Host, ev.Port, ev.Method, ev.Path = t.host, t.port, req.Method, pathOnly(t.rest)
	if t.icpt != nil {
		ev.Kind, ev.InterceptRule = audit.Intercept, t.icpt.rule
	}
	body := &countingBody{r: req.Body, conn: conn, idle: cc.p.cfg.IdleTimeout}
	x, keep, err := cc.forward(ctx, a, req, t, &ev, body)
	var refusal *Error // written once the event is recorded, as every refusal is
	if err != nil {
		e := asError(err)
		if body.stalled.Load() {
			e = limitError(fmt.Sprintf("request body stalled: no byte for %s", cc.p.cfg.IdleTimeout), time.Second)
		}
		if x != nil && x.Scrubs() {
			// An error may quote what the upstream sent (a parser error
			// does), and the upstream may have echoed a secret.
			e = &Error{Status: e.Status, Code: e.Code, Reason: x.ScrubString(e.Error()), RetryAfter: e.RetryAfter}
		}
		ev.Status = e.Status
		if ev.Allow { // the policy allowed; something after it failed
			ev.Code, ev.Error = e.Code, e.Error()
		}
		refusal = e
		keep = false
		linger = req.ContentLength != 0 && !body.eof.Load()
	} else if req.ContentLength != 0 && !body.eof.Load() {
		// The sandbox is still sending a body nobody will read: closing
		// now would reset the connection under the response it has not
		// read yet.
		linger = true
		keep = false
	}
	if x != nil {
		x.Close() // the modules' error pass may add notes
		a := x.Audit()
		ev.Transforms, ev.Notes, ev.NotesDropped = a.Transforms, a.Notes, a.NotesDropped
		if a.Module != "" {
			ev.Module = a.Module
		}
		ev.Error = x.ScrubString(ev.Error)
	}
	ev.BytesIn, ev.Duration = body.n.Load(), time.Since(start)
	cc.p.record(ev)
	if refusal != nil {
		a.writeError(refusal, true)
	}
	return keep, linger
}

// continue100 answers "Expect: 100-continue" on the connection.
func (cc *clientConn) continue100() {
	io.WriteString(cc.bw, "HTTP/1.1 100 Continue\r\n\r\n")
	cc.bw.Flush()
}

// forward does the work of route; ev is filled as it goes. It returns the
// request's passage through the transformation chain (nil if it did not
// get that far), which route closes. An error means nothing has been
// written to the sandbox yet.
func (cc *clientConn) forward(ctx context.Context, a answerer, req *http.Request, t target, ev *audit.Event, body *countingBody) (*transforms.Exchange, bool, error) {
	// A request inside an intercepted connection is judged as the
	// connection was (CONNECT host:443): the routes' extra hosts do not
	// apply, and the policy is asked again at each request.
	dec, err := cc.p.cfg.Decider.Decide(ctx, netpolicy.DecideArgs{Policy: cc.tenant.Policy(), Host: t.host, Port: t.port, Route: t.icpt == nil, Plain: t.plain})
	fillDecision(ev, dec)
	if err != nil {
		return nil, false, err
	}
	if !dec.Allow {
		return nil, false, denied(dec)
	}
	ev.Port = dec.Port

	expect := req.ContentLength != 0 && strings.EqualFold(req.Header.Get("Expect"), "100-continue")
	out, err := outboundRequest(req, dec, t, body)
	if err != nil {
		return nil, false, err
	}
	continue100 := func() {
		if expect {
			expect = false
			a.continue100()
		}
	}

	// The chain enforces the order: modules, then the swap; on the way
	// back the scrub, then the modules.
	chain := transforms.Chain{Modules: cc.tenant.modulesWith(cc.p.cfg.Modules), Rules: cc.tenant.transforms}
	info := transforms.RequestInfo{Sandbox: cc.tenant.id, Proto: req.Proto}
	if expect {
		info.BeforeBodyRead = continue100
	}
	if chain.Modules.Len() > 0 {
		if a := cc.c.RemoteAddr(); a != nil {
			info.SourceAddr = a.String()
		}
	}
	x, err := chain.Request(ctx, out, info)
	if err != nil {
		sealedRefusal(ev, err)
		return x, false, err
	}
	if ans := x.Answer(); ans != nil {
		keep, err := answer(ctx, a, req, x, ans, ev)
		return x, keep, err
	}

	continue100()
	resp, addr, err := cc.tenant.upstream(cc.p).roundTrip(ctx, out, upstreamDest{host: dec.Host.String(), port: dec.Port, plain: t.plain}, &dec)
	if addr.IsValid() {
		ev.Addr = netip.AddrPortFrom(addr, uint16(dec.Port)).String()
	}
	if err != nil {
		return x, false, err
	}
	defer resp.Body.Close()
	if err := x.Response(ctx, resp); err != nil {
		return x, false, responseError(err)
	}
	ev.Status = resp.StatusCode
	closing := req.Close
	n, werr := a.writeResponse(req, resp, closing)
	ev.BytesOut = n
	if werr != nil {
		ev.Error = werr.Error()
		return x, false, nil
	}
	return x, !closing, nil
}

// responseError maps a failed response pass to what the sandbox sees: a
// response that could not be scrubbed, a module's failure, or the upstream
// body that could not be read.
func responseError(err error) error {
	var mf transforms.ModuleFailure
	switch {
	case errors.Is(err, transforms.ErrScrub):
		return &Error{Status: http.StatusBadGateway, Code: CodeTransform, Reason: transforms.ErrScrub.Error(), Err: err}
	case errors.As(err, &mf):
		return err
	}
	return &Error{Status: http.StatusBadGateway, Code: CodeUpstream, Reason: "reading upstream body", Err: err}
}

// answer writes the response a module gave instead of the upstream's: a
// refusal (its body, or the proxy's error naming the module and reason) or
// the module's own response, which the modules before it may rewrite in
// their handle_response.
func answer(ctx context.Context, w answerer, req *http.Request, x *transforms.Exchange, a *transforms.Answer, ev *audit.Event) (bool, error) {
	if a.Refused {
		ev.Allow, ev.Code = false, CodeModuleRefused
		ev.Reason = fmt.Sprintf("wasm module %s refused the request: %s", a.Module, a.Reason)
		if a.Body == nil {
			return false, &Error{Status: a.Status, Code: CodeModuleRefused, Reason: ev.Reason}
		}
	}
	resp := &http.Response{
		StatusCode: a.Status, ProtoMajor: 1, ProtoMinor: 1, Request: req,
		Header: a.Header, ContentLength: int64(len(a.Body)), Body: io.NopCloser(bytes.NewReader(a.Body)),
	}
	if err := x.Response(ctx, resp); err != nil {
		return false, responseError(err)
	}
	ev.Status = resp.StatusCode
	n, werr := w.writeResponse(req, resp, req.Close)
	ev.BytesOut = n
	if werr != nil {
		ev.Error = werr.Error()
		return false, nil
	}
	return !req.Close, nil
}

// hopHeaders are removed from requests and responses crossing the proxy
// (RFC 9110 §7.6.1), with every Proxy-* header and whatever Connection names.
var hopHeaders = []string{"Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Expect"}

func stripHop(h http.Header) {
	for _, v := range h.Values("Connection") {
		for f := range strings.SplitSeq(v, ",") {
			if f = strings.TrimSpace(f); f != "" {
				h.Del(f)
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
	for k := range h {
		if strings.HasPrefix(k, "Proxy-") {
			delete(h, k)
		}
	}
}

// outboundRequest builds the request sent upstream: same method, path,
// query, headers (less hop-by-hop and Proxy-*) and streaming body; Host is
// the decided host. Nothing is added: no X-Forwarded-*, no User-Agent.
// The sandbox's request gives its header map to the outbound one (req.Header
// is nil after): nothing reads it again, and the swap writes only into out.
func outboundRequest(req *http.Request, dec netpolicy.Decision, t target, body *countingBody) (*http.Request, error) {
	u, err := url.ParseRequestURI(t.rest)
	if err != nil {
		return nil, badRequest("route path %q: %v", truncate(t.rest, 100), err)
	}
	host := dec.Host.String()
	if dec.Host.IsIP() && dec.Host.Addr.Is6() {
		host = "[" + host + "]"
	}
	scheme := "https"
	if t.plain {
		scheme = "http"
	}
	if dec.Port != 0 && dec.Port != netpolicy.HTTPSPort && !(t.plain && dec.Port == 80) {
		host += ":" + strconv.Itoa(dec.Port) // a base URL's own port
	}
	// Keep RawPath exactly as sent; nothing else of the sandbox's URI.
	*u = url.URL{Scheme: scheme, Host: host, Path: u.Path, RawPath: u.RawPath, RawQuery: u.RawQuery}
	var rb io.ReadCloser = http.NoBody
	if req.ContentLength != 0 {
		rb = body
	}
	h := req.Header
	req.Header = nil
	if h == nil {
		h = http.Header{}
	}
	stripHop(h)
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""} // net/http would add its own
	}
	out := &http.Request{
		Method: req.Method, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: h, Body: rb, ContentLength: req.ContentLength, Host: host,
	}
	if req.ContentLength < 0 {
		// Say so, or net/http probes the body with a goroutine of its own
		// that can outlive the request and read the sandbox's connection.
		out.TransferEncoding = []string{"chunked"}
	}
	return out, nil
}

// countingBody counts a request body's bytes and notes its EOF (read on the
// transport's goroutine, checked on the connection's). Each read must make
// progress within idle, or the request fails as stalled.
type countingBody struct {
	r       io.ReadCloser
	conn    net.Conn
	idle    time.Duration
	n       atomic.Int64
	eof     atomic.Bool
	stalled atomic.Bool
}

func (b *countingBody) Read(p []byte) (int, error) {
	if b.conn != nil {
		b.conn.SetReadDeadline(time.Now().Add(b.idle))
	}
	n, err := b.r.Read(p)
	b.n.Add(int64(n))
	if err == io.EOF {
		b.eof.Store(true)
	} else if err != nil && isTimeout(err) {
		b.stalled.Store(true)
	}
	return n, err
}

// Close does not close the sandbox's connection: the transport calls it
// when done with the body.
func (b *countingBody) Close() error { return nil }

var respBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// writeResponse writes resp to the sandbox: status line, headers less
// hop-by-hop, and the body, streamed and flushed as it arrives (chunked when
// its length is unknown), so server-sent events reach the client one by one.
// It returns the body bytes written.
func (cc *clientConn) writeResponse(req *http.Request, resp *http.Response, closing bool) (int64, error) {
	h := resp.Header
	stripHop(h)
	bodyless := req.Method == http.MethodHead || resp.StatusCode/100 == 1 || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified
	chunked := false
	switch {
	case bodyless:
		if req.Method == http.MethodHead && resp.ContentLength >= 0 {
			h.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
		}
	case resp.ContentLength >= 0:
		h.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	default:
		h.Del("Content-Length")
		chunked = true
		h.Set("Transfer-Encoding", "chunked")
	}
	if closing {
		h.Set("Connection", "close")
	}
	text := http.StatusText(resp.StatusCode)
	if text == "" {
		text = "status code " + strconv.Itoa(resp.StatusCode)
	}
	fmt.Fprintf(cc.bw, "HTTP/1.1 %03d %s\r\n", resp.StatusCode, text)
	if err := h.Write(cc.bw); err != nil {
		return 0, err
	}
	if _, err := io.WriteString(cc.bw, "\r\n"); err != nil {
		return 0, err
	}
	if bodyless {
		// The body is empty by protocol; reading its EOF lets the upstream
		// connection go back to the pool.
		io.Copy(io.Discard, resp.Body)
		return 0, cc.bw.Flush()
	}
	bp := respBufs.Get().(*[]byte)
	defer respBufs.Put(bp)
	buf := *bp
	var n int64
	for {
		nr, rerr := resp.Body.Read(buf)
		if nr > 0 {
			if chunked {
				fmt.Fprintf(cc.bw, "%x\r\n", nr)
			}
			cc.bw.Write(buf[:nr])
			if chunked {
				cc.bw.WriteString("\r\n")
			}
			n += int64(nr)
			if err := cc.bw.Flush(); err != nil {
				return n, err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			// The head is out: all we can do is cut the connection so
			// the client sees a truncated body, not a complete one.
			return n, fmt.Errorf("reading upstream body: %w", rerr)
		}
	}
	if chunked {
		cc.bw.WriteString("0\r\n\r\n")
	}
	return n, cc.bw.Flush()
}
