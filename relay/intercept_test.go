package relay

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/transforms"
)

// interceptEnv is an env whose proxy has an interception CA.
func interceptEnv(t *testing.T, policy, rules string, opts ...envOpt) (*env, *ca.Authority) {
	t.Helper()
	ica, err := ca.New()
	if err != nil {
		t.Fatal(err)
	}
	opts = append(opts, func(c *Config) { c.CA = ica })
	return newEnv(t, policy, rules, opts...), ica
}

// trusting is the test CA's pool plus the interception CA: what a sandbox
// trusts.
func (e *env) trusting(ica *ca.Authority) *x509.CertPool {
	pool := e.ca.Pool.Clone()
	pool.AppendCertsFromPEM(ica.CertPEM())
	return pool
}

// interceptClient sends requests through CONNECT, trusting pool, speaking
// HTTP/2 when h2 (else HTTP/1.1 only).
func (e *env) interceptClient(pool *x509.CertPool, h2 bool) *http.Client {
	pu, _ := url.Parse("http://" + e.addr)
	tr := &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: pool}, DisableCompression: true}
	tr.Protocols = new(http.Protocols)
	if h2 {
		tr.Protocols.SetHTTP2(true)
	} else {
		tr.Protocols.SetHTTP1(true)
	}
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// eventsOf waits (bounded) until the sandbox has n events of kind.
func (e *env) eventsOf(kind audit.Kind, n int) []audit.Event {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	var got []audit.Event
	for time.Now().Before(deadline) {
		got = got[:0]
		for _, ev := range e.rings.Events(e.tenant.ID()) {
			if ev.Kind == kind {
				got = append(got, ev)
			}
		}
		if len(got) >= n {
			return got
		}
		time.Sleep(5 * time.Millisecond)
	}
	e.t.Fatalf("%d %s events never came; have %+v", n, kind, e.rings.Events(e.tenant.ID()))
	return nil
}

const interceptRules = `[{"match":{"host":"api.example.com"},"transform":{"headers":{"authorization":{"env":"CANARY_KEY"}}}}]`

// echoAuth answers with what it was sent, credential included.
func echoAuth(seen *[]string, mu *sync.Mutex) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		*seen = append(*seen, r.Method+" "+r.RequestURI+" "+r.Header.Get("Authorization")+" "+r.Proto)
		mu.Unlock()
		w.Header().Set("X-Echo", r.Header.Get("Authorization"))
		fmt.Fprintf(w, "you sent %s to %s", r.Header.Get("Authorization"), r.URL.Path)
	})
}

func TestInterceptSwapsAndScrubsOverConnect(t *testing.T) {
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprintf("h2=%v", h2), func(t *testing.T) {
			e, ica := interceptEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"],"intercept":["api.example.com"]}`, interceptRules)
			var mu sync.Mutex
			var seen []string
			e.upstream("api.example.com", echoAuth(&seen, &mu))
			ph := transforms.PlaceholderPrefix + "CANARY_KEY"
			cl := e.interceptClient(e.trusting(ica), h2)
			for i := range 2 { // the second on the same connection
				req, _ := http.NewRequest("POST", "https://api.example.com/v1/x?q=1", strings.NewReader("{}"))
				req.Header.Set("Authorization", ph)
				resp, err := cl.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				if wantMajor := map[bool]int{false: 1, true: 2}[h2]; resp.ProtoMajor != wantMajor {
					t.Errorf("the sandbox spoke HTTP/%d, want %d", resp.ProtoMajor, wantMajor)
				}
				if got, want := body(t, resp), "you sent "+ph+" to /v1/x"; got != want {
					t.Errorf("request %d: got %q, want %q (the echo scrubbed)", i, got, want)
				}
				if resp.TLS == nil || resp.TLS.PeerCertificates[0].Issuer.CommonName != ica.Certificate().Subject.CommonName {
					t.Errorf("the sandbox did not get the interception CA's certificate")
				}
			}
			cl.CloseIdleConnections()
			mu.Lock()
			for _, s := range seen {
				if !strings.Contains(s, " "+canary+" ") || strings.Contains(s, ph) || !strings.HasPrefix(s, "POST /v1/x?q=1") {
					t.Errorf("upstream got %q, want the real credential", s)
				}
			}
			if len(seen) != 2 {
				t.Errorf("upstream saw %d requests, want 2", len(seen))
			}
			mu.Unlock()
			reqs := e.eventsOf(audit.Intercept, 2)
			for _, ev := range reqs {
				if !ev.Allow || ev.Status != 200 || ev.Path != "/v1/x" || ev.InterceptRule != "api.example.com" || len(ev.Transforms) == 0 {
					t.Errorf("request event = %+v", ev)
				}
			}
			conn := e.eventsOf(audit.Connect, 1)[0]
			if !conn.Allow || conn.InterceptRule != "api.example.com" || conn.BytesIn == 0 || conn.Addr != "" {
				t.Errorf("connection event = %+v", conn)
			}
		})
	}
}

