// Package server is sandgate's HTTP service over the lifecycle manager:
// protocol 1 of ai-sdk-sandbox-cloud-run (so its TypeScript client works
// unchanged) and sandgate's own routes beside it under /v1. It keeps no
// state of its own about a sandbox: handlers parse, call the Backend, and
// write; a handler returns its error, and what an error means becomes a
// status in one place (status).
package server

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// Config is what a Server serves. Backend is required.
type Config struct {
	// Backend runs the sandboxes: the lifecycle manager.
	Backend Backend
	// Token, when not empty, is the service token every request and
	// tunnel must carry (compared in constant time).
	Token string
	// LocalOnly says the service listens on loopback without a token:
	// then a request a browser sent (one with an Origin header) and one
	// for a host name other than localhost or an IP address (a DNS
	// rebinding) are refused, so that no web page can drive the sandboxes.
	LocalOnly bool
	// LocalHosts are more host names LocalOnly answers for (a compose
	// service's name, say), compared without letter case.
	LocalHosts []string
	// Version is the implementation version /health reports.
	Version string
	// Home and WorkDir are a sandbox's home and working directory;
	// "{sandbox}" is replaced by its name. Defaults /home/agent and
	// /workspace.
	Home, WorkDir string
	// Path is the PATH of sandbox commands; default the usual system one.
	Path string
	// EgressPort is the relay's port inside sandboxes; 0 picks one.
	EgressPort int
	// Metrics, when set, is served at /metrics, with the server's own
	// metrics registered on it.
	Metrics *prometheus.Registry
	// WaitTimeout is the longest a wait call waits; default 5 minutes.
	WaitTimeout time.Duration
	// Logger receives the server's events; nil discards. Commands, their
	// variables and credentials are never logged.
	Logger *slog.Logger
	// OpenAPI is the document GET /v1/openapi.json serves; nil means the
	// server's own (OpenAPI). The service gives the one document of all
	// its routes, the Cloudflare bridge's included.
	OpenAPI []byte
	// MaxModuleBytes is the largest WebAssembly module PUT …/modules takes
	// (413 past it), as the module runtime's wasm.Config.MaxModuleBytes;
	// 0 means wasm.DefaultMaxModuleBytes. TempDir is where an upload's
	// modules are decoded to on their way to the runtime; "" means
	// os.TempDir.
	MaxModuleBytes int64
	TempDir        string
}

func (c Config) withDefaults() Config {
	if c.Home == "" {
		c.Home = "/home/agent"
	}
	if c.WorkDir == "" {
		c.WorkDir = "/workspace"
	}
	if c.Path == "" {
		c.Path = agent.DefaultPath
	}
	if c.WaitTimeout <= 0 {
		c.WaitTimeout = 5 * time.Minute
	}
	if c.MaxModuleBytes <= 0 {
		c.MaxModuleBytes = wasm.DefaultMaxModuleBytes
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Server is the HTTP service. It is an http.Handler.
type Server struct {
	cfg      Config
	b        Backend
	mux      *http.ServeMux
	token    [32]byte // sha256 of the token
	log      *slog.Logger
	met      *serverMetrics
	patterns []string // every route, for the OpenAPI check
}

// New builds the server.
func New(cfg Config) (*Server, error) {
	if cfg.Backend == nil {
		return nil, errors.New("server: Config needs a Backend")
	}
	cfg = cfg.withDefaults()
	s := &Server{cfg: cfg, b: cfg.Backend, mux: http.NewServeMux(), log: cfg.Logger}
	s.token = sha256.Sum256([]byte(cfg.Token))
	s.met = newServerMetrics(cfg.Metrics)
	s.routes()
	return s, nil
}

// Close does nothing: the server keeps nothing that needs stopping (the
// backend and an http.Server serving it are their owners' to stop). It
// is kept for callers written when it did.
func (s *Server) Close() {}

// handler is a route's handler: it writes its answer, or returns the
// error that is the answer (written by route, through status).
type handler func(w http.ResponseWriter, r *http.Request) error

// route registers one route.
func (s *Server) route(pattern string, h handler) {
	s.patterns = append(s.patterns, pattern)
	s.mux.Handle(pattern, s.met.instrument(pattern, func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			writeError(w, err)
		}
	}))
}

