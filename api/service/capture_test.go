package service_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// noProxy runs a command without the proxy variables every command has.
const noProxy = "env -u HTTPS_PROXY -u https_proxy -u HTTP_PROXY -u http_proxy -u NODE_USE_ENV_PROXY "

// put writes data into the sandbox at path, mode perm.
func (r *rig) put(name, path string, data []byte, perm os.FileMode) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := r.m.WriteFile(ctx, name, path, bytes.NewReader(data)); err != nil {
		r.t.Fatal(err)
	}
	if res := r.exec(name, fmt.Sprintf("chmod %o %s", perm, path), nil); res.exit != 0 {
		r.t.Fatalf("chmod %s: %+v", path, res)
	}
}

// netprobe puts internal/testkit/netprobe (a program with its own DNS query
// and HTTP transport) in the sandbox, and the upstream's CA beside it.
func (r *rig) netprobe(name string) {
	r.t.Helper()
	bin, err := os.ReadFile(gobuild.Static(r.t, "github.com/sandgate/sandgate/internal/testkit/netprobe"))
	if err != nil {
		r.t.Fatal(err)
	}
	r.put(name, "/usr/local/bin/netprobe", bin, 0o755)
	r.put(name, "/tmp/upstream-ca.pem", r.ca.PEM, 0o644)
}

