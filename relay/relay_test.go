package relay

import (
	"bufio"
	"compress/gzip"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

// canary is a secret that must reach the upstream and appear in no log,
// audit event, error or response the sandbox sees.
const canary = "sk-canary-7Hq2ZpX9vLrT4mNw"

// env is a proxy on loopback with its DNS server, CA and upstreams.
type env struct {
	t       testing.TB
	dns     *dnstest.Server
	ca      *tlstest.CA
	decider *netpolicy.Decider
	proxy   *Proxy
	tenant  *Tenant
	addr    string // proxy listen address
	rings   *audit.Rings
	log     *syncbuf.Buffer    // audit JSON lines and operational logs
	stop    context.CancelFunc // ends Serve's context (a graceful stop)
	served  chan struct{}      // closed when Serve returned
}

type envOpt func(*Config)

func newEnv(t *testing.T, policy string, rules string, opts ...envOpt) *env {
	return newEnvTB(t, policy, rules, opts...)
}

func newEnvTB(t testing.TB, policy string, rules string, opts ...envOpt) *env {
	t.Helper()
	e := &env{t: t, dns: dnstest.Start(t), ca: tlstest.MustCA(t), rings: audit.NewRings(100), log: &syncbuf.Buffer{}}
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{e.dns.Addr}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Close() })
	e.decider = &netpolicy.Decider{Resolver: res, DialTimeout: 5 * time.Second}
	logger := slog.New(slog.NewJSONHandler(e.log, nil))
	cfg := Config{
		Decider:       e.decider,
		Audit:         audit.Multi{audit.NewJSONLines(e.log), e.rings},
		Logger:        logger,
		UpstreamRoots: e.ca.Pool,
	}
	for _, o := range opts {
		o(&cfg)
	}
	e.proxy, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	pol, err := netpolicy.ParsePolicy([]byte(policy))
	if err != nil {
		t.Fatal(err)
	}
	rs := transforms.NewRuleSet()
	if rules != "" {
		list, err := transforms.ParseRules([]byte(rules), func(k string) (string, bool) {
			if k == "CANARY_KEY" {
				return canary, true
			}
			return "", false
		})
		if err != nil {
			t.Fatal(err)
		}
		rs.Set(list...)
	}
	e.tenant = NewTenant("tenant-test", pol, rs)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e.addr = ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	e.stop, e.served = cancel, done
	go func() { e.proxy.Serve(ctx, ln, e.tenant); close(done) }()
	t.Cleanup(func() {
		cancel()
		e.proxy.Close()
		e.tenant.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("proxy did not stop within 10s")
		}
		if strings.Contains(e.log.String(), canary) {
			t.Errorf("the canary secret appears in the proxy's logs:\n%s", e.log.String())
		}
		for _, ev := range e.rings.Events(e.tenant.ID()) {
			b, _ := json.Marshal(ev)
			if strings.Contains(string(b), canary) {
				t.Errorf("the canary secret appears in an audit event: %s", b)
			}
		}
	})
	return e
}

// upstream starts an HTTPS server for name on 127.x.y.z:443, points name at
// it in DNS, and exempts its address from the loopback refusal.
func (e *env) upstream(name string, h http.Handler) *httptest.Server {
	e.t.Helper()
	srv := e.ca.Server(e.t, h, name)
	a := tlstest.Addr(srv)
	e.dns.Set(name, a)
	e.decider.AllowPrivate = append(e.decider.AllowPrivate, netip.PrefixFrom(a, 32))
	return srv
}

// tunnelClient sends requests through the proxy with CONNECT.
func (e *env) tunnelClient() *http.Client {
	pu, _ := url.Parse("http://" + e.addr)
	return &http.Client{
		Transport: &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: e.ca.Pool}},
		Timeout:   20 * time.Second,
	}
}

