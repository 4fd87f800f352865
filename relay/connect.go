package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/internal/bulkcopy"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
)

// connect serves CONNECT host:443: decide, dial the checked address, answer
// 200, then splice bytes both ways until either side closes or the tunnel
// idles out (or, for a host the policy intercepts, terminate its TLS and
// carry its requests as routes). The audit event is written when the
// tunnel closes.
func (cc *clientConn) connect(ctx context.Context, req *http.Request, t target) {
	ev := cc.event(audit.Connect)
	ev.Host, ev.Port, ev.Method = t.host, t.port, req.Method
	cc.tunnel(ctx, &ev, t.host, t.port, func(e *Error) { cc.writeError(e, true) }, func() bool {
		_, err := io.WriteString(cc.bw, "HTTP/1.1 200 Connection established\r\n\r\n")
		return err == nil && cc.bw.Flush() == nil
	})
}

// tunnel carries a connection that asks, as a whole, for host:port (a
// CONNECT, or a connection captured in the sandbox): the same decision,
// dial, ClientHello check, splice or interception, and one audit event
// (ev, filled as it goes) when it ends. refuse answers a refusal before
// anything was carried (a CONNECT's 403; nothing for a captured
// connection, which is closed); opened tells the client the tunnel is
// open and says whether it still listens.
func (cc *clientConn) tunnel(ctx context.Context, ev *audit.Event, host string, port int, refuse func(*Error), opened func() bool) {
	start := time.Now()
	dec, err := cc.p.cfg.Decider.Decide(ctx, netpolicy.DecideArgs{Policy: cc.tenant.Policy(), Host: host, Port: port})
	fillDecision(ev, dec)
	if err == nil && !dec.Allow {
		err = denied(dec)
	}
	// A host the policy intercepts is not dialed now: each request inside
	// gets its own pinned connection (a failure then is that request's
	// 502, which the client can read).
	var rule string
	if err == nil {
		if r, ok := cc.tenant.Policy().Intercepts(dec.Host); ok {
			rule = r.String()
			if cc.p.cfg.CA == nil {
				// Sandgate's own refusal: the tunnel would carry what the
				// policy wants transformed.
				e := &Error{Status: http.StatusForbidden, Code: CodeNoCA, Reason: fmt.Sprintf("%s is to be intercepted (rule %s) but this proxy has no interception CA; give it one (sandgate proxy --intercept-ca DIR)", dec.Host, rule)}
				ev.Allow, ev.Code, ev.Reason = false, e.Code, e.Reason
				err = e
			}
		} else if name, ok := cc.tenant.transforms.Targets(dec.Host.String()); ok {
			// A host a credential rule targets: what it answers may hold
			// the credential (sent to it on a route, or kept by it), so
			// it is carried only where its answers are scrubbed.
			if ue, sealed := cc.tenant.transforms.Unscrubbable(dec.Host.String()); sealed {
				e := asError(ue)
				ev.Allow, ev.Code, ev.Reason = false, e.Code, e.Reason
				err = e
			} else if cc.p.cfg.CA == nil || dec.Host.IsIP() {
				e := credentialHostError(dec.Host, name, cc.p.cfg.CA != nil)
				ev.Allow, ev.Code, ev.Reason = false, e.Code, e.Reason
				err = e
			} else {
				rule = CredentialInterceptPrefix + name
			}
		}
	}
	var up net.Conn
	if err == nil && rule == "" {
		up, err = cc.p.cfg.Decider.Dial(ctx, &dec)
	}
	if err != nil {
		// The event keeps the policy's decision; a failure after an allow
		// (the lookup, the dial) shows as its code, status and error.
		e := asError(err)
		ev.Status, ev.Duration = e.Status, time.Since(start)
		if ev.Allow {
			ev.Code, ev.Error = e.Code, e.Error()
		}
		cc.p.record(*ev)
		refuse(e)
		return
	}
	if up != nil {
		defer up.Close()
		ev.Addr = netip.AddrPortFrom(dec.Addr, uint16(dec.Port)).String()
	}
	ev.Status = http.StatusOK
	if cc.p.cfg.Metrics != nil {
		cc.p.cfg.Metrics.TunnelOpened()
		defer cc.p.cfg.Metrics.TunnelClosed()
	}
	if !opened() {
		ev.Error, ev.Duration = "client went away before the tunnel opened", time.Since(start)
		cc.p.record(*ev)
		return
	}
	if rule != "" {
		ev.InterceptRule = rule
		cc.intercept(ctx, ev, dec, start)
		cc.p.record(*ev)
		return
	}
	// The tunnel must open with a ClientHello for the host that was judged
	// (see sni.go). What was read to find out goes first to the upstream,
	// then whatever else the sandbox pipelined.
	sni, pre, herr := sniffHello(cc.c, cc.br, time.Now().Add(cc.p.cfg.HeaderTimeout))
	why := ""
	switch {
	case herr != nil && isTimeout(herr):
		ev.Allow, ev.Code, ev.Reason = false, CodeLimit, fmt.Sprintf("no TLS ClientHello within %s", cc.p.cfg.HeaderTimeout)
	case herr != nil:
		ev.Allow, ev.Code, ev.Reason = false, CodeNotTLS, "HTTPS only: "+errNotTLS.Error()
	default:
		why = checkSNI(dec.Host, sni)
		if why != "" {
			ev.Allow, ev.Code, ev.Reason = false, CodeSNIMismatch, why
		}
	}
	if herr != nil || why != "" {
		ev.Duration = time.Since(start)
		cc.p.record(*ev)
		return
	}
	if n := cc.br.Buffered(); n > 0 {
		rest, _ := cc.br.Peek(n)
		pre = append(pre, rest...)
	}
	in, out, serr := splice(cc.c, up, pre, cc.p.cfg.IdleTimeout)
	ev.BytesIn, ev.BytesOut, ev.Duration = in, out, time.Since(start)
	if serr != nil {
		ev.Error = serr.Error()
	}
	cc.p.record(*ev)
}

