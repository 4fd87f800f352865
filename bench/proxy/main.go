// Command proxy measures `sandgate proxy` against a direct connection to the
// same loopback HTTPS upstream, in one run, and prints the ratios:
//
//   - CONNECT tunnel throughput (a large HTTPS download through the tunnel
//     against the same download direct);
//   - base-URL route request rate (keep-alive, concurrent) against direct
//     HTTPS requests;
//   - added latency per routed request, p50 and p99, one request at a time.
//
// Everything runs on loopback: a DNS server, the upstream on 127.x.y.z:443
// (binding 443 needs root), and the proxy built from this checkout. Run it
// with bench/proxy.sh.
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandgate/sandgate/internal/dnstest"
	"github.com/sandgate/sandgate/internal/tlstest"
)

const host = "api.bench.example.com"

func main() {
	bin := flag.String("sandgate", "", "path to the sandgate binary (built from this checkout when empty)")
	bulk := flag.Int64("bulk", 1<<30, "bytes per tunnel throughput download")
	dur := flag.Duration("duration", 5*time.Second, "duration of each request-rate run")
	conc := flag.Int("concurrency", 8, "concurrent clients in the request-rate runs")
	lat := flag.Int("latency-requests", 3000, "sequential requests per latency run")
	serve := flag.String("serve-upstream", "", "internal: serve the upstream with the PEM cert+key in this file and print its address")
	flag.Parse()
	log.SetFlags(0)
	if *serve != "" {
		if err := serveUpstream(*serve); err != nil {
			log.Fatal("upstream: ", err)
		}
		return
	}
	if err := run(*bin, *bulk, *dur, *conc, *lat); err != nil {
		log.Fatal("bench: ", err)
	}
}

