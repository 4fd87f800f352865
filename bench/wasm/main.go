// Command wasm measures what WebAssembly transform modules cost on the
// egress proxy's base-URL routes, in one run, through real `sandgate proxy`
// processes built from this checkout:
//
//   - added latency per routed request (p50, p99; one request at a time on
//     keep-alive connections) with 0, 1 and 3 modules loaded, against the
//     same upstream reached directly, and the module's own cost (1 module
//     minus 0 modules; target under 10 µs at p50);
//   - requests per second on the route (concurrent keep-alive clients) with
//     0, 1 and 3 modules, as ratios to 0 modules and to direct;
//   - what a module that loops forever costs everyone else: the normal
//     requests' rate and p50 through a proxy whose module loops on /loop
//     requests, while a few clients keep sending those, against the same
//     proxy without them; and the status the looping requests got.
//
// Every module runs under the proxy's defaults: a deadline per call
// (100 ms) and a memory cap per instance (32 MiB). The one module is
// wasm-examples/add-header; the three are add-header, audit-tag (which
// records a header of every request as an audit note) and deny-path with
// a pattern no request matches. The looping module is testdata/loop.
//
// Everything runs on loopback: a DNS server, the upstream on 127.x.y.z:443
// (binding 443 needs root), the proxies. Run it with bench/wasm.sh. It
// fails, with a message, if a module is refused, a module does not act
// (its effect is checked), or a request that should succeed does not.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// options are the bench's flags.
type options struct {
	bin     string
	dur     time.Duration
	conc    int
	latN    int
	loopers int
	seqN    int
	rounds  int
}

func main() {
	log.SetFlags(0)
	if child, err := benchkit.UpstreamChild(); child {
		log.Fatal("upstream: ", err)
	}
	var o options
	flag.StringVar(&o.bin, "sandgate", "", "path to the sandgate binary (built from this checkout when empty)")
	flag.DurationVar(&o.dur, "duration", 5*time.Second, "time each target gets in the request-rate measure (split over -rounds), and each phase of the looping-module run")
	flag.IntVar(&o.rounds, "rounds", 5, "alternating rounds the request-rate measure is split into")
	flag.IntVar(&o.conc, "concurrency", 8, "concurrent keep-alive clients in the request-rate runs")
	flag.IntVar(&o.latN, "latency-requests", 3000, "sequential requests per target in the latency run")
	flag.IntVar(&o.loopers, "loopers", 2, "clients sending requests the looping module loops on")
	flag.IntVar(&o.seqN, "loop-sequential", 1000, "sequential normal requests per phase of the looping-module run")
	flag.Parse()
	if o.dur <= 0 || o.rounds < 1 || o.conc < 1 || o.latN < 1 || o.loopers < 1 || o.seqN < 1 {
		log.Fatal("bench: -duration must be positive, and -rounds, -concurrency, -latency-requests, -loopers and -loop-sequential at least 1")
	}
	if err := run(o); err != nil {
		log.Fatal("bench: ", err)
	}
}

// The modules' configs. add-header's header comes back from the upstream as
// X-Echo-X-Bench-Added, which proves the module ran; audit-tag records
// taskHeader, which every request carries; deny-path's pattern matches no
// request the bench sends.
const (
	addedHeader = "X-Bench-Added"
	addedValue  = "by add-header"
	taskHeader  = "X-Task-Id"
	taskID      = "bench-task-42"
	denyPattern = "^/admin(/|$)"
	loopPrefix  = "/loop"
)

