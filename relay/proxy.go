// Package relay carries a sandbox's egress: an HTTP proxy that serves
// CONNECT tunnels to port 443 and base-URL routes
// (/https/<host>/<path>) forwarded over HTTPS, connections captured in the
// sandbox as if they were CONNECT (ServeCaptured), and, for the hosts a
// policy intercepts, the requests inside a tunnel as routes (intercept.go).
// It asks netpolicy what is allowed, transforms what to rewrite, and
// writes one audit event per tunnel and per request. The sandbox a
// connection belongs to is the listener or link it came on, never
// anything it says.
package relay

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/transforms"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// Config configures a Proxy. Zero values take the documented defaults.
type Config struct {
	// Decider judges every destination and dials what it allowed. Required.
	Decider *netpolicy.Decider
	// Audit receives one event per tunnel and per routed request. Nil
	// discards events.
	Audit audit.Sink
	// Metrics, when set, tracks the active-tunnels gauge. (Count events by
	// adding it to Audit too.)
	Metrics *audit.Metrics
	// Logger receives operational messages (not audit events). Nil discards.
	Logger *slog.Logger
	// UpstreamRoots verifies upstream certificates on base-URL routes; nil
	// means the system roots.
	UpstreamRoots *x509.CertPool
	// MaxHeaderBytes caps a request's line and headers; default 64 KiB.
	MaxHeaderBytes int
	// MaxConns caps the connections one sandbox may have open at once
	// (tunnels, routed requests and idle kept-alive connections together);
	// default 256.
	MaxConns int
	// HeaderTimeout bounds reading a request's headers; default 30s.
	HeaderTimeout time.Duration
	// IdleTimeout closes a tunnel, or a kept-alive connection, with no
	// traffic for this long; default 10m.
	IdleTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait for an upstream's response
	// headers on a base-URL route; default 10m (model APIs can think long).
	ResponseHeaderTimeout time.Duration
	// ErrorWriteTimeout bounds writing one of the proxy's own error
	// answers (a refusal, a limit) to a sandbox that does not read it;
	// default 10s.
	ErrorWriteTimeout time.Duration
	// Modules are WebAssembly transform modules applied, in order, to every
	// sandbox's base-URL routes, before the sandbox's own modules
	// (Tenant.SetModules) and before the secret swap. Nil means none. The
	// caller owns them (closes them after the proxy).
	Modules *wasm.Chain
	// CA signs the certificates the proxy presents for the hosts a
	// sandbox's policy intercepts (netpolicy.Policy.Intercept). Nil means
	// no interception: a tunnel to such a host is refused, naming why.
	CA *ca.Authority
}