func run(bin string, bulk int64, dur time.Duration, conc, latN int) error {
	dir, err := os.MkdirTemp("", "sandgate-bench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if bin == "" {
		bin = filepath.Join(dir, "sandgate")
		if out, err := exec.Command("go", "build", "-o", bin, "./cmd/sandgate").CombinedOutput(); err != nil {
			return fmt.Errorf("go build: %v\n%s", err, out)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dns, err := dnstest.New()
	if err != nil {
		return err
	}
	defer dns.Close()
	ca, err := tlstest.NewCA()
	if err != nil {
		return err
	}
	// The upstream runs in a process of its own, as a real API would: both
	// the direct client and the proxy reach it across processes.
	upAddr, stopUp, err := startUpstream(ctx, ca, dir)
	if err != nil {
		return err
	}
	defer stopUp()
	dns.Set(host, upAddr)
	caFile, err := ca.WritePEM(dir)
	if err != nil {
		return err
	}
	rules := filepath.Join(dir, "rules.json")
	// A few rules, as a real deployment has: two that do not match, one that
	// swaps a secret in.
	os.WriteFile(rules, []byte(`[
 {"match":{"host":"api.openai.com"},"transform":{"headers":{"authorization":{"env":"BENCH_KEY","prefix":"Bearer "}}}},
 {"match":{"host":"*.example.org","path":{"startsWith":"/v1/"}},"transform":{"headers":{"x-other":"1"}}},
 {"match":{"host":"`+host+`","method":["GET","POST"]},"transform":{"headers":{"x-api-key":{"env":"BENCH_KEY"}}}}
]`), 0o600)

	cmd := exec.CommandContext(ctx, bin, "proxy", "--listen", "127.0.0.1:0", "--allow", host,
		"--dns", dns.Addr, "--allow-private", upAddr.String()+"/32", "--upstream-ca", caFile,
		"--transformations", rules, "--audit-log", filepath.Join(dir, "audit.jsonl"))
	cmd.Env = append(os.Environ(), "BENCH_KEY=sk-bench-0123456789")
	proxyAddr, err := startProxy(cmd)
	if err != nil {
		return err
	}
	defer func() {
		// Stop the proxy the way an operator would, so it shuts down cleanly.
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
		}
	}()

	tlsConf := &tls.Config{RootCAs: ca.Pool, ServerName: host}
	direct := func() *http.Client {
		return &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "tcp", netip.AddrPortFrom(upAddr, 443).String())
			},
			TLSClientConfig: tlsConf.Clone(), MaxIdleConnsPerHost: 64, DisableCompression: true,
		}}
	}
	pu, _ := url.Parse("http://" + proxyAddr)
	tunnel := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: tlsConf.Clone(), DisableCompression: true}}
	routeC := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64, DisableCompression: true}}
	directURL := "https://" + host
	routeURL := "http://" + proxyAddr + "/https/" + host

	fmt.Printf("sandgate proxy bench: %d cores, upstream %s:443, proxy %s\n\n", runtime.NumCPU(), upAddr, proxyAddr)

	// Warm up both paths (TLS sessions, DNS cache, keep-alive pools).
	for range 50 {
		get(direct(), directURL+"/small")
		get(routeC, routeURL+"/small")
	}

	// 1. Tunnel throughput: best of 3, alternating.
	var dT, pT float64
	dc := direct()
	cpu0 := procCPU(cmd.Process.Pid)
	for range 3 {
		dT = max(dT, throughput(dc, directURL+"/bulk?n="+strconv.FormatInt(bulk, 10), bulk))
		pT = max(pT, throughput(tunnel, directURL+"/bulk?n="+strconv.FormatInt(bulk, 10), bulk))
	}
	proxyCPU := procCPU(cmd.Process.Pid) - cpu0
	fmt.Printf("CONNECT tunnel throughput  direct %8.0f MB/s   proxy %8.0f MB/s   ratio %.2f  (target >= 0.90)\n", dT/1e6, pT/1e6, pT/dT)
	// Where the tunnel's cost goes: the proxy's own CPU per GiB carried,
	// against the wall time a GiB takes direct (2 cores shared by client,
	// upstream and proxy).
	gib := float64(3*bulk) / (1 << 30)
	fmt.Printf("  proxy CPU per GiB tunneled %6.2f s   (direct: %.2f s of wall time per GiB)\n", proxyCPU.Seconds()/gib, (1<<30)/dT)

	// 2. Request rate, concurrent keep-alive clients.
	dR := rate(direct(), directURL+"/small", conc, dur)
	rR := rate(routeC, routeURL+"/small", conc, dur)
	fmt.Printf("route request rate (c=%d)   direct %8.0f req/s  route %8.0f req/s  ratio %.2f\n", conc, dR, rR, rR/dR)

	// 3. Latency, one request at a time, interleaved so that noise hits both.
	dl, rl := latencies(direct(), routeC, directURL+"/small", routeURL+"/small", latN)
	fmt.Printf("latency p50                direct %8.1f µs    route %8.1f µs    added %6.1f µs  (target < 100)\n", us(pct(dl, 50)), us(pct(rl, 50)), us(pct(rl, 50)-pct(dl, 50)))
	fmt.Printf("latency p99                direct %8.1f µs    route %8.1f µs    added %6.1f µs\n", us(pct(dl, 99)), us(pct(rl, 99)), us(pct(rl, 99)-pct(dl, 99)))
	return nil
}

var payload = make([]byte, 256<<10)

