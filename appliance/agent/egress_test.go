package agent

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

// egressEnv is a real relay.Proxy on loopback (its own DNS server, a CA and
// an HTTPS upstream on 127.x.y.z:443) serving a link's egress streams.
type egressEnv struct {
	l      *link
	ca     *tlstest.CA
	rings  *audit.Rings
	tenant *relay.Tenant

	mu    sync.Mutex
	types map[string]int // the Go types of the conns handed to Egress
}

// connTypes returns how many conns of each Go type reached Egress.
func (e *egressEnv) connTypes() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.types)
}

// newEgressEnvOver is a real relay.Proxy serving the egress of a link over
// a transport of kind.
func newEgressEnvOver(t *testing.T, kind transport) *egressEnv {
	t.Helper()
	skipIfNotLinux(t)
	dns := dnstest.Start(t)
	ca := tlstest.MustCA(t)
	srv := ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "upstream saw %s %s", r.Method, r.URL.Path)
	}), "api.example.com") // skips without root: the proxy only dials :443
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{dns.Addr}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Close() })
	a := tlstest.Addr(srv)
	dns.Set("api.example.com", a)
	decider := &netpolicy.Decider{Resolver: res, DialTimeout: 5 * time.Second, AllowPrivate: []netip.Prefix{netip.PrefixFrom(a, 32)}}
	rings := audit.NewRings(100)
	proxy, err := relay.New(relay.Config{Decider: decider, Audit: rings, UpstreamRoots: ca.Pool})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := netpolicy.ParsePolicy([]byte(`{"mode":"custom","allowedHosts":["api.example.com"]}`))
	if err != nil {
		t.Fatal(err)
	}
	tenant := relay.NewTenant("tenant-agent-test", pol, nil)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); proxy.Close(); tenant.Close() })
	e := &egressEnv{ca: ca, rings: rings, tenant: tenant, types: map[string]int{}}
	e.l = startLinkOver(t, kind, ClientOptions{
		Config: Config{BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}},
		Egress: func(c net.Conn, p Peer) {
			e.mu.Lock()
			e.types[fmt.Sprintf("%T", c)]++
			e.mu.Unlock()
			proxy.ServePeer(ctx, c, tenant, relay.Peer{PID: p.PID, Args: p.Args})
		},
	}, nil)
	return e
}

// event waits (bounded) for an audit event matching fn.
func (e *egressEnv) event(t *testing.T, fn func(audit.Event) bool) audit.Event {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		for _, ev := range e.rings.Events(e.tenant.ID()) {
			if fn(ev) {
				return ev
			}
		}
	}
	t.Fatalf("no matching audit event within 10s; have %+v", e.rings.Events(e.tenant.ID()))
	return audit.Event{}
}

// TestEgressThroughRelay: connections to the agent's relay listener reach
// relay.Proxy over the link, as tunnels and as base-URL routes, and are
// judged under the link's sandbox. Over a socketpair they are the
// sandbox's own sockets, passed (a *net.TCPConn reaches Egress); over
// net.Pipe their bytes travel on yamux streams.
func TestEgressThroughRelay(t *testing.T) {
	for _, kind := range []transport{netPipe, socketPair} {
		t.Run(kind.String(), func(t *testing.T) {
			e := newEgressEnvOver(t, kind)
			testEgressThroughRelay(t, e)
			want, fdPass := "*agent.streamConn", false
			if kind == socketPair {
				want, fdPass = "*agent.passedConn", true
			}
			if got := e.l.c.Info().FDPass; got != fdPass {
				t.Errorf("Info().FDPass = %v, want %v", got, fdPass)
			}
			types := e.connTypes()
			if len(types) != 1 || types[want] < 3 {
				t.Errorf("Egress got conns %v, want 3 or more, all %s", types, want)
			}
		})
	}
}

func testEgressThroughRelay(t *testing.T, e *egressEnv) {
	relayAddr := e.l.c.Info().RelayAddr

	// A process in the sandbox using HTTPS_PROXY (CONNECT).
	pu, _ := url.Parse("http://" + relayAddr)
	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: e.ca.Pool}}}
	resp, err := hc.Get("https://api.example.com/tunnel")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "upstream saw GET /tunnel" {
		t.Errorf("tunnel: %q", b)
	}
	hc.CloseIdleConnections()
	e.event(t, func(ev audit.Event) bool { return ev.Kind == audit.Connect && ev.Allow && ev.Host == "api.example.com" })

	// A base-URL route.
	rc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{Proxy: nil}}
	resp, err = rc.Get("http://" + relayAddr + "/https/api.example.com/route")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "upstream saw GET /route" {
		t.Errorf("route: %d %q", resp.StatusCode, b)
	}

	// A denied host: refused by the relay, with its audit event.
	c, err := net.DialTimeout("tcp", relayAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(20 * time.Second))
	io.WriteString(c, "CONNECT evil.example.com:443 HTTP/1.1\r\nHost: evil.example.com:443\r\n\r\n")
	resp, err = http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("CONNECT to a denied host: %d", resp.StatusCode)
	}
	ev := e.event(t, func(ev audit.Event) bool { return !ev.Allow && ev.Host == "evil.example.com" })
	if !strings.Contains(ev.Reason, "evil.example.com") {
		t.Errorf("deny event: %+v", ev)
	}
}

// TestEgressCurl: curl run by the agent, with nothing but the environment
// the agent gives it, reaches the upstream through the relay both ways and
// is refused for a denied host.
func TestEgressCurl(t *testing.T) {
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("curl is not installed on this machine")
	}
	for _, kind := range []transport{netPipe, socketPair} {
		t.Run(kind.String(), func(t *testing.T) { testEgressCurl(t, newEgressEnvOver(t, kind)) })
	}
}

func testEgressCurl(t *testing.T, e *egressEnv) {
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, e.ca.PEM, 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(script string) (string, string, ExitStatus) {
		var out, errOut syncbuf.Buffer
		st, err := e.l.c.Run(testCtx(t), Cmd{Args: []string{"sh", "-c", script}, Env: []string{"CA=" + ca}, Stdout: &out, Stderr: &errOut})
		if err != nil {
			t.Fatal(err)
		}
		return out.String(), errOut.String(), st
	}
	out, errOut, st := run(`curl -sS --max-time 20 --cacert "$CA" https://api.example.com/curl-tunnel`)
	if !st.Success() || out != "upstream saw GET /curl-tunnel" {
		t.Errorf("curl through HTTPS_PROXY: %v %q %q", st, out, errOut)
	}
	out, errOut, st = run(`curl -sS --max-time 20 "$ANTHROPIC_BASE_URL/v1/messages"`)
	if !st.Success() || out != "upstream saw GET /v1/messages" {
		t.Errorf("curl to the base-URL route: %v %q %q", st, out, errOut)
	}
	_, errOut, st = run(`curl -sS --max-time 20 https://evil.example.com/`)
	if st.Success() || !strings.Contains(errOut, "403") {
		t.Errorf("curl to a denied host: %v, stderr %q; want a failure with the relay's 403", st, errOut)
	}
	e.event(t, func(ev audit.Event) bool { return !ev.Allow && ev.Host == "evil.example.com" })
}

// TestEgressRefusedWithoutHandler: with no Egress handler, connections to
// the relay listener are closed at once.
func TestEgressRefusedWithoutHandler(t *testing.T) {
	l := startLink(t, ClientOptions{})
	c, err := net.DialTimeout("tcp", l.c.Info().RelayAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Errorf("read %d bytes from a refused egress connection", n)
	}
}
