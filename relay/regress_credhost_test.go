// Regression tests from an attack run: a host of a credential rule,
// reached around the scrub.

package relay

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/tlstest"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/transforms"
)

// keptKey is an upstream that keeps the credential it was last sent and
// hands it to whoever asks, as an API that echoes what it holds does.
type keptKey struct {
	mu    sync.Mutex
	first bool // keep the first key it was sent, not the last
	last  string
}

func (k *keptKey) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if v := r.Header.Get("X-Api-Key"); v != "" && (!k.first || k.last == "") {
		k.last = v
	}
	fmt.Fprintf(w, "the key I hold: %s", k.last)
}

// credHostRules sends the canary to api.example.com as X-Api-Key.
const credHostRules = `[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`

// plant sends the key to api.example.com through the base-URL route, as
// the sandbox's own requests do, and checks that the route's answer is
// scrubbed.
func plant(t *testing.T, e *env) {
	t.Helper()
	resp, err := e.routeClient().Get(e.routeURL("api.example.com/v1/x"))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); b != "the key I hold: "+transforms.PlaceholderPrefix+"CANARY_KEY" {
		t.Fatalf("through the route: %q", b)
	}
}

// getOver sends GET /echo over an open TLS-speaking connection to host and
// returns the answer's body, or the error that ended it.
func getOver(t *testing.T, tc *tls.Conn, host string) (string, error) {
	t.Helper()
	fmt.Fprintf(tc, "GET /echo HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host)
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		return "", err
	}
	return body(t, resp), nil
}

// TestCredentialHostNotReachedAroundTheScrub: a sandbox with a credential
// rule for a host its policy also allows read the real key back through a
// CONNECT tunnel or a captured connection to that host, where nothing is
// scrubbed (the base-URL route's answer had it scrubbed). Without an
// interception CA such a tunnel is refused now, saying why and what to do;
// with one it is intercepted, so its answers are scrubbed as the route's
// are.
func TestCredentialHostNotReachedAroundTheScrub(t *testing.T) {
	const policy = `{"mode":"custom","allowedHosts":["api.example.com"]}`
	t.Run("no CA", func(t *testing.T) {
		e := newEnv(t, policy, credHostRules)
		e.upstream("api.example.com", &keptKey{})
		plant(t, e)

		// CONNECT, as a client honouring HTTPS_PROXY sends it.
		if resp, err := e.tunnelClient().Get("https://api.example.com/echo"); err == nil {
			b := body(t, resp)
			t.Errorf("a CONNECT tunnel to the credential's host carried its answer, unscrubbed: %q", b)
		}
		resp := e.raw("CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n")
		b := body(t, resp)
		if resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Sandgate-Error") == "" ||
			!strings.Contains(b, "http://127.0.0.1:3128/https/api.example.com/") || !strings.Contains(b, "intercept") || !strings.Contains(b, "("+CodeCredentialHost+")") {
			t.Errorf("CONNECT: %d %q, want a 403 naming the base URL and interception", resp.StatusCode, b)
		}
		for _, ev := range e.eventsOf(audit.Connect, 2) {
			if ev.Allow || ev.Code != CodeCredentialHost || ev.Status != http.StatusForbidden || !strings.Contains(ev.Reason, "rule[0] api.example.com") {
				t.Errorf("CONNECT event = %+v", ev)
			}
		}

		// A captured connection (no proxy variables), served as CONNECT.
		tc := tls.Client(e.captured("api.example.com", 443), &tls.Config{ServerName: "api.example.com", RootCAs: e.ca.Pool})
		if got, err := getOver(t, tc, "api.example.com"); err == nil {
			t.Errorf("a captured connection to the credential's host carried its answer, unscrubbed: %q", got)
		}
		if ev := e.eventsOf(audit.Capture, 1)[0]; ev.Allow || ev.Code != CodeCredentialHost || !strings.Contains(ev.Reason, "base URL") {
			t.Errorf("capture event = %+v", ev)
		}
	})

	t.Run("CA", func(t *testing.T) {
		e, ica := interceptEnv(t, policy, credHostRules)
		e.upstream("api.example.com", &keptKey{})
		plant(t, e)
		want := "the key I hold: " + transforms.PlaceholderPrefix + "CANARY_KEY"
		pool := e.trusting(ica)

		cl := e.interceptClient(pool, false)
		resp, err := cl.Get("https://api.example.com/echo")
		if err != nil {
			t.Fatal(err)
		}
		if b := body(t, resp); b != want {
			t.Errorf("through CONNECT: %q, want %q (intercepted, so scrubbed)", b, want)
		}
		cl.CloseIdleConnections()
		if ev := e.eventsOf(audit.Connect, 1)[0]; !ev.Allow || ev.InterceptRule != "credentials rule[0] api.example.com" {
			t.Errorf("CONNECT event = %+v, want it intercepted under the credential rule", ev)
		}

		tc := tls.Client(e.captured("api.example.com", 443), &tls.Config{ServerName: "api.example.com", RootCAs: pool})
		got, err := getOver(t, tc, "api.example.com")
		if err != nil || got != want {
			t.Errorf("through a captured connection: %q %v, want %q", got, err, want)
		}
		if ev := e.eventsOf(audit.Capture, 1)[0]; !ev.Allow || ev.InterceptRule != "credentials rule[0] api.example.com" {
			t.Errorf("capture event = %+v, want it intercepted under the credential rule", ev)
		}
	})
}