// routeClient sends base-URL route requests to the proxy directly.
func (e *env) routeClient() *http.Client {
	return &http.Client{
		Transport:     &http.Transport{Proxy: nil, DisableCompression: true},
		Timeout:       20 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}

func (e *env) routeURL(hostPath string) string { return "http://" + e.addr + "/https/" + hostPath }

// dial opens a raw connection to the proxy, closed when the test ends and
// bounded to 20s.
func (e *env) dial() (net.Conn, *bufio.Reader) {
	e.t.Helper()
	c, err := net.DialTimeout("tcp", e.addr, 5*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return c, bufio.NewReader(c)
}

// raw sends raw bytes to the proxy and reads one response.
func (e *env) raw(req string) *http.Response {
	e.t.Helper()
	c, br := e.dial()
	if _, err := io.WriteString(c, req); err != nil {
		e.t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		e.t.Fatalf("reading response to %q: %v", req, err)
	}
	return resp
}

// lastEvent waits (bounded) for the sandbox's n-th audit event.
func (e *env) event(n int) audit.Event {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if evs := e.rings.Events(e.tenant.ID()); len(evs) >= n {
			return evs[n-1]
		}
		time.Sleep(5 * time.Millisecond)
	}
	e.t.Fatalf("audit event %d never came; have %v", n, e.rings.Events(e.tenant.ID()))
	return audit.Event{}
}

// body reads a response the sandbox got. No response a sandbox sees, error
// or not, may carry the canary secret, or a run of MinPartialRun bytes of
// it, in its headers or its body.
func body(t *testing.T, r *http.Response) string {
	t.Helper()
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	for k, vs := range r.Header {
		for _, v := range vs {
			if holdsCanary(k + ": " + v) {
				t.Errorf("the canary secret reached the sandbox in header %s", k)
			}
		}
	}
	if holdsCanary(string(b)) {
		t.Errorf("the canary secret reached the sandbox in a %d response body", r.StatusCode)
	}
	return string(b)
}

// holdsCanary reports whether s holds the canary or a run of
// transforms.MinPartialRun bytes of it.
func holdsCanary(s string) bool {
	for i := 0; i+transforms.MinPartialRun <= len(canary); i++ {
		if strings.Contains(s, canary[i:i+transforms.MinPartialRun]) {
			return true
		}
	}
	return false
}

func hello(w http.ResponseWriter, r *http.Request) {
	fmt.Fprintf(w, "hello %s %s", r.Method, r.URL.Path)
}

func TestConnectAllowed(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	srv := e.upstream("api.example.com", http.HandlerFunc(hello))
	resp, err := e.tunnelClient().Get("https://api.example.com/x")
	if err != nil {
		t.Fatal(err)
	}
	if got := body(t, resp); got != "hello GET /x" {
		t.Errorf("got %q, want %q", got, "hello GET /x")
	}
	e.tunnelClient().CloseIdleConnections()
	resp.Body.Close()
	// The event is written when the tunnel closes.
	e.tunnelClient().Transport.(*http.Transport).CloseIdleConnections()
	_ = srv
}

func TestConnectEvent(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	srv := e.upstream("api.example.com", http.HandlerFunc(hello))
	cl := e.tunnelClient()
	resp, err := cl.Get("https://api.example.com/x")
	if err != nil {
		t.Fatal(err)
	}
	body(t, resp)
	cl.CloseIdleConnections()
	ev := e.event(1)
	if ev.Kind != audit.Connect || !ev.Allow || ev.Host != "api.example.com" || ev.Port != 443 ||
		ev.Addr != netip.AddrPortFrom(tlstest.Addr(srv), 443).String() || ev.Rule != "allowedHosts:api.example.com" ||
		ev.BytesIn == 0 || ev.BytesOut == 0 || ev.Status != 200 || ev.Code != "allowed_host" {
		t.Errorf("connect event = %+v", ev)
	}
	if !strings.Contains(e.log.String(), `"message":"egress"`) || !strings.Contains(e.log.String(), `"decision":"allow"`) {
		t.Errorf("no canonical egress log line: %s", e.log.String())
	}
}

func TestConnectRefusals(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com","private.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(hello))
	e.dns.Set("private.example.com", netip.MustParseAddr("10.0.0.5"))
	tests := []struct {
		target string
		status int
		reason string
	}{
		{"evil.example.com:443", 403, "no allowedHosts rule matches evil.example.com"},
		{"api.example.com:22", 403, "port 22 is not allowed: HTTPS (443) only"},
		{"api.example.com:80", 403, "port 80 is not allowed: HTTPS (443) only"},
		{"private.example.com:443", 403, "10.0.0.5 is not reachable from the sandbox: private.example.com resolves only to private addresses"},
		{"127.0.0.1:443", 403, "127.0.0.1 is not reachable from the sandbox (a loopback address)"},
		{"2130706433:443", 403, "127.0.0.1 is not reachable from the sandbox (a loopback address)"},
		{"[::ffff:169.254.169.254]:443", 403, "169.254.169.254"},
		{"0x7f.1:443", 403, "loopback"},
		{"localhost:443", 403, "no allowedHosts rule matches localhost"},
		{"metadata.google.internal:443", 403, "metadata"},
		{"api.example.com", 400, "no port"},
		{"user@api.example.com:443", 403, "userinfo"},
	}
	for _, tt := range tests {
		resp := e.raw("CONNECT " + tt.target + " HTTP/1.1\r\nHost: " + tt.target + "\r\n\r\n")
		b := body(t, resp)
		if resp.StatusCode != tt.status || !strings.Contains(b, tt.reason) || !strings.Contains(resp.Header.Get("X-Sandgate-Error"), tt.reason) {
			t.Errorf("CONNECT %s: %d %q (X-Sandgate-Error %q), want %d with %q", tt.target, resp.StatusCode, b, resp.Header.Get("X-Sandgate-Error"), tt.status, tt.reason)
		}
		// What a command shows: the body (curl, for a route) and the
		// status line (pip, go; curl -v), both saying sandgate refused.
		if !wantRefusalBody(b, resp.Header.Get("X-Sandgate-Error")) || !strings.HasSuffix(b, ")\n") || !strings.Contains(resp.Status, "(sandgate: ") {
			t.Errorf("CONNECT %s: status %q, body %q; want both to say sandgate refused it and why", tt.target, resp.Status, b)
		}
	}
}

func TestConnectIPLiteralNeedsCIDR(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	srv := e.upstream("api.example.com", http.HandlerFunc(hello))
	a := tlstest.Addr(srv)
	resp := e.raw("CONNECT " + a.String() + ":443 HTTP/1.1\r\n\r\n")
	if b := body(t, resp); resp.StatusCode != 403 || !strings.Contains(b, "allowed only by an allowedCIDRs rule") {
		t.Errorf("IP literal without CIDR rule: %d %q", resp.StatusCode, b)
	}
	pol, _ := netpolicy.ParsePolicy([]byte(`{"mode":"custom","allowedCIDRs":["` + a.String() + `/32"]}`))
	e.tenant.SetPolicy(pol)
	resp = e.raw("CONNECT " + a.String() + ":443 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Errorf("IP literal with CIDR rule: %d %q", resp.StatusCode, body(t, resp))
	}
}

