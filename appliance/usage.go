package appliance

import (
	"bufio"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
)

// Usage is what a running sandbox uses of the host now. It is read when
// asked (Get, List, a scrape of the metrics), never polled: from the
// sandbox's cgroups and its writable layer, where the sandbox CLI keeps
// them where the service can read them (`sandgate sandbox`). Google's CLI
// runs each sandbox in a gVisor instance of its own that the service cannot
// look into: none is reported there (Info.Usage is nil). A field that is
// not known (a controller the host does not have) is zero, and left out on
// the wire.
type Usage struct {
	// CPUSeconds is the CPU time its processes have used since it
	// started (cgroup cpu.stat usage_usec; v1 cpuacct.usage).
	CPUSeconds float64 `json:"cpuSeconds,omitempty"`
	// MemoryBytes is the memory it holds now: its processes', its /tmp
	// and /dev/shm, and the page cache of its files (memory.current; v1
	// memory.usage_in_bytes); MemoryPeakBytes the most it held since it
	// started (memory.peak, Linux 5.19 and later; v1
	// memory.max_usage_in_bytes). Limits.Memory bounds both.
	MemoryBytes     int64 `json:"memoryBytes,omitempty"`
	MemoryPeakBytes int64 `json:"memoryPeakBytes,omitempty"`
	// DiskBytes is what its writable layer allocates on the host's disk
	// (blocks, not apparent sizes: a hole costs nothing); DiskQuotaBytes
	// is what it may allocate (Limits.Disk), zero when it has no quota.
	DiskBytes      int64 `json:"diskBytes,omitempty"`
	DiskQuotaBytes int64 `json:"diskQuotaBytes,omitempty"`
	// Processes is how many processes and threads it has now, as
	// Limits.Pids counts them (pids.current).
	Processes int `json:"processes,omitempty"`
}

// usage reads what sandbox b, running here, uses now (nil where the CLI
// keeps nothing the service can read: Google's), and the apparent size of
// its writable layer (Info.LayerBytes): one walk of the layer for both.
func (m *Manager) usage(b *box) (*Usage, int64) {
	size, allocated := m.l.upperBytes(b.id)
	u, ok := m.l.cgroupUsage(b.id)
	if !ok {
		return nil, size
	}
	u.DiskBytes, u.DiskQuotaBytes = allocated, m.effectiveLimits(b.limits).Disk
	return &u, size
}

// runningUsage reads the Usage of every sandbox running here, by id.
func (m *Manager) runningUsage() map[string]*Usage {
	m.mu.Lock()
	var live []*box
	for _, b := range m.boxes {
		if b.live.Load() != nil {
			live = append(live, b)
		}
	}
	m.mu.Unlock()
	out := map[string]*Usage{}
	for _, b := range live {
		if u, _ := m.usage(b); u != nil {
			out[b.id] = u
		}
	}
	return out
}

// sandboxDir is where `sandgate sandbox` keeps sandbox id.
func (l *Launcher) sandboxDir(id string) string {
	state := l.cfg.StateDir
	if state == "" {
		state = sandboxcli.DefaultStateDir
	}
	return filepath.Join(state, id)
}

// cgroupUsage reads sandbox id's cgroups: the directories its state.json
// names (localbox's runState: one under cgroup v2, one per v1 hierarchy).
func (l *Launcher) cgroupUsage(id string) (Usage, bool) {
	if l.google {
		return Usage{}, false
	}
	var rs struct {
		Cgroups []string `json:"cgroups"`
		V2      bool     `json:"cgroupV2"`
	}
	b, err := os.ReadFile(filepath.Join(l.sandboxDir(id), "state.json"))
	if err != nil || json.Unmarshal(b, &rs) != nil || len(rs.Cgroups) == 0 {
		return Usage{}, false
	}
	// read is the first of the cgroup's files of that name, as a number;
	// 0 where none has it.
	read := func(name string) int64 {
		for _, d := range rs.Cgroups {
			if b, err := os.ReadFile(filepath.Join(d, name)); err == nil {
				v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
				return v
			}
		}
		return 0
	}
	u := Usage{Processes: int(read("pids.current"))}
	if rs.V2 {
		u.MemoryBytes, u.MemoryPeakBytes = read("memory.current"), read("memory.peak")
		u.CPUSeconds = float64(statField(filepath.Join(rs.Cgroups[0], "cpu.stat"), "usage_usec")) / 1e6
	} else {
		u.MemoryBytes, u.MemoryPeakBytes = read("memory.usage_in_bytes"), read("memory.max_usage_in_bytes")
		u.CPUSeconds = float64(read("cpuacct.usage")) / 1e9
	}
	return u, true
}

