package relay

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/netpolicy"
)

// upstreamPool is a sandbox's HTTP/1.1-over-TLS client for base-URL routes.
// It is net/http's parser and writer on connections that this package
// dials and pools itself, for two reasons:
//
//   - pinning: a kept-alive connection is reused only when its address is
//     among the addresses this request's decision checked, so a policy or
//     DNS change is honoured on the next request, not the next dial;
//   - latency: the request is written and the response read on the
//     caller's goroutine, with none of the hand-offs between the reading
//     and writing goroutines of http.Transport (each a thread wake-up,
//     which on a small VM costs more than the rest of the proxy).
type upstreamPool struct {
	p *Proxy

	mu   sync.Mutex
	idle map[string][]*upstreamConn // by destination (upstreamDest.key)
	gen  int                        // bumped by closeIdle; older conns are not pooled
}

// upstreamDest is where a route goes: a host (its canonical name, the TLS
// server name) on a port, over TLS or, for an http route, not.
type upstreamDest struct {
	host  string
	port  int
	plain bool
}

// key is the pool's key: connections go only to the destination they were
// dialed for.
func (d upstreamDest) key() string {
	scheme := "https://"
	if d.plain {
		scheme = "http://"
	}
	return scheme + net.JoinHostPort(d.host, strconv.Itoa(d.port))
}

// upstreamConn is one connection to an upstream: TLS, or plain TCP for an
// http route.
type upstreamConn struct {
	c      net.Conn        // *tls.Conn
	raw    syscall.RawConn // the TCP socket under c, for idleQuiet; nil if none
	rec    *recordConn     // the TCP connection under c, following TLS records; nil if none
	br     *bufio.Reader
	bw     *bufio.Writer
	addr   netip.Addr
	gen    int
	used   time.Time // when it went back to the pool
	reused bool      // taken from the pool: the upstream may have closed it
	// canceled is set when the request's context ended: a deadline set
	// after that must not undo the one that cut the connection.
	canceled atomic.Bool
}

const (
	maxIdlePerHost  = 32
	upstreamIdleTTL = 60 * time.Second
)

func newUpstreamPool(p *Proxy) *upstreamPool {
	return &upstreamPool{p: p, idle: make(map[string][]*upstreamConn)}
}

// closeIdle drops every idle connection (a policy change).
func (u *upstreamPool) closeIdle() {
	u.mu.Lock()
	idle := u.idle
	u.idle = make(map[string][]*upstreamConn)
	u.gen++
	u.mu.Unlock()
	for _, cs := range idle {
		for _, c := range cs {
			c.c.Close()
		}
	}
}

// get returns an idle connection to host whose address dec checked and
// that is still quiet (see idleQuiet), or nil.
func (u *upstreamPool) get(host string, dec *netpolicy.Decision) *upstreamConn {
	for range maxIdlePerHost {
		c := u.take(host, dec)
		if c == nil || idleQuiet(c) {
			return c
		}
		c.c.Close()
	}
	return nil
}

// idleQuiet reports whether a pooled connection holds nothing to read. A
// byte that no request asked for — an upstream that closed or reset the
// connection, sent a TLS alert, or answered twice (a desynchronised or
// hostile upstream: a second response echoing a request that carried a
// secret) — would be taken for the next request's response, so any byte
// retires the connection. It looks everywhere such a byte can wait:
//
//   - the bufio reader;
//   - the TLS layer, which may have pulled whole records, or part of one,
//     off the socket along with the end of the last response: a Read whose
//     deadline has already passed decrypts the whole records without
//     touching the socket (its timeout leaves the connection usable), and
//     recordConn says whether a part of a record is left;
//   - the socket, with one recv(MSG_PEEK|MSG_DONTWAIT): no wait, no
//     scheduler hand-off.
//
// It runs right before the connection is reused. Bytes still on their way
// at that moment cannot be told from the next response; they are read as
// that response, whatever follows it is caught when that response ends,
// and every response of a host the sandbox holds credentials for is
// scrubbed anyway (transforms.Applied.Scrub), so no secret rides on them.
func idleQuiet(c *upstreamConn) bool {
	if c.br.Buffered() > 0 {
		return false
	}
	if _, ok := c.c.(*tls.Conn); ok {
		c.c.SetReadDeadline(aLongTimeAgo)
		_, err := c.br.Peek(1)
		c.c.SetReadDeadline(time.Time{})
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return false // a record of data (err == nil), or the connection ended
		}
	}
	if c.rec != nil && !c.rec.atBoundary() {
		return false // part of a record sits in the TLS layer
	}
	if c.raw == nil {
		return true
	}
	quiet := false
	rerr := c.raw.Read(func(fd uintptr) bool {
		var b [1]byte
		// recvfrom(2) without a source address (unix.Recvfrom would
		// allocate one); it never blocks, so no scheduler hand-off.
		_, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1, unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
		quiet = errno == unix.EAGAIN
		return true // never wait
	})
	return rerr == nil && quiet
}