func run(o options) error {
	start := time.Now()
	env, err := benchkit.Setup(o.bin)
	if err != nil {
		return err
	}
	defer env.Close()

	// Build the modules from their sources now, so that the bench measures
	// this checkout's examples.
	mods := filepath.Join(env.Dir, "modules")
	wasm := func(name string) string { return filepath.Join(mods, name+".wasm") }
	wasmEnv := []string{"GOOS=wasip1", "GOARCH=wasm"}
	for name, pkg := range map[string]string{
		"add-header": "./wasm-examples/add-header",
		"audit-tag":  "./wasm-examples/audit-tag",
		"deny-path":  "./wasm-examples/deny-path",
		"loop":       "./bench/wasm/testdata/loop",
	} {
		if err := benchkit.GoBuild(wasm(name), wasmEnv, "-buildmode=c-shared", pkg); err != nil {
			return err
		}
	}

	// One compilation cache for all proxies, as one host would have.
	cache := []string{"--wasm-cache-dir", filepath.Join(env.Dir, "wasm-cache")}
	addHeader := "--transform-module=" + wasm("add-header") + "?" + addedHeader + ": " + addedValue
	proxies := map[string][]string{
		"route0": nil,
		"route1": {addHeader},
		"route3": {addHeader,
			"--transform-module=" + wasm("audit-tag") + "?" + taskHeader,
			"--transform-module=" + wasm("deny-path") + "?" + denyPattern},
		"loop": {"--transform-module=" + wasm("loop") + "?" + loopPrefix},
	}
	px := map[string]*benchkit.Proxy{}
	for _, name := range []string{"route0", "route1", "route3", "loop"} {
		args := append(append(env.ProxyArgs(name), cache...), proxies[name]...)
		p, err := env.StartProxy(nil, args...)
		if err != nil {
			return fmt.Errorf("proxy %s: %w", name, err)
		}
		px[name] = p
	}

	hdr := http.Header{taskHeader: {taskID}}
	direct := benchkit.Target{Name: "direct", Client: env.DirectClient(), URL: benchkit.DirectURL + "/small", Header: hdr}
	route := func(name string) benchkit.Target {
		return benchkit.Target{Name: name, Client: benchkit.RouteClient(), URL: px[name].RouteURL() + "/small", Header: hdr}
	}
	targets := []benchkit.Target{direct, route("route0"), route("route1"), route("route3")}
	normal := route("loop")

	fmt.Printf("sandgate wasm transform bench: %s\n", benchkit.Machine())
	fmt.Printf("upstream %s:443 (own process), 4 proxies built from this checkout, modules under their default 100ms call deadline and 32 MiB memory cap\n\n", env.Upstream)

	// Warm up every path (TLS sessions, DNS cache, keep-alive pools, and
	// every module's pool of instances), then check that the modules act.
	for _, t := range append(targets, normal) {
		if _, _, err := benchkit.Rate(t, o.conc, 300*time.Millisecond); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
	}
	if err := checkModulesAct(targets, px["route3"], env.Dir); err != nil {
		return err
	}

	// 1. Latency, one request at a time, interleaved so that noise hits
	// every target alike.
	ls, err := benchkit.Latencies(targets, o.latN)
	if err != nil {
		return err
	}
	us, pct := benchkit.US, benchkit.Pct
	fmt.Printf("Latency per request, one at a time on keep-alive, %d rounds over the 4 targets interleaved\n", o.latN)
	fmt.Printf("  %-50s %9s %9s %11s %11s\n", "", "p50 µs", "p99 µs", "added p50", "added p99")
	labels := []string{"direct to upstream", "route, 0 modules", "route, 1 module: add-header", "route, 3 modules: add-header, audit-tag, deny-path"}
	for i, l := range ls {
		fmt.Printf("  %-50s %9.1f %9.1f", labels[i], us(pct(l, 50)), us(pct(l, 99)))
		if i > 0 {
			fmt.Printf(" %11.1f %11.1f", us(pct(l, 50)-pct(ls[0], 50)), us(pct(l, 99)-pct(ls[0], 99)))
		}
		fmt.Println()
	}
	one50, one99 := pct(ls[2], 50)-pct(ls[1], 50), pct(ls[2], 99)-pct(ls[1], 99)
	three50, three99 := pct(ls[3], 50)-pct(ls[1], 50), pct(ls[3], 99)-pct(ls[1], 99)
	verdict := "met"
	if one50 >= 10*time.Microsecond {
		verdict = "NOT met"
	}
	fmt.Printf("  one module's own cost (1 − 0 modules):    p50 %6.1f µs  p99 %6.1f µs   (target p50 < 10 µs: %s)\n", us(one50), us(one99), verdict)
	fmt.Printf("  three modules' cost  (3 − 0 modules):    p50 %6.1f µs  p99 %6.1f µs\n\n", us(three50), us(three99))

	// 2. Request rate, concurrent keep-alive clients, the targets taking
	// turns in rounds so that the host's load hits them alike.
	fmt.Printf("Requests per second, %d concurrent keep-alive clients, %s per target in %d alternating rounds\n", o.conc, o.dur, o.rounds)
	fmt.Printf("  %-50s %9s %10s %12s %14s\n", "", "req/s", "÷ direct", "÷ 0 modules", "rounds' ÷ 0")
	rs, err := benchkit.RateRounds(targets, o.conc, o.dur, o.rounds, nil)
	if err != nil {
		return err
	}
	for i, r := range rs.Rate {
		fmt.Printf("  %-50s %9.0f %10.2f", labels[i], r, r/rs.Rate[0])
		if i > 1 {
			lo, hi := rs.RatioSpread(i, 1)
			fmt.Printf(" %12.2f %9.2f–%.2f", r/rs.Rate[1], lo, hi)
		} else if i == 1 {
			fmt.Printf(" %12.2f", 1.0)
		}
		fmt.Println()
	}
	verdict = "met"
	if rs.Rate[2]/rs.Rate[1] < 0.9 {
		verdict = "NOT met"
	}
	fmt.Printf("  rate with 1 module ÷ with none: %.2f   (target >= 0.9: %s)\n\n", rs.Rate[2]/rs.Rate[1], verdict)

	// 3. A module that loops forever on some requests.
	if err := loopRun(o, px["loop"], normal); err != nil {
		return err
	}
	for name, p := range px {
		if !p.Alive() {
			return fmt.Errorf("proxy %s exited during the bench:\n%s", name, p.Log())
		}
	}

	fmt.Printf(`
What the figures mean:
  added p50/p99   route latency minus direct latency at that percentile: what the proxy (and its modules) add to one request.
  1 − 0 modules   route with add-header minus route without modules: the module's own cost (instance from the pool, handle_request
                  with its deadline armed, and handle_response), everything else equal.
  ÷ direct        the route's request rate against HTTPS straight to the upstream; ÷ 0 modules against the route without modules.
  looping module  normal requests through a proxy whose module loops on %s* while %d clients keep sending such requests; the ratio
                  is against the same proxy and clients without them. Each looping request holds one core until its 100ms deadline,
                  so on a 2-core machine that every process here shares, some drop is CPU share, not blocking.
(total bench time %s)
`, loopPrefix, o.loopers, time.Since(start).Round(time.Second))
	return nil
}

