// Package benchkit is the loopback rig the bench programs share: a DNS
// server, a CA, an HTTPS upstream in a process of its own on 127.x.y.z:443
// (the only port the proxy dials; binding it needs root), `sandgate proxy`
// processes built from this checkout, and the few measurements the
// programs make (request rate, latency percentiles, a process's CPU time).
//
// It exists so that bench/proxy and bench/wasm measure the same way: what
// one of them reports can be compared with the other's figures.
//
// A program that uses it must call [UpstreamChild] first thing in main:
// the upstream is this same program re-executed, and that call is where the
// re-executed copy turns into the upstream.
package benchkit

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
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

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
)

// Host is the upstream's name: the DNS server answers it with the
// upstream's address, and its certificate is issued for it.
const Host = "api.bench.example.com"

// upstreamEnv tells a re-executed bench program to serve the upstream with
// the PEM certificate and key in the file it names.
const upstreamEnv = "SANDGATE_BENCH_UPSTREAM_PEM"

// Env is one bench run's loopback world. Make it with [Setup]; Close
// removes everything it started and wrote.
type Env struct {
	// Dir is a temporary directory removed by Close.
	Dir string
	// Bin is the sandgate binary the proxies run.
	Bin string
	// DNS answers Host with Upstream.
	DNS *dnstest.Server
	// CA issued the upstream's certificate; CAFile holds it as PEM, for
	// the proxy's --upstream-ca.
	CA     *tlstest.CA
	CAFile string
	// Upstream is the upstream's address; it listens on port 443.
	Upstream netip.Addr

	closers []func()
}

// Setup starts the DNS server and the upstream process, and builds
// ./cmd/sandgate into a temporary directory unless bin names a binary.
// It must run from the repository root (the bench scripts cd there).
func Setup(bin string) (_ *Env, err error) {
	e := &Env{}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	if e.Dir, err = os.MkdirTemp("", "sandgate-bench"); err != nil {
		return nil, err
	}
	e.closers = append(e.closers, func() { os.RemoveAll(e.Dir) })
	e.Bin = bin
	if bin == "" {
		e.Bin = filepath.Join(e.Dir, "sandgate")
		if err := GoBuild(e.Bin, nil, "./cmd/sandgate"); err != nil {
			return nil, err
		}
	}
	if e.DNS, err = dnstest.New(); err != nil {
		return nil, fmt.Errorf("DNS server: %w", err)
	}
	e.closers = append(e.closers, func() { e.DNS.Close() })
	if e.CA, err = tlstest.NewCA(); err != nil {
		return nil, err
	}
	// The upstream runs in a process of its own, as a real API would: both
	// the direct client and the proxy reach it across processes.
	if err := e.startUpstream(); err != nil {
		return nil, fmt.Errorf("upstream: %w", err)
	}
	e.DNS.Set(Host, e.Upstream)
	if e.CAFile, err = e.CA.WritePEM(e.Dir); err != nil {
		return nil, err
	}
	return e, nil
}

// Close stops what Setup started, in reverse order, and removes Dir.
func (e *Env) Close() {
	for i := len(e.closers) - 1; i >= 0; i-- {
		e.closers[i]()
	}
	e.closers = nil
}

// GoBuild runs `go build -o out` on pkgs with env added to the
// environment (GOOS=wasip1 GOARCH=wasm for a module), and returns the
// compiler's output in the error when it fails.
func GoBuild(out string, env []string, args ...string) error {
	cmd := exec.Command("go", append([]string{"build", "-o", out}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %v\n%s", strings.Join(args, " "), err, b)
	}
	return nil
}

// startUpstream re-runs this program as the upstream server, in its own
// process, with a certificate for Host from the CA.
func (e *Env) startUpstream() error {
	leaf, err := e.CA.Leaf(Host)
	if err != nil {
		return err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(leaf.PrivateKey)
	if err != nil {
		return err
	}
	pemFile := filepath.Join(e.Dir, "upstream.pem")
	data := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leaf.Certificate[0]}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})...)
	if err := os.WriteFile(pemFile, data, 0o600); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), upstreamEnv+"="+pemFile)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	stop := func() { cmd.Process.Kill(); cmd.Wait() }
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
		io.Copy(io.Discard, out)
	}()
	select {
	case l, ok := <-line:
		a, err := netip.ParseAddr(l)
		if !ok || err != nil {
			stop()
			return fmt.Errorf("the upstream process said %q instead of its address (binding 127.x.y.z:443 needs root)", l)
		}
		e.Upstream = a
		e.closers = append(e.closers, stop)
		return nil
	case <-time.After(30 * time.Second):
		stop()
		return errors.New("the upstream process did not start within 30s")
	}
}

// UpstreamChild reports whether this process is the upstream a bench
// program started, and if so serves it until killed; the error says why it
// could not. Call it first thing in main:
//
//	if child, err := benchkit.UpstreamChild(); child {
//		log.Fatal("upstream: ", err)
//	}
func UpstreamChild() (bool, error) {
	pemFile := os.Getenv(upstreamEnv)
	if pemFile == "" {
		return false, nil
	}
	return true, serveUpstream(pemFile)
}