// statField is the value of key in a cgroup v2 flat-keyed file (cpu.stat);
// 0 where it is not.
func statField(file, key string) int64 {
	f, err := os.Open(file)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key+" "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// upperBytes walks sandbox id's writable layer once (`sandgate sandbox`;
// zeros for Google's CLI): the apparent size of its regular files, and the
// bytes its entries allocate (st_blocks, each inode once: a hole costs
// nothing, a hard link nothing more).
func (l *Launcher) upperBytes(id string) (size, allocated int64) {
	if l.google {
		return 0, 0
	}
	seen := map[uint64]bool{}
	upper := filepath.Join(l.sandboxDir(id), "layer", "upper") // on a file system of its own (a disk quota)
	if _, err := os.Lstat(upper); err != nil {
		upper = filepath.Join(l.sandboxDir(id), "upper")
	}
	filepath.WalkDir(upper, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		if d.Type().IsRegular() {
			size += fi.Size()
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			if st.Nlink > 1 && !d.IsDir() {
				if seen[st.Ino] {
					return nil
				}
				seen[st.Ino] = true
			}
			allocated += st.Blocks * 512
		}
		return nil
	})
	return size, allocated
}

// usageCollector reports each running sandbox's Usage to Prometheus when
// scraped, reading it then: an idle sandbox costs nothing between scrapes.
type usageCollector struct {
	m                                  *Manager
	cpu, mem, peak, disk, quota, procs *prometheus.Desc
}

func newUsageCollector(m *Manager) *usageCollector {
	desc := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, []string{"sandbox"}, nil)
	}
	return &usageCollector{m: m,
		cpu:   desc("sandgate_sandbox_cpu_seconds_total", "CPU time a running sandbox's processes have used since it started."),
		mem:   desc("sandgate_sandbox_memory_bytes", "Memory a running sandbox holds now (processes, /tmp, /dev/shm, page cache)."),
		peak:  desc("sandgate_sandbox_memory_peak_bytes", "The most memory a running sandbox has held since it started."),
		disk:  desc("sandgate_sandbox_disk_bytes", "Bytes a running sandbox's writable layer allocates on the host's disk."),
		quota: desc("sandgate_sandbox_disk_quota_bytes", "Bytes a running sandbox's writable layer may allocate (sandboxes with a disk limit)."),
		procs: desc("sandgate_sandbox_processes", "Processes and threads a running sandbox has now."),
	}
}

func (c *usageCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.cpu, c.mem, c.peak, c.disk, c.quota, c.procs} {
		ch <- d
	}
}

func (c *usageCollector) Collect(ch chan<- prometheus.Metric) {
	for id, u := range c.m.runningUsage() {
		ch <- prometheus.MustNewConstMetric(c.cpu, prometheus.CounterValue, u.CPUSeconds, id)
		ch <- prometheus.MustNewConstMetric(c.mem, prometheus.GaugeValue, float64(u.MemoryBytes), id)
		if u.MemoryPeakBytes > 0 {
			ch <- prometheus.MustNewConstMetric(c.peak, prometheus.GaugeValue, float64(u.MemoryPeakBytes), id)
		}
		ch <- prometheus.MustNewConstMetric(c.disk, prometheus.GaugeValue, float64(u.DiskBytes), id)
		if u.DiskQuotaBytes > 0 {
			ch <- prometheus.MustNewConstMetric(c.quota, prometheus.GaugeValue, float64(u.DiskQuotaBytes), id)
		}
		ch <- prometheus.MustNewConstMetric(c.procs, prometheus.GaugeValue, float64(u.Processes), id)
	}
}
