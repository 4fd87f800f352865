package relay

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
)

func FuzzParseTarget(f *testing.F) {
	for _, s := range [][2]string{
		{"CONNECT", "api.example.com:443"}, {"CONNECT", "[::1]:443"}, {"CONNECT", "x"},
		{"GET", "/https/api.example.com/v1/messages?beta=true"}, {"POST", "/https/api.example.com:443"},
		{"GET", "/https/[::1]:443/x"}, {"GET", "http://x/"}, {"GET", "/https//x"}, {"GET", "/https/a?b"},
	} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, method, uri string) {
		tg, err := parseTarget(method, uri)
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error %T is not *Error", err)
			}
			return
		}
		switch tg.kind {
		case kindConnect:
			if tg.port < 1 || tg.port > 65535 || tg.host == "" {
				t.Fatalf("connect target %+v", tg)
			}
		case kindRoute:
			if tg.host == "" || !strings.HasPrefix(tg.rest, "/") || strings.ContainsAny(tg.rest, " \r\n\x00") {
				t.Fatalf("route target %+v from %q", tg, uri)
			}
			if strings.ContainsAny(tg.host, "/?") {
				t.Fatalf("route host %q contains a path", tg.host)
			}
			if tg.port != 0 && (tg.port < 1 || tg.port > 65535) {
				t.Fatalf("route port %d", tg.port)
			}
		default:
			t.Fatalf("kind %d", tg.kind)
		}
	})
}

// FuzzServeConn feeds arbitrary bytes to a proxy connection under a policy
// that denies everything: it must answer or close, never panic, never hang,
// never dial.
func FuzzServeConn(f *testing.F) {
	for _, s := range []string{
		"CONNECT a.example.com:443 HTTP/1.1\r\n\r\n",
		"GET /https/a.example.com/x HTTP/1.1\r\nHost: x\r\n\r\n",
		"POST /https/a.example.com/x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
		"GET http://a/ HTTP/1.0\r\n\r\n", "\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{"127.0.0.1:9"}, Timeout: 50 * time.Millisecond})
	if err != nil {
		f.Fatal(err)
	}
	p, err := New(Config{Decider: &netpolicy.Decider{Resolver: res}, HeaderTimeout: 100 * time.Millisecond, IdleTimeout: 100 * time.Millisecond})
	if err != nil {
		f.Fatal(err)
	}
	tenant := NewTenant("fuzz", netpolicy.Policy{Mode: netpolicy.DenyAll}, nil)
	f.Fuzz(func(t *testing.T, data []byte) {
		client, server := net.Pipe()
		done := make(chan struct{})
		go func() { p.ServeConn(context.Background(), server, tenant); close(done) }()
		go func() {
			client.SetDeadline(time.Now().Add(2 * time.Second))
			client.Write(data)
		}()
		client.SetReadDeadline(time.Now().Add(2 * time.Second))
		io.Copy(io.Discard, client)
		client.Close()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("ServeConn did not return for %q", data)
		}
	})
}

// FuzzSniffHello: whatever a sandbox sends first in a tunnel, the sniffer
// returns (never hangs, never panics), and what it consumed is exactly a
// prefix of what was sent, so replaying it loses and invents nothing.
func FuzzSniffHello(f *testing.F) {
	f.Add([]byte("\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00"))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Add([]byte{})
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	f.Fuzz(func(t *testing.T, data []byte) {
		sni, consumed, err := sniffHello(a, bytes.NewReader(data), time.Now().Add(time.Second))
		if !bytes.HasPrefix(data, consumed) {
			t.Fatalf("consumed %q is not a prefix of the input", consumed)
		}
		if err != nil && sni != "" {
			t.Fatalf("an error with a server name %q", sni)
		}
	})
}

