package server

import (
	"bufio"
	_ "embed"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/relay/audit"
)

// audit serves a sandbox's egress events, running or suspended, that the
// query selects (since, until: RFC 3339 times; decision; host; cursor;
// limit): a page as one JSON object, {"events": [...], "cursor": "...",
// "more": bool}, each event the bytes of its audit line; or with follow,
// every one so far then each new one as it happens, one line each, across
// suspends and resumes, until the caller leaves or the sandbox is
// destroyed.
func (s *Server) audit(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		return err
	}
	q, err := auditQuery(r.URL.Query())
	if err != nil {
		return err
	}
	if f := r.URL.Query().Get("follow"); f == "" || f == "0" {
		page, err := s.b.AuditEvents(r.Context(), name, q)
		if err != nil {
			return err
		}
		b := []byte(`{"events":[`)
		for i, l := range page.Lines {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, l...)
		}
		b = append(b, `],"cursor":`...)
		b = strconv.AppendQuote(b, page.Next.String())
		b = append(b, `,"more":`...)
		b = strconv.AppendBool(b, page.More)
		b = append(b, "}\n"...)
		w.Header().Set("Content-Type", "application/json")
		w.Write(b)
		return nil
	}
	rc := http.NewResponseController(w)
	started := false
	buf := make([]byte, 0, 1024)
	err = s.b.FollowAudit(r.Context(), name, q, func(line []byte) error {
		if !started {
			started = true
			w.Header().Set("Content-Type", "application/x-ndjson")
			w.WriteHeader(http.StatusOK)
			if line == nil {
				return rc.Flush() // the stream is open
			}
		}
		buf = append(append(buf[:0], line...), '\n') // nil: a keep-alive, an empty line
		if _, err := w.Write(buf); err != nil {
			return err
		}
		return rc.Flush()
	})
	if started {
		return nil // the stream ended; its status is long sent
	}
	return err
}

// auditQuery reads an audit request's query: each bad value is named.
func auditQuery(v url.Values) (audit.Query, error) {
	var q audit.Query
	for _, k := range []string{"since", "until"} {
		s := v.Get(k)
		if s == "" {
			continue
		}
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			return q, badRequest("%s %q: want an RFC 3339 time such as 2025-06-01T00:00:00Z", k, audit.Truncate(s, 80))
		}
		if k == "since" {
			q.Since = t
		} else {
			q.Until = t
		}
	}
	q.Decision, q.Host = v.Get("decision"), v.Get("host")
	var err error
	if q.After, err = audit.ParseCursor(v.Get("cursor")); err != nil {
		return q, badRequest("cursor: %v", err)
	}
	if l := v.Get("limit"); l != "" {
		if q.Limit, err = strconv.Atoi(l); err != nil || q.Limit < 1 {
			return q, badRequest("limit %q: want 1 to %d", audit.Truncate(l, 20), audit.MaxLimit)
		}
	}
	if err := q.Check(); err != nil {
		return q, badRequest("%v", err)
	}
	return q, nil
}

// setModules replaces a sandbox's own WebAssembly transform modules:
// {"modules":[{"name":..., "wasm": base64, "config": string}]}, each loaded
// and checked as `sandgate wasm check` does, run after the service's and
// before the credential swap, and kept with the sandbox across suspend
// and resume. An empty list removes them. The body is read as it streams
// in, each module decoded into a temporary file (moduleBody): what the
// service holds of an upload is the module it is compiling, a bounded
// number at a time (503 with Retry-After when too many wait).
func (s *Server) setModules(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	limit := maxModulesPerBody * (s.cfg.MaxModuleBytes*4/3 + 4 + 6*maxModuleConfig + 64<<10)
	mb := &moduleBody{br: bufio.NewReaderSize(http.MaxBytesReader(w, r.Body, limit), 64<<10), dir: s.cfg.TempDir, maxModule: s.cfg.MaxModuleBytes}
	defer mb.cleanup()
	srcs, err := mb.read()
	if err != nil {
		return err
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
