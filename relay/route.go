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
	"github.com/sandgate/sandgate/transforms/wasm"
)

// route forwards a base-URL request (/https/<host>/<path>?<query>) over
// HTTPS to host, after the policy allowed it and the transformation chain
// rewrote its headers; the response streams back, scrubbed of any secret
// that went out. It reports whether the connection may carry another
// request.
func (cc *clientConn) route(ctx context.Context, req *http.Request, t target) bool {
	start := time.Now()
	ev := audit.Event{Sandbox: cc.sb.id, Kind: audit.Route, Host: t.host, Port: t.port, Method: req.Method, Path: pathOnly(t.rest)}
	body := &countingBody{r: req.Body, conn: cc.c, idle: cc.p.cfg.IdleTimeout}
	var applied transforms.Applied
	keep, err := cc.forward(ctx, req, t, &ev, body, &applied)
	ev.BytesIn, ev.Duration = body.n.Load(), time.Since(start)
	if err != nil {
		e := asError(err)
		if body.stalled.Load() {
			e = limitError(fmt.Sprintf("request body stalled: no byte for %s", cc.p.cfg.IdleTimeout), time.Second)
		}
		if len(applied.Secrets) > 0 {
			// An error may quote what the upstream sent (a parser error
			// does), and the upstream may have echoed the secret.
			e = &Error{Status: e.Status, Code: e.Code, Reason: applied.ScrubString(e.Error()), RetryAfter: e.RetryAfter}
		}
		ev.Status = e.Status
		if ev.Allow { // the policy allowed; something after it failed
			ev.Code, ev.Error = e.Code, e.Error()
		}
		scrubNotes(&ev, applied)
		cc.p.record(ev)
		cc.writeError(e, true)
		cc.linger = req.ContentLength != 0 && !body.eof.Load()
		return false
	}
	ev.Error = applied.ScrubString(ev.Error)
	scrubNotes(&ev, applied)
	cc.p.record(ev)
	if req.ContentLength != 0 && !body.eof.Load() {
		// The sandbox is still sending a body nobody will read: closing
		// now would reset the connection under the response it has not
		// read yet.
		cc.linger = true
		return false
	}
	return keep
}

// scrubNotes replaces any swapped secret in the modules' audit notes by
// its placeholder. Modules run before the swap and so never see a secret,
// but a note may quote what the upstream sent back.
func scrubNotes(ev *audit.Event, applied transforms.Applied) {
	if len(applied.Secrets) == 0 {
		return
	}
	for i, n := range ev.Notes {
		ev.Notes[i] = applied.ScrubString(n)
	}
}

// forward does the work of route; ev is filled as it goes. An error means
// nothing has been written to the sandbox yet.
func (cc *clientConn) forward(ctx context.Context, req *http.Request, t target, ev *audit.Event, body *countingBody, applied *transforms.Applied) (bool, error) {
	dec, err := cc.p.cfg.Decider.Decide(ctx, netpolicy.DecideArgs{Policy: cc.sb.Policy(), Host: t.host, Port: t.port, Route: true})
	fillDecision(ev, dec)
	if err != nil {
		return false, err
	}
	if !dec.Allow {
		return false, denied(dec)
	}
	ev.Port = netpolicy.HTTPSPort

	out, err := outboundRequest(ctx, req, dec, t, body)
	if err != nil {
		return false, err
	}
	expect := strings.EqualFold(req.Header.Get("Expect"), "100-continue") && req.ContentLength != 0
	continue100 := func() {
		if expect {
			expect = false
			io.WriteString(cc.bw, "HTTP/1.1 100 Continue\r\n\r\n")
			cc.bw.Flush()
		}
	}

	// User modules run first: they see the request with placeholders, never
	// a secret, and cannot change the destination host.
	var ex *wasm.Exchange
	if cc.p.cfg.Modules.Len() > 0 || cc.sb.Modules().Len() > 0 {
		info := wasm.RequestInfo{Sandbox: cc.sb.id, Proto: req.Proto, BeforeBodyRead: continue100}
		if a := cc.c.RemoteAddr(); a != nil {
			info.SourceAddr = a.String()
		}
		ex, err = wasm.HandleRequest(ctx, out, info, cc.p.cfg.Modules, cc.sb.Modules())
		defer func() {
			ex.Close()
			ev.Notes, ev.NotesDropped = ex.Notes(), ex.NotesDropped()
		}()
		if err != nil {
			return false, moduleFailed(ev, err)
		}
		if a := ex.Answer(); a != nil {
			return cc.answer(ctx, req, ex, a, ev)
		}
	}

	*applied = cc.sb.transforms.Apply(out)
	ev.Transforms = applied.Rules

	continue100()
	resp, addr, err := cc.sb.upstream(cc.p).roundTrip(ctx, out, dec.Host.String(), &dec)
	if addr.IsValid() {
		ev.Addr = netip.AddrPortFrom(addr, netpolicy.HTTPSPort).String()
	}
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	if len(applied.Secrets) > 0 {
		if err := scrub(resp, *applied); err != nil {
			return false, err
		}
	}
	if err := ex.HandleResponse(ctx, resp); err != nil {
		return false, moduleFailed(ev, err)
	}
	ev.Status = resp.StatusCode
	closing := req.Close
	n, werr := cc.writeResponse(req, resp, closing)
	ev.BytesOut = n
	if werr != nil {
		ev.Error = werr.Error()
		return false, nil
	}
	return !closing, nil
}

