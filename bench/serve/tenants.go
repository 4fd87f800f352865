package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// hog starts eight busy loops in a sandbox, each in a session of its own
// (setsid), as a hostile tenant would start them: out of the reach of the
// command's process group, which exec's end kills. Their pids go to
// /var/tmp/hog so that unhog can end them.
const (
	hog   = `for i in 1 2 3 4 5 6 7 8; do setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 & echo $! >> /var/tmp/hog; done`
	unhog = `kill -9 $(cat /var/tmp/hog) && rm /var/tmp/hog`
)

// tenantPhase is what one phase measured of sandbox B and of the API.
type tenantPhase struct {
	exec50 time.Duration // B's `exec true` through the API, p50
	loop   time.Duration // B's fixed CPU-bound loop, median of its runs
	api99  time.Duration // GET /v1/sandboxes/B, p99
}

// benchTenants measures what a CPU hog in sandbox A takes from sandbox B
// and from the service: B's `exec true` p50 through the API, a fixed
// CPU-bound loop in B (timed inside B, so the exec's own cost is out of
// it), and the API's p99 (GET /v1/sandboxes/B), each with A idle and with
// A running eight busy loops, phases taking turns for rounds rounds; the
// ratios of each round, and their median (targets: B's loop keeps ≥ 0.8 of
// its idle throughput, the API's p99 within 2×). Whatever limits the
// service gives its sandboxes by default apply: none before CPU limits
// existed, the defaults after.
func (r *rig) benchTenants(rounds, execs, apiCalls int) error {
	c, cancel := ctx(30 * time.Minute)
	defer cancel()
	for _, name := range []string{"tenant-a", "tenant-b"} {
		if _, err := r.must(c, http.StatusCreated, http.MethodPost, "/v1/sandboxes", map[string]string{"name": name}); err != nil {
			return err
		}
	}
	defer func() {
		for _, name := range []string{"tenant-a", "tenant-b"} {
			r.call(context.Background(), http.MethodDelete, "/v1/sandboxes/"+name, nil)
		}
	}()
	iters, err := r.calibrateLoop(c, "tenant-b", 500*time.Millisecond)
	if err != nil {
		return err
	}
	fmt.Printf("tenants: sandbox A idle, then running eight busy loops (each in its own session), %d rounds; B's loop: %d shell iterations\n", rounds, iters)
	fmt.Printf("load before: %s\n", loadAvg())
	phase := func() (tenantPhase, error) {
		var p tenantPhase
		var execs1, loops, apis []time.Duration
		for range execs {
			t0 := time.Now()
			if err := r.execOK(c, "tenant-b", "true"); err != nil {
				return p, err
			}
			execs1 = append(execs1, time.Since(t0))
		}
		for range 3 {
			d, err := r.loop(c, "tenant-b", iters)
			if err != nil {
				return p, err
			}
			loops = append(loops, d)
		}
		for range apiCalls {
			t0 := time.Now()
			if _, err := r.must(c, http.StatusOK, http.MethodGet, "/v1/sandboxes/tenant-b", nil); err != nil {
				return p, err
			}
			apis = append(apis, time.Since(t0))
		}
		return tenantPhase{benchkit.Pct(execs1, 50), benchkit.Pct(loops, 50), benchkit.Pct(apis, 99)}, nil
	}
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	var rExec, rLoop, rAPI []float64
	for i := range rounds {
		idle, err := phase()
		if err != nil {
			return err
		}
		if err := r.execOK(c, "tenant-a", hog); err != nil {
			return err
		}
		time.Sleep(time.Second) // the loops spread over the cores
		busy, err := phase()
		if err != nil {
			return err
		}
		if err := r.execOK(c, "tenant-a", unhog); err != nil {
			return err
		}
		re, rl, ra := busy.exec50.Seconds()/idle.exec50.Seconds(), idle.loop.Seconds()/busy.loop.Seconds(), busy.api99.Seconds()/idle.api99.Seconds()
		rExec, rLoop, rAPI = append(rExec, re), append(rLoop, rl), append(rAPI, ra)
		fmt.Printf("  round %d: B exec true p50 %.2f → %.2f ms (×%.2f)   B loop %.0f → %.0f ms (throughput %.2f)   API p99 %.2f → %.2f ms (×%.2f)\n",
			i+1, ms(idle.exec50), ms(busy.exec50), re, ms(idle.loop), ms(busy.loop), rl, ms(idle.api99), ms(busy.api99), ra)
	}
	med := func(v []float64) float64 { s := slices.Clone(v); slices.Sort(s); return s[len(s)/2] }
	fmt.Printf("  median over %d rounds, A hogging ÷ A idle: B exec true p50 ×%.2f; B loop throughput %.2f (target ≥ 0.8); API p99 ×%.2f (target ≤ 2)\n",
		rounds, med(rExec), med(rLoop), med(rAPI))
	fmt.Printf("load after: %s\n\n", loadAvg())
	return nil
}

// loop runs n iterations of a shell loop in sandbox name and returns how
// long they took, as timed inside the sandbox.
func (r *rig) loop(ctx context.Context, name string, n int) (time.Duration, error) {
	cmd := fmt.Sprintf(`s=$(date +%%s%%N); i=0; while [ $i -lt %d ]; do i=$((i+1)); done; e=$(date +%%s%%N); echo $((e-s))`, n)
	code, out, err := r.exec(ctx, name, cmd)
	if err != nil {
		return 0, err
	}
	ns, perr := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if code != 0 || perr != nil {
		return 0, fmt.Errorf("the loop in %s: exit %d: %q", name, code, out)
	}
	return time.Duration(ns), nil
}

// calibrateLoop finds how many iterations of loop take about target in
// sandbox name, idle.
func (r *rig) calibrateLoop(ctx context.Context, name string, target time.Duration) (int, error) {
	n := 100000
	for range 8 {
		d, err := r.loop(ctx, name, n)
		if err != nil {
			return 0, err
		}
		if d >= target/2 {
			return max(1, int(float64(n)*target.Seconds()/d.Seconds())), nil
		}
		n *= 4
	}
	return n, nil
}

// loadAvg is the host's load averages, for the record: other work on the
// host weighs on every figure.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ") + " (1, 5, 15 min)"
}