func TestRoute(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	var got struct {
		method, uri, host string
		header            http.Header
		body              string
	}
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.method, got.uri, got.host, got.header, got.body = r.Method, r.RequestURI, r.Host, r.Header.Clone(), string(b)
		w.Header().Set("X-Upstream", "yes")
		w.WriteHeader(201)
		io.WriteString(w, "created")
	}))
	req, _ := http.NewRequest("POST", e.routeURL("api.example.com/v1/messages/a%2Fb?beta=true&x=%20y"), strings.NewReader(`{"q":1}`))
	req.Header.Set("Connection", "X-Hop")
	req.Header.Set("X-Hop", "secret-hop")
	req.Header.Set("Proxy-Authorization", "Basic Zm9vOmJhcg==")
	req.Header.Set("X-Keep", "kept")
	resp, err := e.routeClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 201 || b != "created" || resp.Header.Get("X-Upstream") != "yes" {
		t.Fatalf("got %d %q %v", resp.StatusCode, b, resp.Header)
	}
	if got.method != "POST" || got.uri != "/v1/messages/a%2Fb?beta=true&x=%20y" || got.host != "api.example.com" || got.body != `{"q":1}` {
		t.Errorf("upstream saw %s %q host %q body %q", got.method, got.uri, got.host, got.body)
	}
	for k := range got.header {
		if strings.HasPrefix(k, "X-Forwarded") || strings.HasPrefix(k, "Proxy-") || k == "X-Hop" || k == "Via" || k == "Forwarded" {
			t.Errorf("upstream saw header %s", k)
		}
	}
	if got.header.Get("X-Keep") != "kept" {
		t.Errorf("X-Keep did not reach the upstream")
	}
	ev := e.event(1)
	if ev.Kind != audit.Route || !ev.Allow || ev.Method != "POST" || ev.Path != "/v1/messages/a%2Fb" || ev.Status != 201 || ev.BytesIn != 7 || ev.BytesOut != 7 {
		t.Errorf("route event = %+v", ev)
	}
}

func TestRouteNoRedirectFollow(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.RedirectHandler("https://evil.example.com/", http.StatusFound))
	resp, err := e.routeClient().Get(e.routeURL("api.example.com/r"))
	if err != nil {
		t.Fatal(err)
	}
	body(t, resp)
	if resp.StatusCode != 302 || resp.Header.Get("Location") != "https://evil.example.com/" {
		t.Errorf("got %d %q, want the 302 itself", resp.StatusCode, resp.Header.Get("Location"))
	}
}

func TestRouteKeepAlive(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(hello))
	c, br := e.dial()
	for i := range 3 {
		fmt.Fprintf(c, "GET /https/api.example.com/k%d HTTP/1.1\r\nHost: x\r\n\r\n", i)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("request %d on one connection: %v", i, err)
		}
		if b := body(t, resp); b != fmt.Sprintf("hello GET /k%d", i) {
			t.Errorf("request %d: got %q", i, b)
		}
	}
}

