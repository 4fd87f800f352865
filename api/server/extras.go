package server

import (
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/appliance"
)

// audit serves a sandbox's egress decisions: the ones kept, as JSON, or
// with ?follow=1 those as they happen, one JSON line each.
func (s *Server) audit(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		return err
	}
	if r.URL.Query().Get("follow") == "" || r.URL.Query().Get("follow") == "0" {
		events, err := s.b.AuditEvents(r.Context(), name)
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, map[string]any{"events": events})
		return nil
	}
	kept, f, gone, stop, err := s.b.FollowAudit(name)
	if err != nil {
		return err
	}
	defer stop()
	w.Header().Set("Content-Type", "application/x-ndjson")
	rc := http.NewResponseController(w)
	w.WriteHeader(http.StatusOK)
	rc.Flush()
	enc := json.NewEncoder(w)
	for _, e := range kept {
		if enc.Encode(e) != nil {
			return nil
		}
	}
	rc.Flush()
	keepalive := time.NewTicker(30 * time.Second)
	defer keepalive.Stop()
	for {
		select {
		case <-r.Context().Done():
			return nil
		case <-gone:
			return nil
		case e := <-f.C:
			if enc.Encode(e) != nil {
				return nil
			}
			rc.Flush()
		case <-keepalive.C:
			if _, err := w.Write([]byte("\n")); err != nil {
				return nil
			}
			rc.Flush()
		}
	}
}

// setModules replaces a sandbox's own WebAssembly transform modules:
// {"modules":[{"name":..., "wasm": base64, "config": string}]}, each loaded
// and checked as `sandgate wasm check` does, run after the service's and
// before the credential swap, and kept with the sandbox across suspend
// and resume. An empty list removes them.
func (s *Server) setModules(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := s.mustRun(r.Context(), name); err != nil {
		return err
	}
	o, err := readObject(r, 64<<20)
	if err != nil {
		return err
	}
	if err := o.only("modules", "modules"); err != nil {
		return err
	}
	var items []json.RawMessage
	if raw, ok := o["modules"]; !ok || !isJSONArray(raw) || json.Unmarshal(raw, &items) != nil {
		return badRequest("field \"modules\" must be a list of {name, wasm (base64), config}")
	}
	var srcs []appliance.ModuleSource
	for i, item := range items {
		mo, err := parseObject(item)
		if err != nil || !isJSONObject(item) {
			return badRequest("modules[%d]: want {name, wasm (base64), config}", i)
		}
		if err := mo.only(fmt.Sprintf("modules[%d]", i), "name", "wasm", "config"); err != nil {
			return err
		}
		modName, _, err := mo.str("name")
		if err != nil {
			return badRequest("modules[%d]: %v", i, err)
		}
		wasm, _, err := mo.str("wasm")
		if err != nil {
			return badRequest("modules[%d]: %v", i, err)
		}
		config, _, err := mo.str("config")
		if err != nil {
			return badRequest("modules[%d]: %v", i, err)
		}
		bin, err := base64.StdEncoding.DecodeString(wasm)
		if err != nil || modName == "" || len(bin) == 0 {
			return badRequest("modules[%d]: want a name and the module's bytes in base64", i)
		}
		srcs = append(srcs, appliance.ModuleSource{Name: modName, Wasm: bin, Config: []byte(config)})
	}
	if err := s.b.SetModules(r.Context(), name, srcs); err != nil {
		return err
	}
	noContent(w)
	return nil
}

//go:embed openapi.json
var openAPIDoc []byte

// OpenAPI is the server's own OpenAPI document: protocol 1's routes and
// sandgate's /v1.
func OpenAPI() []byte { return slices.Clone(openAPIDoc) }

func (s *Server) openAPI(w http.ResponseWriter, r *http.Request) error {
	doc := s.cfg.OpenAPI
	if doc == nil {
		doc = openAPIDoc
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(doc)))
	w.WriteHeader(http.StatusOK)
	w.Write(doc)
	return nil
}

// serverMetrics counts HTTP requests by route and status.
type serverMetrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
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
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.duration)
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
