package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

const canary = "sk-canary-cli-Qm3Vx8RtZ2"

func TestPolicyCheck(t *testing.T) {
	d := dnstest.Start(t)
	d.Set("api.example.com", netip.MustParseAddr("93.184.216.34"))
	d.Set("private.example.com", netip.MustParseAddr("10.0.0.5"))
	d.SetRcode("servfail.example.com", dns.RcodeServerFailure)
	dir := t.TempDir()
	pol := filepath.Join(dir, "policy.json")
	os.WriteFile(pol, []byte(`{"mode":"custom","allowedHosts":["private.example.com"]}`), 0o644)
	badPol := filepath.Join(dir, "bad.json")
	os.WriteFile(badPol, []byte(`{"mode":"custom","allowedHost":[]}`), 0o644)
	tests := []struct {
		args []string
		code int
		out  string // stdout, or stderr for exit 2
	}{
		{[]string{"--dns", d.Addr, "--allow", "api.example.com", "api.example.com"}, 0, "allow: api.example.com matched allowed host rule api.example.com (93.184.216.34)\n"},
		{[]string{"--dns", d.Addr, "--allow", "api.example.com", "api.example.com:443"}, 0, "allow: "},
		{[]string{"api.example.com", "--dns", d.Addr, "--allow", "api.example.com"}, 0, "allow: "},
		{[]string{"--dns", d.Addr, "--allow", "api.example.com", "api.example.com:22"}, 3, "deny: port 22 is not allowed: HTTPS (443) only\n"},
		{[]string{"--dns", d.Addr, "other.example.com"}, 3, "deny: no allowedHosts rule matches other.example.com\n"},
		{[]string{"--dns", d.Addr, "--policy", pol, "private.example.com"}, 3, "deny: 10.0.0.5 is not reachable from the sandbox: private.example.com resolves only to private addresses\n"},
		{[]string{"--dns", d.Addr, "2130706433"}, 3, "deny: 127.0.0.1 is not reachable from the sandbox (a loopback address)\n"},
		// A failed lookup is not a refusal: it used to print "deny:" and exit 3.
		{[]string{"--dns", d.Addr, "--allow", "nx.example.com", "nx.example.com"}, 4, "allow by rule, but lookup failed: lookup nx.example.com: no such host (nx.example.com matched allowed host rule nx.example.com)\n"},
		{[]string{"--dns", d.Addr, "--allow", "*.example.com", "servfail.example.com"}, 4, "allow by rule, but lookup failed: lookup servfail.example.com: "},
		{[]string{"--dns", d.Addr, "nx.example.com"}, 3, "deny: no allowedHosts rule matches nx.example.com\n"},
		{[]string{"--dns", d.Addr, "--allow", "*", "x.com"}, 2, "use {\"mode\":\"allow-all\"}"},
		{[]string{"--dns", d.Addr, "--policy", badPol, "x.com"}, 2, `unknown key "allowedHost"`},
		{[]string{"--dns", d.Addr}, 2, "takes one HOST[:PORT]"},
		{[]string{"--dns", d.Addr, "x.com:99999"}, 2, "port"},
		{[]string{"--nope", "x.com"}, 2, "flag provided but not defined"},
	}
	for _, tt := range tests {
		code, out, errOut := runCLI(t, append([]string{"policy", "check"}, tt.args...)...)
		got := out
		if tt.code == 2 {
			got = errOut
		}
		if code != tt.code || !strings.Contains(got, tt.out) {
			t.Errorf("policy check %v = %d, %q / %q; want %d and %q", tt.args, code, out, errOut, tt.code, tt.out)
		}
	}
	t.Setenv("SANDBOX_ALLOWED_HOSTS", "x.example.com, api.example.com")
	if code, out, _ := runCLI(t, "policy", "check", "--dns", d.Addr, "api.example.com"); code != 0 || !strings.HasPrefix(out, "allow:") {
		t.Errorf("SANDBOX_ALLOWED_HOSTS not honoured: %d %q", code, out)
	}
}

func TestMain(m *testing.M) {
	code := m.Run()
	closeRemoteService()
	gobuild.Cleanup()
	os.Exit(code)
}

// binary builds sandgate once for the tests that run it as a process.
func binary(t *testing.T) string {
	t.Helper()
	return gobuild.Sandgate(t)
}

