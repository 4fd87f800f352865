// Package bridge serves the HTTP contract of the Cloudflare sandbox SDK's
// bridge (@cloudflare/sandbox 0.12's /v1/sandbox/... routes, exec as
// server-sent events, sessions, files, workspace tars, pool statistics)
// over the same sandboxes as protocol 1 and sandgate's /v1: a second front
// door onto the lifecycle manager, so that the bridge's clients run
// unchanged and their sandboxes get what that bridge never had: an egress
// policy, credential swap, audit, suspend and resume.
//
// It keeps no state of its own about a sandbox: handlers parse, call the
// Backend and write, and an error becomes the contract's status and code
// in one place (answer). Every route needs Authorization: Bearer with the
// service's SANDBOX_API_KEY; without a key configured every route is
// refused, never open.
package bridge

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
)

// DefaultMaxBody caps a file write and a hydrate body when Config.MaxBody
// is zero (the agent caps a file at 1 GiB itself).
const DefaultMaxBody = 1 << 30

// MinKeyLength is the shortest SANDBOX_API_KEY the bridge accepts.
const MinKeyLength = 16

// Config is what a Bridge serves. Backend is required.
type Config struct {
	// Backend runs the sandboxes: the lifecycle manager.
	Backend Backend
	// Key is SANDBOX_API_KEY: every route needs Authorization: Bearer
	// <Key> (the scheme in any letter case), compared in constant time.
	// Empty: every route is refused (401), never open.
	Key string
	// Network is where the sandboxes the bridge starts may go, on top of
	// the service's own allowed hosts and base URLs.
	Network appliance.NetworkSpec
	// MaxBody caps a file write and a hydrate request body; 0 means
	// DefaultMaxBody.
	MaxBody int64
	// Agent and Dirs give a sandbox's agent configuration and the
	// directories made for it, as the rest of the service does; nil means
	// the manager's configuration and /workspace alone.
	Agent func(id string) *agent.Config
	Dirs  func(id string) []string
	// OpenAPI is what GET /v1/openapi.json serves to a caller with the
	// key: the service's one document (MergeOpenAPI); nil means the
	// bridge's part alone.
	OpenAPI []byte
	// Metrics, when set, registers the bridge's request counts.
	Metrics prometheus.Registerer
	// Logger receives the bridge's events; nil discards. Commands, their
	// variables and the key are never logged.
	Logger *slog.Logger
}

// Bridge is the bridge's HTTP front door. It is an http.Handler for the
// requests it Owns; Front puts it before the rest of the service.
type Bridge struct {
	cfg      Config
	b        Backend
	mux      *http.ServeMux
	key      [32]byte // sha256 of the key
	doc      []byte
	log      *slog.Logger
	requests *prometheus.CounterVec
	patterns []string
}

// New builds the bridge.
func New(cfg Config) (*Bridge, error) {
	if cfg.Backend == nil {
		return nil, errors.New("bridge: Config needs a Backend")
	}
	if cfg.Key != "" && len(cfg.Key) < MinKeyLength {
		return nil, errors.New("bridge: SANDBOX_API_KEY is shorter than 16 characters: use a random one, such as `openssl rand -hex 32`")
	}
	if strings.TrimSpace(cfg.Key) != cfg.Key {
		return nil, errors.New("bridge: SANDBOX_API_KEY begins or ends with white space, which no Authorization header can carry")
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	b := &Bridge{cfg: cfg, b: cfg.Backend, mux: http.NewServeMux(), log: cfg.Logger, doc: cfg.OpenAPI}
	if b.doc == nil {
		b.doc = Document()
	}
	b.key = sha256.Sum256([]byte(cfg.Key))
	b.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "sandgate_bridge_requests_total",
		Help: "Requests of the Cloudflare bridge's routes, by route and status.",
	}, []string{"route", "status"})
	if cfg.Metrics != nil {
		if err := cfg.Metrics.Register(b.requests); err != nil {
			return nil, err
		}
	}
	b.routes()
	return b, nil
}

// handler is a route's handler: it writes its answer, or returns the
// error that is the answer, answered as f says (failure).
type handler func(w http.ResponseWriter, r *http.Request) error

func (b *Bridge) route(pattern string, f failure, h handler) {
	b.patterns = append(b.patterns, pattern)
	b.mux.Handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
		defer func() { b.requests.WithLabelValues(pattern, strconv.Itoa(sw.code)).Inc() }()
		if strings.Contains(pattern, "{id}") {
			if err := checkSandboxID(r.PathValue("id")); err != nil {
				writeError(sw, err, f)
				return
			}
		}
		if err := h(sw, r); err != nil {
			writeError(sw, err, f)
		}
	}))
}