// TestRouteStreamsSSE: each event reaches the client before the upstream
// writes the next, so nothing is buffered on the way.
func TestRouteStreamsSSE(t *testing.T) {
	for _, withSecret := range []bool{false, true} {
		t.Run(fmt.Sprintf("scrubbed=%v", withSecret), func(t *testing.T) {
			rules := ""
			if withSecret {
				rules = `[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
			}
			e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, rules)
			next := make(chan struct{})
			e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				for i := range 3 {
					fmt.Fprintf(w, "event: message\ndata: {\"n\":%d}\n\n", i)
					w.(http.Flusher).Flush()
					select {
					case <-next:
					case <-time.After(20 * time.Second):
						return
					}
				}
			}))
			resp, err := e.routeClient().Get(e.routeURL("api.example.com/v1/stream"))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			for i := range 3 {
				var ev strings.Builder
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						t.Fatalf("event %d: %v (got %q)", i, err, ev.String())
					}
					ev.WriteString(line)
					if line == "\n" {
						break
					}
				}
				if want := fmt.Sprintf("event: message\ndata: {\"n\":%d}\n\n", i); ev.String() != want {
					t.Errorf("event %d = %q, want %q", i, ev.String(), want)
				}
				next <- struct{}{}
			}
		})
	}
}

// TestSecretSwap: the sandbox sends the placeholder; the upstream receives
// the secret and never the placeholder; the secret echoed back reaches the
// sandbox as the placeholder, in headers and in plain and gzip bodies.
func TestSecretSwap(t *testing.T) {
	rules := `[{"match":{"host":"api.example.com","path":{"startsWith":"/v1/"}},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, rules)
	var mu sync.Mutex
	var seen []string
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		dump := fmt.Sprintf("%s %s %v", r.Method, r.RequestURI, r.Header)
		mu.Lock()
		seen = append(seen, dump)
		mu.Unlock()
		key := r.Header.Get("X-Api-Key")
		w.Header().Set("X-Echo", "key="+key)
		if r.URL.Query().Get("br") == "1" {
			// An encoding the scrubber cannot read: the body might hide
			// the secret, so it must never reach the sandbox.
			w.Header().Set("Content-Encoding", "br")
			fmt.Fprintf(w, "opaque %s", key)
			return
		}
		if r.URL.Query().Get("gzip") == "1" {
			w.Header().Set("Content-Encoding", "gzip")
			zw := gzip.NewWriter(w)
			fmt.Fprintf(zw, "you sent %s and %s", key, r.Header.Get("Authorization"))
			zw.Close()
			return
		}
		fmt.Fprintf(w, "you sent %s and %s", key, r.Header.Get("Authorization"))
	}))
	ph := transforms.PlaceholderPrefix + "CANARY_KEY"
	for _, q := range []string{"", "?gzip=1"} {
		req, _ := http.NewRequest("POST", e.routeURL("api.example.com/v1/messages"+q), strings.NewReader("{}"))
		req.Header.Set("X-Api-Key", ph)
		req.Header.Set("Authorization", "Bearer "+ph)
		req.Header.Set("Accept-Encoding", "gzip, br")
		resp, err := e.routeClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b := body(t, resp)
		if want := "you sent " + ph + " and Bearer " + ph; b != want {
			t.Errorf("%s: sandbox got body %q, want %q", q, b, want)
		}
		if h := resp.Header.Get("X-Echo"); h != "key="+ph {
			t.Errorf("%s: sandbox got X-Echo %q, want the placeholder", q, h)
		}
	}
	mu.Lock()
	seenCopy := append([]string(nil), seen...)
	mu.Unlock()
	for _, s := range seenCopy {
		if !strings.Contains(s, "X-Api-Key:["+canary+"]") || !strings.Contains(s, "Bearer "+canary) {
			t.Errorf("upstream did not receive the secret: %s", s)
		}
		if strings.Contains(s, ph) {
			t.Errorf("the placeholder reached the upstream: %s", s)
		}
		if strings.Contains(s, "br") {
			t.Errorf("Accept-Encoding br reached the upstream though the response must be scrubbed: %s", s)
		}
	}
	ev := e.event(1)
	if len(ev.Transforms) != 1 || !strings.Contains(ev.Transforms[0], "api.example.com") {
		t.Errorf("event transforms = %v", ev.Transforms)
	}
	req, _ := http.NewRequest("GET", e.routeURL("api.example.com/v1/x?br=1"), nil)
	req.Header.Set("X-Api-Key", ph)
	resp, err := e.routeClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 502 || !strings.Contains(b, "could not be scrubbed") {
		t.Errorf("an unscrubbable encoding got %d %q, want 502", resp.StatusCode, b)
	}
	// Not matching the rule's path: nothing swapped.
	req, _ = http.NewRequest("GET", e.routeURL("api.example.com/other"), nil)
	req.Header.Set("X-Api-Key", ph)
	resp, err = e.routeClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); !strings.Contains(b, "you sent "+ph) {
		t.Errorf("a request outside the rule got %q", b)
	}
}

func TestRouteRefusals(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com","nx.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(hello))
	tests := []struct {
		name, req string
		status    int
		reason    string
	}{
		{"denied host", "GET /https/evil.example.com/x HTTP/1.1\r\nHost: p\r\n\r\n", 403, "no allowedHosts rule matches evil.example.com"},
		{"port", "GET /https/api.example.com:8443/x HTTP/1.1\r\nHost: p\r\n\r\n", 403, "port 8443 is not allowed: a route reaches port 443, or the port of one of the sandbox's own base URLs"},
		{"dns failure", "GET /https/nx.example.com/x HTTP/1.1\r\nHost: p\r\n\r\n", 502, "lookup nx.example.com"},
		{"plain http", "GET http://api.example.com/ HTTP/1.1\r\nHost: api.example.com\r\n\r\n", 403, "plain http:// is refused"},
		{"absolute https", "GET https://api.example.com/ HTTP/1.1\r\nHost: api.example.com\r\n\r\n", 400, "CONNECT host:443"},
		{"http route to a host no rule admits", "GET /http/evil.example.com/x HTTP/1.1\r\nHost: p\r\n\r\n", 403, "no allowedHosts rule matches evil.example.com"},
		{"http route spelled oddly", "GET /HTTP/api.example.com/x HTTP/1.1\r\nHost: p\r\n\r\n", 403, "no route for"},
		{"unknown route", "GET /v1/messages HTTP/1.1\r\nHost: p\r\n\r\n", 403, "/https/<host>/<path>"},
		{"no host", "GET /https/ HTTP/1.1\r\nHost: p\r\n\r\n", 400, "names no host"},
		{"smuggling", "POST /https/api.example.com/x HTTP/1.1\r\nHost: p\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "both Content-Length and Transfer-Encoding"},
		{"smuggling spelled oddly", "POST /https/api.example.com/x HTTP/1.1\r\nHost: p\r\ncontent-length: 3\r\nTRANSFER-ENCODING: chunked\r\n\r\n0\r\n\r\n", 400, "both Content-Length"},
		{"loopback literal", "GET /https/127.0.0.1/x HTTP/1.1\r\nHost: p\r\n\r\n", 403, "loopback"},
		{"metadata literal", "GET /https/169.254.169.254/latest/meta-data HTTP/1.1\r\nHost: p\r\n\r\n", 403, "metadata"},
		{"percent host", "GET /https/api.example.com%2eevil.com/x HTTP/1.1\r\nHost: p\r\n\r\n", 403, "percent"},
		{"userinfo host", "GET /https/x@api.example.com/x HTTP/1.1\r\nHost: p\r\n\r\n", 403, "userinfo"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := e.raw(tt.req)
			b := body(t, resp)
			if resp.StatusCode != tt.status || !strings.Contains(b, tt.reason) || !strings.Contains(resp.Header.Get("X-Sandgate-Error"), tt.reason) {
				t.Errorf("got %d %q (X-Sandgate-Error %q), want %d with %q", resp.StatusCode, b, resp.Header.Get("X-Sandgate-Error"), tt.status, tt.reason)
			}
			if !wantRefusalBody(b, resp.Header.Get("X-Sandgate-Error")) || !strings.Contains(resp.Status, "(sandgate: ") {
				t.Errorf("status %q, body %q; want both to say sandgate refused it", resp.Status, b)
			}
		})
	}
}

// A refused plain-http request names the host it was for: an auditor
// sees where a tool tried to go in cleartext.
func TestPlainHTTPRefusalNamesItsHost(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	body(t, e.raw("GET http://api.example.com/pkg?token=x HTTP/1.1\r\nHost: api.example.com\r\n\r\n"))
	ev := e.event(1)
	if ev.Kind != audit.Refused || ev.Allow || ev.Code != CodePlainHTTP || ev.Host != "api.example.com" || ev.Port != 80 || ev.Path != "/pkg" {
		t.Errorf("event = %+v; want a plain_http refusal of api.example.com:80 /pkg", ev)
	}
}