// TestProxyEndToEnd runs `sandgate proxy` as a process with a
// transformation whose secret comes from the environment, sends a routed
// request and a CONNECT through it, and greps every artifact for the secret.
func TestProxyEndToEnd(t *testing.T) {
	t.Parallel() // a process of its own, waiting more than working
	bin := binary(t)
	d := dnstest.Start(t)
	ca := tlstest.MustCA(t)
	var upstreamSaw string
	var mu sync.Mutex
	srv := ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		upstreamSaw = r.Header.Get("X-Api-Key")
		mu.Unlock()
		fmt.Fprintf(w, "key=%s", r.Header.Get("X-Api-Key"))
	}), "api.example.com")
	a := tlstest.Addr(srv)
	d.Set("api.example.com", a)

	dir := t.TempDir()
	caFile, err := ca.WritePEM(dir)
	if err != nil {
		t.Fatal(err)
	}
	rules := filepath.Join(dir, "rules.json")
	os.WriteFile(rules, []byte(`[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"TEST_API_KEY"}}}}]`), 0o600)
	auditLog := filepath.Join(dir, "audit.jsonl")

	cmd := exec.Command(bin, "proxy", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
		"--allow", "api.example.com", "--dns", d.Addr, "--allow-private", a.String()+"/32",
		"--transformations", rules, "--upstream-ca", caFile, "--audit-log", auditLog)
	cmd.Env = append(os.Environ(), "TEST_API_KEY="+canary)
	stderr, _ := cmd.StderrPipe()
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var logs bytes.Buffer
	addrs := make(chan [2]string, 1)
	go func() {
		var proxyAddr, metricsAddr string
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			logs.Write(sc.Bytes())
			logs.WriteByte('\n')
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil {
				switch m["message"] {
				case "proxy listening":
					proxyAddr = m["addr"].(string)
				case "metrics listening":
					metricsAddr = m["addr"].(string)
				}
			}
			if proxyAddr != "" && metricsAddr != "" {
				addrs <- [2]string{proxyAddr, metricsAddr}
				proxyAddr = ""
			}
		}
	}()
	var got [2]string
	select {
	case got = <-addrs:
	case <-time.After(20 * time.Second):
		t.Fatal("proxy did not say it was listening within 20s")
	}
	proxyAddr, metricsAddr := got[0], got[1]

	ph := "sandgate-placeholder-TEST_API_KEY"
	req, _ := http.NewRequest("GET", "http://"+proxyAddr+"/https/api.example.com/v1/models", nil)
	req.Header.Set("X-Api-Key", ph)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "key="+ph {
		t.Errorf("sandbox got %q, want the placeholder back", b)
	}
	mu.Lock()
	if upstreamSaw != canary {
		t.Errorf("upstream saw %q, want the secret", upstreamSaw)
	}
	mu.Unlock()
	resp, err = http.Get("http://" + proxyAddr + "/https/evil.example.com/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 403 {
		t.Errorf("denied host: %d", resp.StatusCode)
	}

	resp, err = http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`sandgate_egress_decisions_total{code="allowed_host",decision="allow",kind="route"} 1`, `sandgate_egress_decisions_total{code="no_rule",decision="deny",kind="route"} 1`, "sandgate_active_tunnels 0"} {
		if !bytes.Contains(mb, []byte(want)) {
			t.Errorf("metrics lack %q", want)
		}
	}

	cmd.Process.Signal(os.Interrupt)
	waitDone := make(chan error, 1)
	go func() { waitDone <- cmd.Wait() }()
	select {
	case err := <-waitDone:
		if err != nil {
			t.Errorf("proxy exited with %v on SIGINT", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("proxy did not stop within 20s of SIGINT")
	}
	auditBytes, err := os.ReadFile(auditLog)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(auditBytes)), "\n")
	if len(lines) != 2 {
		t.Fatalf("audit log has %d lines, want 2:\n%s", len(lines), auditBytes)
	}
	var ev map[string]any
	json.Unmarshal([]byte(lines[0]), &ev)
	for k, want := range map[string]any{"message": "egress", "severity": "INFO", "decision": "allow", "kind": "route", "host": "api.example.com", "path": "/v1/models", "status": 200.0, "addr": a.String() + ":443"} {
		if ev[k] != want {
			t.Errorf("audit event %s = %v, want %v (%s)", k, ev[k], want, lines[0])
		}
	}
	for name, data := range map[string][]byte{"audit log": auditBytes, "stderr": logs.Bytes(), "stdout": stdout.Bytes(), "metrics": mb} {
		if bytes.Contains(data, []byte(canary)) {
			t.Errorf("the canary secret appears in the proxy's %s", name)
		}
	}
	if !bytes.Contains(logs.Bytes(), []byte(`"severity":"WARNING"`)) || !bytes.Contains(logs.Bytes(), []byte("--allow-private")) {
		t.Errorf("no start-up warning for --allow-private:\n%s", logs.Bytes())
	}
}