func (b *Bridge) routes() {
	b.route("POST /v1/sandbox", poolFailure, b.create)
	b.route("DELETE /v1/sandbox/{id}", poolFailure, b.destroy)
	b.route("GET /v1/sandbox/{id}/running", poolFailure, b.running)
	b.route("POST /v1/sandbox/{id}/exec", execFailure, b.exec)
	b.route("GET /v1/sandbox/{id}/exec/{pid}", execFailure, b.execOutput)
	b.route("POST /v1/sandbox/{id}/session", sessionFailure, b.createSession)
	b.route("DELETE /v1/sandbox/{id}/session/{sid}", sessionFailure, b.deleteSession)
	b.route("GET /v1/sandbox/{id}/file/{path...}", readFailure, b.readFile)
	b.route("PUT /v1/sandbox/{id}/file/{path...}", writeFailure, b.writeFile)
	b.route("POST /v1/sandbox/{id}/hydrate", hydrateFailure, b.hydrate)
	b.route("POST /v1/sandbox/{id}/persist", persistFailure, b.persist)
	b.route("POST /v1/sandbox/{id}/tunnel/{port}", tunnelFailure, b.createTunnel)
	b.route("DELETE /v1/sandbox/{id}/tunnel/{port}", tunnelFailure, b.deleteTunnel)
	b.route("/v1/sandbox/{id}/tunnel/{port}/{rest...}", tunnelFailure, b.tunnel)
	b.route("POST /v1/sandbox/{id}/mount", poolFailure, b.mount)
	b.route("POST /v1/sandbox/{id}/unmount", poolFailure, b.unmount)
	b.route("GET /v1/sandbox/{id}/pty", termFailure, b.pty)
	b.route("GET /v1/pool/stats", poolFailure, b.poolStats)
	b.route("POST /v1/pool/prime", poolFailure, b.poolNoop)
	b.route("POST /v1/pool/shutdown-prewarmed", poolFailure, b.poolNoop)
	b.route("GET /v1/openapi.json", poolFailure, b.openAPI)
}

// Patterns lists the routes the bridge serves ("METHOD /path", or "/path"
// for every method), for the OpenAPI document's test.
func (b *Bridge) Patterns() []string { return slices.Clone(b.patterns) }

// Owns reports whether a request is the bridge's: every request under
// /v1/sandbox (singular) and /v1/pool; with a key configured, GET
// /v1/openapi.json when it carries the key (the same document is served to
// protocol 1's callers by the rest of the service), and any request that
// presents a bridge key that is wrong, on any route, so that it gets the
// bridge's 401 rather than what the rest of the service would answer
// without one (a bridge client's preflight must not pass with a wrong
// key).
func (b *Bridge) Owns(r *http.Request) bool {
	switch {
	case bridgePath(r.URL.Path):
		return true
	case b.cfg.Key == "" || !presentsKey(r):
		return false
	}
	return r.URL.Path == "/v1/openapi.json" || b.authorize(r) != nil
}

// bridgePath says whether p is under the bridge's own routes: /v1/sandbox
// (singular) and /v1/pool.
func bridgePath(p string) bool {
	return p == "/v1/sandbox" || strings.HasPrefix(p, "/v1/sandbox/") || p == "/v1/pool" || strings.HasPrefix(p, "/v1/pool/")
}

// presentsKey says whether r presents a bridge key, right or wrong: an
// Authorization header with the Bearer scheme whose token is not an
// identity token (a JWT, which Cloud Run's IAM checks and protocol 1's
// clients send on every call), an Authorization header sent twice, or
// ?token= on /v1/openapi.json.
func presentsKey(r *http.Request) bool {
	switch v := r.Header.Values("Authorization"); {
	case len(v) > 1:
		return true
	case len(v) == 1:
		scheme, token, _ := strings.Cut(v[0], " ")
		return strings.EqualFold(scheme, "bearer") && !isJWT(token)
	}
	return r.URL.Path == "/v1/openapi.json" && r.URL.Query().Has("token")
}

// isJWT says whether a token has a JWT's shape: three base64url parts, the
// first a JSON object's encoding.
func isJWT(token string) bool {
	return strings.HasPrefix(token, "eyJ") && strings.Count(token, ".") == 2
}

// Front is the service with the bridge before it: requests the bridge
// Owns go to it, all others to rest.
func (b *Bridge) Front(rest http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if b.Owns(r) {
			if !bridgePath(r.URL.Path) {
				w.Header().Set(api.HeaderProtocol, "1") // protocol 1's route: its answers say so
			}
			b.ServeHTTP(w, r)
			return
		}
		rest.ServeHTTP(w, r)
	})
}

// ServeHTTP checks the key, then routes. No route is 404 (405 with Allow
// for another method), in the contract's error shape.
func (b *Bridge) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !b.Authorize(w, r) {
		return
	}
	if _, pattern := b.mux.Handler(r); pattern == "" {
		rec := &statusRecorder{header: http.Header{}}
		h, _ := b.mux.Handler(r)
		h.ServeHTTP(rec, r)
		switch {
		case rec.code == http.StatusMethodNotAllowed:
			w.Header().Set("Allow", rec.header.Get("Allow"))
			writeJSON(w, rec.code, ErrorBody{Error: "method " + r.Method + " is not allowed on " + r.URL.Path + " (allowed: " + rec.header.Get("Allow") + ")", Code: codeInvalid})
		case rec.code/100 == 3: // ServeMux's redirect to the clean path
			for k, v := range rec.header {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.code)
		default:
			writeJSON(w, http.StatusNotFound, ErrorBody{Error: "no route " + r.Method + " " + r.URL.Path + " (see /v1/openapi.json)", Code: codeInvalid})
		}
		return
	}
	b.mux.ServeHTTP(w, r)
}