func (c Config) withDefaults() Config {
	if c.MaxHeaderBytes <= 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	if c.MaxConns <= 0 {
		c.MaxConns = 256
	}
	if c.HeaderTimeout <= 0 {
		c.HeaderTimeout = 30 * time.Second
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 10 * time.Minute
	}
	if c.ResponseHeaderTimeout <= 0 {
		c.ResponseHeaderTimeout = 10 * time.Minute
	}
	if c.ErrorWriteTimeout <= 0 {
		c.ErrorWriteTimeout = 10 * time.Second
	}
	if c.Audit == nil {
		c.Audit = audit.Multi(nil)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Proxy is the egress proxy. It is safe for concurrent use; one Proxy serves
// every sandbox, each on listeners or links of its own.
type Proxy struct {
	cfg Config

	// hard ends when Close is called: requests and tunnels in progress run
	// under it, so that ending a Serve context lets them finish.
	hard     context.Context
	hardStop context.CancelCauseFunc
	// soft ends when Shutdown is called: Serve stops accepting and idle
	// connections close, as when a Serve context ends.
	soft     context.Context
	softStop context.CancelCauseFunc
	idle     chan struct{} // closed by untrack when the last connection goes, once Shutdown began

	// readers and writers pool connection buffers (MaxHeaderBytes and
	// 16 KiB), so that a connection that comes and goes allocates nothing.
	readers, writers sync.Pool

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// New returns a proxy with cfg.
func New(cfg Config) (*Proxy, error) {
	if cfg.Decider == nil || cfg.Decider.Resolver == nil {
		return nil, errors.New("relay: Config.Decider with a Resolver is required")
	}
	p := &Proxy{cfg: cfg.withDefaults(), conns: make(map[net.Conn]struct{})}
	p.hard, p.hardStop = context.WithCancelCause(context.Background())
	p.soft, p.softStop = context.WithCancelCause(context.Background())
	return p, nil
}

// CanIntercept reports whether the proxy has an interception CA, so that a
// policy's intercept list can be honoured.
func (p *Proxy) CanIntercept() bool { return p.cfg.CA != nil }

// Tenant is one sandbox as the proxy sees it: the identity and rules that
// connections on one listener or link are served under. Its policy and transformations may be changed while
// it is served; each request sees one version or the other.
type Tenant struct {
	id         string
	policy     atomic.Pointer[netpolicy.Policy]
	transforms *transforms.RuleSet
	modules    atomic.Pointer[wasm.Chain]
	joined     atomic.Pointer[joinedModules]
	open       atomic.Int64
	seen       atomic.Int64 // unix nanoseconds of the last connection's start or end
	// drained is closed (and replaced) when open falls to zero while
	// someone waits for it (Drain).
	dmu     sync.Mutex
	drained chan struct{}

	tmu  sync.Mutex
	pool *upstreamPool
}

// NewTenant returns the identity for sandbox id with a network policy and
// transformation rules (nil means none).
func NewTenant(id string, policy netpolicy.Policy, rules *transforms.RuleSet) *Tenant {
	if rules == nil {
		rules = transforms.NewRuleSet()
	}
	s := &Tenant{id: id, transforms: rules}
	s.policy.Store(&policy)
	return s
}

// ID returns the sandbox id.
func (s *Tenant) ID() string { return s.id }

// Policy returns the current network policy.
func (s *Tenant) Policy() netpolicy.Policy { return *s.policy.Load() }

// SetPolicy replaces the network policy. Kept-alive upstream connections
// are dropped, so nothing dialed under the old policy is reused.
func (s *Tenant) SetPolicy(p netpolicy.Policy) {
	s.policy.Store(&p)
	s.tmu.Lock()
	if s.pool != nil {
		s.pool.closeIdle()
	}
	s.tmu.Unlock()
}

// Transforms returns the sandbox's live transformation rules.
func (s *Tenant) Transforms() *transforms.RuleSet { return s.transforms }

// SetModules replaces the sandbox's own WebAssembly transform modules
// (nil means none). They run after the proxy's service-wide modules
// (Config.Modules) and before the secret swap; a request in progress keeps
// the chain it started with. The caller owns the modules; closing an old
// chain while requests use it is safe (instances in use close when they are
// returned; a request that has yet to reach a closed module fails with 502).
func (s *Tenant) SetModules(c *wasm.Chain) { s.modules.Store(c) }

// Modules returns the sandbox's own transform modules (nil when none).
func (s *Tenant) Modules() *wasm.Chain { return s.modules.Load() }

// Egress reports the sandbox's connections open now (tunnels, requests
// and kept-alive connections) and when one last opened or closed (zero
// when none ever did): what an idle check needs to know of its egress.
func (s *Tenant) Egress() (open int64, last time.Time) {
	if n := s.seen.Load(); n != 0 {
		last = time.Unix(0, n)
	}
	return s.open.Load(), last
}

// joinedModules is the service-wide chain followed by the sandbox's own,
// kept so that a request does not join them again.
type joinedModules struct{ svc, own, both *wasm.Chain }

// modulesWith returns the modules a request of the sandbox runs: svc (the
// proxy's), then the sandbox's own. The result is nil when there are none.
func (s *Tenant) modulesWith(svc *wasm.Chain) *wasm.Chain {
	own := s.modules.Load()
	if j := s.joined.Load(); j != nil && j.svc == svc && j.own == own {
		return j.both
	}
	j := &joinedModules{svc: svc, own: own, both: wasm.Join(svc, own)}
	s.joined.Store(j)
	return j.both
}

// Close releases the sandbox's kept-alive upstream connections.
func (s *Tenant) Close() {
	s.tmu.Lock()
	if s.pool != nil {
		s.pool.closeIdle()
	}
	s.tmu.Unlock()
}

// upstream returns the sandbox's own pool of upstream connections. Each
// sandbox has its own, so a connection dialed under one sandbox's policy is
// never reused for another's request.
func (s *Tenant) upstream(p *Proxy) *upstreamPool {
	s.tmu.Lock()
	defer s.tmu.Unlock()
	if s.pool == nil {
		s.pool = newUpstreamPool(p)
	}
	return s.pool
}

// Serve accepts connections on ln and serves each as the tenant until ctx
// ends or ln fails, then closes ln and returns when every connection it
// accepted is finished: idle ones are closed at once, requests and tunnels
// in progress are let finish (until Close).
func (p *Proxy) Serve(ctx context.Context, ln net.Listener, tenant *Tenant) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stopSoft := context.AfterFunc(p.soft, func() { cancel(context.Cause(p.soft)) })
	defer stopSoft()
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	defer ln.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.ServeConn(ctx, c, tenant)
		}()
	}
}