// payload is what /bulk sends, over and over.
var payload = make([]byte, 256<<10)

// Small is the body of the upstream's /small answer, the size of a short
// API reply.
const Small = `{"id":"msg_01","type":"message","content":[{"type":"text","text":"ok"}]}`

// serveUpstream is the upstream process: Small on /small (with every
// X-Bench-* request header echoed as X-Echo-X-Bench-*) and n bytes on
// /bulk?n=, over HTTP/1.1 and HTTP/2. It prints its address on stdout.
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
		// Echoing X-Bench-* request headers lets a bench check that a
		// transform ran, at a cost every target pays alike.
		for k, v := range r.Header {
			if strings.HasPrefix(k, "X-Bench-") {
				w.Header()["X-Echo-"+k] = v
			}
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, Small)
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

// ProxyArgs are the `sandgate proxy` flags every bench proxy needs: a
// loopback listener on a free port, Host allowed, the rig's DNS server,
// the upstream's private address allowed, its CA trusted, and the audit
// log in a file of its own (name is the proxy's name in the rig).
func (e *Env) ProxyArgs(name string) []string {
	return []string{"proxy", "--listen", "127.0.0.1:0", "--allow", Host,
		"--dns", e.DNS.Addr, "--allow-private", e.Upstream.String() + "/32", "--upstream-ca", e.CAFile,
		"--audit-log", filepath.Join(e.Dir, name+"-audit.jsonl")}
}

// Proxy is a running `sandgate proxy` process.
type Proxy struct {
	// Addr is the address the proxy said it listens on.
	Addr string
	// Cmd is the process; Cmd.Process.Pid for ProcCPU.
	Cmd *exec.Cmd

	exited  chan struct{} // closed once the process was waited for
	mu      sync.Mutex
	tail    []string // the last lines of its stderr, for error messages
	stopped bool
}

// StartProxy runs e.Bin with args (ProxyArgs and more) and env added to
// the environment, and returns once the proxy logs that it listens. A
// proxy that exits first (a flag refused, a module refused at load) is an
// error carrying the end of its log. Stop it with Stop.
func (e *Env) StartProxy(env []string, args ...string) (*Proxy, error) {
	cmd := exec.Command(e.Bin, args...)
	cmd.Env = append(os.Environ(), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Proxy{Cmd: cmd, exited: make(chan struct{})}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.tail = append(p.tail, sc.Text())
			if len(p.tail) > 40 {
				p.tail = p.tail[1:]
			}
			p.mu.Unlock()
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["message"] == "proxy listening" {
				if a, ok := m["addr"].(string); ok {
					addr <- a
				}
			}
		}
		io.Copy(io.Discard, stderr)
		cmd.Wait()
		close(p.exited)
	}()
	select {
	case p.Addr = <-addr:
		e.closers = append(e.closers, p.Stop)
		return p, nil
	case <-p.exited:
		return nil, fmt.Errorf("sandgate %s exited before listening (%v):\n%s", strings.Join(args, " "), cmd.ProcessState, p.Log())
	case <-time.After(60 * time.Second):
		p.Stop()
		return nil, fmt.Errorf("sandgate proxy did not start within 60s:\n%s", p.Log())
	}
}

// Log returns the last lines the proxy wrote to its stderr.
func (p *Proxy) Log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.tail, "\n")
}

// Alive reports whether the proxy process is still running.
func (p *Proxy) Alive() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// Stop stops the proxy the way an operator would (SIGINT), so it shuts
// down cleanly, and kills it after 10s. It is safe to call twice.
func (p *Proxy) Stop() {
	p.mu.Lock()
	stopped := p.stopped
	p.stopped = true
	p.mu.Unlock()
	if stopped {
		return
	}
	p.Cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		p.Cmd.Process.Kill()
		<-p.exited
	}
}

// RouteURL is the proxy's base-URL route to the upstream.
func (p *Proxy) RouteURL() string { return "http://" + p.Addr + "/https/" + Host }

// DirectURL is the upstream's own URL.
const DirectURL = "https://" + Host

// DirectClient returns a keep-alive client that reaches the upstream
// directly (dialling its address, verifying its certificate for Host).
func (e *Env) DirectClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", netip.AddrPortFrom(e.Upstream, 443).String())
		},
		TLSClientConfig: e.TLSConfig(), MaxIdleConnsPerHost: 64, DisableCompression: true,
	}}
}

// TLSConfig trusts the rig's CA and names Host, for a client of the
// upstream.
func (e *Env) TLSConfig() *tls.Config {
	return &tls.Config{RootCAs: e.CA.Pool, ServerName: Host}
}

// RouteClient returns a keep-alive client for base-URL routes (plain HTTP
// to the proxy).
func RouteClient() *http.Client {
	return &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64, DisableCompression: true}}
}