func (s *Server) routes() {
	// Protocol 1.
	s.route("GET /health", s.health)
	s.route("POST /v1/sandboxes", s.create)
	s.route("POST /v1/sandboxes/{name}/resume", s.resume)
	s.route("POST /v1/sandboxes/{name}/suspend", s.suspend)
	s.route("DELETE /v1/sandboxes/{name}", s.destroy)
	s.route("POST /v1/sandboxes/{name}/exec", s.exec)
	s.route("GET /v1/sandboxes/{name}/processes/{pid}", s.wait)
	s.route("DELETE /v1/sandboxes/{name}/processes/{pid}", s.kill)
	s.route("DELETE /v1/sandboxes/{name}/processes", s.killAll)
	s.route("POST /v1/sandboxes/{name}/transformations", s.addTransformations)
	s.route("PUT /v1/sandboxes/{name}/transformations", s.setTransformations)
	s.route("PUT /v1/sandboxes/{name}/network", s.setNetwork)
	s.route("POST /v1/sandboxes/{name}/template", s.saveTemplate)
	s.route("GET /v1/templates/{id}", s.templateExists)
	s.route("DELETE /v1/templates/{id}", s.deleteTemplate)
	// sandgate's own.
	s.route("GET /v1/openapi.json", s.openAPI)
	s.route("GET /v1/sandboxes", s.list)
	s.route("GET /v1/sandboxes/{name}", s.get)
	s.route("GET /v1/templates", s.listTemplates)
	s.route("POST /v1/sandboxes/{name}/fork", s.fork)
	s.route("GET /v1/sandboxes/{name}/files/{path...}", s.readFile)
	s.route("PUT /v1/sandboxes/{name}/files/{path...}", s.writeFile)
	s.route("GET /v1/sandboxes/{name}/workspace", s.workspaceOut)
	s.route("PUT /v1/sandboxes/{name}/workspace", s.workspaceIn)
	s.route("GET /v1/sandboxes/{name}/processes/{pid}/output", s.output)
	s.route("PUT /v1/sandboxes/{name}/modules", s.setModules)
	s.route("GET /v1/sandboxes/{name}/audit", s.audit)
	s.route("GET /v1/sandboxes/{name}/tcp/{port}", s.tcpBridge)
	s.route("GET /v1/sandboxes/{name}/pty", s.pty)
	if s.cfg.Metrics != nil {
		metrics := promhttp.HandlerFor(s.cfg.Metrics, promhttp.HandlerOpts{})
		s.route("GET /metrics", func(w http.ResponseWriter, r *http.Request) error { metrics.ServeHTTP(w, r); return nil })
	}
}

// Patterns lists the routes the server serves ("METHOD /path"), for the
// OpenAPI document's test.
func (s *Server) Patterns() []string { return append([]string(nil), s.patterns...) }

// ServeHTTP applies protocol 1's checks, sends an Upgrade to the port
// tunnel, and routes the rest.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set(api.HeaderProtocol, "1")
	if !s.Authorize(w, r) {
		return
	}
	if isTunnel(r) {
		s.tunnel(w, r)
		return
	}
	if r.Method == http.MethodHead && r.URL.Path != "/health" {
		// ServeMux would run a GET handler for it: a whole tar, a whole
		// file, an endless follow, for nothing.
		w.Header().Set("Allow", "GET")
		writeJSON(w, http.StatusMethodNotAllowed, api.Error{Error: "HEAD is not served here: use GET"})
		return
	}
	h, pattern := s.mux.Handler(r)
	if pattern == "" {
		// No route: 404, or 405 when the path has routes for other
		// methods. ServeMux knows which; the body is ours.
		rec := &statusRecorder{header: http.Header{}}
		h.ServeHTTP(rec, r)
		if allow := rec.header.Get("Allow"); allow != "" {
			w.Header().Set("Allow", allow)
		}
		code := rec.code
		if code != http.StatusMethodNotAllowed {
			code = http.StatusNotFound
		}
		if code == http.StatusNotFound {
			writeJSON(w, code, api.Error{Error: "no route " + r.Method + " " + r.URL.Path + " (see /v1/openapi.json)"})
		} else {
			writeJSON(w, code, api.Error{Error: "method " + r.Method + " is not allowed on " + r.URL.Path + " (allowed: " + w.Header().Get("Allow") + ")"})
		}
		return
	}
	s.mux.ServeHTTP(w, r)
}

// isTunnel says whether r is for protocol 1's port tunnel: any request
// with Upgrade but to sandgate's own WebSocket routes.
func isTunnel(r *http.Request) bool {
	return r.Header.Get("Upgrade") != "" && !isWebSocketRoute(r.URL.Path)
}

// Authorize applies protocol 1's checks to r (check; /health is exempt,
// but not for a tunnel) and reports whether it may go on; when not, it
// has answered, as ServeHTTP does (on the raw connection for a tunnel).
// The forwarding front asks it before sending a request to another shard
// with this shard's own credentials.
func (s *Server) Authorize(w http.ResponseWriter, r *http.Request) bool {
	tunnel := isTunnel(r)
	if r.URL.Path == "/health" && !tunnel {
		return true
	}
	if err := s.check(r); err != nil {
		if tunnel {
			rawStatus(w, status(err))
		} else {
			w.Header().Set(api.HeaderProtocol, "1")
			writeError(w, err)
		}
		return false
	}
	return true
}

