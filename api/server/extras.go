package server

import (
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// audit serves a sandbox's egress decisions: the ones kept, as JSON, or
// with ?follow=1 those as they happen, one JSON line each.
func (s *Server) audit(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		writeError(w, err)
		return
	}
	if s.cfg.Audit == nil {
		writeError(w, errorf(http.StatusNotImplemented, "this service keeps no audit events"))
		return
	}
	if _, err := s.m.Get(r.Context(), name); err != nil {
		writeError(w, err)
		return
	}
	if r.URL.Query().Get("follow") == "" || r.URL.Query().Get("follow") == "0" {
		events := s.cfg.Audit.Events(name)
		if events == nil {
			events = []audit.Event{}
		}
		writeJSON(w, http.StatusOK, map[string]any{"events": events})
		return
	}
	sb, err := s.m.Sandbox(name)
	if err != nil {
		writeError(w, errNoSandbox(name))
		return
	}
	f, stop := s.cfg.Audit.Follow(name)
	defer stop()
	w.Header().Set("Content-Type", "application/x-ndjson")
	rc := http.NewResponseController(w)
	w.WriteHeader(http.StatusOK)
	rc.Flush()
	enc := json.NewEncoder(w)
	for _, e := range s.cfg.Audit.Events(name) {
		if enc.Encode(e) != nil {
			return
		}
	}
	rc.Flush()
	keepalive := time.NewTicker(30 * time.Second)
	defer keepalive.Stop()
	for {
		select {
		case <-r.Context().Done():
			return
		case <-sb.Context().Done():
			return
		case e := <-f.C:
			if enc.Encode(e) != nil {
				return
			}
			rc.Flush()
		case <-keepalive.C:
			if _, err := w.Write([]byte("\n")); err != nil {
				return
			}
			rc.Flush()
		}
	}
}

// setModules replaces a sandbox's own WebAssembly transform modules:
// {"modules":[{"name":..., "wasm": base64, "config": string}]}, each loaded
// and checked as `sandgate wasm check` does, run after the service's and
// before the credential swap. An empty list removes them.
func (s *Server) setModules(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	sb, err := s.m.Sandbox(name)
	if err != nil {
		writeError(w, errNoSandbox(name))
		return
	}
	if s.cfg.Modules == nil {
		writeError(w, errorf(http.StatusNotImplemented, "this service runs no WebAssembly modules"))
		return
	}
	o, err := readObject(r, 64<<20)
	if err != nil {
		writeError(w, err)
		return
	}
	var specs []struct {
		Name   string `json:"name"`
		Wasm   string `json:"wasm"`
		Config string `json:"config"`
	}
	if raw, ok := o["modules"]; !ok || json.Unmarshal(raw, &specs) != nil {
		writeError(w, badRequest("field \"modules\" must be a list of {name, wasm (base64), config}"))
		return
	}
	var mods []*wasm.Module
	closeAll := func() {
		for _, m := range mods {
			m.Close(r.Context())
		}
	}
	for i, spec := range specs {
		bin, err := base64.StdEncoding.DecodeString(spec.Wasm)
		if err != nil || spec.Name == "" {
			closeAll()
			writeError(w, badRequest("modules[%d]: want a name and the module's bytes in base64", i))
			return
		}
		m, err := s.cfg.Modules.Load(r.Context(), spec.Name, bin, []byte(spec.Config))
		if err != nil {
			closeAll()
			writeError(w, badRequest("modules[%d]: %v", i, err))
			return
		}
		mods = append(mods, m)
	}
	var chain *wasm.Chain
	if len(mods) > 0 {
		chain = wasm.NewChain(mods...)
	}
	old := sb.Relay().Modules()
	sb.Relay().SetModules(chain)
	if old != nil {
		old.Close(r.Context())
	}
	noContent(w)
}

//go:embed openapi.json
var openAPIDoc []byte

func (s *Server) openAPI(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(openAPIDoc)))
	w.WriteHeader(http.StatusOK)
	w.Write(openAPIDoc)
}

// serverMetrics counts HTTP requests by route and status.
type serverMetrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	execs    prometheus.Counter
}

func newServerMetrics(reg *prometheus.Registry) *serverMetrics {
	m := &serverMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandgate_http_requests_total",
			Help: "HTTP requests by route and status.",
		}, []string{"route", "status"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "sandgate_http_request_seconds",
			Help:    "Time to the end of a response, by route (exec streams and tunnels run as long as they do).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10),
		}, []string{"route"}),
		execs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sandgate_exec_processes_total",
			Help: "Commands started by exec.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.duration, m.execs)
	}
	return m
}

// instrument counts a route's requests.
func (m *serverMetrics) instrument(route string, h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
		h(sw, r)
		m.requests.WithLabelValues(route, strconv.Itoa(sw.code)).Inc()
		m.duration.WithLabelValues(route).Observe(time.Since(start).Seconds())
	})
}

// statusWriter notes the status a handler wrote; Unwrap lets
// ResponseController reach the connection (flush, hijack, full duplex).
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	w.code = code
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