// aLongTimeAgo is a deadline in the past: a Read with it returns at once.
var aLongTimeAgo = time.Unix(1, 0)

// recordConn is the TCP connection under an upstream's TLS. It follows the
// TLS record framing of the bytes it hands up (a 5-byte header whose last
// two bytes are the length of the body after it), so idleQuiet can tell
// whether the TLS layer holds part of a record: bytes that neither the
// bufio reader nor the socket shows. It is read by one goroutine at a time
// (whoever holds the connection).
type recordConn struct {
	net.Conn
	left int // bytes of the current record's body still to come
	nh   int // bytes of the next record's header seen so far
	hdr  [5]byte
}

func (r *recordConn) Read(p []byte) (int, error) {
	n, err := r.Conn.Read(p)
	for b := p[:n]; len(b) > 0; {
		if r.left > 0 {
			k := min(r.left, len(b))
			r.left -= k
			b = b[k:]
			continue
		}
		r.hdr[r.nh] = b[0]
		r.nh++
		b = b[1:]
		if r.nh == len(r.hdr) {
			r.left = int(r.hdr[3])<<8 | int(r.hdr[4])
			r.nh = 0
		}
	}
	return n, err
}

// atBoundary reports whether the bytes read so far end with a whole record.
func (r *recordConn) atBoundary() bool { return r.left == 0 && r.nh == 0 }