// Authorize checks r's key and reports whether it may go on; when not, it
// has answered the contract's 401. The forwarding front asks it before
// sending a request the bridge Owns to another shard with this shard's
// own credentials.
func (b *Bridge) Authorize(w http.ResponseWriter, r *http.Request) bool {
	if err := b.authorize(r); err != nil {
		writeError(w, err, poolFailure)
		return false
	}
	return true
}

// authorize checks the key: Authorization: Bearer <key> (the scheme in any
// letter case, sent once), or for the OpenAPI document ?token=<key> as
// the contract allows.
func (b *Bridge) authorize(r *http.Request) error {
	if b.cfg.Key == "" {
		return fail(http.StatusUnauthorized, codeUnauthorized, "Unauthorized: the Cloudflare bridge is closed on this service (no SANDBOX_API_KEY); set SANDBOX_API_KEY and send Authorization: Bearer <key>")
	}
	var token string
	switch v := r.Header.Values("Authorization"); {
	case len(v) > 1:
		return fail(http.StatusUnauthorized, codeUnauthorized, "Unauthorized: Authorization is sent %d times; send Bearer <SANDBOX_API_KEY> once", len(v))
	case len(v) == 1 && len(v[0]) > len("bearer ") && strings.EqualFold(v[0][:len("bearer ")], "bearer "):
		token = v[0][len("bearer "):]
	case len(v) == 0 && r.URL.Path == "/v1/openapi.json" && len(r.URL.Query()["token"]) == 1:
		token = r.URL.Query().Get("token")
	}
	got := sha256.Sum256([]byte(token))
	if token == "" || subtle.ConstantTimeCompare(got[:], b.key[:]) != 1 {
		return fail(http.StatusUnauthorized, codeUnauthorized, "Unauthorized: send Authorization: Bearer <SANDBOX_API_KEY>")
	}
	return nil
}

// ensure makes sandbox id run, as the contract's pool does before any
// route under an id: running, it is used as it is; suspended (for
// whatever reason: the contract knows no suspended sandbox), it is
// resumed with the network kept with it, or the bridge's when none was
// kept; unknown, it is created when create says so (any well-formed id
// may be used without POST /v1/sandbox).
func (b *Bridge) ensure(ctx context.Context, id string, create bool) error {
	var err error
	for range 4 {
		var in appliance.Info
		in, err = b.b.Get(ctx, id)
		switch {
		case err == nil && in.State == appliance.Running:
			return nil
		case err == nil && in.State == appliance.Suspended:
			// A suspended sandbox describes the network kept with it.
			_, err = b.b.Resume(ctx, id, appliance.ResumeOptions{Network: b.cfg.Network, KeepNetwork: in.Policy != nil, Agent: b.agent(id), Dirs: b.dirs(id)})
			if !errors.Is(err, appliance.ErrNotFound) {
				return err
			}
			continue // destroyed meanwhile
		case err != nil && !errors.Is(err, appliance.ErrNotFound):
			return err
		case err != nil && !create:
			return err
		}
		// Unknown, or starting or suspending: a create waits for what is
		// in progress on the id and says what it became.
		_, err = b.b.Create(ctx, id, appliance.CreateOptions{Network: b.cfg.Network, Agent: b.agent(id), Dirs: b.dirs(id)})
		if err == nil {
			b.log.Info("bridge: sandbox created on first use", "sandbox", id)
			return nil
		}
		if !errors.Is(err, appliance.ErrExists) {
			return err
		}
	}
	return err
}

func (b *Bridge) agent(id string) *agent.Config {
	if b.cfg.Agent == nil {
		return nil
	}
	return b.cfg.Agent(id)
}

func (b *Bridge) dirs(id string) []string {
	var d []string
	if b.cfg.Dirs != nil {
		d = b.cfg.Dirs(id)
	}
	if !slices.Contains(d, Workspace) {
		d = append(d, Workspace)
	}
	return d
}

// statusWriter notes the status a handler wrote, for the metrics.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	w.code = code
	w.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach the connection (flush,
// hijack, deadlines).
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// statusRecorder captures what ServeMux's own 404/405 handlers write.
type statusRecorder struct {
	header http.Header
	code   int
}

func (r *statusRecorder) Header() http.Header         { return r.header }
func (r *statusRecorder) Write(p []byte) (int, error) { return len(p), nil }
func (r *statusRecorder) WriteHeader(code int)        { r.code = code }

// now is the clock of timestamps in replies.
func now() string { return time.Now().UTC().Format(time.RFC3339Nano) }
