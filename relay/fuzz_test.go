package relay

import (
	"bytes"
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/netpolicy"
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
