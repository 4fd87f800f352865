// Package service assembles sandgate's appliance as one value: the
// resolver, the decider, the egress proxy with its audit and modules, the
// launcher, the lifecycle manager over the store, and the HTTP server; and
// stops them in one bounded order. `sandgate serve`, the test stacks and
// the benchmarks all build it, so what the tests run is what runs.
package service

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/console"
	"github.com/sandgate/sandgate/api/forward"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// Config is what a Service is built from. Store is required; the zero
// value of the rest is a working service (sandboxes reach nothing but
// their base URLs, resolved with /etc/resolv.conf's servers).
type Config struct {
	// DNSServers are the servers the proxy resolves with (IP or IP:port);
	// empty means /etc/resolv.conf's.
	DNSServers []string
	// DNSTimeout bounds each exchange with one DNS server, DialTimeout each
	// connection to an upstream; zero means netpolicy's defaults.
	DNSTimeout, DialTimeout time.Duration
	// AllowPrivate exempts address ranges from the refusal of private,
	// loopback and other special addresses: tests, and operators who open
	// a private network on purpose. Empty in production.
	AllowPrivate []netip.Prefix
	// UpstreamRoots verify upstreams' certificates; nil means the system's.
	UpstreamRoots *x509.CertPool
	// InterceptCA signs what the proxy presents for the hosts sandboxes'
	// policies intercept; every sandbox trusts its certificate (the
	// launcher's TrustCA). Nil: no interception (a policy naming hosts
	// to intercept is refused).
	InterceptCA *ca.Authority
	// AuditLog receives every egress decision as a JSON line (the same
	// bytes the store and the API have); nil none.
	AuditLog io.Writer
	// AuditFlush is how often a running sandbox's new events are written
	// to the store (what a kill -9 of the service can lose); 0 means
	// audit.JournalsConfig's default, 10 s.
	AuditFlush time.Duration
	// Modules compiles sandboxes' own WebAssembly modules and runs
	// ServiceModules, every sandbox's routes' service-wide modules (run
	// before its own); nil means none. The caller owns both: it closes them
	// after Shutdown.
	Modules        *wasm.Runtime
	ServiceModules *wasm.Chain
	// Store holds snapshots and templates. The service owns it from New
	// on: Shutdown closes it (New does too, when it fails).
	Store store.Store
	// Launcher configures the sandbox CLI.
	Launcher appliance.LauncherConfig
	// Manager configures the lifecycle; its Launcher, Proxy, Store, Audit,
	// Modules, Logger and Metrics are the service's.
	Manager appliance.ManagerConfig
	// Server configures the HTTP service; its Backend, Metrics, Logger and
	// OpenAPI are the service's.
	Server server.Config
	// Peers are the shards a request may be forwarded to
	// (SANDGATE_SHARD_PEERS); the zero value admits loopback peers only.
	// A forwarded request carries this shard's own credentials (Server's
	// Token; for the bridge's routes, Bridge's Key), never the client's.
	Peers forward.Peers
	// PeerAuth, when set, gives a request forwarded to another shard
	// this one's identity for it (on Cloud Run, an identity token for the
	// peer's URL, in X-Serverless-Authorization, since Authorization may
	// carry the bridge's key). The shards themselves are Manager.Shard.
	PeerAuth func(ctx context.Context, req *http.Request, peerURL string) error
	// Bridge configures the Cloudflare sandbox bridge's routes
	// (/v1/sandbox/..., /v1/pool/...): its Key (SANDBOX_API_KEY; without
	// one they refuse every request), the network of the sandboxes it
	// starts and its size limit. Its Backend, Agent, Dirs, OpenAPI,
	// Metrics and Logger are the service's.
	Bridge bridge.Config
	// NoConsole turns the web console (/ui, package api/console) off; it
	// is served by default, under the API's auth.
	NoConsole bool
	// Logger receives the service's events (JSON lines Cloud Logging
	// reads, or text); nil discards.
	Logger *slog.Logger
	// Metrics is the registry /metrics serves; nil makes one with the Go
	// runtime's and the process's collectors.
	Metrics *prometheus.Registry
}