// rawConn returns the socket of a TCP connection, for idleQuiet, or nil.
func rawConn(c net.Conn) syscall.RawConn {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// take removes and returns an idle connection to host whose address dec
// checked, or nil.
func (u *upstreamPool) take(host string, dec *netpolicy.Decision) *upstreamConn {
	u.mu.Lock()
	defer u.mu.Unlock()
	cs := u.idle[host]
	now := time.Now()
	for i := len(cs) - 1; i >= 0; i-- {
		c := cs[i]
		if now.Sub(c.used) > upstreamIdleTTL {
			continue
		}
		if slices.Contains(dec.Addrs, c.addr) {
			u.idle[host] = slices.Delete(cs, i, i+1)
			c.reused = true
			return c
		}
	}
	return nil // expired ones are swept by put
}

func (u *upstreamPool) put(host string, c *upstreamConn) {
	c.used = time.Now()
	var expired []*upstreamConn
	u.mu.Lock()
	for h, cs := range u.idle { // sweep every host, so nothing idles forever
		keep := cs[:0]
		for _, ic := range cs {
			if c.used.Sub(ic.used) > upstreamIdleTTL {
				expired = append(expired, ic)
			} else {
				keep = append(keep, ic)
			}
		}
		if len(keep) == 0 {
			delete(u.idle, h)
		} else {
			u.idle[h] = keep
		}
	}
	if c.gen == u.gen && len(u.idle[host]) < maxIdlePerHost {
		u.idle[host] = append(u.idle[host], c)
		c = nil
	}
	u.mu.Unlock()
	for _, ic := range expired {
		ic.c.Close()
	}
	if c != nil {
		c.c.Close()
	}
}

// dial connects to an address dec checked and completes TLS, verifying the
// certificate for the destination's host (an http route's connection is
// the TCP one as it is).
func (u *upstreamPool) dial(ctx context.Context, dest upstreamDest, dec *netpolicy.Decision) (*upstreamConn, error) {
	// The generation is taken before dialing: a policy change during the
	// dial keeps this connection out of the pool.
	u.mu.Lock()
	gen := u.gen
	u.mu.Unlock()
	raw, err := u.p.cfg.Decider.Dial(ctx, dec)
	if err != nil {
		return nil, err
	}
	if dest.plain {
		return &upstreamConn{c: raw, raw: rawConn(raw), br: bufio.NewReaderSize(raw, 16<<10), bw: bufio.NewWriterSize(raw, 16<<10), addr: dec.Addr, gen: gen}, nil
	}
	host := dest.host
	rec := &recordConn{Conn: raw}
	tc := tls.Client(rec, &tls.Config{
		ServerName: host,
		RootCAs:    u.p.cfg.UpstreamRoots,
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1"},
	})
	hctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := tc.HandshakeContext(hctx); err != nil {
		raw.Close()
		return nil, fmt.Errorf("TLS handshake with %s: %w", host, err)
	}
	return &upstreamConn{c: tc, raw: rawConn(raw), rec: rec, br: bufio.NewReaderSize(tc, 16<<10), bw: bufio.NewWriterSize(tc, 16<<10), addr: dec.Addr, gen: gen}, nil
}

// roundTrip sends out on a pooled or new connection and reads the response
// headers. The response body, when read to its end, puts the connection
// back; closed early, it closes the connection. reused says whether the
// connection came from the pool (a failure before any response byte on a
// reused connection may be retried on a fresh one by the caller).
func (u *upstreamPool) roundTrip(ctx context.Context, out *http.Request, dest upstreamDest, dec *netpolicy.Decision) (*http.Response, netip.Addr, error) {
	host := dest.key()
	if c := u.get(host, dec); c != nil {
		resp, err := u.exchange(ctx, out, host, c)
		if err == nil {
			return resp, c.addr, nil
		}
		// A kept-alive connection the upstream had closed: retry once on
		// a fresh one, but only when nothing of the body was consumed.
		if !errors.Is(err, errStaleConn) {
			return nil, c.addr, err
		}
	}
	c, err := u.dial(ctx, dest, dec)
	if err != nil {
		return nil, dec.Addr, err
	}
	resp, err := u.exchange(ctx, out, host, c)
	return resp, c.addr, err
}

var errStaleConn = errors.New("kept-alive upstream connection was closed")

func (u *upstreamPool) exchange(ctx context.Context, out *http.Request, host string, c *upstreamConn) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() {
		c.canceled.Store(true)
		c.c.SetDeadline(time.Unix(1, 0))
	})
	body := out.Body
	bodyRead := false
	if body != nil && body != http.NoBody {
		out.Body = readTracker{r: body, read: &bodyRead, c: c.c, idle: u.p.cfg.IdleTimeout}
	}
	// fail closes the connection. A reused connection that the upstream
	// had closed while idle may be retried on a fresh one, but only a
	// request without a body whose method is idempotent, and only when not
	// a byte of a response arrived: the upstream may have acted on it.
	retryable := c.reused && (body == nil || body == http.NoBody) && idempotent(out.Method)
	fail := func(err error) (*http.Response, error) {
		stop()
		c.c.Close()
		out.Body = body
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		if retryable && !bodyRead && (errors.Is(err, io.EOF) || errors.Is(err, errConnReset) || errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed)) {
			return nil, errStaleConn
		}
		return nil, err
	}
	// A write deadline, refreshed as the body is read: an upstream that
	// stops reading must not hold the request forever.
	c.c.SetWriteDeadline(time.Now().Add(u.p.cfg.IdleTimeout))
	// Given a *bufio.Writer, net/http flushes after each chunk of a body of
	// unknown length, so a request body the sandbox streams is not held back.
	werr := out.Write(c.bw)
	if werr == nil {
		werr = c.bw.Flush()
	}
	var resp *http.Response
	if werr != nil {
		if ctx.Err() != nil || !bodyRead || isTimeout(werr) {
			return fail(werr)
		}
		// The upstream stopped reading the body: it may have answered
		// first (413, 401), as servers do. That answer is the response.
		if resp = earlyResponse(c, out); resp == nil {
			return fail(werr)
		}
		c.reused = false
	}
	c.c.SetWriteDeadline(time.Time{})
	c.c.SetReadDeadline(time.Now().Add(u.p.cfg.ResponseHeaderTimeout))
	if c.canceled.Load() {
		c.c.SetDeadline(time.Unix(1, 0)) // the context ended meanwhile: keep it cut
	}
	for resp == nil {
		r, err := http.ReadResponse(c.br, out)
		if err != nil {
			if errors.Is(err, io.EOF) && c.br.Buffered() == 0 {
				return fail(err) // closed before a byte of a response
			}
			if isStale(err) || isTimeout(err) || ctx.Err() != nil {
				retryable = false
				return fail(err)
			}
			return fail(&protocolError{err})
		}
		c.reused = false // the upstream answered: no retry from here on
		if r.StatusCode >= 200 || r.StatusCode == http.StatusSwitchingProtocols {
			resp = r
			break
		}
		io.Copy(io.Discard, r.Body) // 100 Continue, 103 Early Hints: skip
	}
	out.Body = body
	c.c.SetReadDeadline(time.Time{})
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return fail(errors.New("upstream switched protocols; base-URL routes carry HTTP only"))
	}
	reusable := !resp.Close && !out.Close && !framingViolated(resp)
	ub := &upstreamBody{rc: resp.Body, u: u, host: host, c: c, stop: stop, reusable: reusable}
	if resp.Body == http.NoBody {
		// HEAD, 204, 304: nothing to read; the connection is free now, and
		// the body stays NoBody so that nobody mistakes it for one.
		ub.finish(reusable)
		return resp, nil
	}
	resp.Body = ub
	return resp, nil
}

