// Regression tests from the review of the route's upstream pool.

package relay

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/tlstest"
)

// rawUpstream: a TLS upstream where behave(i, conn) handles connection i.
func rawUpstream(t *testing.T, e *env, behave func(i int, raw *net.TCPConn, c *tls.Conn)) {
	leaf, err := e.ca.Leaf("api.example.com")
	if err != nil {
		t.Fatal(err)
	}
	ln := tlstest.Listen443(t)
	t.Cleanup(func() { ln.Close() })
	var n atomic.Int32
	go func() {
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			i := int(n.Add(1)) - 1
			go func() {
				tc := tls.Server(raw, &tls.Config{Certificates: []tls.Certificate{leaf}, NextProtos: []string{"http/1.1"}})
				if tc.Handshake() != nil {
					raw.Close()
					return
				}
				behave(i, raw.(*net.TCPConn), tc)
			}()
		}
	}()
	a := netip.MustParseAddrPort(ln.Addr().String()).Addr()
	e.dns.Set("api.example.com", a)
	e.decider.AllowPrivate = append(e.decider.AllowPrivate, netip.PrefixFrom(a, 32))
}

// Stale retry while net/http's probe goroutine (GET + chunked body) is
// still blocked reading the sandbox's body: a byte is lost.
func TestChunkedBodyOnStaleConnectionArrivesWhole(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	var mu sync.Mutex
	var got []string
	rawUpstream(t, e, func(i int, raw *net.TCPConn, c *tls.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		b, _ := io.ReadAll(req.Body)
		mu.Lock()
		got = append(got, fmt.Sprintf("conn%d %s %q", i, req.URL.Path, b))
		mu.Unlock()
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(b), b)
		if i == 0 {
			// idle-close with RST
			time.Sleep(100 * time.Millisecond)
			raw.SetLinger(0)
			raw.Close()
			return
		}
		c.Close()
	})
	if code, _ := e.get(t, "api.example.com/first"); code != 200 {
		t.Fatal(code)
	}
	time.Sleep(300 * time.Millisecond)
	c, br := e.dial()
	io.WriteString(c, "GET /https/api.example.com/second HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
	time.Sleep(600 * time.Millisecond)
	io.WriteString(c, "5\r\nhello\r\n0\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	mu.Lock()
	t.Logf("upstream saw: %v", got)
	mu.Unlock()
	if resp.StatusCode != 200 || string(b) != "hello" {
		t.Errorf("sandbox got %d %q; want 200 \"hello\"", resp.StatusCode, b)
	}
}

// Regression, caught by the race detector (CI runs -race): with a chunked
// body net/http probed it from a goroutine of its own; when the write failed
// on a fresh connection that goroutine outlived the request and touched the
// pooled reader after release(). Write failure while the probe is blocked:
// the goroutine outlives the request, and touches cc.br after release().
func TestChunkedBodyReaderDoesNotOutliveRequest(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	rawUpstream(t, e, func(i int, raw *net.TCPConn, c *tls.Conn) {
		raw.SetLinger(0)
		raw.Close() // RST right after the handshake
	})
	c, br := e.dial()
	io.WriteString(c, "DELETE /https/api.example.com/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(resp.Body); resp.StatusCode != 502 {
		t.Errorf("got %d %q, want 502: the upstream reset the connection", resp.StatusCode, b)
	}
	// Meanwhile other connections take pooled readers.
	for range 5 {
		c2, br2 := e.dial()
		io.WriteString(c2, "GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
		http.ReadResponse(br2, nil)
		c2.Close()
	}
	time.Sleep(200 * time.Millisecond)
	c.Close()
	time.Sleep(200 * time.Millisecond)
}