// Service is an assembled appliance. Its fields are its parts, for
// callers that need one (a test reading the manager, a bench timing the
// proxy); they are not to be stopped one by one: Shutdown stops them all.
type Service struct {
	Resolver *netpolicy.DNSResolver
	Decider  *netpolicy.Decider
	Proxy    *relay.Proxy
	Audit    *audit.Journals
	Launcher *appliance.Launcher
	Manager  *appliance.Manager
	Server   *server.Server
	Bridge   *bridge.Bridge
	// Console is the web console at /ui (nil with NoConsole).
	Console *console.Console
	// Front sends requests for sandboxes other shards run to them, and
	// serves the rest: the bridge's routes, then Server's.
	Front   *forward.Front
	Metrics *prometheus.Registry

	handler http.Handler

	store store.Store
	log   *slog.Logger

	mu       sync.Mutex
	hs       *http.Server
	ln       net.Listener
	shutdown bool
}

// New assembles a service: the resolver, the decider, the proxy, the
// launcher, the manager (which recovers what a previous run left) and the
// HTTP server. A bad setting is an error naming it (appliance.ErrBadInput
// for a caller's mistake).
func New(ctx context.Context, cfg Config) (_ *Service, err error) {
	if cfg.Store == nil {
		return nil, errors.New("service: Config needs a Store")
	}
	s := &Service{store: cfg.Store, log: cfg.Logger, Metrics: cfg.Metrics}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if s.Metrics == nil {
		s.Metrics = prometheus.NewRegistry()
		s.Metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	servers := cfg.DNSServers
	if len(servers) == 0 {
		if servers, err = netpolicy.ServersFromResolvConf("/etc/resolv.conf"); err != nil {
			return nil, fmt.Errorf("no DNS servers given (SANDBOX_DNS) and /etc/resolv.conf is unusable: %w", err)
		}
	}
	if s.Resolver, err = netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: servers, Timeout: cfg.DNSTimeout}); err != nil {
		return nil, fmt.Errorf("%w: DNS servers (SANDBOX_DNS): %v", appliance.ErrBadInput, err)
	}
	s.Decider = &netpolicy.Decider{Resolver: s.Resolver, AllowPrivate: cfg.AllowPrivate, DialTimeout: cfg.DialTimeout}
	for _, p := range cfg.AllowPrivate {
		s.log.Warn("address-class refusal disabled for a range: sandboxes may reach it", "cidr", p.String())
	}
	metrics := audit.NewMetrics(s.Metrics)
	jc := audit.JournalsConfig{Writer: appliance.NewAuditStore(cfg.Store), FlushEvery: cfg.AuditFlush, Logger: s.log, Metrics: metrics}
	if cfg.AuditLog != nil {
		jc.Log = audit.NewJSONLines(cfg.AuditLog)
	}
	if s.Audit, err = audit.NewJournals(jc); err != nil {
		return nil, err
	}
	if s.Proxy, err = relay.New(relay.Config{
		Decider: s.Decider, Audit: audit.Multi{s.Audit, metrics}, Metrics: metrics, Logger: s.log,
		UpstreamRoots: cfg.UpstreamRoots, Modules: cfg.ServiceModules, CA: cfg.InterceptCA,
	}); err != nil {
		return nil, err
	}
	lc := cfg.Launcher
	if cfg.InterceptCA != nil && lc.TrustCA == nil {
		lc.TrustCA = cfg.InterceptCA.CertPEM()
	}
	if lc.Logger == nil {
		lc.Logger = s.log
	}
	if s.Launcher, err = appliance.NewLauncher(lc); err != nil {
		return nil, err
	}
	mc := cfg.Manager
	mc.Launcher, mc.Proxy, mc.Store, mc.Audit, mc.Modules, mc.Logger, mc.Metrics = s.Launcher, s.Proxy, cfg.Store, s.Audit, cfg.Modules, s.log, s.Metrics
	if s.Manager, err = appliance.NewManager(ctx, mc); err != nil {
		return nil, err
	}
	// One OpenAPI document for every route: the bridge's are in it when
	// they can be used (a key is configured).
	doc := server.OpenAPI()
	if cfg.Bridge.Key != "" {
		if doc, err = bridge.MergeOpenAPI(doc); err != nil {
			return nil, err
		}
	}
	sc := cfg.Server
	sc.Backend, sc.Metrics, sc.Logger, sc.OpenAPI = s.Manager, s.Metrics, s.log, doc
	if s.Server, err = server.New(sc); err != nil {
		return nil, err
	}
	bc := cfg.Bridge
	bc.Backend, bc.Agent, bc.Dirs, bc.OpenAPI, bc.Metrics, bc.Logger = s.Manager, s.Server.AgentConfig, s.Server.Dirs, doc, s.Metrics, s.log
	if s.Bridge, err = bridge.New(bc); err != nil {
		return nil, fmt.Errorf("%w: %v", appliance.ErrBadInput, err)
	}
	s.Front = forward.New(forward.Config{
		Locator: s.Manager, Next: s.Bridge.Front(s.Server), Peers: cfg.Peers, Logger: s.log,
		Authenticate: func(w http.ResponseWriter, r *http.Request) bool {
			if s.Bridge.Owns(r) {
				return s.Bridge.Authorize(w, r)
			}
			return s.Server.Authorize(w, r)
		},
		Credentials: func(ctx context.Context, req *http.Request, peer string) error {
			if sc.Token != "" {
				req.Header.Set(api.HeaderToken, sc.Token)
			}
			if bc.Key != "" && s.Bridge.Owns(req) {
				req.Header.Set("Authorization", "Bearer "+bc.Key)
			}
			if cfg.PeerAuth != nil {
				return cfg.PeerAuth(ctx, req, peer)
			}
			return nil
		},
	})
	s.handler = s.Front
	if !cfg.NoConsole {
		// The console reads through the manager of this shard; a sandbox
		// another shard runs links to that shard's console.
		if s.Console, err = console.New(console.Config{
			Backend: s.Manager, Token: sc.Token, LocalOnly: sc.LocalOnly, LocalHosts: sc.LocalHosts,
			Agent: s.Server.AgentConfig, Dirs: s.Server.Dirs, Version: sc.Version, Logger: s.log,
		}); err != nil {
			return nil, err
		}
		s.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if console.Owns(r) {
				s.Console.ServeHTTP(w, r)
				return
			}
			s.Front.ServeHTTP(w, r)
		})
	}
	return s, nil
}