// ServeConn serves one connection (a TCP connection or a stream of a
// sandbox's link) as tenant, and closes it when done. When ctx ends the
// connection is closed if it is between requests; a request or tunnel in
// progress is let finish, until Close cuts it. ServeConn returns when the
// connection is finished. Its audit events name no process (see
// ServePeer).
func (p *Proxy) ServeConn(ctx context.Context, c net.Conn, tenant *Tenant) {
	p.ServePeer(ctx, c, tenant, Peer{})
}

// Peer is what the caller knows of the process that opened a connection:
// a sandbox's agent finds it from the connection's address (its pid in the
// sandbox, its arguments). It only attributes the connection's events;
// nothing is decided on it.
type Peer struct {
	PID  int
	Args []string
}

// ServePeer is ServeConn for a connection opened by peer: every audit event
// of the connection names it (audit.Event.PID and Cmd). Its command line is
// rendered once, by audit.CommandLine; one that holds a secret of the
// sandbox's rules is replaced whole.
func (p *Proxy) ServePeer(ctx context.Context, c net.Conn, tenant *Tenant, peer Peer) {
	if !p.track(c) {
		c.Close()
		return
	}
	defer p.untrack(c)
	cc := newClientConn(p, tenant, c)
	cc.pid, cc.cmd = peerCmd(tenant, peer)
	defer cc.release() // after the Close below: nothing reads c's buffers then
	defer c.Close()
	// Every connection counts against the sandbox's cap from the moment it
	// is accepted, idle or half-sent ones included: each holds buffers.
	if !tenant.acquire(p.cfg.MaxConns) {
		cc.refuse(limitError(fmt.Sprintf("sandbox %s already has %d connections open", tenant.id, p.cfg.MaxConns), time.Second), nil)
		return
	}
	defer tenant.release()
	stop := context.AfterFunc(ctx, cc.stop)
	defer stop()
	stopSoft := context.AfterFunc(p.soft, cc.stop)
	defer stopSoft()
	cc.serve(ctx)
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	if len(p.conns) == 0 && p.idle != nil {
		close(p.idle)
		p.idle = nil
	}
	p.mu.Unlock()
}

// Shutdown stops the proxy gracefully, as http.Server's does: every Serve
// stops accepting, idle connections close at once, and requests and
// tunnels in progress are let finish until ctx ends; then Close cuts what
// is left. It returns nil when everything finished in time, else the
// cause of ctx. The proxy refuses connections afterwards.
func (p *Proxy) Shutdown(ctx context.Context) error {
	p.softStop(errors.New("proxy shutting down"))
	p.mu.Lock()
	var idle chan struct{}
	if len(p.conns) > 0 {
		if p.idle == nil {
			p.idle = make(chan struct{})
		}
		idle = p.idle
	}
	p.mu.Unlock()
	var err error
	if idle != nil {
		select {
		case <-idle:
		case <-ctx.Done():
			err = context.Cause(ctx)
		}
	}
	p.Close()
	return err
}

// Close cuts every connection the proxy is serving, requests and tunnels
// in progress included, and refuses new ones. For a graceful stop, end the
// contexts given to Serve first, wait (bounded) for Serve to return, then
// Close.
func (p *Proxy) Close() error {
	p.hardStop(errors.New("proxy closed"))
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.conns = map[net.Conn]struct{}{}
	p.mu.Unlock()
	for c := range conns {
		c.Close()
	}
	return nil
}

// peerCmd renders peer for the audit: its pid (0 if out of range) and its
// command line.
func peerCmd(tenant *Tenant, peer Peer) (int, string) {
	pid := peer.PID
	if pid < 0 || pid > 1<<22 { // the kernel's pid_max bound
		pid = 0
	}
	cmd := audit.CommandLine(peer.Args)
	if cmd != "" {
		if g := tenant.transforms.Guard(); !g.Empty() && g.Check("cmd", strings.Join(peer.Args, " "), cmd) != nil {
			cmd = audit.Redacted + " (the command line held a secret of this sandbox's rules)"
		}
	}
	return pid, cmd
}

// Drain waits until the tenant has no connection open (every event of
// those it had is recorded by then), or ctx ends.
func (s *Tenant) Drain(ctx context.Context) error {
	for {
		s.dmu.Lock()
		if s.open.Load() <= 0 {
			s.dmu.Unlock()
			return nil
		}
		if s.drained == nil {
			s.drained = make(chan struct{})
		}
		ch := s.drained
		s.dmu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

func (p *Proxy) record(e audit.Event) {
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	p.cfg.Audit.Record(e)
}