// checkModulesAct fails unless add-header's header reached the upstream
// through the 1- and 3-module routes (and not through the others), and
// audit-tag's note is in the 3-module proxy's audit log: a bench of modules
// that do nothing would measure nothing.
func checkModulesAct(targets []benchkit.Target, p3 *benchkit.Proxy, dir string) error {
	for i, t := range targets {
		status, h, err := t.Do(context.Background())
		if err != nil {
			return err
		}
		got := h.Get("X-Echo-" + addedHeader)
		want := ""
		if i >= 2 {
			want = addedValue
		}
		if status != http.StatusOK || got != want {
			return fmt.Errorf("%s: the upstream saw %s %q (status %d), want %q: add-header did not act as configured", t.Name, addedHeader, got, status, want)
		}
	}
	// The audit log is written as events happen; the warm-up made plenty.
	f, err := os.Open(filepath.Join(dir, "route3-audit.jsonl"))
	if err != nil {
		return fmt.Errorf("audit log of the 3-module proxy: %w", err)
	}
	defer f.Close()
	want := strings.ToLower(taskHeader) + "=" + taskID
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev struct {
			Notes []string `json:"notes"`
		}
		if json.Unmarshal(sc.Bytes(), &ev) == nil {
			for _, n := range ev.Notes {
				if strings.HasSuffix(n, want) {
					return nil
				}
			}
		}
	}
	return fmt.Errorf("no audit event of the 3-module proxy has the note %q: audit-tag did not act (log: %s)", want, f.Name())
}

// loopStats is what the looping clients got.
type loopStats struct {
	mu       sync.Mutex
	statuses map[int]int
	reason   string
	total    time.Duration
	n        int
	errs     []error
}

