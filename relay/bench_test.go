package relay

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
)

// Benchmarks compare the proxy with a direct connection to the same
// loopback upstream in the same run; bench/proxy.sh does the same across
// processes, which is what the README's figures come from.

func smallJSON(w http.ResponseWriter, r *http.Request) {
	io.WriteString(w, `{"id":"msg_01","type":"message","content":[{"type":"text","text":"ok"}]}`)
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

// directClient talks HTTPS straight to srv, for the host names it serves.
func directClient(e *env, srv *httptest.Server) *http.Client {
	addr := srv.Listener.Addr().String()
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", addr)
		},
		TLSClientConfig: &tls.Config{RootCAs: e.ca.Pool},
	}}
}

// benchGets fetches u b.N times, reading each body to its end.
func benchGets(b *testing.B, c *http.Client, u string) {
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

const benchPolicy = `{"mode":"custom","allowedHosts":["api.example.com"]}`

// BenchmarkRoute: one routed request at a time, with a secret-swapping rule.
func BenchmarkRoute(b *testing.B) {
	e := newEnvTB(b, benchPolicy, `[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`)
	e.upstream("api.example.com", http.HandlerFunc(smallJSON))
	benchGets(b, e.routeClient(), e.routeURL("api.example.com/v1/messages"))
}

// BenchmarkRoutePlain: BenchmarkRoute without transformation rules.
func BenchmarkRoutePlain(b *testing.B) {
	e := newEnvTB(b, benchPolicy, "")
	e.upstream("api.example.com", http.HandlerFunc(smallJSON))
	benchGets(b, e.routeClient(), e.routeURL("api.example.com/v1/messages"))
}

// BenchmarkDirect: the baseline of the route benchmarks.
func BenchmarkDirect(b *testing.B) {
	e := newEnvTB(b, benchPolicy, "")
	srv := e.upstream("api.example.com", http.HandlerFunc(smallJSON))
	benchGets(b, directClient(e, srv), "https://api.example.com/v1/messages")
}

// BenchmarkTunnel: an HTTPS download through a CONNECT tunnel.
func BenchmarkTunnel(b *testing.B) {
	e := newEnvTB(b, benchPolicy, "")
	e.upstream("api.example.com", http.HandlerFunc(bulkHandler))
	b.SetBytes(tunnelBulk)
	benchGets(b, e.tunnelClient(), "https://api.example.com/bulk")
}

// BenchmarkTunnelDirect: the baseline of BenchmarkTunnel.
func BenchmarkTunnelDirect(b *testing.B) {
	e := newEnvTB(b, benchPolicy, "")
	srv := e.upstream("api.example.com", http.HandlerFunc(bulkHandler))
	b.SetBytes(tunnelBulk)
	benchGets(b, directClient(e, srv), "https://api.example.com/bulk")
}
