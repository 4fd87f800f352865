package appliance

import (
	"runtime"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// TestUsageReported: a running sandbox that holds memory, runs processes
// and writes files reports what it uses, in Get, List and the metrics,
// with values that make sense: at least what it was made to use, at most
// its limits (nothing is timed). A hole costs no disk. A suspended
// sandbox, and one on Google's CLI, report none.
func TestUsageReported(t *testing.T) {
	for _, mode := range cliModes {
		t.Run(string(mode), func(t *testing.T) { testUsageReported(t, mode) })
	}
}

func testUsageReported(t *testing.T, mode cliMode) {
	reg := prometheus.NewRegistry()
	r := newManagerRigOn(t, mode, newStore(t, "dir"), func(c *ManagerConfig) { c.Metrics = reg })
	start := time.Now()
	r.create("use", CreateOptions{Limits: Limits{Memory: 512 << 20, Pids: 256, Disk: 256 << 20}})
	script := `head -c 33554432 /dev/zero > /tmp/held &&
		head -c 4194304 /dev/urandom > /data.bin &&
		truncate -s 1G /sparse &&
		for i in 1 2 3 4; do sleep 600 </dev/null >/dev/null 2>&1 & done`
	if code, out := r.sh("use", script); code != 0 {
		t.Fatalf("%d %s", code, out)
	}
	in, err := r.m.Get(r.ctx(), "use")
	if err != nil {
		t.Fatal(err)
	}
	if mode == googleCLI {
		if in.Usage != nil {
			t.Errorf("Google's CLI: usage %+v, want none (its sandboxes cannot be looked into)", *in.Usage)
		}
		return
	}
	u := in.Usage
	if u == nil {
		t.Fatal("a running sandbox reports no usage")
	}
	elapsed := time.Since(start).Seconds() * float64(runtime.NumCPU())
	if u.CPUSeconds <= 0 || u.CPUSeconds > elapsed {
		t.Errorf("cpuSeconds %v: want more than 0 and at most %v (its whole life on every core)", u.CPUSeconds, elapsed)
	}
	if u.MemoryBytes < 32<<20 || u.MemoryBytes > 512<<20 {
		t.Errorf("memoryBytes %d: want at least the 32 MiB it holds in /tmp, at most its 512 MiB limit", u.MemoryBytes)
	}
	if u.MemoryPeakBytes != 0 && (u.MemoryPeakBytes < u.MemoryBytes || u.MemoryPeakBytes > 512<<20) {
		t.Errorf("memoryPeakBytes %d: want between memoryBytes %d and the limit", u.MemoryPeakBytes, u.MemoryBytes)
	}
	if u.Processes < 5 || u.Processes > 256 {
		t.Errorf("processes %d: want at least its four sleeps and its init, at most its limit of 256", u.Processes)
	}
	if u.DiskBytes < 4<<20 || u.DiskBytes > 64<<20 {
		t.Errorf("diskBytes %d: want at least the 4 MiB file it wrote, and nothing of the 1 GiB hole", u.DiskBytes)
	}
	if u.DiskQuotaBytes != 256<<20 {
		t.Errorf("diskQuotaBytes %d, want its limit %d", u.DiskQuotaBytes, 256<<20)
	}
	if in.LayerBytes < 1<<30 {
		t.Errorf("layerBytes %d: the apparent size, holes included, is over 1 GiB", in.LayerBytes)
	}
	list, err := r.m.List(r.ctx())
	if err != nil {
		t.Fatal(err)
	}
	for _, li := range list {
		if li.ID == "use" && (li.Usage == nil || li.Usage.MemoryBytes < 32<<20) {
			t.Errorf("List: usage %+v", li.Usage)
		}
	}
	if got := gauge(t, reg, "sandgate_sandbox_memory_bytes", "use"); got < 32<<20 {
		t.Errorf("the metric of its memory: %v", got)
	}
	if got := gauge(t, reg, "sandgate_sandbox_processes", "use"); got < 5 {
		t.Errorf("the metric of its processes: %v", got)
	}
	if got := gauge(t, reg, "sandgate_sandbox_disk_quota_bytes", "use"); got != 256<<20 {
		t.Errorf("the metric of its disk quota: %v", got)
	}

	if err := r.m.Suspend(r.ctx(), "use"); err != nil {
		t.Fatal(err)
	}
	if in, err := r.m.Get(r.ctx(), "use"); err != nil || in.Usage != nil {
		t.Errorf("suspended: usage %+v, %v; want none", in.Usage, err)
	}
	if got := gauge(t, reg, "sandgate_sandbox_memory_bytes", "use"); got != -1 {
		t.Errorf("suspended: the metric of its memory is still there (%v)", got)
	}
}

// gauge is the value of metric name for sandbox id in reg; -1 if none.
func gauge(t *testing.T, reg *prometheus.Registry, name, id string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if labelOf(m, "sandbox") == id {
				if m.GetGauge() != nil {
					return m.GetGauge().GetValue()
				}
				return m.GetCounter().GetValue()
			}
		}
	}
	return -1
}

func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}