func TestHostNotInterceptedIsTunnelledAsItIs(t *testing.T) {
	e, ica := interceptEnv(t, `{"mode":"custom","allowedHosts":["api.example.com","other.example.com"],"intercept":["api.example.com"]}`, interceptRules)
	var mu sync.Mutex
	var seen []string
	srv := e.upstream("other.example.com", echoAuth(&seen, &mu))
	ph := transforms.PlaceholderPrefix + "CANARY_KEY"
	req, _ := http.NewRequest("GET", "https://other.example.com/x", nil)
	req.Header.Set("Authorization", ph)
	resp, err := e.interceptClient(e.trusting(ica), false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body(t, resp)
	if got, want := resp.TLS.PeerCertificates[0].Raw, srv.TLS.Certificates[0].Certificate[0]; string(got) != string(want) {
		t.Errorf("the sandbox did not get the upstream's own certificate through a tunnel that is not intercepted")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 1 || !strings.Contains(seen[0], ph) {
		t.Errorf("upstream got %q: the placeholder, untouched, was expected", seen)
	}
}

func TestPinningClientFailsWithAReason(t *testing.T) {
	e, _ := interceptEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"],"intercept":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(hello))
	// Trusts the upstream's CA alone: as a client pinning the real
	// certificate would, it refuses sandgate's.
	_, err := e.interceptClient(e.ca.Pool, false).Get("https://api.example.com/")
	if err == nil {
		t.Fatal("a client that does not trust the interception CA got an answer")
	}
	ev := e.eventsOf(audit.Connect, 1)[0]
	if ev.Code != audit.CodeInterceptRefused || !strings.Contains(ev.Error, "refused sandgate's certificate for api.example.com") ||
		!strings.Contains(ev.Error, "pins certificates") || ev.InterceptRule != "api.example.com" {
		t.Errorf("event = %+v", ev)
	}
}

func TestInterceptedConnectionCarriesOneHostOnly(t *testing.T) {
	e, ica := interceptEnv(t, `{"mode":"custom","allowedHosts":["api.example.com","other.example.com"],"intercept":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(hello))
	c, br := e.dial()
	io.WriteString(c, "CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != 200 {
		t.Fatalf("tunnel: %v %v", resp, err)
	}
	tc := tls.Client(&bufferedConn{Conn: c, r: br}, &tls.Config{ServerName: "api.example.com", RootCAs: e.trusting(ica)})
	io.WriteString(tc, "GET /x HTTP/1.1\r\nHost: other.example.com\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != http.StatusMisdirectedRequest || !strings.Contains(b, "opened for api.example.com") {
		t.Errorf("got %d %q, want 421", resp.StatusCode, b)
	}
	if ev := e.eventsOf(audit.Intercept, 1)[0]; ev.Code != audit.CodeMisdirected || ev.Allow {
		t.Errorf("event = %+v", ev)
	}
}

func TestInterceptRefusesASecondNameInTheHello(t *testing.T) {
	e, ica := interceptEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"],"intercept":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(hello))
	c, br := e.dial()
	io.WriteString(c, "CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != 200 {
		t.Fatalf("tunnel: %v %v", resp, err)
	}
	tc := tls.Client(&bufferedConn{Conn: c, r: br}, &tls.Config{ServerName: "other.example.org", RootCAs: e.trusting(ica)})
	if err := tc.Handshake(); err == nil {
		t.Error("a ClientHello for another name was intercepted")
	}
	if ev := e.eventsOf(audit.Connect, 1)[0]; ev.Allow || ev.Code != CodeSNIMismatch {
		t.Errorf("event = %+v", ev)
	}
}

func TestInterceptWithoutCAIsRefused(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"],"intercept":["api.example.com"]}`, "")
	e.upstream("api.example.com", http.HandlerFunc(hello))
	resp := e.raw("CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
	if b := body(t, resp); resp.StatusCode != 403 || !strings.Contains(b, "no interception CA") {
		t.Errorf("got %d %q", resp.StatusCode, b)
	}
	if ev := e.eventsOf(audit.Connect, 1)[0]; ev.Allow || ev.Code != CodeNoCA {
		t.Errorf("event = %+v", ev)
	}
}

func TestInterceptedWebSocketPassesTheRequestPass(t *testing.T) {
	rules := `[{"match":{"host":"creds.example.com"},"transform":{"headers":{"authorization":{"env":"CANARY_KEY"}}}}]`
	e, ica := interceptEnv(t, `{"mode":"custom","allowedHosts":["ws.example.com","creds.example.com"],"intercept":["ws.example.com","creds.example.com"]}`, rules)
	upgrades := func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" || r.Header.Get("X-Pass") != "1" {
			http.Error(w, "want an upgrade", 400)
			return
		}
		c, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		rw.Flush()
		line, _ := rw.ReadString('\n')
		rw.WriteString("echo " + line)
		rw.Flush()
	}
	e.upstream("ws.example.com", http.HandlerFunc(upgrades))
	e.upstream("creds.example.com", http.HandlerFunc(upgrades))
	open := func(host string) (*tls.Conn, *bufio.Reader) {
		c, br := e.dial()
		io.WriteString(c, "CONNECT "+host+":443 HTTP/1.1\r\n\r\n")
		if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != 200 {
			t.Fatalf("tunnel: %v %v", resp, err)
		}
		tc := tls.Client(&bufferedConn{Conn: c, r: br}, &tls.Config{ServerName: host, RootCAs: e.trusting(ica), NextProtos: []string{"http/1.1"}})
		io.WriteString(tc, "GET /socket HTTP/1.1\r\nHost: "+host+"\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nX-Pass: 1\r\n\r\n")
		return tc, bufio.NewReader(tc)
	}
	tc, tbr := open("ws.example.com")
	resp, err := http.ReadResponse(tbr, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols || resp.Header.Get("Upgrade") != "websocket" {
		t.Fatalf("switch: %v %v", resp, err)
	}
	io.WriteString(tc, "ping\n")
	if line, err := tbr.ReadString('\n'); err != nil || line != "echo ping\n" {
		t.Errorf("after the switch got %q, %v", line, err)
	}
	tc.Close()
	if ev := e.eventsOf(audit.Intercept, 1)[0]; ev.Status != 101 || !ev.Allow || ev.BytesIn == 0 {
		t.Errorf("event = %+v", ev)
	}
	// A host a credential rule targets: what comes back after a switch
	// could not be scrubbed, so there is no switch.
	_, tbr = open("creds.example.com")
	resp, err = http.ReadResponse(tbr, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 403 || !strings.Contains(b, "could not be scrubbed") {
		t.Errorf("got %d %q", resp.StatusCode, b)
	}
}

// captured connects to a listener the test owns and hands the accepted
// connection to ServeCaptured as a connection to host:port; it returns the
// client's end.
func (e *env) captured(host string, port int) net.Conn {
	e.t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		e.t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		e.t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	go e.proxy.ServeCaptured(context.Background(), s, e.tenant, host, port, Peer{})
	return c
}

func TestCapturedConnectionsAreJudgedAsConnect(t *testing.T) {
	e, ica := interceptEnv(t, `{"mode":"custom","allowedHosts":["api.example.com","plain.example.com"],"intercept":["api.example.com"]}`, interceptRules)
	var mu sync.Mutex
	var seen []string
	e.upstream("api.example.com", echoAuth(&seen, &mu))
	e.upstream("plain.example.com", http.HandlerFunc(hello))
	pool := e.trusting(ica)
	get := func(host, path string, hdr string) (*http.Response, error) {
		tc := tls.Client(e.captured(host, 443), &tls.Config{ServerName: host, RootCAs: pool, NextProtos: []string{"http/1.1"}})
		fmt.Fprintf(tc, "GET %s HTTP/1.1\r\nHost: %s\r\n%s\r\n", path, host, hdr)
		return http.ReadResponse(bufio.NewReader(tc), nil)
	}
	resp, err := get("plain.example.com", "/p", "")
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); b != "hello GET /p" {
		t.Errorf("captured tunnel got %q", b)
	}
	ph := transforms.PlaceholderPrefix + "CANARY_KEY"
	resp, err = get("api.example.com", "/v1", "Authorization: "+ph+"\r\n")
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); b != "you sent "+ph+" to /v1" {
		t.Errorf("captured and intercepted got %q", b)
	}
	mu.Lock()
	if len(seen) != 1 || !strings.Contains(seen[0], canary) {
		t.Errorf("upstream got %q", seen)
	}
	mu.Unlock()
	// Refusals: the connection closes, and the event says why.
	for _, tt := range []struct {
		host string
		port int
		code string
	}{{"nope.example.com", 443, "no_rule"}, {"plain.example.com", 22, "port"}} {
		c := e.captured(tt.host, tt.port)
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Errorf("%s:%d: a refused captured connection was answered", tt.host, tt.port)
		}
		found := false
		for _, ev := range e.eventsOf(audit.Capture, 1) {
			if ev.Host == tt.host && ev.Port == tt.port && !ev.Allow && ev.Code == tt.code && ev.Reason != "" {
				found = true
			}
		}
		if !found {
			t.Errorf("no capture event refusing %s:%d with %s: %+v", tt.host, tt.port, tt.code, e.rings.Events(e.tenant.ID()))
		}
	}
}
