package service_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
)

// waitSuspended waits (bounded) until sandbox name is suspended, and
// returns how the service describes it.
func (r *rig) waitSuspended(name string) api.Sandbox {
	r.t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
		var in api.Sandbox
		if code, out, _ := r.do("GET", "/v1/sandboxes/"+name, nil); code == 200 && json.Unmarshal([]byte(out), &in) == nil && in.State == "suspended" {
			return in
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("sandbox %s was not suspended within 2 minutes", name)
		}
	}
}

// An idle-suspended sandbox answered exec with 404 "is suspended (resume
// it)", although the service had suspended it on its own and the deploy
// guide says the next call resumes it. The next call wakes it now, with
// the network it had (a host it was refused stays refused, one it was
// allowed stays allowed), its files and its modules; a sandbox its caller
// suspended stays suspended (404) until resumed.
func TestIdleSuspendedSandboxWakesOnItsNextCall(t *testing.T) {
	r := newRigOn(t, stacktest.Config{Manager: func(mc *appliance.ManagerConfig) { mc.IdleSuspend = time.Second }}, nil)
	r.create("box", map[string]any{"policy": map[string]any{"mode": "custom", "allowedHosts": []string{"api.example.com"}}})
	// What CONNECT answers for each host, as curl sees it: 200 for an
	// allowed host, 403 for one the policy refuses.
	connect := func() string {
		res := r.exec("box", `for h in api.example.com denied.example.com; do printf '%s=%s ' $h "$(curl -sk -o /dev/null -w '%{http_connect}' -x "$HTTPS_PROXY" https://$h/ 2>/dev/null)"; done; cat /workspace/mark`, nil)
		return res.stdout
	}
	r.must(http.StatusNoContent, "PUT", "/v1/sandboxes/box/files/workspace/mark", "kept")
	const want = "api.example.com=200 denied.example.com=403 kept"
	if got := connect(); got != want {
		t.Fatalf("before the idle suspend: %q, want %q", got, want)
	}

	in := r.waitSuspended("box")
	if in.SuspendedBy != "idle" {
		t.Errorf("suspended by %q, want idle", in.SuspendedBy)
	}
	if p, _ := json.Marshal(in.Policy); !strings.Contains(string(p), "api.example.com") {
		t.Errorf("a suspended sandbox describes the policy it wakes with: %s", p)
	}
	// Its next call wakes it, as it was.
	if got := connect(); got != want {
		t.Errorf("after the idle suspend: %q, want %q", got, want)
	}
	if !strings.Contains(r.log.String(), `"woken":true`) {
		t.Error("no log line says the sandbox was woken")
	}

	// Suspended by its caller (whether or not the idle suspend came
	// first): it stays suspended, 404 as protocol 1 says, until resumed.
	r.must(http.StatusNoContent, "POST", "/v1/sandboxes/box/suspend", nil)
	if in := r.waitSuspended("box"); in.SuspendedBy != "caller" {
		t.Errorf("suspended by %q, want caller", in.SuspendedBy)
	}
	line, _ := json.Marshal(map[string]any{"command": "true"})
	if code, out, _ := r.do("POST", "/v1/sandboxes/box/exec", append(line, '\n')); code != http.StatusNotFound || !strings.Contains(out, "is suspended (resume it)") {
		t.Errorf("exec on a sandbox its caller suspended: %d %s, want 404", code, out)
	}
	// sandgate's resume keeps its network, and says so; protocol 1's
	// resume without one gives the service's alone.
	out := r.must(http.StatusOK, "POST", "/v1/sandboxes/box/resume", map[string]any{"keepNetwork": true})
	var d api.Description
	if json.Unmarshal([]byte(out), &d) != nil || d.Network == nil || !d.Network.Kept || !strings.Contains(out, "api.example.com") {
		t.Errorf("resume keeping the network answered %s", out)
	}
	if got := connect(); got != want {
		t.Errorf("after a resume that kept the network: %q, want %q", got, want)
	}
	r.must(http.StatusNoContent, "POST", "/v1/sandboxes/box/suspend", nil)
	r.must(http.StatusOK, "POST", "/v1/sandboxes/box/resume", map[string]any{})
	if got := connect(); got != "api.example.com=403 denied.example.com=403 kept" {
		t.Errorf("after protocol 1's resume without allowedHosts: %q, want every host refused", got)
	}
}