// CredentialInterceptPrefix starts the InterceptRule of a connection
// intercepted because a credential rule targets its host, before the
// rule's name: "credentials rule[0] api.example.com".
const CredentialInterceptPrefix = "credentials "

// credentialHostError refuses a tunnel to host, which the credential rule
// named targets, where it cannot be intercepted: the proxy has no CA, or
// host is an address.
func credentialHostError(host netpolicy.Host, rule string, haveCA bool) *Error {
	why := "this proxy has no interception CA to carry it intercepted, where its answers are scrubbed; " +
		"reach it through its base URL instead, or give the proxy an interception CA (sandgate proxy --intercept-ca DIR; sandgate serve has one unless SANDGATE_INTERCEPT_CA=off)"
	if haveCA {
		why = "an address cannot be intercepted (no certificate names one), so its answers could not be scrubbed; reach it through its base URL instead"
	}
	route := host.String()
	if host.IsIP() && host.Addr.Is6() {
		route = "[" + route + "]"
	}
	return &Error{Status: http.StatusForbidden, Code: CodeCredentialHost, Reason: fmt.Sprintf(
		"%s is a host of this sandbox's credential rules (%s): a tunnel to it would carry its answers unscrubbed, and %s: "+
			"$HTTPS_PROXY/https/%s/… (http://127.0.0.1:3128/https/%s/… by default)", host, rule, why, route, route)}
}

// fillDecision copies a decision into an audit event.
func fillDecision(ev *audit.Event, dec netpolicy.Decision) {
	ev.Allow, ev.Code, ev.Reason, ev.Rule, ev.DNSTime = dec.Allow, string(dec.Code), dec.Reason, dec.Rule, dec.DNSTime
	if dec.Host != (netpolicy.Host{}) {
		ev.Host = dec.Host.String()
	}
	ev.Port = dec.Port
}

// tunnelCopier copies one direction of a tunnel, noting activity for the
// idle watchdog. It is a named type so that stack traces say what a
// goroutine is doing.
type tunnelCopier struct {
	dst, src net.Conn
	last     *atomic.Int64 // unix nanoseconds of the last byte either way
	n        int64
	err      error
}

func (t *tunnelCopier) run(pre []byte) {
	if len(pre) > 0 {
		n, err := t.dst.Write(pre)
		t.n += int64(n)
		if err != nil {
			t.err = err
			return
		}
	}
	n, err := bulkcopy.Copy(t.dst, t.src, bulkcopy.Large1M, func() { t.last.Store(time.Now().UnixNano()) })
	t.n += n
	t.err = err
}

// splice copies client↔upstream until both directions end (a side's EOF is
// passed on as a half-close where the connection supports it) or nothing
// moves for idle. It returns the bytes from the client (in) and to it (out).
func splice(client, up net.Conn, pre []byte, idle time.Duration) (in, out int64, err error) {
	var last atomic.Int64
	last.Store(time.Now().UnixNano())
	toUp := &tunnelCopier{dst: up, src: client, last: &last}
	toClient := &tunnelCopier{dst: client, src: up, last: &last}
	done := make(chan struct{}, 2)
	go func() { toUp.run(pre); closeWrite(up); done <- struct{}{} }()
	go func() { toClient.run(nil); closeWrite(client); done <- struct{}{} }()

	tick := time.NewTicker(min(idle/4+time.Millisecond, 30*time.Second))
	defer tick.Stop()
	var idled bool
	for pending := 2; pending > 0; {
		select {
		case <-done:
			pending--
			if pending == 1 {
				// One side finished; the other gets the idle bound to
				// finish too (a peer that never closes must not pin us).
				last.Store(time.Now().UnixNano())
			}
		case now := <-tick.C:
			if now.Sub(time.Unix(0, last.Load())) >= idle && !idled {
				idled = true
				client.Close()
				up.Close()
			}
		}
	}
	if idled {
		return toUp.n, toClient.n, errTunnelIdle
	}
	return toUp.n, toClient.n, firstErr(toUp.err, toClient.err)
}

var errTunnelIdle = &Error{Status: http.StatusTooManyRequests, Code: CodeLimit, Reason: "tunnel closed after its idle time"}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil && !isClosedErr(e) {
			return e
		}
	}
	return nil
}

func isClosedErr(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, io.ErrClosedPipe) || errors.Is(err, syscall.ECONNRESET)
}

// closeWrite half-closes c when it can, so the peer sees EOF while the other
// direction keeps flowing.
func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
		return
	}
	c.Close()
}
