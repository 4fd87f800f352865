// Command proxy measures `sandgate proxy` against a direct connection to the
// same loopback HTTPS upstream, in one run, and prints the ratios:
//
//   - CONNECT tunnel throughput (a large HTTPS download through the tunnel
//     against the same download direct);
//   - base-URL route request rate (keep-alive, concurrent) against direct
//     HTTPS requests;
//   - added latency per routed request, p50 and p99, one request at a time;
//   - beside both, the floor: a process that forwards bytes and nothing
//     else (floor.go), what a second hop costs on this machine whatever the
//     proxy does;
//   - what the durable audit (--audit-store) adds to a routed request: the
//     same proxy with and without it, in the same rounds;
//   - an intercepted request (CONNECT to a host the policy intercepts,
//     the proxy terminating TLS) against the same request as a base-URL
//     route, rate and latency (intercept.go).
//
// Everything runs on loopback: a DNS server, the upstream on 127.x.y.z:443
// (binding 443 needs root), and the proxy built from this checkout. Run it
// with bench/proxy.sh.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

func main() {
	log.SetFlags(0)
	if child, err := benchkit.UpstreamChild(); child {
		log.Fatal("upstream: ", err)
	}
	if child, err := floorChild(); child {
		log.Fatal("floor: ", err)
	}
	bin := flag.String("sandgate", "", "path to the sandgate binary (built from this checkout when empty)")
	bulk := flag.Int64("bulk", 1<<30, "bytes per tunnel throughput download")
	dur := flag.Duration("duration", 5*time.Second, "time each target gets in the request-rate measure, split over its rounds")
	conc := flag.Int("concurrency", 8, "concurrent clients in the request-rate runs")
	lat := flag.Int("latency-requests", 3000, "sequential requests per latency run")
	h2 := flag.Bool("intercept-h2", false, "speak HTTP/2 inside the intercepted connections (default HTTP/1.1, as the route)")
	flag.Parse()
	if err := run(*bin, *bulk, *dur, *conc, *lat, *h2); err != nil {
		log.Fatal("bench: ", err)
	}
}

