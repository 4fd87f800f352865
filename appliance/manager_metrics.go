package appliance

import (
	"bufio"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
)

// metrics are the lifecycle's Prometheus metrics.
type metrics struct {
	ops       *prometheus.CounterVec
	durations *prometheus.HistogramVec
	states    *prometheus.GaugeVec // starting, suspending
	running   prometheus.Gauge
	suspended prometheus.Gauge
	execs     prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		ops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandgate_lifecycle_operations_total",
			Help: "Lifecycle operations by kind (create, resume, suspend, destroy, fork, template) and result (ok, error).",
		}, []string{"op", "result"}),
		durations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "sandgate_lifecycle_operation_seconds",
			Help:    "Time lifecycle operations took, by kind.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 14),
		}, []string{"op"}),
		states: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "sandgate_sandboxes_in_transition",
			Help: "Sandboxes starting or suspending now.",
		}, []string{"state"}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sandgate_sandboxes_running",
			Help: "Sandboxes running (or starting), counted against the service's cap.",
		}),
		suspended: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sandgate_sandboxes_suspended",
			Help: "Sandboxes suspended in the store.",
		}),
		execs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sandgate_exec_processes_total",
			Help: "Commands started by exec.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.ops, m.durations, m.states, m.running, m.suspended, m.execs)
	}
	return m
}

// memTotal is the host's memory in bytes (0 if unknown).
func memTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err == nil {
				return kb << 10
			}
		}
	}
	return 0
}

// UpperSize is what sandbox id's writable layer takes on disk, where the
// CLI keeps it where sandgate can see it (`sandgate sandbox`); 0 when
// unknown (Google's CLI).
func (l *Launcher) UpperSize(id string) int64 {
	if l.google {
		return 0
	}
	state := l.cfg.StateDir
	if state == "" {
		state = sandboxcli.DefaultStateDir
	}
	upper := filepath.Join(state, id, "layer", "upper") // on its own file system (a disk quota)
	if _, err := os.Lstat(upper); err != nil {
		upper = filepath.Join(state, id, "upper")
	}
	var n int64
	filepath.WalkDir(upper, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Sys().(*syscall.Stat_t).Blocks * 512 // what it takes: a hole takes nothing
			}
		}
		return nil
	})
	return n
}