// Handler is the HTTP service: protocol 1, sandgate's /v1 and the
// Cloudflare bridge's routes, forwarded to the shard running the sandbox
// a request names; and the web console at /ui.
func (s *Service) Handler() http.Handler { return s.handler }

// Serve serves the HTTP service on ln, as `sandgate serve` does: HTTP/1.1
// and HTTP/2 without TLS (Cloud Run's front end speaks it to the container
// when the service uses --use-http2, which lifts its 32 MiB cap on HTTP/1
// request bodies). It returns http.ErrServerClosed once Shutdown began.
func (s *Service) Serve(ln net.Listener) error {
	hs := &http.Server{Handler: s.handler, ReadHeaderTimeout: 30 * time.Second, ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
	hs.Protocols = new(http.Protocols)
	hs.Protocols.SetHTTP1(true)
	hs.Protocols.SetUnencryptedHTTP2(true)
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		ln.Close()
		return http.ErrServerClosed
	}
	s.hs, s.ln = hs, ln
	s.mu.Unlock()
	return hs.Serve(ln)
}

// ShutdownResult says what Shutdown saved and what it had to cut.
type ShutdownResult struct {
	appliance.SaveAllResult
	// RequestsCut and EgressCut say that HTTP requests (streams, tunnels)
	// or egress connections still open when ctx ended were cut.
	RequestsCut, EgressCut bool
	// AuditLost says why audit events held in memory could not all be
	// written to the store (they are in the audit log); nil when they were.
	AuditLost error
}

// Shutdown stops the service within ctx, in this order: no new
// connections; every running sandbox saved, in parallel (SaveAll: a
// sandbox that could not be saved keeps its previous snapshot), its audit
// with it; the HTTP requests drained (their streams end with their
// sandboxes); the egress connections drained; what is left of the audit
// written; the store and the resolver closed. What is still open when ctx
// ends is cut.
func (s *Service) Shutdown(ctx context.Context) ShutdownResult {
	s.mu.Lock()
	s.shutdown = true
	hs, ln := s.hs, s.ln
	s.mu.Unlock()
	if ln != nil {
		ln.Close() // no new connections; those open are served until drained
	}
	var res ShutdownResult
	res.SaveAllResult = s.Manager.Close(ctx)
	if hs != nil {
		if err := hs.Shutdown(ctx); err != nil {
			hs.Close()
			res.RequestsCut = true
		}
	}
	if err := s.Proxy.Shutdown(ctx); err != nil {
		res.EgressCut = true
	}
	if err := s.Audit.Close(ctx); err != nil {
		res.AuditLost = err
	}
	s.close()
	return res
}

// close releases what New made, and the store.
func (s *Service) close() {
	if s.Proxy != nil {
		s.Proxy.Close()
	}
	if s.Audit != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		s.Audit.Close(ctx) // a second Close writes what came since, if anything
		cancel()
	}
	if s.store != nil {
		s.store.Close()
	}
	if s.Resolver != nil {
		s.Resolver.Close()
	}
}
