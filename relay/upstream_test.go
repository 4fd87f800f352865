package relay

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/tlstest"
)

// remoteAddrs records the client addresses an upstream saw.
type remoteAddrs struct {
	mu   sync.Mutex
	seen map[string]int
}

func (r *remoteAddrs) handler(name string) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		if r.seen == nil {
			r.seen = map[string]int{}
		}
		r.seen[req.RemoteAddr]++
		r.mu.Unlock()
		fmt.Fprintf(w, "%s %s", name, req.URL.Path)
	}
}

func (r *remoteAddrs) conns() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.seen)
}

func (e *env) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := e.routeClient().Get(e.routeURL(path))
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, body(t, resp)
}

func TestUpstreamConnectionReuse(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	var ra remoteAddrs
	srv := e.upstream("api.example.com", ra.handler("a"))
	for i := range 3 {
		if code, b := e.get(t, fmt.Sprintf("api.example.com/%d", i)); code != 200 || b != fmt.Sprintf("a /%d", i) {
			t.Fatalf("request %d: %d %q", i, code, b)
		}
	}
	// A response without a body (HEAD) leaves its connection reusable too.
	resp, err := e.routeClient().Head(e.routeURL("api.example.com/head"))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("HEAD: %v %v", resp, err)
	}
	body(t, resp)
	if code, _ := e.get(t, "api.example.com/3"); code != 200 {
		t.Fatalf("after HEAD: %d", code)
	}
	if n := ra.conns(); n != 1 {
		t.Errorf("5 sequential requests used %d upstream connections, want 1 kept alive", n)
	}
	// The upstream drops its idle connections: the next request retries on
	// a fresh one instead of failing.
	srv.CloseClientConnections()
	if code, b := e.get(t, "api.example.com/after-close"); code != 200 || b != "a /after-close" {
		t.Errorf("after the upstream closed the kept-alive connection: %d %q", code, b)
	}
	// A policy change drops kept-alive connections.
	before := ra.conns()
	e.tenant.SetPolicy(e.tenant.Policy())
	if code, _ := e.get(t, "api.example.com/after-policy"); code != 200 {
		t.Fatalf("after SetPolicy: %d", code)
	}
	if n := ra.conns(); n != before+1 {
		t.Errorf("after SetPolicy the request reused a connection dialed under the old policy (%d conns, want %d)", n, before+1)
	}
}

// TestUpstreamPoolHonoursNewAnswer: a kept-alive connection to the address a
// name used to resolve to is not reused once the name resolves elsewhere;
// the request goes to the address just checked.
func TestUpstreamPoolHonoursNewAnswer(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	a := e.ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "A") }), "api.example.com")
	b := e.ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "B") }), "api.example.com")
	aa, ba := tlstest.Addr(a), tlstest.Addr(b)
	e.decider.AllowPrivate = []netip.Prefix{netip.PrefixFrom(aa, 32), netip.PrefixFrom(ba, 32)}
	e.dns.SetTTL("api.example.com", 0)
	e.dns.SetSequence("api.example.com", []netip.Addr{aa}, []netip.Addr{ba})
	if _, got := e.get(t, "api.example.com/1"); got != "A" {
		t.Fatalf("first request went to %q, want A", got)
	}
	// Each get is a new client connection: the first request's event may
	// still be on its way when the second one finishes. Wait for it.
	e.event(1)
	if _, got := e.get(t, "api.example.com/2"); got != "B" {
		t.Errorf("second request went to %q over the kept-alive connection; want B, the address just checked", got)
	}
	if ev := e.event(2); ev.Addr != netip.AddrPortFrom(ba, 443).String() {
		t.Errorf("event addr %q, want %s", ev.Addr, netip.AddrPortFrom(ba, 443))
	}
}

// TestUpstreamNotReusedAfterPartialBody: when the sandbox goes away in the
// middle of a response, the upstream connection is closed, never pooled
// with the rest of that body unread, and the next request works.
func TestUpstreamNotReusedAfterPartialBody(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	var ra remoteAddrs
	chunk := make([]byte, 64<<10)
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ra.handler("x")(discardWriter{w.Header()}, r)
		if r.URL.Path != "/big" {
			io.WriteString(w, "small")
			return
		}
		for range 256 { // 16 MiB, far more than socket buffers hold
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))
	c, br := e.dial()
	io.WriteString(c, "GET /https/api.example.com/big HTTP/1.1\r\nHost: p\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("big response: %v %v", resp, err)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	c.Close() // the sandbox goes away mid-body
	e.event(1)
	if code, b := e.get(t, "api.example.com/small"); code != 200 || b != "small" {
		t.Fatalf("next request: %d %q", code, b)
	}
	if n := ra.conns(); n != 2 {
		t.Errorf("upstream saw %d connections, want 2: the half-read one must not be reused", n)
	}
}

// discardWriter is a ResponseWriter that drops what is written.
type discardWriter struct{ h http.Header }

func (d discardWriter) Header() http.Header         { return d.h }
func (d discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (d discardWriter) WriteHeader(int)             {}

// TestMalformedUpstreamResponseDoesNotLeakSecret: a response head the proxy
// cannot parse, echoing the secret, must not reach the sandbox, the audit
// event or the logs (net/http's parser errors quote the bytes they choke on).
func TestMalformedUpstreamResponseDoesNotLeakSecret(t *testing.T) {
	rules := `[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, rules)
	leaf, err := e.ca.Leaf("api.example.com")
	if err != nil {
		t.Fatal(err)
	}
	ln := tlstest.Listen443(t)
	t.Cleanup(func() { ln.Close() })
	tln := tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{leaf}})
	go func() {
		for {
			c, err := tln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				// An upstream that echoes the key in a header line it gets wrong.
				fmt.Fprintf(c, "HTTP/1.1 401 Unauthorized\r\nInvalid key %s\r\n\r\n", req.Header.Get("X-Api-Key"))
			}()
		}
	}()
	a := netip.MustParseAddrPort(ln.Addr().String()).Addr()
	e.dns.Set("api.example.com", a)
	e.decider.AllowPrivate = append(e.decider.AllowPrivate, netip.PrefixFrom(a, 32))

	c, br := e.dial()
	io.WriteString(c, "GET /https/api.example.com/v1/x HTTP/1.1\r\nHost: x\r\nX-Api-Key: sandgate-placeholder-CANARY_KEY\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 502 || !strings.Contains(b, "malformed") {
		t.Errorf("got %d %q, want 502 saying the upstream response was malformed", resp.StatusCode, b)
	}
	if ev := e.event(1); strings.Contains(ev.Error, canary) || ev.Status != 502 {
		t.Errorf("audit event %+v", ev)
	}
	// The env's cleanup greps the logs and every event for the canary.
}

// TestEarlyUpstreamAnswerDuringUpload: an upstream that refuses a large
// upload before reading it (413) gets its answer to the sandbox, not a 502
// for the write that failed. (Found in review.)
func TestEarlyUpstreamAnswerDuringUpload(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	rawUpstream(t, e, func(i int, raw *net.TCPConn, c *tls.Conn) {
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 413 Request Entity Too Large\r\nContent-Length: 9\r\nConnection: close\r\n\r\ntoo large")
		c.Close()
	})
	big := strings.NewReader(strings.Repeat("x", 3<<20)) // more than socket buffers, less than the linger drain
	resp, err := e.routeClient().Post(e.routeURL("api.example.com/upload"), "application/octet-stream", big)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 413 || b != "too large" {
		t.Errorf("got %d %q, want the upstream's 413", resp.StatusCode, b)
	}
}
