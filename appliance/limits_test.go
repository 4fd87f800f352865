package appliance

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestLimitsJSON(t *testing.T) {
	var l Limits
	in := `{"cpu":1.5,"cpuWeight":200,"memory":"512m","pids":100,"disk":1073741824,"lifetime":"24h","keepSuspended":"90m"}`
	if err := json.Unmarshal([]byte(in), &l); err != nil {
		t.Fatal(err)
	}
	want := Limits{CPU: 1.5, CPUWeight: 200, Memory: 512 << 20, Pids: 100, Disk: 1 << 30, Lifetime: 24 * time.Hour, KeepSuspended: 90 * time.Minute}
	if l != want {
		t.Fatalf("got %+v, want %+v", l, want)
	}
	out, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	var back Limits
	if err := json.Unmarshal(out, &back); err != nil || back != want {
		t.Fatalf("round trip through %s: %+v, %v", out, back, err)
	}
	if out, _ := json.Marshal(Limits{}); string(out) != "{}" {
		t.Errorf("zero limits marshal as %s, want {}", out)
	}
	for _, bad := range []string{
		`{"cpus":1}`, `{"memory":"lots"}`, `{"memory":-1.5}`, `{"lifetime":3600}`, `{"lifetime":"a day"}`, `[]`,
	} {
		var l Limits
		err := json.Unmarshal([]byte(bad), &l)
		if !errors.Is(err, ErrBadInput) {
			t.Errorf("%s: %v, want ErrBadInput", bad, err)
		}
	}
	var l2 Limits
	if err := json.Unmarshal([]byte(`{"cpus":1}`), &l2); err == nil || !strings.Contains(err.Error(), `"cpus"`) {
		t.Errorf("an unknown field is not named: %v", err)
	}
}

func TestLimitsCheck(t *testing.T) {
	for _, l := range []Limits{
		{CPU: 0.001}, {CPU: -1}, {CPUWeight: -1}, {CPUWeight: 10001}, {Memory: 1 << 20}, {Memory: -1},
		{Pids: 3}, {Disk: 1000}, {Lifetime: time.Second}, {KeepSuspended: -time.Hour},
	} {
		if err := l.Check(); !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "limits") {
			t.Errorf("%+v: %v, want ErrBadInput naming the field", l, err)
		}
	}
	for _, l := range []Limits{{}, {CPU: 0.5, CPUWeight: 1, Memory: 16 << 20, Pids: 16, Disk: 1 << 20, Lifetime: time.Minute, KeepSuspended: time.Hour}} {
		if err := l.Check(); err != nil {
			t.Errorf("%+v: %v", l, err)
		}
	}
	got := Limits{CPU: 2}.Or(Limits{CPU: 1, Memory: 5, Lifetime: time.Hour})
	if want := (Limits{CPU: 2, Memory: 5, Lifetime: time.Hour}); got != want {
		t.Errorf("Or: %+v, want %+v", got, want)
	}
}

// memoryLimitOf reads sandbox id's memory limit from its cgroup, as
// `sandgate sandbox` recorded it in its state; "" where the host has no
// memory controller.
func (r *mrig) memoryLimitOf(id string) string {
	r.t.Helper()
	return r.cgroupValue(id, "memory.max", "memory.limit_in_bytes")
}

// TestOwnLimitsKeptWithTheSandbox: a sandbox's own limits apply, over the
// service's defaults, and come back with it after a suspend.
func TestOwnLimitsKeptWithTheSandbox(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("own", CreateOptions{Limits: Limits{Memory: 300 << 20, Pids: 200}})
	r.create("dflt", CreateOptions{})
	if r.memoryLimitOf("own") == "" {
		t.Skip("no memory controller on this host")
	}
	check := func(when string) {
		t.Helper()
		if got := r.memoryLimitOf("own"); got != strconv.Itoa(300<<20) {
			t.Errorf("%s: the sandbox's memory limit is %s, want its own %d", when, got, 300<<20)
		}
		in, err := r.m.Get(r.ctx(), "own")
		if err != nil {
			t.Fatal(err)
		}
		if in.Limits.Memory != 300<<20 || in.Limits.Pids != 200 {
			t.Errorf("%s: Get says limits %+v", when, in.Limits)
		}
	}
	check("created")
	if got, want := r.memoryLimitOf("dflt"), strconv.Itoa(2<<30); got != want {
		t.Errorf("a sandbox without limits of its own: %s, want the default %s", got, want)
	}
	if err := r.m.Suspend(r.ctx(), "own"); err != nil {
		t.Fatal(err)
	}
	in, err := r.m.Get(r.ctx(), "own")
	if err != nil {
		t.Fatal(err)
	}
	if in.State != Suspended || in.Limits.Memory != 300<<20 {
		t.Errorf("suspended: %s with limits %+v", in.State, in.Limits)
	}
	if _, err := r.m.Resume(r.ctx(), "own", ResumeOptions{}); err != nil {
		t.Fatal(err)
	}
	check("resumed")
}
