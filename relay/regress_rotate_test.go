// Regression tests from an attack run: a rotated credential, handed back.

package relay

import (
	"crypto/tls"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
)

// TestRotatedKeyStaysScrubbed: after the sandbox's rules were replaced,
// with a new secret or with none, an upstream that kept the earlier key
// handed it to the sandbox in clear. It is masked now, on the route and
// inside an intercepted tunnel, and a tunnel to its host is still carried
// only where it is scrubbed.
func TestRotatedKeyStaysScrubbed(t *testing.T) {
	const policy = `{"mode":"custom","allowedHosts":["api.example.com"]}`
	newRules, err := transforms.ParseRules([]byte(credHostRules), func(string) (string, bool) { return "sk-rotated-Zq8Wc3Lp6Yt1Bn4Mx", true })
	if err != nil {
		t.Fatal(err)
	}
	mask := strings.Repeat(string(transforms.PartialMask), len(canary))
	for _, next := range []struct {
		name  string
		rules []transforms.Rule
	}{{"a new key", newRules}, {"no rules", nil}} {
		t.Run(next.name, func(t *testing.T) {
			e, ica := interceptEnv(t, policy, credHostRules)
			e.upstream("api.example.com", &keptKey{first: true})
			plant(t, e)
			e.tenant.Transforms().Set(next.rules...)

			resp, err := e.routeClient().Get(e.routeURL("api.example.com/echo"))
			if err != nil {
				t.Fatal(err)
			}
			if b := body(t, resp); b != "the key I hold: "+mask {
				t.Errorf("through the route: %q, want the earlier key masked", b)
			}
			cl := e.interceptClient(e.trusting(ica), true)
			resp, err = cl.Get("https://api.example.com/echo")
			if err != nil {
				t.Fatal(err)
			}
			if b := body(t, resp); b != "the key I hold: "+mask {
				t.Errorf("through CONNECT: %q, want the earlier key masked", b)
			}
			cl.CloseIdleConnections()
			if ev := e.eventsOf(audit.Connect, 1)[0]; !strings.HasPrefix(ev.InterceptRule, CredentialInterceptPrefix) {
				t.Errorf("CONNECT event = %+v, want it intercepted", ev)
			}
		})
	}
	t.Run("no CA", func(t *testing.T) {
		e := newEnv(t, policy, credHostRules)
		e.upstream("api.example.com", &keptKey{first: true})
		plant(t, e)
		e.tenant.Transforms().Set()
		tc := tls.Client(e.captured("api.example.com", 443), &tls.Config{ServerName: "api.example.com", RootCAs: e.ca.Pool})
		if got, err := getOver(t, tc, "api.example.com"); err == nil {
			t.Errorf("a captured connection carried %q; want it refused", got)
		}
		if ev := e.eventsOf(audit.Capture, 1)[0]; ev.Allow || ev.Code != CodeCredentialHost || !strings.Contains(ev.Reason, "held credential CANARY_KEY (api.example.com)") {
			t.Errorf("capture event = %+v", ev)
		}
	})
}

// A host a held credential targets that this service cannot unseal is
// refused on every path: its answers could not be scrubbed of it.
func TestSealedElsewhereHostRefused(t *testing.T) {
	e, _ := interceptEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	e.upstream("api.example.com", &keptKey{})
	theirs, _ := transforms.NewSealKey([]byte("the seal key of another service, 32+"))
	ours, _ := transforms.NewSealKey([]byte("this service's own seal key, 32 bytes+"))
	held, _ := transforms.ParseRules([]byte(credHostRules), func(string) (string, bool) { return canary, true })
	sealed := transforms.NewRuleSet(held...).Seal(theirs, e.tenant.ID())
	if err := e.tenant.Transforms().Unseal(ours, e.tenant.ID(), sealed); !errors.Is(err, transforms.ErrSealed) {
		t.Fatalf("Unseal: %v", err)
	}
	resp, err := e.routeClient().Get(e.routeURL("api.example.com/echo"))
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != http.StatusForbidden || !strings.Contains(b, CodeSealedCredential) || !strings.Contains(b, "SANDGATE_SEAL_KEY") {
		t.Errorf("route: %d %q", resp.StatusCode, b)
	}
	if ev := e.eventsOf(audit.Route, 1)[0]; ev.Allow || ev.Code != CodeSealedCredential || ev.Status != http.StatusForbidden {
		t.Errorf("route event = %+v, want a deny", ev)
	}
	r := e.raw("CONNECT api.example.com:443 HTTP/1.1\r\n\r\n")
	if b := body(t, r); r.StatusCode != http.StatusForbidden || !strings.Contains(b, CodeSealedCredential) {
		t.Errorf("CONNECT: %d %q", r.StatusCode, b)
	}
}
