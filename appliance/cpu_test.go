package appliance

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// cgroupValue is the first of names among sandbox id's cgroup files (as
// `sandgate sandbox` recorded them in its state), trimmed; "" where none
// is there.
func (r *mrig) cgroupValue(id string, names ...string) string {
	r.t.Helper()
	var st struct {
		Cgroups []string `json:"cgroups"`
	}
	data, err := os.ReadFile(filepath.Join(r.egress.state, id, "state.json"))
	if err != nil {
		r.t.Fatal(err)
	}
	if err := json.Unmarshal(data, &st); err != nil {
		r.t.Fatal(err)
	}
	for _, n := range names {
		for _, d := range st.Cgroups {
			if b, err := os.ReadFile(filepath.Join(d, n)); err == nil {
				return strings.TrimSpace(string(b))
			}
		}
	}
	return ""
}

// TestSandboxCPULimitEnforced: a sandbox's own CPU limit and weight, and
// the service's default for one without, reach its cgroup while it runs a
// busy loop (the cgroup's quota is read; nothing is timed). Before, CPU
// limits were kept with a sandbox but applied nowhere.
func TestSandboxCPULimitEnforced(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("a default limit below the host's cores needs two of them")
	}
	if !hasCPUController() {
		t.Skip("no cpu controller on this host")
	}
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("half", CreateOptions{Limits: Limits{CPU: 0.5, CPUWeight: 50}})
	r.create("dflt", CreateOptions{})
	if code, out := r.sh("half", `setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &`); code != 0 {
		t.Fatalf("busy loop: %d %s", code, out)
	}
	if got := r.cgroupValue("half", "cpu.max", "cpu.cfs_quota_us"); got != "50000 100000" && got != "50000" {
		t.Errorf("cpu 0.5: the cgroup's quota is %q, want 50000 µs per 100000", got)
	}
	if got := r.cgroupValue("half", "cpu.weight", "cpu.shares"); got != "50" && got != "512" {
		t.Errorf("cpuWeight 50: the cgroup's weight is %q, want 50 (v1: 512 shares)", got)
	}
	want := int64(DefaultCPULimit() * 100000)
	if got := r.cgroupValue("dflt", "cpu.max", "cpu.cfs_quota_us"); got != fmt.Sprintf("%d 100000", want) && got != fmt.Sprint(want) {
		t.Errorf("the service's default (%v cores): the cgroup's quota is %q, want %d", DefaultCPULimit(), got, want)
	}
	in, err := r.m.Get(r.ctx(), "dflt")
	if err != nil {
		t.Fatal(err)
	}
	if in.Limits.CPU != DefaultCPULimit() || in.Limits.CPUWeight != DefaultCPUWeight {
		t.Errorf("the default's limits: %+v", in.Limits)
	}
}

// hasCPUController reports whether the host offers the cgroup cpu
// controller (v1 mounted, or v2 with it).
func hasCPUController() bool {
	if _, err := os.Stat("/sys/fs/cgroup/cpu/cpu.shares"); err == nil {
		return true
	}
	b, _ := os.ReadFile("/sys/fs/cgroup/cgroup.controllers")
	return strings.Contains(" "+string(b)+" ", " cpu ")
}