func run(bin string, bulk int64, dur time.Duration, conc, latN int, h2 bool) error {
	env, err := benchkit.Setup(bin)
	if err != nil {
		return err
	}
	defer env.Close()
	rules := filepath.Join(env.Dir, "rules.json")
	// A few rules, as a real deployment has: two that do not match, one that
	// swaps a secret in.
	if err := os.WriteFile(rules, []byte(`[
 {"match":{"host":"api.openai.com"},"transform":{"headers":{"authorization":{"env":"BENCH_KEY","prefix":"Bearer "}}}},
 {"match":{"host":"*.example.org","path":{"startsWith":"/v1/"}},"transform":{"headers":{"x-other":"1"}}},
 {"match":{"host":"`+benchkit.Host+`","method":["GET","POST"]},"transform":{"headers":{"x-api-key":{"env":"BENCH_KEY"}}}}
]`), 0o600); err != nil {
		return err
	}
	p, err := env.StartProxy([]string{"BENCH_KEY=sk-bench-0123456789"},
		append(env.ProxyArgs("proxy"), "--transformations", rules)...)
	if err != nil {
		return err
	}

	// The same proxy keeping its audit durably, as serve keeps each
	// sandbox's, and its twin without: what the durable audit adds to a
	// routed request. Both start together and carry the same traffic (the
	// first proxy's heap grew in the tunnel measure, which changes what
	// its garbage collector costs per request).
	stored, err := env.StartProxy([]string{"BENCH_KEY=sk-bench-0123456789"},
		append(env.ProxyArgs("stored"), "--transformations", rules, "--audit-store", filepath.Join(env.Dir, "audit-store"))...)
	if err != nil {
		return err
	}
	twin, err := env.StartProxy([]string{"BENCH_KEY=sk-bench-0123456789"}, append(env.ProxyArgs("twin"), "--transformations", rules)...)
	if err != nil {
		return err
	}

	direct := benchkit.Target{Name: "direct", Client: env.DirectClient(), URL: benchkit.DirectURL + "/small"}
	route := benchkit.Target{Name: "route", Client: benchkit.RouteClient(), URL: p.RouteURL() + "/small"}
	routeStored := benchkit.Target{Name: "route, durable audit", Client: benchkit.RouteClient(), URL: stored.RouteURL() + "/small"}
	routeTwin := benchkit.Target{Name: "route, its twin", Client: benchkit.RouteClient(), URL: twin.RouteURL() + "/small"}
	floorAddr, stopFloor, floorPid, err := startFloor(netip.AddrPortFrom(env.Upstream, 443).String(), benchkit.Host, env.CAFile)
	if err != nil {
		return err
	}
	defer stopFloor()
	floor := benchkit.Target{Name: "floor", Client: benchkit.RouteClient(), URL: "http://" + floorAddr + "/small"}
	pu, _ := url.Parse("http://" + p.Addr)
	tunnel := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: env.TLSConfig(), DisableCompression: true}}

	fmt.Printf("sandgate proxy bench: %d cores, upstream %s:443, proxy %s\n\n", runtime.NumCPU(), env.Upstream, p.Addr)

	// Warm up both paths (TLS sessions, DNS cache, keep-alive pools).
	for range 50 {
		if err := direct.Get(context.Background()); err != nil {
			return err
		}
		if err := route.Get(context.Background()); err != nil {
			return err
		}
		if err := floor.Get(context.Background()); err != nil {
			return err
		}
		if err := routeStored.Get(context.Background()); err != nil {
			return err
		}
		if err := routeTwin.Get(context.Background()); err != nil {
			return err
		}
	}

	// 1. Tunnel throughput: rounds of one download each way, alternating;
	// the ratio of the medians, and the spread of the rounds' own ratios.
	var dTs, pTs, ratios []float64
	dc := env.DirectClient()
	bulkURL := benchkit.DirectURL + "/bulk?n=" + strconv.FormatInt(bulk, 10)
	cpu0 := benchkit.ProcCPU(p.Cmd.Process.Pid)
	for range tunnelRounds {
		d, err := throughput(dc, bulkURL, bulk)
		if err != nil {
			return err
		}
		t, err := throughput(tunnel, bulkURL, bulk)
		if err != nil {
			return err
		}
		dTs, pTs, ratios = append(dTs, d), append(pTs, t), append(ratios, t/d)
	}
	proxyCPU := benchkit.ProcCPU(p.Cmd.Process.Pid) - cpu0
	dT, pT := median(dTs), median(pTs)
	fmt.Printf("CONNECT tunnel throughput  direct %8.0f MB/s   proxy %8.0f MB/s   ratio %.2f  (target >= 0.95; medians of %d alternating rounds, whose own ratios span %.2f–%.2f)\n",
		dT/1e6, pT/1e6, pT/dT, tunnelRounds, slices.Min(ratios), slices.Max(ratios))
	// Where the tunnel's cost goes: the proxy's own CPU per GiB carried,
	// against the wall time a GiB takes direct (2 cores shared by client,
	// upstream and proxy).
	gib := float64(tunnelRounds*bulk) / (1 << 30)
	fmt.Printf("  proxy CPU per GiB tunneled %6.2f s   (direct: %.2f s of wall time per GiB)\n", proxyCPU.Seconds()/gib, (1<<30)/dT)

	// 2. Request rate, concurrent keep-alive clients, the three targets
	// taking turns in rounds.
	rs, err := benchkit.RateRounds([]benchkit.Target{direct, route, floor, routeTwin, routeStored}, conc, dur, rateRounds,
		[]int{0, p.Cmd.Process.Pid, floorPid, twin.Cmd.Process.Pid, stored.Cmd.Process.Pid})
	if err != nil {
		return err
	}
	dR, rR, fR := rs.Rate[0], rs.Rate[1], rs.Rate[2]
	lo, hi := rs.RatioSpread(1, 0)
	fmt.Printf("route request rate (c=%d)   direct %8.0f req/s  route %8.0f req/s  ratio %.2f   (target >= 0.6; rounds %.2f–%.2f; floor %.0f req/s, ratio %.2f)\n", conc, dR, rR, rR/dR, lo, hi, fR, fR/dR)
	// What a routed request costs the proxy process itself (user and
	// system CPU, kernel TCP work on its sockets included), against the
	// whole machine's CPU per direct request (client and upstream).
	fmt.Printf("  proxy CPU per routed request %6.1f µs   (floor %.1f µs; direct: %.1f µs of the %d cores' time per request)\n",
		rs.CPU[1].Seconds()/float64(rs.N[1])*1e6, rs.CPU[2].Seconds()/float64(rs.N[2])*1e6, float64(runtime.NumCPU())/dR*1e6, runtime.NumCPU())

	// 3. Latency, one request at a time, interleaved so that noise hits both.
	ls, err := benchkit.Latencies([]benchkit.Target{direct, route, floor, routeTwin, routeStored}, latN)
	if err != nil {
		return err
	}
	dl, rl, fl, tl, sl := ls[0], ls[1], ls[2], ls[3], ls[4]
	us, pct := benchkit.US, benchkit.Pct
	fmt.Printf("latency p50                direct %8.1f µs    route %8.1f µs    added %6.1f µs  (target < 50; floor adds %.1f µs)\n", us(pct(dl, 50)), us(pct(rl, 50)), us(pct(rl, 50)-pct(dl, 50)), us(pct(fl, 50)-pct(dl, 50)))
	fmt.Printf("latency p99                direct %8.1f µs    route %8.1f µs    added %6.1f µs  (floor adds %.1f µs)\n", us(pct(dl, 99)), us(pct(rl, 99)), us(pct(rl, 99)-pct(dl, 99)), us(pct(fl, 99)-pct(dl, 99)))
	fmt.Println("  floor: a process that only forwards the bytes of each request and answer over a kept-alive TLS connection (bench/proxy/floor.go)")

	// 4. The durable audit (--audit-store: each event also kept in
	// segments written to a store), against its twin without it,
	// measured in the same rounds.
	perReq := func(i int) float64 { return rs.CPU[i].Seconds() / float64(rs.N[i]) * 1e6 }
	slo, shi := rs.RatioSpread(4, 3)
	fmt.Printf("durable audit              twin %8.0f req/s  with it %8.0f req/s  ratio %.3f (rounds %.3f–%.3f)\n", rs.Rate[3], rs.Rate[4], rs.Rate[4]/rs.Rate[3], slo, shi)
	fmt.Printf("  proxy CPU per routed request: twin %6.1f µs, with it %6.1f µs: %+.1f µs   latency p50 %+.1f µs, p99 %+.1f µs  (target < 2 µs added)\n",
		perReq(3), perReq(4), perReq(4)-perReq(3), us(pct(sl, 50)-pct(tl, 50)), us(pct(sl, 99)-pct(tl, 99)))
	fmt.Printf("  the twin against the first proxy (both without; the noise of these figures): CPU %+.1f µs, latency p50 %+.1f µs\n",
		perReq(3)-perReq(1), us(pct(tl, 50)-pct(rl, 50)))
	p.Stop() // the interception bench has a proxy of its own
	return interceptBench(env, rules, conc, dur, latN, h2)
}

// tunnelRounds and rateRounds are how many alternating rounds the tunnel
// and the request-rate measures take.
const (
	tunnelRounds = 5
	rateRounds   = 5
)

// median returns the median of xs, which it does not change.
func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// throughput downloads n bytes from u and returns the bytes per second.
func throughput(c *http.Client, u string, n int64) (float64, error) {
	start := time.Now()
	resp, err := c.Get(u)
	if err != nil {
		return 0, err
	}
	got, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil || got != n {
		return 0, fmt.Errorf("download %s: %d of %d bytes: %v", u, got, n, err)
	}
	return float64(n) / time.Since(start).Seconds(), nil
}