// moduleFailed notes in ev which module failed and returns err.
func moduleFailed(ev *audit.Event, err error) error {
	var we *wasm.Error
	if errors.As(err, &we) {
		ev.Module = we.Module
	}
	return err
}

// answer writes the response a module gave instead of the upstream's: a
// refusal (its body, or the proxy's error naming the module and reason) or
// the module's own response, which the modules before it may rewrite in
// their handle_response.
func (cc *clientConn) answer(ctx context.Context, req *http.Request, ex *wasm.Exchange, a *wasm.Answer, ev *audit.Event) (bool, error) {
	ev.Module = a.Module
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
	if !a.Refused {
		if err := ex.HandleResponse(ctx, resp); err != nil {
			return false, moduleFailed(ev, err)
		}
	}
	ev.Status = resp.StatusCode
	n, werr := cc.writeResponse(req, resp, req.Close)
	ev.BytesOut = n
	if werr != nil {
		ev.Error = werr.Error()
		return false, nil
	}
	return !req.Close, nil
}

// wholeBodyMax is the largest response that is scrubbed whole rather than
// streamed: small answers keep an exact Content-Length (one write, no
// chunking) after the secret is replaced.
const wholeBodyMax = 256 << 10

// scrub replaces the swapped secrets in resp by their placeholders. A small
// body of known length is read and scrubbed whole, so it keeps a
// Content-Length; anything else (streams, SSE, large downloads) is scrubbed
// as it streams.
func scrub(resp *http.Response, applied transforms.Applied) error {
	known := resp.ContentLength
	if resp.Body == nil || resp.Body == http.NoBody || resp.Request != nil && resp.Request.Method == http.MethodHead {
		known = -1 // no body to read whole; a HEAD keeps the length it announced
	}
	if err := applied.ScrubResponse(resp); err != nil {
		return &Error{Status: http.StatusBadGateway, Code: CodeTransform, Reason: "response could not be scrubbed of the swapped credential", Err: err}
	}
	if known < 0 || known > wholeBodyMax {
		return nil
	}
	// The decoded, scrubbed body may be larger than the wire length (gzip):
	// read at most wholeBodyMax, and stream the rest if there is more.
	buf, err := io.ReadAll(io.LimitReader(resp.Body, wholeBodyMax+1))
	if err != nil {
		return &Error{Status: http.StatusBadGateway, Code: CodeUpstream, Reason: "reading upstream body", Err: err}
	}
	if len(buf) > wholeBodyMax {
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), resp.Body), resp.Body}
		return nil
	}
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(buf))
	resp.ContentLength = int64(len(buf))
	return nil
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
func outboundRequest(ctx context.Context, req *http.Request, dec netpolicy.Decision, t target, body *countingBody) (*http.Request, error) {
	ru, err := url.ParseRequestURI(t.rest)
	if err != nil {
		return nil, badRequest("route path %q: %v", truncate(t.rest, 100), err)
	}
	host := dec.Host.String()
	if dec.Host.IsIP() && dec.Host.Addr.Is6() {
		host = "[" + host + "]"
	}
	u := &url.URL{Scheme: "https", Host: host, Path: ru.Path, RawPath: ru.RawPath, RawQuery: ru.RawQuery}
	var rb io.ReadCloser = http.NoBody
	if req.ContentLength != 0 {
		rb = body
	}
	out, err := http.NewRequestWithContext(ctx, req.Method, u.String(), rb)
	if err != nil {
		return nil, badRequest("route: %v", err)
	}
	out.URL = u // keep RawPath exactly as sent
	out.ContentLength = req.ContentLength
	if req.ContentLength < 0 {
		// Say so, or net/http probes the body with a goroutine of its own
		// that can outlive the request and read the sandbox's connection.
		out.TransferEncoding = []string{"chunked"}
	}
	out.Header = req.Header.Clone()
	stripHop(out.Header)
	if _, ok := out.Header["User-Agent"]; !ok {
		out.Header["User-Agent"] = []string{""} // net/http would add its own
	}
	out.Host = host
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