// FuzzInterceptHello feeds arbitrary bytes, as the first bytes of a
// captured connection to a host the policy intercepts, to the proxy's own
// TLS server (which parses the ClientHello, checks its server name and
// answers with a minted certificate): it must end the connection with one
// audit event, never panic, never hang, never dial.
func FuzzInterceptHello(f *testing.F) {
	f.Add([]byte("\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00"))
	f.Add([]byte("GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n"))
	f.Add([]byte{})
	// A real ClientHello for the host, and one for another.
	for _, name := range []string{"api.example.com", "other.example.org"} {
		a, b := net.Pipe()
		go func() {
			tls.Client(a, &tls.Config{ServerName: name, NextProtos: []string{"h2", "http/1.1"}}).Handshake()
			a.Close()
		}()
		b.SetReadDeadline(time.Now().Add(5 * time.Second))
		hello := make([]byte, 4096)
		n, _ := io.ReadAtLeast(b, hello, 5)
		b.Close()
		f.Add(hello[:n])
	}
	dns := dnstest.Start(f)
	dns.Set("api.example.com", netip.MustParseAddr("192.0.2.1")) // never dialed: interception dials per request
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{dns.Addr}, Timeout: 5 * time.Second})
	if err != nil {
		f.Fatal(err)
	}
	ica, err := ca.New()
	if err != nil {
		f.Fatal(err)
	}
	rings := audit.NewRings(10)
	p, err := New(Config{Decider: &netpolicy.Decider{Resolver: res, DialTimeout: time.Millisecond}, CA: ica, Audit: rings,
		HeaderTimeout: 200 * time.Millisecond, IdleTimeout: 200 * time.Millisecond})
	if err != nil {
		f.Fatal(err)
	}
	pol, err := netpolicy.ParsePolicy([]byte(`{"mode":"custom","allowedHosts":["api.example.com"],"intercept":["api.example.com"]}`))
	if err != nil {
		f.Fatal(err)
	}
	tenant := NewTenant("fuzz", pol, nil)
	f.Fuzz(func(t *testing.T, data []byte) {
		client, server := net.Pipe()
		done := make(chan struct{})
		before := len(rings.Events("fuzz"))
		go func() {
			p.ServeCaptured(context.Background(), server, tenant, "api.example.com", 443, Peer{})
			close(done)
		}()
		go func() {
			client.SetDeadline(time.Now().Add(2 * time.Second))
			client.Write(data)
		}()
		client.SetReadDeadline(time.Now().Add(2 * time.Second))
		io.Copy(io.Discard, client)
		client.Close()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("ServeCaptured did not return for %q", data)
		}
		if got := len(rings.Events("fuzz")) - before; got < 1 && before < 10 {
			t.Fatalf("no audit event for %q", data)
		}
	})
}

// FuzzInterceptTarget: whatever Host and request target a request inside
// an intercepted connection carries, it goes to the intercepted host only,
// with an origin-form path, or is refused.
func FuzzInterceptTarget(f *testing.F) {
	for _, s := range [][3]string{
		{"GET", "api.example.com", "/v1/x?y=1"}, {"GET", "API.example.com:443", "/"}, {"GET", "other.example.com", "/"},
		{"GET", "api.example.com", "https://api.example.com/abs"}, {"OPTIONS", "api.example.com", "*"},
		{"GET", "api.example.com:8443", "/"}, {"GET", "", "/"}, {"CONNECT", "api.example.com", "api.example.com:443"},
	} {
		f.Add(s[0], s[1], s[2])
	}
	host, _ := netpolicy.CanonicalHost("api.example.com")
	ic := &interception{rule: "api.example.com", host: host, port: 443}
	f.Fuzz(func(t *testing.T, method, hostHdr, uri string) {
		req := &http.Request{Method: method, Host: hostHdr, RequestURI: uri, URL: &url.URL{}}
		if u, err := url.ParseRequestURI(uri); err == nil {
			req.URL = u
		}
		tg, err := ic.target(req)
		if err != nil {
			if _, ok := err.(*Error); !ok {
				t.Fatalf("error %T is not *Error", err)
			}
			return
		}
		if tg.host != "api.example.com" || tg.port != 443 || tg.icpt != ic {
			t.Fatalf("target %+v for Host %q", tg, hostHdr)
		}
		if !strings.HasPrefix(tg.rest, "/") || strings.ContainsAny(tg.rest, " \t\r\n\x00") {
			t.Fatalf("path %q from %q", tg.rest, uri)
		}
	})
}