// startUpstream re-runs this program as the upstream server, in its own
// process, with a certificate for host from ca.
func startUpstream(ctx context.Context, ca *tlstest.CA, dir string) (netip.Addr, func(), error) {
	leaf, err := ca.Leaf(host)
	if err != nil {
		return netip.Addr{}, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(leaf.PrivateKey)
	if err != nil {
		return netip.Addr{}, nil, err
	}
	pemFile := filepath.Join(dir, "upstream.pem")
	data := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leaf.Certificate[0]}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})...)
	if err := os.WriteFile(pemFile, data, 0o600); err != nil {
		return netip.Addr{}, nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return netip.Addr{}, nil, err
	}
	cmd := exec.CommandContext(ctx, self, "-serve-upstream", pemFile)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return netip.Addr{}, nil, err
	}
	if err := cmd.Start(); err != nil {
		return netip.Addr{}, nil, err
	}
	stop := func() { cmd.Process.Kill(); cmd.Wait() }
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			line <- sc.Text()
		}
		io.Copy(io.Discard, out)
	}()
	select {
	case l := <-line:
		a, err := netip.ParseAddr(l)
		if err != nil {
			stop()
			return netip.Addr{}, nil, fmt.Errorf("upstream said %q", l)
		}
		return a, stop, nil
	case <-time.After(30 * time.Second):
		stop()
		return netip.Addr{}, nil, fmt.Errorf("upstream did not start within 30s")
	}
}

// serveUpstream is the upstream process: small JSON answers on /small and
// n bytes on /bulk?n=, over HTTP/1.1 and HTTP/2.
func serveUpstream(pemFile string) error {
	cert, err := tls.LoadX509KeyPair(pemFile, pemFile)
	if err != nil {
		return err
	}
	ln, err := tlstest.ListenLoopback443()
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/small", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"msg_01","type":"message","content":[{"type":"text","text":"ok"}]}`)
	})
	mux.HandleFunc("/bulk", func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		for n > 0 {
			k := min(n, int64(len(payload)))
			if _, err := w.Write(payload[:k]); err != nil {
				return
			}
			n -= k
		}
	})
	fmt.Println(netip.MustParseAddrPort(ln.Addr().String()).Addr())
	srv := &http.Server{Handler: mux, TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}}}
	return srv.ServeTLS(ln, "", "")
}

// startProxy starts the proxy and returns the address it says it listens on.
func startProxy(cmd *exec.Cmd) (string, error) {
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return "", err
	}
	if err := cmd.Start(); err != nil {
		return "", err
	}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["message"] == "proxy listening" {
				addr <- m["addr"].(string)
			}
		}
	}()
	select {
	case a := <-addr:
		return a, nil
	case <-time.After(30 * time.Second):
		return "", fmt.Errorf("proxy did not start within 30s")
	}
}

func get(c *http.Client, u string) error {
	resp, err := c.Get(u)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: %s", u, resp.Status)
	}
	return err
}

func throughput(c *http.Client, u string, n int64) float64 {
	start := time.Now()
	resp, err := c.Get(u)
	if err != nil {
		log.Fatal(err)
	}
	got, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil || got != n {
		log.Fatalf("download %s: %d of %d bytes: %v", u, got, n, err)
	}
	return float64(n) / time.Since(start).Seconds()
}

func rate(c *http.Client, u string, conc int, dur time.Duration) float64 {
	var n atomic.Int64
	deadline := time.Now().Add(dur)
	var wg sync.WaitGroup
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				if err := get(c, u); err != nil {
					log.Fatal(err)
				}
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	return float64(n.Load()) / dur.Seconds()
}

func latencies(dc, rc *http.Client, du, ru string, n int) (d, r []time.Duration) {
	for range n {
		for _, x := range []struct {
			c   *http.Client
			u   string
			out *[]time.Duration
		}{{dc, du, &d}, {rc, ru, &r}} {
			start := time.Now()
			if err := get(x.c, x.u); err != nil {
				log.Fatal(err)
			}
			*x.out = append(*x.out, time.Since(start))
		}
	}
	return d, r
}

func pct(ds []time.Duration, p int) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

func us(d time.Duration) float64 { return float64(d) / 1e3 }

// procCPU returns the user+system CPU time a process has used so far.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command name (which is in parentheses and may hold
	// spaces): state is field 3, utime 14, stime 15 (clock ticks, 100/s).
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * (time.Second / 100)
}