// Target is one thing a bench sends requests to: a client, a URL and the
// request headers, under a name for the table.
type Target struct {
	Name   string
	Client *http.Client
	URL    string
	Header http.Header
}

// Do sends one GET, reads the whole answer and returns its status and
// response headers.
func (t Target) Do(ctx context.Context) (int, http.Header, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, t.URL, nil)
	if err != nil {
		return 0, nil, err
	}
	for k, v := range t.Header {
		req.Header[k] = v
	}
	resp, err := t.Client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header, err
}

// Get is Do for a request that must succeed: anything but 200 is an error
// naming the target and the proxy's reason.
func (t Target) Get(ctx context.Context) error {
	status, h, err := t.Do(ctx)
	if err != nil {
		return fmt.Errorf("%s: GET %s: %w", t.Name, t.URL, err)
	}
	if status != http.StatusOK {
		return fmt.Errorf("%s: GET %s: status %d %s", t.Name, t.URL, status, h.Get("X-Sandgate-Error"))
	}
	return nil
}

// Rate runs conc clients sending requests to t back to back for dur and
// returns the requests per second and every request's latency. The first
// failed request stops the run and is the error.
func Rate(t Target, conc int, dur time.Duration) (float64, []time.Duration, error) {
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	var n atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	start := time.Now()
	deadline := start.Add(dur)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			var mine []time.Duration
			for time.Now().Before(deadline) && ctx.Err() == nil {
				t0 := time.Now()
				if err := t.Get(ctx); err != nil {
					cancel(err)
					break
				}
				mine = append(mine, time.Since(t0))
				n.Add(1)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return 0, nil, err
	}
	return float64(n.Load()) / time.Since(start).Seconds(), lat, nil
}

// Rates is what RateRounds measured: per target, its rate over all its
// rounds, the process CPU it cost, and each round's rate.
type Rates struct {
	Rate   []float64       // requests per second over all of the target's rounds
	CPU    []time.Duration // CPU of the target's process (Pids) during its rounds
	N      []int64         // requests answered
	Rounds [][]float64     // Rounds[r][i]: target i's rate in round r
}

// RateRounds measures every target's request rate in rounds: each round
// gives each target in turn dur/rounds of conc clients, so that a change in
// the host's load during the run hits every target alike instead of the one
// that happened to run then. pids[i], when not 0, is the process whose CPU
// target i's rounds are charged with (pids may be nil).
func RateRounds(targets []Target, conc int, dur time.Duration, rounds int, pids []int) (Rates, error) {
	rounds = max(rounds, 1)
	slice := dur / time.Duration(rounds)
	res := Rates{Rate: make([]float64, len(targets)), CPU: make([]time.Duration, len(targets)), N: make([]int64, len(targets))}
	spent := make([]time.Duration, len(targets))
	for range rounds {
		row := make([]float64, len(targets))
		for i, t := range targets {
			pid := 0
			if i < len(pids) {
				pid = pids[i]
			}
			var cpu0 time.Duration
			if pid != 0 {
				cpu0 = ProcCPU(pid)
			}
			t0 := time.Now()
			r, lat, err := Rate(t, conc, slice)
			if err != nil {
				return res, err
			}
			spent[i] += time.Since(t0)
			if pid != 0 {
				res.CPU[i] += ProcCPU(pid) - cpu0
			}
			res.N[i] += int64(len(lat))
			row[i] = r
		}
		res.Rounds = append(res.Rounds, row)
	}
	for i := range targets {
		res.Rate[i] = float64(res.N[i]) / spent[i].Seconds()
	}
	return res, nil
}

// RatioSpread returns the lowest and highest of target i's per-round rate
// divided by target j's in the same round.
func (r Rates) RatioSpread(i, j int) (lo, hi float64) {
	for k, row := range r.Rounds {
		x := row[i] / row[j]
		if k == 0 || x < lo {
			lo = x
		}
		if k == 0 || x > hi {
			hi = x
		}
	}
	return lo, hi
}

// Latencies sends n rounds of one request to each target in turn, one
// request at a time, so that noise hits every target alike, and returns
// each target's latencies in the order of targets.
func Latencies(targets []Target, n int) ([][]time.Duration, error) {
	out := make([][]time.Duration, len(targets))
	for range n {
		for i, t := range targets {
			start := time.Now()
			if err := t.Get(context.Background()); err != nil {
				return nil, err
			}
			out[i] = append(out[i], time.Since(start))
		}
	}
	return out, nil
}

// Pct returns the p-th percentile (0–100) of ds, which it does not change.
func Pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

// US is d in microseconds, for printing.
func US(d time.Duration) float64 { return float64(d) / 1e3 }

// ProcCPU returns the user+system CPU time a process has used so far (0 if
// it cannot be read).
func ProcCPU(pid int) time.Duration {
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

// Machine describes where the bench runs, in one line: the CPU model, the
// cores and the Go toolchain.
func Machine() string {
	model := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d cores (GOMAXPROCS %d), %s %s/%s", model, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
