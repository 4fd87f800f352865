package relay

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"syscall"
	"testing"

	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
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

// segmentFiles is a SegmentWriter over a directory store, as appliance's
// AuditStore is (which relay cannot import).
type segmentFiles struct{ st store.Store }

func (s segmentFiles) WriteSegment(ctx context.Context, sandbox, name string, data []byte) error {
	_, err := s.st.Put(ctx, "audit/"+sandbox+"/"+name+".jsonl.zst", bytes.NewReader(data), store.PutOptions{})
	return err
}

// BenchmarkRouteAudit: routed requests from several clients at once, the
// proxy's audit the log alone or the log and the durable audit over a
// directory store; the process's CPU per request, every goroutine's.
func BenchmarkRouteAudit(b *testing.B) {
	for _, durable := range []bool{false, true} {
		b.Run(fmt.Sprintf("durable=%v", durable), func(b *testing.B) {
			var js *audit.Journals
			e := newEnvTB(b, benchPolicy, "", func(c *Config) {
				log := audit.NewJSONLines(io.Discard)
				c.Audit = log
				if durable {
					st, err := store.NewDir(b.TempDir())
					if err != nil {
						b.Fatal(err)
					}
					js, _ = audit.NewJournals(audit.JournalsConfig{Writer: segmentFiles{st}, Log: log})
					js.Open("tenant-test")
					c.Audit = js
				}
			})
			e.upstream("api.example.com", http.HandlerFunc(smallJSON))
			c := e.routeClient()
			c.Transport.(*http.Transport).MaxIdleConnsPerHost = 16
			u := e.routeURL("api.example.com/v1/messages")
			var ru0 syscall.Rusage
			syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
			b.SetParallelism(4)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := c.Get(u)
					if err != nil {
						b.Error(err)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
			if js != nil {
				js.Close(context.Background())
			}
			var ru1 syscall.Rusage
			syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
			cpu := ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano()
			b.ReportMetric(float64(cpu)/float64(b.N)/1e3, "cpu-µs/req")
		})
	}
}
