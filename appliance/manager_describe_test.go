package appliance

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
)

// What an operator's view reads of a sandbox: its credential rules by host
// and header names, never a value (and only while it runs: they go when
// it stops), its sessions running and suspended; neither counts as
// activity.
func TestDescribeRulesAndSessions(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	ctx := r.ctx()
	r.create("desc", CreateOptions{Rules: r.rules(t).Rules()})
	if err := r.m.CreateSession(ctx, "desc", "dev", Session{Dir: "/workspace", Env: map[string]string{"PROJECT": "demo"}}); err != nil {
		t.Fatal(err)
	}
	live := func() int64 { r.m.mu.Lock(); defer r.m.mu.Unlock(); return r.m.boxes["desc"].live.Load().active.Load() }
	active := live()
	rules, err := r.m.CredentialRules("desc")
	if err != nil || len(rules) != 1 || rules[0].Host != "api.example.com" || !slices.Equal(rules[0].Headers, []string{"X-Api-Key"}) {
		t.Fatalf("the rules: %+v %v", rules, err)
	}
	js, _ := json.Marshal(rules)
	if strings.Contains(string(js), r.canary) {
		t.Errorf("the rules' description holds the secret: %s", js)
	}
	sess, err := r.m.Sessions(ctx, "desc")
	if err != nil || len(sess) != 1 || sess["dev"].Dir != "/workspace" || sess["dev"].Env["PROJECT"] != "demo" {
		t.Fatalf("the sessions of a running sandbox: %+v %v", sess, err)
	}
	if after := live(); after != active {
		t.Errorf("describing the sandbox counted as activity: last active %d, then %d", active, after)
	}
	if err := r.m.Suspend(ctx, "desc"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.m.CredentialRules("desc"); !errors.Is(err, ErrNotRunning) {
		t.Errorf("the rules of a suspended sandbox: %v, want ErrNotRunning", err)
	}
	if sess, err := r.m.Sessions(ctx, "desc"); err != nil || sess["dev"].Dir != "/workspace" {
		t.Errorf("the sessions of a suspended sandbox: %+v %v", sess, err)
	}
	if _, err := r.m.CredentialRules("-bad"); !errors.Is(err, ErrBadInput) {
		t.Errorf("a bad id: %v", err)
	}
	if sess, err := r.m.Sessions(ctx, "nothing"); err != nil || len(sess) != 0 {
		t.Errorf("the sessions of no sandbox: %+v %v", sess, err)
	}
}