// check is protocol 1's two checks, in order: the protocol header (absent
// is fine), then the service token. Either header sent twice is a 400, not
// "the first one wins": a request that says two things is refused rather
// than read one way here and another way by whatever stands in front.
func (s *Server) check(r *http.Request) error {
	if v, ok := r.Header[http.CanonicalHeaderKey(api.HeaderProtocol)]; ok {
		if len(v) > 1 {
			return badRequest("%s is sent %d times: send it once, as 1", api.HeaderProtocol, len(v))
		}
		if len(v) == 0 || v[0] != "1" {
			return badRequest("this service speaks protocol 1; the request says %s %q: update the client", api.HeaderProtocol, strings.Join(v, ","))
		}
	}
	if v := r.Header.Values(api.HeaderToken); len(v) > 1 {
		return badRequest("%s is sent %d times: send the service token once", api.HeaderToken, len(v))
	}
	if s.cfg.LocalOnly {
		if r.Header.Get("Origin") != "" {
			return errorf(http.StatusForbidden, "a request from a web page (it has an Origin header) is refused: this service has no token; give it one (SANDBOX_SERVICE_TOKEN) to be called from elsewhere")
		}
		if host, ok := LocalHost(r.Host, s.cfg.LocalHosts); !ok {
			return errorf(http.StatusForbidden, "host %q is refused: without a token this service answers only for localhost, IP addresses and the names in SANDGATE_LOCAL_HOSTNAMES (a DNS rebinding defence); add %q to SANDGATE_LOCAL_HOSTNAMES, or set SANDBOX_SERVICE_TOKEN", host, host)
		}
	}
	if s.cfg.Token != "" {
		got := sha256.Sum256([]byte(r.Header.Get(api.HeaderToken)))
		if subtle.ConstantTimeCompare(got[:], s.token[:]) != 1 {
			return errorf(http.StatusUnauthorized, "missing or wrong %s: give the service token", api.HeaderToken)
		}
	}
	return nil
}

// LocalHost says whether a request's Host (with or without a port) is one
// a service without a token answers for: localhost, an IP address, or one
// of names (SANDGATE_LOCAL_HOSTNAMES), in any letter case; host is it
// without its port. The API and the console (api/console) share it.
func LocalHost(hostport string, names []string) (host string, ok bool) {
	host = hostport
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	named := strings.EqualFold(host, "localhost") || slices.ContainsFunc(names, func(h string) bool { return strings.EqualFold(h, host) })
	_, err := netip.ParseAddr(strings.Trim(host, "[]"))
	return host, err == nil || named
}

// statusRecorder captures what ServeMux's own 404/405 handlers write.
type statusRecorder struct {
	header http.Header
	code   int
}

func (r *statusRecorder) Header() http.Header         { return r.header }
func (r *statusRecorder) Write(p []byte) (int, error) { return len(p), nil }
func (r *statusRecorder) WriteHeader(code int)        { r.code = code }

func (s *Server) health(w http.ResponseWriter, r *http.Request) error {
	writeJSON(w, http.StatusOK, api.Health{Status: "ok", Protocol: api.ProtocolVersion, Version: s.cfg.Version, OK: true})
	return nil
}

// awake makes sandbox name run for a route that needs it running,
// checked before the route reads its body: a sandbox the service
// suspended on its own (idle, stopping, a shard that died) is resumed as
// it was; one its caller suspended is protocol 1's "not running" (404)
// until resumed; one neither running nor suspended is 404 too.
func (s *Server) awake(ctx context.Context, name string) error {
	if _, err := s.b.Wake(ctx, name, appliance.ResumeOptions{Agent: s.agentConfig(name), Dirs: s.dirs(name)}); err != nil {
		return err
	}
	return nil
}

// agentConfig is what every sandbox's agent starts with: the service's
// PATH and the sandbox's home, the relay port, and no base URLs of its
// own (each command gets the sandbox's from the manager).
func (s *Server) agentConfig(name string) *agent.Config {
	return &agent.Config{
		RelayAddr:    fmt.Sprintf("127.0.0.1:%d", s.cfg.EgressPort),
		Path:         s.cfg.Path,
		Home:         sandboxDir(s.cfg.Home, name),
		OnlyBaseURLs: true,
	}
}

// AgentConfig is the agent configuration a sandbox of this service starts
// with, for another front door (the Cloudflare bridge) starting one.
func (s *Server) AgentConfig(name string) *agent.Config { return s.agentConfig(name) }

// Dirs are the directories made for a sandbox: its home and working
// directory.
func (s *Server) Dirs(name string) []string { return s.dirs(name) }

// sandboxDir expands {sandbox} in a configured directory.
func sandboxDir(pattern, name string) string { return strings.ReplaceAll(pattern, "{sandbox}", name) }

func (s *Server) describe(name string) api.Description {
	return api.Description{Name: name, Home: sandboxDir(s.cfg.Home, name), WorkingDirectory: sandboxDir(s.cfg.WorkDir, name)}
}
