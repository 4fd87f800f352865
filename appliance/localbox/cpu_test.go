package localbox

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// cgroupValue is the content of the first of names among sandbox id's
// cgroup files, trimmed; "" where none is there.
func cgroupValue(t *testing.T, m *Runtime, id string, names ...string) string {
	t.Helper()
	var rs runState
	if err := readJSON(filepath.Join(m.sandboxDir(id), stateFile), &rs); err != nil {
		t.Fatal(err)
	}
	cg := &cgroups{dirs: rs.Cgroups, v2: rs.CgroupV2}
	for _, n := range names {
		if p := cg.file(n); p != "" {
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			return strings.TrimSpace(string(b))
		}
	}
	return ""
}

// TestCPULimitAndWeightApplied: --cpus and --cpu-weight reach the
// sandbox's cgroup, which its busy processes are in. Before, nothing bound
// a sandbox's CPU: eight busy loops in one sandbox took every core from
// every other (a fixed task in another ran at 0.21-0.23 of its speed).
func TestCPULimitAndWeightApplied(t *testing.T) {
	m := newRuntime(t)
	if runtime.NumCPU() < 2 {
		t.Skip("a limit of half a core is no limit where the host has one")
	}
	runDetached(t, m, "cpu", func(o *RunOptions) { o.CPU = 0.5; o.CPUWeight = 50; o.SandboxesCPUWeight = 25 })
	runDetached(t, m, "nocpu", nil)
	if !hostHasCPUController(t) {
		t.Skip("no cpu controller on this host")
	}
	if code, _, errOut := sh(t, m, "cpu", `setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &`); code != 0 {
		t.Fatalf("starting a busy loop: %d %q", code, errOut)
	}
	if got := cgroupValue(t, m, "cpu", "cpu.max", "cpu.cfs_quota_us"); got != "50000 100000" && got != "50000" {
		t.Errorf("the quota of --cpus 0.5: %q, want 50000 µs per 100000", got)
	}
	if got := cgroupValue(t, m, "cpu", "cpu.max", "cpu.cfs_period_us"); got != "50000 100000" && got != "100000" {
		t.Errorf("the period: %q", got)
	}
	if got := cgroupValue(t, m, "cpu", "cpu.weight", "cpu.shares"); got != "50" && got != "512" {
		t.Errorf("the weight of --cpu-weight 50: %q, want 50 (v1: 512 shares)", got)
	}
	// The loop, in a session of its own, is in the sandbox's cgroup all
	// the same.
	inCgroup := false
	for _, pid := range strings.Fields(cpuCgroupProcs(t, m, "cpu")) {
		if b, _ := os.ReadFile("/proc/" + pid + "/cmdline"); strings.Contains(string(b), "while :") {
			inCgroup = true
		}
	}
	if !inCgroup {
		t.Errorf("the busy loop is not in the sandbox's cpu cgroup")
	}
	// Without --cpus: no quota, but a cgroup of its own all the same, so
	// that sandboxes, not processes, share the cores.
	if got := cgroupValue(t, m, "nocpu", "cpu.max", "cpu.cfs_quota_us"); got != "max 100000" && got != "-1" {
		t.Errorf("the quota without --cpus: %q, want none", got)
	}
	// All the sandboxes of the state directory together weigh what
	// --sandboxes-cpu-weight says, against what is beside them; another
	// state directory's, which says nothing, have the kernel's default.
	parentWeight := func(m *Runtime, id string) string {
		t.Helper()
		var rs runState
		readJSON(filepath.Join(m.sandboxDir(id), stateFile), &rs)
		for _, d := range rs.Cgroups {
			for _, f := range []string{"cpu.weight", "cpu.shares"} {
				if b, err := os.ReadFile(filepath.Join(filepath.Dir(d), f)); err == nil {
					return strings.TrimSpace(string(b))
				}
			}
		}
		return ""
	}
	if got := parentWeight(m, "cpu"); got != "25" && got != "256" {
		t.Errorf("the sandboxes' parent cgroup weighs %q, want 25 (v1: 256 shares)", got)
	}
	other := newRuntime(t)
	runDetached(t, other, "cpu", nil)
	if got := parentWeight(other, "cpu"); got != "100" && got != "1024" {
		t.Errorf("another state directory's sandboxes weigh %q, want the kernel's default", got)
	}
	// The parent goes with its last sandbox.
	var rs runState
	readJSON(filepath.Join(other.sandboxDir("cpu"), stateFile), &rs)
	if err := other.Delete(testCtx(t), "cpu", true); err != nil {
		t.Fatal(err)
	}
	for _, d := range rs.Cgroups {
		if _, err := os.Stat(filepath.Dir(d)); err == nil {
			t.Errorf("the parent cgroup %s outlived the state directory's last sandbox", filepath.Dir(d))
		}
	}
}

// hostHasCPUController reports whether the host offers the cgroup cpu
// controller: a v1 hierarchy of it, or v2 at /sys/fs/cgroup with it.
func hostHasCPUController(t *testing.T) bool {
	mounts, err := readCgroupMounts()
	if err != nil {
		t.Fatal(err)
	}
	for _, mt := range mounts {
		if mt.fstype == "cgroup" && contains(mt.opts, "cpu") {
			return true
		}
		if mt.fstype == "cgroup2" && mt.point == "/sys/fs/cgroup" {
			b, _ := os.ReadFile(filepath.Join(mt.point, "cgroup.controllers"))
			return contains(strings.Fields(string(b)), "cpu")
		}
	}
	return false
}

// cpuCgroupProcs lists the processes of sandbox id's cpu cgroup.
func cpuCgroupProcs(t *testing.T, m *Runtime, id string) string {
	t.Helper()
	var rs runState
	if err := readJSON(filepath.Join(m.sandboxDir(id), stateFile), &rs); err != nil {
		t.Fatal(err)
	}
	for _, d := range rs.Cgroups {
		for _, f := range []string{"cpu.max", "cpu.shares"} {
			if _, err := os.Stat(filepath.Join(d, f)); err == nil {
				b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
				return string(b)
			}
		}
	}
	return ""
}

func TestCPUFlagsChecked(t *testing.T) {
	for _, tc := range []struct {
		cpu    float64
		weight int
	}{{-1, 0}, {0.001, 0}, {math.NaN(), 0}, {math.Inf(1), 0}, {0, -1}, {0, 10001}} {
		err := checkCPU(tc.cpu, tc.weight)
		if !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "--cpu") {
			t.Errorf("cpu %v, weight %d: %v, want ErrBadInput naming the flag", tc.cpu, tc.weight, err)
		}
	}
	for _, tc := range []struct {
		cpu    float64
		weight int
	}{{0, 0}, {0.01, 1}, {64, 10000}} {
		if err := checkCPU(tc.cpu, tc.weight); err != nil {
			t.Errorf("cpu %v, weight %d: %v", tc.cpu, tc.weight, err)
		}
	}
	for w, want := range map[int]int64{1: 10, 50: 512, 100: 1024, 10000: 102400} {
		if got := cpuShares(w); got != want {
			t.Errorf("cpuShares(%d) = %d, want %d", w, got, want)
		}
	}
	if q := cpuQuota(float64(runtime.NumCPU())); q != 0 {
		t.Errorf("a limit of every core: quota %d, want none", q)
	}
	if q := cpuQuota(0.01); q != 1000 {
		t.Errorf("cpuQuota(0.01) = %d, want the kernel's least, 1000", q)
	}
}
