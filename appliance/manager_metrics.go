package appliance

import (
	"bufio"
	"os"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the lifecycle's Prometheus metrics.
type metrics struct {
	ops       *prometheus.CounterVec
	durations *prometheus.HistogramVec
	states    *prometheus.GaugeVec // starting, suspending
	running   prometheus.Gauge
	suspended prometheus.Gauge
	execs     prometheus.Counter
	expired   *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, output *outputBudget) *metrics {
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
		expired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandgate_sandboxes_expired_total",
			Help: "Sandboxes destroyed when their lifetime or their time suspended ran out, by the state they were in (running, suspended).",
		}, []string{"state"}),
	}
	if reg != nil {
		reg.MustRegister(m.ops, m.durations, m.states, m.running, m.suspended, m.execs, m.expired)
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "sandgate_output_kept_bytes",
			Help: "Output of commands the service keeps now, all sandboxes (bounded by the output budget).",
		}, func() float64 { return float64(output.kept()) }))
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "sandgate_output_dropped_bytes_total",
			Help: "Output of commands dropped to keep the service within its output budget.",
		}, func() float64 { return float64(output.dropped.Load()) }))
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
	size, _ := l.upperBytes(id)
	return size
}
