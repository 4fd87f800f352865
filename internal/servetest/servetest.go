// Package servetest runs a real sandgate service on loopback for tests of
// its clients: the HTTP server (api/server) over a lifecycle manager over
// `sandgate sandbox`, the egress proxy with a loopback DNS server, and an
// HTTPS upstream for api.example.com (a stand-in for a model API or a
// package registry) that echoes the credential headers it received.
//
// It needs what sandboxes need: Linux and root. Start takes no testing.TB,
// so that a TestMain can start one service for a whole package (its
// Example functions included).
package servetest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/dnstest"
	"github.com/sandgate/sandgate/internal/gobuild"
	"github.com/sandgate/sandgate/internal/syncbuf"
	"github.com/sandgate/sandgate/internal/tlstest"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
)

// UpstreamHost is the name the service's DNS server gives the HTTPS
// upstream.
const UpstreamHost = "api.example.com"

// CanRun says whether sandboxes can run here, and if not, why.
func CanRun() (bool, string) {
	if runtime.GOOS != "linux" {
		return false, "sandboxes need Linux namespaces and overlayfs"
	}
	if os.Geteuid() != 0 {
		return false, "sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root"
	}
	return true, ""
}

// Config tweaks the service. The zero value serves with a generated token.
type Config struct {
	// Token is the service token; "" generates one. Open serves with none.
	Token string
	Open  bool
	// Tweak, when set, edits the server's configuration before it starts.
	Tweak func(*server.Config)
}

// Service is a running service. URL serves Handler; Close stops it all.
type Service struct {
	URL     string
	Token   string
	Handler http.Handler
	Manager *appliance.Manager
	// CA signed the upstream's certificate: a sandbox that speaks TLS to
	// the upstream itself (through CONNECT) must trust it.
	CA *tlstest.CA
	// Log is the service's log (JSON lines).
	Log *syncbuf.Buffer

	hs       *httptest.Server
	srv      *server.Server
	launcher *appliance.Launcher
	closers  []func()

	mu   sync.Mutex
	seen []http.Header
}

// Start starts a service. Close it when done.
func Start(cfg Config) (s *Service, err error) {
	if ok, why := CanRun(); !ok {
		return nil, errors.New(why)
	}
	s = &Service{Log: &syncbuf.Buffer{}, Token: cfg.Token}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if s.Token == "" && !cfg.Open {
		s.Token = fmt.Sprintf("servetest-token-%d", time.Now().UnixNano())
	}
	if cfg.Open {
		s.Token = ""
	}
	logger := slog.New(slog.NewJSONHandler(s.Log, nil))
	tmp, err := os.MkdirTemp("", "sandgate-servetest-")
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() { os.RemoveAll(tmp) })
	sub := func(name string) (string, error) {
		d := tmp + "/" + name
		return d, os.MkdirAll(d, 0o755)
	}

	dns, err := dnstest.New()
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() { dns.Close() })
	if s.CA, err = tlstest.NewCA(); err != nil {
		return nil, err
	}
	leaf, err := s.CA.Leaf(UpstreamHost)
	if err != nil {
		return nil, err
	}
	ln, err := tlstest.ListenLoopback443()
	if err != nil {
		return nil, err
	}
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.seen = append(s.seen, r.Header.Clone())
		s.mu.Unlock()
		// Echoes the credentials it got: the proxy must scrub them back
		// to their placeholders on the way in.
		fmt.Fprintf(w, "path=%s auth=%s key=%s", r.URL.Path, r.Header.Get("Authorization"), r.Header.Get("X-Api-Key"))
	}))
	up.Listener.Close()
	up.Listener = ln
	up.EnableHTTP2 = true
	up.Config.ErrorLog = log.New(io.Discard, "", 0)
	up.TLS = &tls.Config{Certificates: []tls.Certificate{leaf}}
	up.StartTLS()
	s.closers = append(s.closers, up.Close)
	upAddr := netip.MustParseAddrPort(up.Listener.Addr().String()).Addr()
	dns.Set(UpstreamHost, upAddr)

	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{dns.Addr}, Timeout: 10 * time.Second})
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() { res.Close() })
	rings := audit.NewRings(200)
	proxy, err := relay.New(relay.Config{
		Decider:       &netpolicy.Decider{Resolver: res, DialTimeout: 5 * time.Second, AllowPrivate: []netip.Prefix{netip.PrefixFrom(upAddr, 32)}},
		Audit:         audit.Multi{rings, audit.Logger{L: logger}},
		UpstreamRoots: s.CA.Pool,
	})
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() { proxy.Close() })

	bin, err := gobuild.SandgateBinary()
	if err != nil {
		return nil, err
	}
	state, err := sub("state")
	if err != nil {
		return nil, err
	}
	if s.launcher, err = appliance.NewLauncher(appliance.LauncherConfig{CLI: bin, AgentBinary: bin, StateDir: state}); err != nil {
		return nil, err
	}
	storeDir, err := sub("store")
	if err != nil {
		return nil, err
	}
	st, err := store.NewDir(storeDir)
	if err != nil {
		return nil, err
	}
	work, err := sub("work")
	if err != nil {
		return nil, err
	}
	s.Manager, err = appliance.NewManager(context.Background(), appliance.ManagerConfig{
		Launcher: s.launcher, Proxy: proxy, Store: st, Version: "test", WorkDir: work, IdleSuspend: -1, Logger: logger,
	})
	if err != nil {
		return nil, err
	}
	scfg := server.Config{
		Manager: s.Manager, Token: s.Token, Version: "test", Audit: rings, Logger: logger,
		BaseURLs:   map[string]string{"ANTHROPIC_BASE_URL": "https://" + UpstreamHost},
		EgressPort: 0, WaitTimeout: 2 * time.Second,
	}
	if cfg.Tweak != nil {
		cfg.Tweak(&scfg)
	}
	if s.srv, err = server.New(scfg); err != nil {
		return nil, err
	}
	s.Handler = s.srv
	s.hs = httptest.NewServer(s.srv)
	s.URL = s.hs.URL
	return s, nil
}

// UpstreamSeen is the headers of every request the upstream received.
func (s *Service) UpstreamSeen() []http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]http.Header(nil), s.seen...)
}

// Close destroys every sandbox and stops the service.
func (s *Service) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if s.Manager != nil {
		// Sandboxes first: their processes end, and with them the
		// streams (exec, audit, tunnels) the HTTP server would wait for.
		infos, _ := s.Manager.List(ctx)
		for _, in := range infos {
			s.Manager.Destroy(ctx, in.ID)
		}
	}
	if s.hs != nil {
		s.hs.CloseClientConnections()
		s.hs.Close()
	}
	if s.srv != nil {
		s.srv.Close()
	}
	if s.Manager != nil {
		s.Manager.Close(ctx)
	}
	if s.launcher != nil {
		names, _ := s.launcher.ListTemplates(ctx) // mounted images: removed, or the state could not be
		for _, n := range names {
			s.launcher.RemoveTemplate(ctx, n)
		}
	}
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
}
