package service_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestProtocol1AsItsClientUsesIt covers what the reference client of
// protocol 1 tripped on: an http base URL (forwarded to an address the
// operator opened, refused at another), a single-label host rule, a base
// URL with a port of its own, and the refusal texts its tests match.
func TestProtocol1AsItsClientUsesIt(t *testing.T) {
	r := newRig(t, nil)
	// A plain HTTP upstream on the address the stack opened (as
	// SANDBOX_ALLOW_PRIVATE_NETWORK opens private ones), on a port of its
	// own, and one on an address nobody opened.
	serve := func(addr string) string {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			fmt.Fprintf(w, "plain %s host=%s", req.URL.Path, req.Host)
		}))
		srv.Listener.Close()
		srv.Listener = ln
		srv.Start()
		t.Cleanup(srv.Close)
		_, port, _ := net.SplitHostPort(ln.Addr().String())
		return port
	}
	opened := serve(net.JoinHostPort(r.stack.UpstreamAddr.String(), "0"))
	closed := serve("127.0.0.1:0")
	r.create("p1", map[string]any{
		"allowedHosts": []string{"localhost", "intranet"},
		"baseUrls": map[string]string{
			"MODEL_BASE_URL": "http://api.example.com:" + opened + "/api",
			"LOCAL_BASE_URL": "http://127.0.0.1:" + closed + "/api",
		},
	})
	r.must(http.StatusNoContent, "PUT", "/v1/sandboxes/p1/network", map[string]any{"allowedHosts": []string{"localhost", "corp-server"}})
	res := r.exec("p1", `echo "route=$MODEL_BASE_URL"
echo "opened=$(curl -sS "$MODEL_BASE_URL/v1")"
echo "closed=$(curl -sS "$LOCAL_BASE_URL/v1")"
echo "notaroute=$(curl -sS -o /dev/null -w '%{http_code}' "$HTTP_PROXY/not-a-route")"
echo "connect=$(curl -sS -w ' %{http_code}' -X CONNECT --request-target 10.0.0.1:443 "$HTTPS_PROXY" | tr '\n' ' ')"`, nil)
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(res.stdout), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok {
			got[k] = v
		}
	}
	if res.exit != 0 {
		t.Fatalf("exit %d: %q %q", res.exit, res.stdout, res.stderr)
	}
	if !strings.HasSuffix(got["route"], "/http/api.example.com:"+opened+"/api") {
		t.Errorf("the http base URL's route: %q", got["route"])
	}
	if got["opened"] != "plain /api/v1 host=api.example.com:"+opened {
		t.Errorf("an http base URL at an opened address: %q; want it forwarded", got["opened"])
	}
	if !strings.Contains(got["closed"], "127.0.0.1 is not reachable from the sandbox") {
		t.Errorf("an http base URL at an address nobody opened: %q; want the refusal", got["closed"])
	}
	if got["notaroute"] != "403" {
		t.Errorf("$HTTP_PROXY/not-a-route: %q, want 403", got["notaroute"])
	}
	if c := got["connect"]; !strings.Contains(c, "10.0.0.1 is not reachable from the sandbox") || !strings.HasSuffix(c, " 403") {
		t.Errorf("CONNECT to a private address: %q; want 403 saying it is not reachable from the sandbox", c)
	}
	// A base URL carrying credentials cannot be honoured: refused at create.
	code, body, _ := r.do("POST", "/v1/sandboxes", map[string]any{"name": "p2", "baseUrls": map[string]string{"X_BASE_URL": "https://u:p@api.example.com/v1"}})
	if code != http.StatusBadRequest || !strings.Contains(body, "X_BASE_URL") {
		t.Errorf("a base URL with credentials: %d %s; want 400 naming it", code, body)
	}
	// What cannot be a host rule at all is still refused.
	for _, bad := range []string{"a b", "https://api.example.com", "*.*.example.com"} {
		if code, body, _ := r.do("POST", "/v1/sandboxes", map[string]any{"name": "p3", "allowedHosts": []string{bad}}); code != http.StatusBadRequest {
			t.Errorf("allowedHosts [%q]: %d %s; want 400", bad, code, body)
		}
	}
}
