package relay

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
)

// BenchmarkRoute measures one routed request at a time through the proxy,
// with a secret-swapping rule, against a loopback HTTPS upstream.
func BenchmarkRoute(b *testing.B) {
	e := newEnvTB(b, `{"mode":"custom","allowedHosts":["api.example.com"]}`,
		`[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`)
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"id":"msg_01","type":"message","content":[{"type":"text","text":"ok"}]}`)
	}))
	c := e.routeClient()
	u := e.routeURL("api.example.com/v1/messages")
	b.ResetTimer()
	for b.Loop() {
		resp, err := c.Get(u)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// BenchmarkDirect is BenchmarkRoute's baseline: the same request straight
// to the upstream over HTTPS.
func BenchmarkDirect(b *testing.B) {
	e := newEnvTB(b, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	srv := e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"id":"msg_01","type":"message","content":[{"type":"text","text":"ok"}]}`)
	}))
	addr := srv.Listener.Addr().String()
	c := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", addr)
		},
		TLSClientConfig:   &tls.Config{RootCAs: e.ca.Pool},
		ForceAttemptHTTP2: true,
	}}
	u := "https://api.example.com/v1/messages"
	b.ResetTimer()
	for b.Loop() {
		resp, err := c.Get(u)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// BenchmarkRoutePlain is BenchmarkRoute without transformation rules.
func BenchmarkRoutePlain(b *testing.B) {
	e := newEnvTB(b, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"id":"msg_01","type":"message","content":[{"type":"text","text":"ok"}]}`)
	}))
	c := e.routeClient()
	u := e.routeURL("api.example.com/v1/messages")
	b.ResetTimer()
	for b.Loop() {
		resp, err := c.Get(u)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

const tunnelBulk = 256 << 20

func bulkHandler(w http.ResponseWriter, r *http.Request) {
	buf := make([]byte, 256<<10)
	w.Header().Set("Content-Length", fmt.Sprint(tunnelBulk))
	for n := tunnelBulk; n > 0; n -= len(buf) {
		if _, err := w.Write(buf); err != nil {
			return
		}
	}
}

// BenchmarkTunnel downloads over HTTPS through a CONNECT tunnel; bytes/s is
// the tunnel's throughput.
func BenchmarkTunnel(b *testing.B) {
	e := newEnvTB(b, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(bulkHandler))
	c := e.tunnelClient()
	b.SetBytes(tunnelBulk)
	for b.Loop() {
		resp, err := c.Get("https://api.example.com/bulk")
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// BenchmarkTunnelDirect is BenchmarkTunnel's baseline, straight to the
// upstream.
func BenchmarkTunnelDirect(b *testing.B) {
	e := newEnvTB(b, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	srv := e.upstream("api.example.com", http.HandlerFunc(bulkHandler))
	addr := srv.Listener.Addr().String()
	c := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", addr)
		},
		TLSClientConfig: &tls.Config{RootCAs: e.ca.Pool},
	}}
	b.SetBytes(tunnelBulk)
	for b.Loop() {
		resp, err := c.Get("https://api.example.com/bulk")
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}