func TestLimits(t *testing.T) {
	t.Run("header size", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, `{"mode":"allow-all"}`, "", func(c *Config) { c.MaxHeaderBytes = 4096 })
		resp := e.raw("GET /https/api.example.com/ HTTP/1.1\r\nX-Big: " + strings.Repeat("a", 5000) + "\r\n\r\n")
		body(t, resp)
		if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" {
			t.Errorf("got %d Retry-After %q, want 429 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
	})
	t.Run("connections per sandbox", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", func(c *Config) { c.MaxConns = 1 })
		e.upstream("api.example.com", http.HandlerFunc(hello))
		c, br := e.dial()
		io.WriteString(c, "CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("first tunnel: %v %v", resp, err)
		}
		resp = e.raw("CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
		if b := body(t, resp); resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "1" || !strings.Contains(b, "already has 1 connections open") {
			t.Errorf("second tunnel: %d %q", resp.StatusCode, b)
		}
	})
	t.Run("idle and half-sent connections count", func(t *testing.T) {
		t.Parallel()
		// Regression: only requests counted, so thousands of connections
		// holding a byte each were kept with their buffers.
		e := newEnv(t, `{"mode":"allow-all"}`, "", func(c *Config) { c.MaxConns = 2 })
		for range 2 {
			c, _ := e.dial()
			io.WriteString(c, "G")
		}
		deadline := time.Now().Add(10 * time.Second)
		for e.tenant.open.Load() < 2 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		resp := e.raw("GET /https/api.example.com/ HTTP/1.1\r\nHost: p\r\n\r\n")
		if b := body(t, resp); resp.StatusCode != 429 || !strings.Contains(b, "already has 2 connections open") {
			t.Errorf("third connection: %d %q, want 429", resp.StatusCode, b)
		}
	})
	t.Run("stalled request body", func(t *testing.T) {
		t.Parallel()
		// Regression: after the head, a body that never came held the
		// request, its slot and an upstream connection forever.
		e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", func(c *Config) { c.IdleTimeout = 200 * time.Millisecond })
		e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
		resp := e.raw("POST /https/api.example.com/x HTTP/1.1\r\nHost: p\r\nContent-Length: 10\r\n\r\nA")
		if b := body(t, resp); resp.StatusCode != 429 || !strings.Contains(b, "stalled") || resp.Header.Get("Retry-After") == "" {
			t.Errorf("got %d %q, want 429 saying the body stalled", resp.StatusCode, b)
		}
	})
	t.Run("stalled response body", func(t *testing.T) {
		t.Parallel()
		// Long enough that the dial and handshake before the stall are
		// never cut on a loaded machine.
		e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", func(c *Config) { c.IdleTimeout = 2 * time.Second })
		release := make(chan struct{})
		defer close(release)
		e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "10")
			io.WriteString(w, "A")
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}))
		c, br := e.dial()
		io.WriteString(c, "GET /https/api.example.com/x HTTP/1.1\r\nHost: p\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if b, err := io.ReadAll(resp.Body); err == nil || string(b) != "A" {
			t.Errorf("read %q, %v; want the byte sent, then the connection cut", b, err)
		}
		if ev := e.event(1); !strings.Contains(ev.Error, "timeout") {
			t.Errorf("event error %q, want a timeout", ev.Error)
		}
	})
	t.Run("header timeout", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, `{"mode":"allow-all"}`, "", func(c *Config) { c.HeaderTimeout = 200 * time.Millisecond })
		resp := e.raw("GET /https/api.example.com/ HTTP/1.1\r\n") // never finished
		body(t, resp)
		if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" {
			t.Errorf("got %d, want 429 with Retry-After", resp.StatusCode)
		}
	})
	t.Run("idle tunnel", func(t *testing.T) {
		t.Parallel()
		// Long enough that no pause within the TLS handshake through the
		// tunnel reaches it on a loaded machine.
		e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", func(c *Config) { c.IdleTimeout = 2 * time.Second })
		e.upstream("api.example.com", http.HandlerFunc(hello))
		c, br := e.dial()
		io.WriteString(c, "CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
		if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != 200 {
			t.Fatalf("tunnel: %v %v", resp, err)
		}
		tc := tls.Client(c, &tls.Config{ServerName: "api.example.com", RootCAs: e.ca.Pool})
		if err := tc.Handshake(); err != nil {
			t.Fatalf("TLS through the tunnel: %v", err)
		}
		if _, err := tc.Read(make([]byte, 1)); err == nil {
			t.Errorf("idle tunnel read succeeded, want the proxy to close it")
		}
		if ev := e.event(1); !strings.Contains(ev.Error, "idle") {
			t.Errorf("event error = %q, want it to say idle", ev.Error)
		}
	})
}

func TestUpstreamTimeout(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["slow.example.com"]}`, "", func(c *Config) { c.ResponseHeaderTimeout = 200 * time.Millisecond })
	release := make(chan struct{})
	defer close(release)
	e.upstream("slow.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	resp, err := e.routeClient().Get(e.routeURL("slow.example.com/"))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 504 {
		t.Errorf("got %d %q, want 504", resp.StatusCode, b)
	}
}

// TestRebindingThroughProxy: a name that first answers the (exempted)
// upstream and then a private address is judged again on the second
// request, and refused.
func TestRebindingThroughProxy(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["rebind.example.com"]}`, "")
	srv := e.upstream("rebind.example.com", http.HandlerFunc(hello))
	e.dns.SetTTL("rebind.example.com", 0)
	e.dns.SetSequence("rebind.example.com", []netip.Addr{tlstest.Addr(srv)}, []netip.Addr{netip.MustParseAddr("10.0.0.5")})
	resp, err := e.routeClient().Get(e.routeURL("rebind.example.com/1"))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 200 {
		t.Fatalf("first request: %d %q", resp.StatusCode, b)
	}
	resp, err = e.routeClient().Get(e.routeURL("rebind.example.com/2"))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 403 || !strings.Contains(b, "10.0.0.5 is not reachable from the sandbox: rebind.example.com resolves only to private addresses") {
		t.Errorf("second request: %d %q", resp.StatusCode, b)
	}
}