// framingViolated reports a response head that announces a body where
// none may be (RFC 9110 §8.6, RFC 9112 §6.1): a 204 with a Content-Length
// other than 0 or with a Transfer-Encoding. net/http reads no body for it,
// so whatever the upstream sends as one would be taken for the next
// response: the connection is not reused. (A HEAD or a 304 may announce
// the length of the body it does not send; the bytes themselves, if any
// come, are caught by finish and idleQuiet.)
func framingViolated(resp *http.Response) bool {
	if resp.StatusCode != http.StatusNoContent {
		return false
	}
	if len(resp.TransferEncoding) > 0 || resp.Header["Transfer-Encoding"] != nil {
		return true
	}
	for _, v := range resp.Header["Content-Length"] {
		if v != "0" {
			return true
		}
	}
	return false
}

// earlyResponseWait bounds the look for an answer after a failed upload.
const earlyResponseWait = 2 * time.Second

// earlyResponse reads a final response the upstream sent before it stopped
// reading the request body, or returns nil. The connection is not reused.
func earlyResponse(c *upstreamConn, out *http.Request) *http.Response {
	c.c.SetReadDeadline(time.Now().Add(earlyResponseWait))
	for range 4 {
		r, err := http.ReadResponse(c.br, out)
		if err != nil {
			return nil
		}
		if r.StatusCode >= 200 {
			if r.StatusCode == http.StatusSwitchingProtocols {
				return nil
			}
			r.Close = true
			return r
		}
		io.Copy(io.Discard, r.Body)
	}
	return nil
}

// isStale reports errors meaning the peer had closed a kept-alive connection.
func isStale(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, errConnReset)
}

// readTracker notes whether any of a body was read (after which a request
// can no longer be retried) and refreshes the upstream write deadline.
type readTracker struct {
	r    io.ReadCloser
	read *bool
	c    net.Conn
	idle time.Duration
}

func (t readTracker) Read(p []byte) (int, error) {
	t.c.SetWriteDeadline(time.Now().Add(t.idle))
	n, err := t.r.Read(p)
	if n > 0 {
		*t.read = true
	}
	return n, err
}

func (t readTracker) Close() error { return t.r.Close() }

// upstreamBody returns its connection to the pool when read to the end.
type upstreamBody struct {
	rc       io.ReadCloser
	u        *upstreamPool
	host     string
	c        *upstreamConn
	stop     func() bool
	reusable bool
	done     bool
}

func (b *upstreamBody) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	// Each read of the body must make progress within the idle time: an
	// upstream that stalls mid-body must not hold the sandbox forever.
	b.c.c.SetReadDeadline(time.Now().Add(b.u.p.cfg.IdleTimeout))
	if b.c.canceled.Load() {
		b.c.c.SetDeadline(time.Unix(1, 0))
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.finish(b.reusable)
	} else if err != nil {
		b.finish(false)
	}
	return n, err
}

func (b *upstreamBody) Close() error {
	b.finish(false)
	return nil
}

func (b *upstreamBody) finish(reuse bool) {
	if b.done {
		return
	}
	b.done = true
	if !b.stop() {
		reuse = false // the context ended: the deadline is poisoned
	}
	// A byte already read past the end of the response (a body after a
	// HEAD, a 204 or a 304; more than Content-Length; anything after the
	// last chunk) breaks the framing: it would be taken for the next
	// response. Bytes that come later are idleQuiet's to find.
	if reuse && b.c.br.Buffered() == 0 {
		b.c.c.SetDeadline(time.Time{})
		b.u.put(b.host, b.c)
		return
	}
	b.c.c.Close()
}

// idempotent methods may be sent again when a kept-alive connection turns
// out to have been closed (RFC 9110 §9.2.2).
func idempotent(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}