// eventsWith waits (bounded) for an audit event of the sandbox that ok
// accepts, and returns it.
func (r *rig) eventWith(name string, what string, ok func(audit.Event) bool) audit.Event {
	r.t.Helper()
	var evs []audit.Event
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		evs = r.audit(name, "?limit=10000").Events
		for _, e := range evs {
			if ok(e) {
				return e
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	r.t.Fatalf("no audit event %s; have %+v", what, evs)
	return audit.Event{}
}

// hasNode reports whether node runs in the sandbox.
func (r *rig) hasNode(name string) bool {
	return r.exec(name, "node --version", nil).exit == 0
}

// TestCaptureWithoutProxyVariables: programs that ignore the proxy
// variables (a Go program with its own transport and its own DNS query,
// Node's fetch) reach an allowed host, and are refused a host the policy
// refuses, both audited with the reason, as CONNECT through the variables
// is.
func TestCaptureWithoutProxyVariables(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", map[string]any{"allowedHosts": []string{"api.example.com"}})
	r.netprobe("box")

	res := r.exec("box", noProxy+"netprobe -ca /tmp/upstream-ca.pem -lookup api.example.com -get https://api.example.com/go", nil)
	if res.exit != 0 || !strings.Contains(res.stdout, "lookup api.example.com NOERROR 198.1") || !strings.Contains(res.stdout, "get 200 path=/go") {
		t.Fatalf("a Go program with its own transport: %+v", res)
	}
	res = r.exec("box", noProxy+"netprobe -ca /tmp/upstream-ca.pem -get https://refused.example.org/x", nil)
	if res.exit == 0 || !strings.Contains(res.stdout, "get error") {
		t.Errorf("a refused host answered: %+v", res)
	}
	allowed := r.eventWith("box", "capture allow api.example.com", func(e audit.Event) bool {
		return e.Kind == audit.Capture && e.Host == "api.example.com" && e.Allow && e.Port == 443 && e.BytesIn > 0
	})
	if allowed.Code != "allowed_host" || allowed.Addr == "" {
		t.Errorf("captured event = %+v", allowed)
	}
	refused := r.eventWith("box", "capture deny refused.example.org", func(e audit.Event) bool {
		return e.Kind == audit.Capture && e.Host == "refused.example.org" && !e.Allow
	})
	// The same connection through the proxy variables: the same decision.
	res = r.exec("box", "curl -sS https://refused.example.org/x", nil)
	if res.exit == 0 {
		t.Errorf("curl through the proxy reached a refused host: %+v", res)
	}
	viaProxy := r.eventWith("box", "connect deny refused.example.org", func(e audit.Event) bool {
		return e.Kind == audit.Connect && e.Host == "refused.example.org"
	})
	if refused.Code != "no_rule" || refused.Code != viaProxy.Code || refused.Reason != viaProxy.Reason || refused.Rule != viaProxy.Rule {
		t.Errorf("captured refusal %q %q, through the proxy %q %q: want the same decision", refused.Code, refused.Reason, viaProxy.Code, viaProxy.Reason)
	}
	// Any port is captured, and judged: CONNECT allows 443 only.
	r.exec("box", noProxy+"netprobe -get https://api.example.com:8443/", nil)
	r.eventWith("box", "capture deny port 8443", func(e audit.Event) bool {
		return e.Kind == audit.Capture && e.Port == 8443 && !e.Allow && e.Code == "port"
	})

	if !r.hasNode("box") {
		t.Log("node is not installed here: the Go program above stands for it")
		return
	}
	fetch := func(url string) execResult {
		js := `fetch(process.argv[1]).then(r => r.text()).then(t => console.log("ok " + t), e => { console.log("err " + (e.cause && e.cause.code || e)); process.exit(1) })`
		return r.exec("box", noProxy+"NODE_EXTRA_CA_CERTS=/tmp/upstream-ca.pem node -e '"+js+"' "+url, nil)
	}
	if res := fetch("https://api.example.com/node"); res.exit != 0 || strings.TrimSpace(res.stdout) != "ok path=/node auth= key=" {
		t.Errorf("node fetch: %+v", res)
	}
	if res := fetch("https://refused2.example.org/"); res.exit == 0 || !strings.HasPrefix(res.stdout, "err ") {
		t.Errorf("node fetch of a refused host: %+v", res)
	}
	r.eventWith("box", "capture deny refused2.example.org", func(e audit.Event) bool {
		return e.Kind == audit.Capture && e.Host == "refused2.example.org" && !e.Allow && e.Code == "no_rule"
	})
}

// TestInterceptInASandbox: a host the policy intercepts gets the chain of
// a base-URL route over CONNECT (curl through the proxy variables) and
// when captured (curl told not to use a proxy, Node's fetch): the
// placeholder is swapped for the credential, its echo scrubbed, a module
// refuses a path; a client that trusts only the real CA fails with an
// audited reason.
func TestInterceptInASandbox(t *testing.T) {
	rt, err := wasm.NewRuntime(context.Background(), wasm.Config{CacheDir: gobuild.WasmCache(t), CallTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close(context.Background()) })
	r := newRigOn(t, stacktest.Config{Modules: rt}, nil)
	r.create("box", nil)
	r.must(204, "PUT", "/v1/sandboxes/box/network", map[string]any{"policy": map[string]any{
		"mode": "custom", "allowedHosts": []string{"api.example.com"}, "intercept": []string{"api.example.com"}}})
	ph := "aisdkhc_placeholder_0123456789"
	r.must(204, "POST", "/v1/sandboxes/box/transformations", map[string]any{"transformations": []any{map[string]any{
		"match":     map[string]any{"host": "api.example.com", "headers": []any{map[string]any{"key": map[string]string{"exact": "authorization"}, "value": map[string]string{"exact": "Bearer " + ph}}}},
		"transform": map[string]any{"headers": map[string]string{"authorization": "Bearer " + r.canary}},
	}}})
	mod, err := os.ReadFile(gobuild.Wasm(t, "github.com/sandgate/sandgate/wasm-examples/deny-path"))
	if err != nil {
		t.Fatal(err)
	}
	r.must(204, "PUT", "/v1/sandboxes/box/modules", map[string]any{"modules": []any{map[string]string{
		"name": "deny-path", "wasm": base64.StdEncoding.EncodeToString(mod), "config": "^/secret"}}})
	r.netprobe("box")

	want := "path=/v1/x auth=Bearer " + ph + " key="
	for _, how := range []string{"", "--noproxy '*' "} { // CONNECT, then captured
		seen := len(r.upstreamSeen())
		res := r.exec("box", "curl -sS "+how+`-H "Authorization: Bearer `+ph+`" https://api.example.com/v1/x`, nil)
		if res.exit != 0 || res.stdout != want {
			t.Errorf("curl %s: %+v; want the echo with the credential scrubbed back to its placeholder", how, res)
		}
		if s := r.upstreamSeen(); len(s) != seen+1 || s[len(s)-1].Get("Authorization") != "Bearer "+r.canary {
			t.Errorf("curl %s: the upstream did not get the credential", how)
		}
		res = r.exec("box", "curl -sS -o /dev/null -w '%{http_code}' "+how+"https://api.example.com/secret", nil)
		if res.stdout != "403" {
			t.Errorf("curl %s of a path the module refuses: %+v", how, res)
		}
	}
	r.eventWith("box", "intercept refused by the module", func(e audit.Event) bool {
		return e.Kind == audit.Intercept && e.Path == "/secret" && e.Code == "module_refused" && e.Module == "deny-path"
	})
	r.eventWith("box", "captured and intercepted", func(e audit.Event) bool {
		return e.Kind == audit.Capture && e.InterceptRule == "api.example.com" && e.Allow
	})
	if r.hasNode("box") {
		// Node 20's fetch ignores the proxy variables: captured, and it
		// trusts the CA through NODE_EXTRA_CA_CERTS, which every command has.
		js := `fetch("https://api.example.com/v1/x", {headers: {"authorization": "Bearer ` + ph + `"}}).then(r => r.text()).then(t => console.log(t), e => { console.log("err " + (e.cause && e.cause.code || e)); process.exit(1) })`
		if res := r.exec("box", noProxy+"node -e '"+js+"'", nil); res.exit != 0 || strings.TrimSpace(res.stdout) != want {
			t.Errorf("node fetch of an intercepted host: %+v", res)
		}
	}
	// A client that pins (trusts only the upstream's own CA).
	res := r.exec("box", noProxy+"netprobe -ca /tmp/upstream-ca.pem -get https://api.example.com/pinned", nil)
	if res.exit == 0 {
		t.Errorf("a pinning client got through: %+v", res)
	}
	ev := r.eventWith("box", "intercept_refused", func(e audit.Event) bool { return e.Code == audit.CodeInterceptRefused })
	if !strings.Contains(ev.Error, "pins certificates") {
		t.Errorf("event = %+v", ev)
	}
}

// TestLookupsWithoutCaptureFailAtOnceAndAreAudited: where nothing is
// captured (here turned off; on Google's CLI, whose link passes no
// sockets), a lookup in the sandbox gets NXDOMAIN at once, not a timeout,
// and the audit says a direct connection was attempted, not one through
// the proxy.
func TestLookupsWithoutCaptureFailAtOnceAndAreAudited(t *testing.T) {
	r := newRigOn(t, stacktest.Config{NoCapture: true}, nil)
	r.create("box", map[string]any{"allowedHosts": []string{"api.example.com"}})
	r.netprobe("box")
	res := r.exec("box", noProxy+"netprobe -lookup api.example.com", nil)
	if res.exit == 0 || !strings.Contains(res.stdout, "lookup api.example.com NXDOMAIN") {
		t.Errorf("a lookup without capture: %+v; want NXDOMAIN (an answer, not a timeout)", res)
	}
	if res := r.exec("box", "getent hosts direct.example.org", nil); res.exit == 0 {
		t.Errorf("getent resolved a name: %+v", res)
	}
	for _, name := range []string{"api.example.com", "direct.example.org"} {
		ev := r.eventWith("box", "dns "+name, func(e audit.Event) bool { return e.Kind == audit.DNS && e.Host == name })
		if ev.Allow || ev.Code != audit.CodeDirectLookup || !strings.Contains(ev.Reason, "through the proxy") {
			t.Errorf("event = %+v", ev)
		}
	}
	// The proxy variables still work as before.
	if res := r.exec("box", "curl -sS https://api.example.com/v1 --cacert /tmp/upstream-ca.pem", nil); res.exit != 0 || !strings.HasPrefix(res.stdout, "path=/v1") {
		t.Errorf("curl through the proxy: %+v", res)
	}
}

// TestInterceptCAKeyInNoArtifact: the interception CA's key (kept in a
// directory of the service's, as SANDGATE_INTERCEPT_CA does) is in no
// file a sandbox has or can read, in no snapshot or template object, in
// no log and no audit event, after the sandbox used interception and
// capture, was suspended, resumed and made a template. Its certificate
// is found where it must be, so the search reaches those places.
func TestInterceptCAKeyInNoArtifact(t *testing.T) {
	keyDir := t.TempDir()
	ica, err := ca.Open(keyDir)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(keyDir, ca.KeyFile))
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(keyPEM)
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	d := k.(*ecdsa.PrivateKey).D
	needles := map[string][]byte{
		"the key's PEM": bytes.TrimSpace(keyPEM), "the key's DER": blk.Bytes,
		"the private scalar": d.FillBytes(make([]byte, 32)), "the scalar in hex": []byte(hex.EncodeToString(d.FillBytes(make([]byte, 32)))),
		"the scalar in decimal": []byte(d.String()),
	}
	for _, line := range strings.Split(string(keyPEM), "\n") {
		if len(line) >= 40 && !strings.HasPrefix(line, "-----") {
			needles["a line of the key's PEM"] = []byte(line)
		}
	}
	search := func(where string, b []byte) {
		for what, n := range needles {
			if bytes.Contains(b, n) {
				t.Errorf("%s is in %s", what, where)
			}
		}
	}

	r := newRigOn(t, stacktest.Config{InterceptCA: ica}, nil)
	r.create("box", nil)
	r.must(204, "PUT", "/v1/sandboxes/box/network", map[string]any{"policy": map[string]any{
		"mode": "custom", "allowedHosts": []string{"api.example.com"}, "intercept": []string{"api.example.com"}}})
	r.netprobe("box")
	for _, cmd := range []string{"curl -sS https://api.example.com/a", "curl -sS --noproxy '*' https://api.example.com/b",
		noProxy + "netprobe -ca /tmp/upstream-ca.pem -get https://api.example.com/pinned", "echo work > /workspace/w"} {
		r.exec("box", cmd, nil)
	}
	r.eventWith("box", "an intercepted request", func(e audit.Event) bool { return e.Kind == audit.Intercept && e.Status == 200 })
	// Everything the sandbox sees outside the host's programs: its /etc,
	// its own directories, /tmp, every process's environment (what it
	// wrote anywhere, /usr included, is in its layer: the store's objects
	// below).
	dump := r.exec("box", `tar -cf - /etc /root /home /workspace /var /run /opt /srv /tmp 2>/dev/null; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do cat "$f"; done 2>/dev/null`, nil)
	t.Logf("dump %d bytes", len(dump.stdout))
	if !strings.Contains(dump.stdout, strings.TrimSpace(string(ica.CertPEM()))) {
		t.Error("the dump of the sandbox lacks the CA's certificate: the search does not reach its trust")
	}
	search("the sandbox", []byte(dump.stdout))
	r.must(204, "POST", "/v1/sandboxes/box/template", map[string]any{"id": "t1"})
	r.must(204, "POST", "/v1/sandboxes/box/suspend", nil)
	r.must(200, "POST", "/v1/sandboxes/box/resume", map[string]any{})
	objects := 0
	if err := stacktest.StoreObjects(r.stack.StoreDir, func(name string, b []byte) {
		objects++
		search("the store's "+name, b)
	}); err != nil {
		t.Fatal(err)
	}
	if objects < 2 {
		t.Errorf("the store holds %d objects: the snapshot and the template were to be searched", objects)
	}
	for _, dir := range []string{r.stack.StateDir, r.stack.WorkDir, filepath.Dir(r.stack.StateDir)} {
		filepath.WalkDir(dir, func(p string, de os.DirEntry, err error) error {
			if err == nil && de.Type().IsRegular() && !strings.HasPrefix(p, keyDir) {
				if b, err := os.ReadFile(p); err == nil {
					search(p, b)
				}
			}
			return nil
		})
	}
	search("the service's log and audit log", []byte(r.log.String()))
	for _, raw := range r.audit("box", "?limit=10000").Raw {
		search("an audit event", raw)
	}
}