// TestCredentialHostSpellings: every spelling of a host a credential rule
// targets is that host: letter case, a trailing dot, Unicode for a
// punycode rule, any subdomain of a wildcard rule, an address for an
// address rule (never intercepted: no certificate names an address).
func TestCredentialHostSpellings(t *testing.T) {
	for _, tt := range []struct {
		rule, allow, name, connect string
	}{
		{"api.example.com", "api.example.com", "api.example.com", "API.Example.COM"},
		{"api.example.com", "api.example.com", "api.example.com", "api.example.com."},
		{"*.wild.example", "*.wild.example", "deep.sub.wild.example", "Deep.Sub.Wild.Example."},
		{"xn--bcher-kva.example", "xn--bcher-kva.example", "xn--bcher-kva.example", "bücher.example"},
		{"xn--bcher-kva.example", "xn--bcher-kva.example", "xn--bcher-kva.example", "BÜCHER.example."},
	} {
		t.Run(tt.connect, func(t *testing.T) {
			rules := `[{"match":{"host":"` + tt.rule + `"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
			for _, withCA := range []bool{false, true} {
				var opts []envOpt
				ica := mustCA(t)
				if withCA {
					opts = append(opts, func(c *Config) { c.CA = ica })
				}
				e := newEnv(t, `{"mode":"custom","allowedHosts":["`+tt.allow+`"]}`, rules, opts...)
				e.upstream(tt.name, &keptKey{})
				c, br := e.dial()
				fmt.Fprintf(c, "CONNECT %s:443 HTTP/1.1\r\n\r\n", tt.connect)
				resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
				if err != nil {
					t.Fatal(err)
				}
				if !withCA {
					b := body(t, resp)
					if ev := e.eventsOf(audit.Connect, 1)[0]; resp.StatusCode != 403 || ev.Code != CodeCredentialHost {
						t.Errorf("without a CA: %d %q, event %+v; want it refused", resp.StatusCode, b, ev)
					}
					continue
				}
				if resp.StatusCode != 200 {
					t.Errorf("with a CA: %d, want the tunnel intercepted", resp.StatusCode)
					continue
				}
				tc := tls.Client(&bufferedConn{Conn: c, r: br}, &tls.Config{ServerName: tt.name, RootCAs: e.trusting(ica)})
				// Intercepted, the request gets the key too (the rule
				// matches it), and the answer is scrubbed.
				if got, err := getOver(t, tc, tt.name); err != nil || got != "the key I hold: "+transforms.PlaceholderPrefix+"CANARY_KEY" {
					t.Errorf("with a CA: %q %v", got, err)
				}
				tc.Close()
				if ev := e.eventsOf(audit.Connect, 1)[0]; !strings.HasPrefix(ev.InterceptRule, "credentials rule[0] ") {
					t.Errorf("with a CA: event %+v; want it intercepted", ev)
				}
			}
		})
	}
	// An address rule: refused with a CA too (and the address spelled
	// otherwise is that address).
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, credHostRules, func(c *Config) { c.CA = mustCA(t) })
	srv := e.upstream("api.example.com", &keptKey{})
	a := tlstest.Addr(srv)
	rules := `[{"match":{"host":"` + a.String() + `"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
	e2 := newEnv(t, `{"mode":"custom","allowedCIDRs":["`+a.String()+`/32"]}`, rules, func(c *Config) { c.CA = mustCA(t) })
	e2.decider.AllowPrivate = e.decider.AllowPrivate
	for _, spelled := range []string{a.String(), "[::ffff:" + a.String() + "]"} {
		resp := e2.raw("CONNECT " + spelled + ":443 HTTP/1.1\r\n\r\n")
		b := body(t, resp)
		// The mapped spelling may be refused as the address class it is
		// first; it must not be carried.
		if resp.StatusCode != 403 || spelled == a.String() && !strings.Contains(b, CodeCredentialHost) {
			t.Errorf("CONNECT %s with an address rule: %d %q, want it refused", spelled, resp.StatusCode, b)
		}
	}
}

// mustCA is an interception CA.
func mustCA(t *testing.T) *ca.Authority {
	t.Helper()
	ica, err := ca.New()
	if err != nil {
		t.Fatal(err)
	}
	return ica
}
