// Package console is sandgate's web console, served by `serve` at /ui: the
// sandboxes with their state, shard, age, idle time and use; one
// sandbox's network policy, credential rules (hosts and header names,
// never a value), modules, sessions and live audit stream, each refusal
// with its reason and the fix; charts of egress over time from the
// durable audit; and suspend, resume and destroy, each asked first.
//
// It is a thin front door like api/server: pages are rendered on the
// server (html/template) from a Backend the manager satisfies, and it
// keeps no state of its own about a sandbox. Its static files (a
// stylesheet, one small script, and uPlot for the charts) are embedded in
// the binary; nothing is built.
//
// Invariants:
//   - Nothing under /ui answers without the service's auth but the sign-in
//     page and the stylesheet it uses: with a service token, a request
//     carries it (x-ai-sdk-sandbox-token) or a session cookie signed with a
//     key derived from it (never the token itself); without one the
//     console is as open as the API (loopback, with the same DNS-rebinding
//     guard, or behind Cloud Run's IAM).
//   - A state-changing request is a POST from the console's own pages: its
//     CSRF token, Origin and Sec-Fetch-Site are checked; it acts only once
//     confirmed (a confirmation page, or the script's confirm()).
//   - Every answer carries a Content-Security-Policy without inline script
//     (frame-ancestors 'none'), nosniff and no-referrer; every answer with
//     data is Cache-Control: no-store.
//   - No page, fragment or stream holds a credential's value: rules are
//     described by host and header names, sessions by variable names.
package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
)

// Config is what a Console serves. Backend is required.
type Config struct {
	Backend Backend
	// Token is the service token (SANDBOX_SERVICE_TOKEN): without it the
	// console is open, as the API is.
	Token string
	// LocalOnly and LocalHosts are the API's: the service listens on
	// loopback without a token, and answers only for localhost, IP
	// addresses and these names (a DNS-rebinding defence).
	LocalOnly  bool
	LocalHosts []string
	// Agent and Dirs are what a sandbox this service resumes starts with
	// (the API's: api/server.Server's AgentConfig and Dirs); nil means
	// the manager's default agent and no directories.
	Agent func(name string) *agent.Config
	Dirs  func(name string) []string
	// Version is shown in the footer.
	Version string
	// MaxChartEvents caps the audit events one chart reads (the page says
	// when it was reached); 0 means DefaultMaxChartEvents.
	MaxChartEvents int
	// SessionTTL is how long a sign-in lasts; 0 means DefaultSessionTTL.
	SessionTTL time.Duration
	// Logger receives the console's events (sign-ins, actions); nil
	// discards.
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Defaults of Config.
const (
	DefaultMaxChartEvents = 50000
	DefaultSessionTTL     = 12 * time.Hour
)

func (c Config) withDefaults() Config {
	if c.MaxChartEvents <= 0 {
		c.MaxChartEvents = DefaultMaxChartEvents
	}
	if c.SessionTTL <= 0 {
		c.SessionTTL = DefaultSessionTTL
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Prefix is where the console is served.
const Prefix = "/ui"

// Owns says whether r is the console's: /ui and everything under it.
func Owns(r *http.Request) bool {
	return r.URL.Path == Prefix || strings.HasPrefix(r.URL.Path, Prefix+"/")
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Console is the web console. It is an http.Handler for /ui and below.
type Console struct {
	cfg  Config
	b    Backend
	mux  *http.ServeMux
	log  *slog.Logger
	tmpl *template.Template
	// key signs sessions and CSRF tokens: derived from the token, or
	// random for a console without one.
	key   []byte
	token [32]byte // sha256 of the token

	mu      sync.Mutex
	revoked map[string]time.Time // signed-out sessions, until they expire
}

// New builds a console.
func New(cfg Config) (*Console, error) {
	if cfg.Backend == nil {
		return nil, errors.New("console: Config needs a Backend")
	}
	cfg = cfg.withDefaults()
	c := &Console{cfg: cfg, b: cfg.Backend, mux: http.NewServeMux(), log: cfg.Logger, revoked: map[string]time.Time{}}
	if cfg.Token != "" {
		m := hmac.New(sha256.New, []byte(cfg.Token))
		m.Write([]byte("sandgate console session key v1"))
		c.key = m.Sum(nil)
		c.token = sha256.Sum256([]byte(cfg.Token))
	} else {
		c.key = make([]byte, 32)
		rand.Read(c.key)
	}
	t, err := template.New("").Funcs(funcs).ParseFS(templateFS, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("console: templates: %w", err)
	}
	c.tmpl = t
	c.routes()
	return c, nil
}

// handler is a route's handler: it writes its answer, or returns the
// error that is the answer (written by route, through writeError).
type handler func(w http.ResponseWriter, r *http.Request) error

func (c *Console) route(pattern string, h handler) {
	c.mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			c.writeError(w, r, err)
		}
	})
}

func (c *Console) routes() {
	c.route("GET /ui", c.list)
	c.route("GET /ui/{$}", c.list)
	c.route("GET /ui/signin", c.signinPage)
	c.route("POST /ui/signin", c.signin)
	c.route("POST /ui/signout", c.signout)
	c.route("GET /ui/sandboxes/{name}", c.sandbox)
	c.route("GET /ui/sandboxes/{name}/events", c.events)
	c.route("POST /ui/sandboxes/{name}/{action}", c.act)
	c.route("GET /ui/egress", c.egressPage)
	c.route("GET /ui/egress.json", c.egressJSON)
	static, _ := fs.Sub(staticFS, "static")
	files := http.StripPrefix("/ui/static/", http.FileServerFS(static))
	c.mux.Handle("GET /ui/static/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Embedded files have no time: revalidate each time (they
		// change with the binary), never list a directory.
		if strings.HasSuffix(r.URL.Path, "/") {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Cache-Control", "no-cache")
		files.ServeHTTP(w, r)
	}))
}

// ServeHTTP sets the console's headers, checks where the request came from
// and who sent it, then routes.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", csp)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	h.Set("Cross-Origin-Resource-Policy", "same-origin")
	if !strings.HasPrefix(r.URL.Path, "/ui/static/") {
		h.Set("Cache-Control", "no-store")
	}
	if err := c.guard(r); err != nil {
		c.writeError(w, r, err)
		return
	}
	s, err := c.authenticate(r)
	if err != nil {
		if r.Method == http.MethodGet && wantsPage(r) {
			// A browser on a page: to the sign-in, and back after.
			http.Redirect(w, r, "/ui/signin?next="+urlQueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
			return
		}
		c.writeError(w, r, err)
		return
	}
	if r.Method == http.MethodPost {
		r.Body = http.MaxBytesReader(w, r.Body, maxForm) // a form of a few fields
	}
	if r.Method == http.MethodPost && !s.header && !publicPath(r) {
		if err := c.checkCSRF(r, s); err != nil {
			c.writeError(w, r, err)
			return
		}
	}
	c.mux.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), sessionKey{}, s)))
}

// maxForm bounds a POST's body: the console's forms are a few fields.
const maxForm = 64 << 10

// csp is every answer's Content-Security-Policy: the console's own files
// only, no inline script or style, no frames, forms posting to itself.
const csp = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// wantsPage says whether r is a browser's navigation to a page (not a
// script's fetch, a stream or a file).
func wantsPage(r *http.Request) bool {
	if m := r.Header.Get("Sec-Fetch-Mode"); m != "" {
		return m == "navigate"
	}
	return strings.Contains(r.Header.Get("Accept"), "text/html")
}
