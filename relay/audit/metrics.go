package audit

import "github.com/prometheus/client_golang/prometheus"

// Metrics counts egress in Prometheus. Register it with the registry that
// /metrics serves; it is also a Sink.
type Metrics struct {
	decisions     *prometheus.CounterVec
	tunnelBytes   *prometheus.CounterVec
	routedBytes   *prometheus.CounterVec
	dnsLatency    prometheus.Histogram
	activeTunnels prometheus.Gauge
	requestTime   *prometheus.HistogramVec
	auditDropped  prometheus.Counter
	segWrites     *prometheus.CounterVec

	// The series every event touches, looked up once (a lookup hashes the
	// label values under a lock).
	tunnelIn, tunnelOut, routedIn, routedOut prometheus.Counter
	connectTime, routeTime                   prometheus.Observer
}

// NewMetrics creates the egress metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandgate_egress_decisions_total",
			Help: "Egress events by decision (allow, deny), code and kind, as in the audit line: code is the rule that allowed, the refusal, or what failed after an allow (dns_failure, upstream_error, ...).",
		}, []string{"decision", "code", "kind"}),
		tunnelBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandgate_tunnel_bytes_total",
			Help: "Bytes carried by CONNECT tunnels; direction in is from the sandbox, out is to it.",
		}, []string{"direction"}),
		routedBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandgate_routed_bytes_total",
			Help: "Body bytes carried by base-URL routes; direction in is from the sandbox, out is to it.",
		}, []string{"direction"}),
		dnsLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "sandgate_dns_lookup_seconds",
			Help:    "Time to resolve a destination name, cache hits included.",
			Buckets: prometheus.ExponentialBuckets(0.00001, 4, 10),
		}),
		activeTunnels: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "sandgate_active_tunnels",
			Help: "CONNECT tunnels open now.",
		}),
		requestTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "sandgate_egress_duration_seconds",
			Help:    "Duration of tunnels and routed requests, by kind.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"kind"}),
		auditDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sandgate_audit_dropped_events_total",
			Help: "Audit events of a sandbox dropped from its durable audit because the store fell too far behind (they are still in the audit log).",
		}),
		segWrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandgate_audit_segment_writes_total",
			Help: "Writes of audit segments to the store, by result (ok, error).",
		}, []string{"result"}),
	}
	reg.MustRegister(m.decisions, m.tunnelBytes, m.routedBytes, m.dnsLatency, m.activeTunnels, m.requestTime, m.auditDropped, m.segWrites)
	m.tunnelIn, m.tunnelOut = m.tunnelBytes.WithLabelValues("in"), m.tunnelBytes.WithLabelValues("out")
	m.routedIn, m.routedOut = m.routedBytes.WithLabelValues("in"), m.routedBytes.WithLabelValues("out")
	m.connectTime, m.routeTime = m.requestTime.WithLabelValues(string(Connect)), m.requestTime.WithLabelValues(string(Route))
	return m
}

// Record implements Sink.
func (m *Metrics) Record(e Event) {
	m.decisions.WithLabelValues(e.Decision(), e.Code, string(e.Kind)).Inc()
	switch e.Kind {
	case Connect, Capture:
		m.tunnelIn.Add(float64(e.BytesIn))
		m.tunnelOut.Add(float64(e.BytesOut))
	case Route, Intercept:
		m.routedIn.Add(float64(e.BytesIn))
		m.routedOut.Add(float64(e.BytesOut))
	}
	if e.DNSTime > 0 {
		m.dnsLatency.Observe(e.DNSTime.Seconds())
	}
	if e.Allow {
		switch e.Kind {
		case Connect:
			m.connectTime.Observe(e.Duration.Seconds())
		case Route:
			m.routeTime.Observe(e.Duration.Seconds())
		default:
			m.requestTime.WithLabelValues(string(e.Kind)).Observe(e.Duration.Seconds())
		}
	}
}

// TunnelOpened and TunnelClosed track the active-tunnels gauge.
func (m *Metrics) TunnelOpened() { m.activeTunnels.Inc() }

// TunnelClosed is the pair of TunnelOpened.
func (m *Metrics) TunnelClosed() { m.activeTunnels.Dec() }

func (m *Metrics) segmentWrite(err error) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.segWrites.WithLabelValues(result).Inc()
}
