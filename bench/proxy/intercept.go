package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// interceptBench measures, on one proxy process, a request to a host its
// policy intercepts (CONNECT, the proxy terminating the client's TLS with
// a certificate of its CA, the chain of a base-URL route, HTTPS to the
// upstream) against the same request as a base-URL route (plain HTTP to
// the proxy): the rate of concurrent keep-alive clients in alternating
// rounds, and the added latency one request at a time. Both carry the
// same rules and swap the same secret; both clients keep their
// connections, so a TLS handshake is paid once per connection, not per
// request.
func interceptBench(env *benchkit.Env, rules string, conc int, dur time.Duration, latN int, h2 bool) error {
	caDir := filepath.Join(env.Dir, "intercept-ca")
	policy := filepath.Join(env.Dir, "intercept-policy.json")
	if err := os.WriteFile(policy, []byte(`{"mode":"custom","allowedHosts":["`+benchkit.Host+`"],"intercept":["`+benchkit.Host+`"]}`), 0o600); err != nil {
		return err
	}
	p, err := env.StartProxy([]string{"BENCH_KEY=sk-bench-0123456789"},
		append(env.ProxyArgs("intercept"), "--transformations", rules, "--policy", policy, "--intercept-ca", caDir)...)
	if err != nil {
		return err
	}
	defer p.Stop()
	caPEM, err := os.ReadFile(filepath.Join(caDir, "ca.pem"))
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	pu, _ := url.Parse("http://" + p.Addr)
	tr := &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: pool}, MaxIdleConnsPerHost: 64, DisableCompression: true}
	tr.Protocols = new(http.Protocols)
	proto := "HTTP/1.1"
	if h2 {
		tr.Protocols.SetHTTP2(true)
		proto = "HTTP/2"
	} else {
		tr.Protocols.SetHTTP1(true)
	}
	route := benchkit.Target{Name: "route", Client: benchkit.RouteClient(), URL: p.RouteURL() + "/small"}
	icpt := benchkit.Target{Name: "intercepted", Client: &http.Client{Transport: tr}, URL: benchkit.DirectURL + "/small"}
	for range 50 {
		for _, t := range []benchkit.Target{route, icpt} {
			if err := t.Get(context.Background()); err != nil {
				return err
			}
		}
	}
	pid := p.Cmd.Process.Pid
	rs, err := benchkit.RateRounds([]benchkit.Target{route, icpt}, conc, dur, rateRounds, []int{pid, pid})
	if err != nil {
		return err
	}
	lo, hi := rs.RatioSpread(1, 0)
	fmt.Printf("\nintercepted request (%s inside, the same rules) against a base-URL route, one proxy process:\n", proto)
	fmt.Printf("  request rate (c=%d)        route %8.0f req/s  intercepted %8.0f req/s  ratio %.2f  (target >= 0.77, i.e. within 1.3x; rounds %.2f–%.2f)\n",
		conc, rs.Rate[0], rs.Rate[1], rs.Rate[1]/rs.Rate[0], lo, hi)
	fmt.Printf("  proxy CPU per request      route %6.1f µs     intercepted %6.1f µs\n",
		rs.CPU[0].Seconds()/float64(rs.N[0])*1e6, rs.CPU[1].Seconds()/float64(rs.N[1])*1e6)
	ls, err := benchkit.Latencies([]benchkit.Target{route, icpt}, latN)
	if err != nil {
		return err
	}
	us, pct := benchkit.US, benchkit.Pct
	for _, q := range []int{50, 99} {
		fmt.Printf("  latency p%d                route %8.1f µs    intercepted %8.1f µs   ratio %.2f  (target <= 1.3)\n",
			q, us(pct(ls[0], q)), us(pct(ls[1], q)), float64(pct(ls[1], q))/float64(pct(ls[0], q)))
	}
	return nil
}