func TestUntrustedUpstreamCertificate(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	other := tlstest.MustCA(t)
	srv := other.Server(t, http.HandlerFunc(hello), "api.example.com")
	a := tlstest.Addr(srv)
	e.dns.Set("api.example.com", a)
	e.decider.AllowPrivate = []netip.Prefix{netip.PrefixFrom(a, 32)}
	resp, err := e.routeClient().Get(e.routeURL("api.example.com/"))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 502 || !strings.Contains(b, "certificate") {
		t.Errorf("got %d %q, want 502 naming the certificate", resp.StatusCode, b)
	}
}

// TestGracefulStop: ending Serve's context closes the listener and idle
// connections at once, lets a request in progress finish, and Serve returns
// when it has.
func TestGracefulStop(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			select {
			case <-release:
			case <-time.After(20 * time.Second):
			}
		}
		io.WriteString(w, "done "+r.URL.Path)
	}))
	idle, idleBr := e.dial()
	io.WriteString(idle, "GET /https/api.example.com/first HTTP/1.1\r\nHost: p\r\n\r\n")
	if resp, err := http.ReadResponse(idleBr, nil); err != nil || body(t, resp) != "done /first" {
		t.Fatalf("first request: %v", err)
	}
	busy, busyBr := e.dial()
	io.WriteString(busy, "GET /https/api.example.com/slow HTTP/1.1\r\nHost: p\r\n\r\n")
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("slow request never reached the upstream")
	}
	e.stop()
	if _, err := idleBr.ReadByte(); err != io.EOF {
		t.Errorf("idle connection after stop: read %v, want EOF", err)
	}
	select {
	case <-e.served:
		t.Fatal("Serve returned while a request was in progress")
	default:
	}
	close(release)
	resp, err := http.ReadResponse(busyBr, nil)
	if err != nil {
		t.Fatalf("request in progress was cut: %v", err)
	}
	if b := body(t, resp); b != "done /slow" {
		t.Errorf("got %q", b)
	}
	select {
	case <-e.served:
	case <-time.After(20 * time.Second):
		t.Fatal("Serve did not return after the last request finished")
	}
	if c, err := net.DialTimeout("tcp", e.addr, time.Second); err == nil {
		c.Close()
		t.Errorf("the listener still accepts after stop")
	}
}

// TestRouteStreamsRequestBody: a request body the sandbox streams reaches
// the upstream piece by piece, not when the sandbox has finished sending.
func TestRouteStreamsRequestBody(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	got := make(chan string, 4)
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		buf := make([]byte, 64)
		for {
			n, err := r.Body.Read(buf)
			if n > 0 {
				got <- string(buf[:n])
			}
			if err != nil {
				break
			}
		}
		io.WriteString(w, "ok")
	}))
	pr, pw := io.Pipe()
	req, _ := http.NewRequest("POST", e.routeURL("api.example.com/upload"), pr)
	done := make(chan *http.Response, 1)
	go func() {
		resp, err := e.routeClient().Do(req)
		if err != nil {
			t.Error(err)
			close(done)
			return
		}
		done <- resp
	}()
	for _, part := range []string{"part one", "part two"} {
		pw.Write([]byte(part))
		select {
		case g := <-got:
			if g != part {
				t.Errorf("upstream read %q, want %q", g, part)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%q did not reach the upstream before the body ended", part)
		}
	}
	pw.Close()
	if resp := <-done; resp != nil {
		if b := body(t, resp); b != "ok" {
			t.Errorf("got %q", b)
		}
	}
}

// TestConnectChecksClientHello: the tunnel's bytes go to the judged host's
// address whatever they say, so a ClientHello naming another server (a
// site sharing a CDN address) or a tunnel that is not TLS is cut, with an
// audit event saying why.
func TestConnectChecksClientHello(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "", func(c *Config) { c.HeaderTimeout = 2 * time.Second })
	// The upstream would serve the other name too: only the proxy stops it.
	srv := e.ca.Server(t, http.HandlerFunc(hello), "api.example.com", "other.example.org")
	a := tlstest.Addr(srv)
	e.dns.Set("api.example.com", a)
	e.decider.AllowPrivate = []netip.Prefix{netip.PrefixFrom(a, 32)}

	open := func() net.Conn {
		c, br := e.dial()
		io.WriteString(c, "CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
		if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != 200 {
			t.Fatalf("tunnel: %v %v", resp, err)
		}
		return c
	}
	tc := tls.Client(open(), &tls.Config{ServerName: "other.example.org", RootCAs: e.ca.Pool})
	if err := tc.Handshake(); err == nil {
		t.Errorf("a ClientHello for other.example.org went through a tunnel opened for api.example.com")
	}
	ev := e.event(1)
	if ev.Allow || ev.Code != CodeSNIMismatch || !strings.Contains(ev.Reason, `"other.example.org" does not match the CONNECT target api.example.com`) {
		t.Errorf("event = %+v", ev)
	}

	c := open()
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Errorf("plain HTTP through the tunnel got an answer")
	}
	if ev := e.event(2); ev.Allow || ev.Code != CodeNotTLS {
		t.Errorf("event = %+v", ev)
	}

	tc = tls.Client(open(), &tls.Config{ServerName: "API.Example.com", RootCAs: e.ca.Pool})
	if err := tc.Handshake(); err != nil {
		t.Errorf("the matching server name (any case) was refused: %v", err)
	}
	tc.Close()
	if ev := e.event(3); !ev.Allow || ev.Code != "allowed_host" {
		t.Errorf("event = %+v", ev)
	}
}