// loopRun measures the normal requests through p without, then with,
// looping clients, and prints the comparison.
func loopRun(o options, p *benchkit.Proxy, normal benchkit.Target) error {
	type phase struct {
		rate     float64
		p50, seq time.Duration
		cpu      time.Duration
		wall     time.Duration
	}
	measure := func() (ph phase, err error) {
		cpu0, t0 := benchkit.ProcCPU(p.Cmd.Process.Pid), time.Now()
		var lat []time.Duration
		if ph.rate, lat, err = benchkit.Rate(normal, o.conc, o.dur); err != nil {
			return ph, err
		}
		seq, err := benchkit.Latencies([]benchkit.Target{normal}, o.seqN)
		if err != nil {
			return ph, err
		}
		ph.p50, ph.seq = benchkit.Pct(lat, 50), benchkit.Pct(seq[0], 50)
		ph.cpu, ph.wall = benchkit.ProcCPU(p.Cmd.Process.Pid)-cpu0, time.Since(t0)
		return ph, nil
	}
	quiet, err := measure()
	if err != nil {
		return fmt.Errorf("looping-module proxy without looping clients: %w", err)
	}

	loop := benchkit.Target{Name: "looping", Client: benchkit.RouteClient(), URL: strings.TrimSuffix(normal.URL, "/small") + loopPrefix + "/forever"}
	st := &loopStats{statuses: map[int]int{}}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range o.loopers {
		wg.Go(func() {
			for ctx.Err() == nil {
				t0 := time.Now()
				status, h, err := loop.Do(ctx)
				d := time.Since(t0)
				st.mu.Lock()
				switch {
				case ctx.Err() != nil: // the bench stopped this one
				case err != nil:
					st.errs = append(st.errs, err)
				default:
					st.statuses[status]++
					st.total += d
					st.n++
					if st.reason == "" {
						st.reason = h.Get("X-Sandgate-Error")
					}
				}
				st.mu.Unlock()
				if err != nil && ctx.Err() == nil {
					time.Sleep(10 * time.Millisecond) // no hot loop on a broken proxy
				}
			}
		})
	}
	// Let the looping requests get going before measuring.
	time.Sleep(300 * time.Millisecond)
	busy, err := measure()
	cancel()
	wg.Wait()
	if err != nil {
		return fmt.Errorf("normal requests while looping requests ran (a loop must cost only its own request): %w", err)
	}
	if len(st.errs) > 0 {
		return fmt.Errorf("%d looping requests got no answer, e.g. %v", len(st.errs), st.errs[0])
	}
	if st.n == 0 {
		return errors.New("no looping request was answered during the run")
	}
	if st.statuses[http.StatusBadGateway] != st.n {
		return fmt.Errorf("looping requests got statuses %v, want all 502 (the module must be stopped at its deadline and fail its request closed)", st.statuses)
	}

	fmt.Printf("A module that loops forever costs only its own request (module loops on %s*, passes the rest)\n", loopPrefix)
	fmt.Printf("  %-50s %14s %14s %7s\n", "normal requests", "no loopers", "loopers", "ratio")
	fmt.Printf("  %-50s %14.0f %14.0f %7.2f\n", fmt.Sprintf("req/s, %d keep-alive clients", o.conc), quiet.rate, busy.rate, busy.rate/quiet.rate)
	fmt.Printf("  %-50s %14.1f %14.1f %7.2f\n", fmt.Sprintf("p50 µs of those %d clients' requests", o.conc), benchkit.US(quiet.p50), benchkit.US(busy.p50), float64(busy.p50)/float64(quiet.p50))
	fmt.Printf("  %-50s %14.1f %14.1f %7.2f\n", "p50 µs, one client alone, sequential", benchkit.US(quiet.seq), benchkit.US(busy.seq), float64(busy.seq)/float64(quiet.seq))
	fmt.Printf("  %-50s %14.2f %14.2f\n", "proxy CPU, cores busy on average", quiet.cpu.Seconds()/quiet.wall.Seconds(), busy.cpu.Seconds()/busy.wall.Seconds())
	fmt.Printf("  looping requests from %d client(s): %d answered, all %d, after %.0f ms on average; reason: %s\n",
		o.loopers, st.n, http.StatusBadGateway, float64(st.total.Milliseconds())/float64(st.n), st.reason)
	return nil
}