func TestCheckSNI(t *testing.T) {
	name := netpolicy.Host{Name: "api.example.com"}
	ip := netpolicy.Host{Addr: netip.MustParseAddr("203.0.113.7")}
	for _, tt := range []struct {
		target netpolicy.Host
		sni    string
		ok     bool
	}{
		{name, "api.example.com", true},
		{name, "API.EXAMPLE.COM.", true},
		{name, "", false},
		{name, "evil.example.com", false},
		{name, "api.example.com.evil.com", false},
		{ip, "", true},
		{ip, "api.example.com", false},
	} {
		if got := checkSNI(tt.target, tt.sni) == ""; got != tt.ok {
			t.Errorf("checkSNI(%v, %q) ok = %v, want %v", tt.target, tt.sni, got, tt.ok)
		}
	}
}

// TestRefusalDuringUploadReachesSandbox: a route refused while the sandbox
// is still sending a large body gets its 403, not a reset.
func TestRefusalDuringUploadReachesSandbox(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	big := strings.NewReader(strings.Repeat("x", 3<<20)) // more than socket buffers, less than the linger drain
	resp, err := e.routeClient().Post(e.routeURL("evil.example.com/upload"), "application/octet-stream", big)
	if err != nil {
		t.Fatalf("the refusal was lost: %v", err)
	}
	if b := body(t, resp); resp.StatusCode != 403 || !strings.Contains(b, "no allowedHosts rule") {
		t.Errorf("got %d %q, want 403", resp.StatusCode, b)
	}
}

// Shutdown lets a request in progress finish, closes idle connections at
// once, and cuts what is left when its context ends.
func TestShutdown(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			<-release
		}
		io.WriteString(w, "done "+r.URL.Path)
	}))
	idle, idleBr := e.dial()
	io.WriteString(idle, "GET /https/api.example.com/first HTTP/1.1\r\nHost: p\r\n\r\n")
	if resp, err := http.ReadResponse(idleBr, nil); err != nil || body(t, resp) != "done /first" {
		t.Fatalf("first request: %v", err)
	}
	busy, busyBr := e.dial()
	io.WriteString(busy, "GET /https/api.example.com/slow HTTP/1.1\r\nHost: p\r\n\r\n")
	<-entered
	shut := make(chan error, 1)
	go func() { shut <- e.proxy.Shutdown(context.Background()) }()
	if _, err := idleBr.ReadByte(); err != io.EOF {
		t.Errorf("idle connection during Shutdown: read %v, want EOF", err)
	}
	close(release)
	if resp, err := http.ReadResponse(busyBr, nil); err != nil || body(t, resp) != "done /slow" {
		t.Errorf("the request in progress: %v", err)
	}
	if err := <-shut; err != nil {
		t.Errorf("Shutdown = %v, want nil", err)
	}

	// A context that ends cuts what is left.
	e2 := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	hold := make(chan struct{})
	defer close(hold)
	e2.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		select {
		case <-hold:
		case <-r.Context().Done():
		}
	}))
	c, br := e2.dial()
	io.WriteString(c, "GET /https/api.example.com/held HTTP/1.1\r\nHost: p\r\n\r\n")
	<-entered
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := e2.proxy.Shutdown(ctx); err == nil {
		t.Error("Shutdown with an ended context and a request in progress = nil")
	}
	if _, err := http.ReadResponse(br, nil); err == nil {
		t.Error("the held request was not cut")
	}
}

// TestBaseURLOwnOriginRouted covers what protocol 1 routes beyond HTTPS on
// port 443: an https base URL's own port, and an http base URL, forwarded
// only to an address the operator opened (the upstream here is exempted,
// as SANDBOX_ALLOW_PRIVATE_NETWORK does) and refused at a public one.
func TestBaseURLOwnOriginRouted(t *testing.T) {
	e := newEnv(t, `{"mode":"custom"}`, "")
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "plain %s %s host=%s", r.Method, r.URL.Path, r.Host)
	}))
	t.Cleanup(plain.Close)
	ap := netip.MustParseAddrPort(plain.Listener.Addr().String())
	e.dns.Set("model.example.com", ap.Addr())
	e.dns.Set("public.example.com", netip.MustParseAddr("93.184.216.34"))
	e.decider.AllowPrivate = append(e.decider.AllowPrivate, netip.PrefixFrom(ap.Addr(), 32))
	// An HTTPS upstream on a port of its own (not 443).
	tlsOther := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "tls host=%s", r.Host)
	}))
	leaf, err := e.ca.Leaf("api.example.com")
	if err != nil {
		t.Fatal(err)
	}
	tlsOther.TLS = &tls.Config{Certificates: []tls.Certificate{leaf}}
	tlsOther.StartTLS()
	t.Cleanup(tlsOther.Close)
	tp := netip.MustParseAddrPort(tlsOther.Listener.Addr().String())
	e.dns.Set("api.example.com", tp.Addr())
	e.decider.AllowPrivate = append(e.decider.AllowPrivate, netip.PrefixFrom(tp.Addr(), 32))
	port := strconv.Itoa(int(ap.Port()))
	tport := strconv.Itoa(int(tp.Port()))
	var origins []netpolicy.Origin
	for _, u := range []string{"http://model.example.com:" + port + "/v1", "https://api.example.com:" + tport + "/v1", "http://public.example.com/v1"} {
		o, _ := netpolicy.OriginOf(u)
		origins = append(origins, o)
	}
	rules, _ := netpolicy.ParseHostRules([]string{"model.example.com", "api.example.com", "public.example.com"})
	e.tenant.SetPolicy(netpolicy.Policy{Mode: netpolicy.Custom, RouteHosts: rules, RouteOrigins: origins})
	get := func(path string) (int, string) {
		resp, err := e.routeClient().Get("http://" + e.addr + path)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, body(t, resp)
	}
	if code, b := get("/http/model.example.com:" + port + "/v1/x"); code != 200 || b != "plain GET /v1/x host=model.example.com:"+port {
		t.Errorf("http route to an opened address: %d %q", code, b)
	}
	if code, b := get("/https/api.example.com:" + tport + "/v1/y"); code != 200 || b != "tls host=api.example.com:"+tport {
		t.Errorf("https route to a base URL's own port: %d %q", code, b)
	}
	if code, b := get("/http/public.example.com/v1"); code != 403 || !strings.Contains(b, "is not an address the operator opened") {
		t.Errorf("http route to a public address: %d %q", code, b)
	}
	if code, b := get("/https/model.example.com:" + port + "/v1"); code != 403 || !strings.Contains(b, "port "+port+" is not allowed") {
		t.Errorf("https route to the http base URL's port: %d %q", code, b)
	}
	if ev := e.event(1); !ev.Allow || ev.Host != "model.example.com" || ev.Port != int(ap.Port()) {
		t.Errorf("the audit event of the http route: %+v; want allowed, port %d", ev, ap.Port())
	}
}

// A connection served for a peer names it in every event: its command
// line as audit.CommandLine renders it, or, when it holds a secret of the
// sandbox's rules, not at all. Drain returns once its events are recorded.
func TestPeerNamedInEvents(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`,
		`[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`)
	serve := func(peer Peer) {
		t.Helper()
		c, s := net.Pipe()
		done := make(chan struct{})
		go func() { e.proxy.ServePeer(context.Background(), s, e.tenant, peer); close(done) }()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		io.WriteString(c, "CONNECT evil.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")
		http.ReadResponse(bufio.NewReader(c), nil)
		c.Close()
		<-done
	}
	serve(Peer{PID: 4242, Args: []string{"curl", "-H", "Authorization: Bearer mine", "https://evil.example.com"}})
	serve(Peer{PID: 7, Args: []string{"sh", "-c", "echo " + canary}})
	serve(Peer{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := e.tenant.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	evs := e.rings.Events(e.tenant.ID())
	if len(evs) != 3 {
		t.Fatalf("%d events once drained, want 3: %+v", len(evs), evs)
	}
	if evs[0].PID != 4242 || evs[0].Cmd != "curl -H Authorization: [REDACTED] https://evil.example.com" {
		t.Errorf("first event names %d %q", evs[0].PID, evs[0].Cmd)
	}
	if evs[1].PID != 7 || strings.Contains(evs[1].Cmd, "echo") || !strings.HasPrefix(evs[1].Cmd, audit.Redacted) {
		t.Errorf("a command line holding the sandbox's secret is %q", evs[1].Cmd)
	}
	if evs[2].PID != 0 || evs[2].Cmd != "" {
		t.Errorf("an unknown peer is %d %q", evs[2].PID, evs[2].Cmd)
	}
}

// wantRefusalBody says whether a refusal's body is as a command should
// read it: "sandgate: <reason> (<code>)", or, where protocol 1 fixes the
// words (an address the sandbox may not reach), those words first.
func wantRefusalBody(body, reason string) bool {
	if strings.Contains(reason, " is not reachable from the sandbox") {
		return strings.HasPrefix(body, reason+" (address_class)")
	}
	return strings.HasPrefix(body, "sandgate: "+reason+" (")
}

// protocol1Refusal is what the reference client's own end-to-end test
// matches in the body of a refused route to the metadata address.
var protocol1Refusal = regexp.MustCompile(`^169\.254\.169\.254 is (not reachable|a private address)`)

// A refused route to the metadata address answers with protocol 1's words
// first, as the reference client's test reads them (it failed on a
// "sandgate: " prefix), whatever the sandbox's policy, deny-all included;
// so does any address the sandbox may not reach, literal or resolved.
func TestAddressRefusalStartsWithProtocol1Words(t *testing.T) {
	for _, policy := range []string{
		`{"mode":"custom","allowedHosts":["registry.npmjs.org"]}`, `{"mode":"deny-all"}`, `{"mode":"allow-all"}`,
	} {
		e := newEnv(t, policy, "")
		for _, target := range []string{"/https/169.254.169.254/computeMetadata/v1/", "/https/169.254.169.254:443/computeMetadata/v1/"} {
			resp := e.raw("GET " + target + " HTTP/1.1\r\nHost: p\r\n\r\n")
			if b := body(t, resp); resp.StatusCode != 403 || !protocol1Refusal.MatchString(b) {
				t.Errorf("policy %s, GET %s: %d %q, want 403 whose body matches %s", policy, target, resp.StatusCode, b, protocol1Refusal)
			}
		}
	}
	e := newEnv(t, `{"mode":"allow-all"}`, "")
	e.dns.Set("private.example.com", netip.MustParseAddr("10.0.0.5"))
	for _, target := range []string{"/https/10.0.0.5/x", "/https/private.example.com/x"} {
		resp := e.raw("GET " + target + " HTTP/1.1\r\nHost: p\r\n\r\n")
		if b := body(t, resp); resp.StatusCode != 403 || !strings.HasPrefix(b, "10.0.0.5 is not reachable from the sandbox") {
			t.Errorf("GET %s: %d %q, want 403 starting with protocol 1's words", target, resp.StatusCode, b)
		}
	}
}
