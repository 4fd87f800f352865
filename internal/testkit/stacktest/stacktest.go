// Package stacktest starts, on loopback, what `sandgate serve` runs beneath
// its HTTP server: a lifecycle manager over `sandgate sandbox` with a
// directory store, the egress proxy with a loopback DNS server and the
// sandboxes' durable audit, and an HTTPS upstream for api.example.com (a
// stand-in for a model API or a package registry) that echoes the
// credential headers it received. internal/testkit/servetest puts the HTTP server
// on top for clients' tests; api/server's own tests put theirs.
//
// It needs what sandboxes need: Linux and root. Start takes no testing.TB,
// so that a TestMain can start one for a whole package.
package stacktest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/forward"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/api/service"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// UpstreamHost is the name the stack's DNS server gives the HTTPS
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

// Config says where the stack keeps its files and how it is set up.
type Config struct {
	// Dir holds the launcher's state, the manager's work and the store,
	// in subdirectories; "" makes a temporary one that Close removes. A
	// Dir given is left in place.
	Dir string
	// AuditFlush is how often running sandboxes' audit events are written
	// to the store; 0 means the service's default.
	AuditFlush time.Duration
	// BaseURLs are the base URLs every sandbox gets; nil means
	// ANTHROPIC_BASE_URL at the upstream.
	BaseURLs map[string]string
	// Modules, when set, compiles sandboxes' own WebAssembly modules.
	Modules *wasm.Runtime
	// Server configures the HTTP server (its Token, WaitTimeout…); its
	// Version is "test" unless set.
	Server server.Config
	// Manager, when set, edits the manager's configuration before the
	// service starts.
	Manager func(*appliance.ManagerConfig)
	// NoCapture and NoIntercept turn off what serve does by default:
	// capture in each sandbox, and an interception CA (made in memory).
	NoCapture, NoIntercept bool
	// InterceptCA, when set, is the interception CA (one kept in a
	// directory, say, whose key a test searches for).
	InterceptCA *ca.Authority
	// Bridge configures the Cloudflare bridge's routes (its Key, the
	// network of its sandboxes).
	Bridge bridge.Config
	// NoConsole turns the web console off (SANDGATE_CONSOLE=false).
	NoConsole bool
	// Peers are the shards requests may be forwarded to (the zero value:
	// loopback ones).
	Peers forward.Peers
}

// Stack is a running stack. Close it when done.
type Stack struct {
	// Service is the assembled service, as `sandgate serve` builds it.
	Service  *service.Service
	Manager  *appliance.Manager
	Launcher *appliance.Launcher
	Store    store.Store
	Audit    *audit.Journals
	// CA signed the upstream's certificate: a sandbox that speaks TLS to
	// the upstream itself (through CONNECT) must trust it.
	CA *tlstest.CA
	// Log is what Logger wrote (JSON lines): the service's log and the
	// proxy's audit log.
	Log    *syncbuf.Buffer
	Logger *slog.Logger
	// StateDir, WorkDir and StoreDir are the launcher's state, the
	// manager's work and the store's directories.
	StateDir, WorkDir, StoreDir string
	// UpstreamAddr is the upstream's address (a random 127.x.y.z): the one
	// private address the proxy may dial (its AllowPrivate).
	UpstreamAddr netip.Addr
	// InterceptCA is the service's interception CA (nil with NoIntercept).
	InterceptCA *ca.Authority
	// DNS is the stack's DNS server, for tests that name more upstreams.
	DNS *dnstest.Server

	closers []func()

	mu   sync.Mutex
	seen []http.Header
}

// Start starts a stack.
func Start(cfg Config) (s *Stack, err error) {
	if ok, why := CanRun(); !ok {
		return nil, errors.New(why)
	}
	made := &Stack{Log: &syncbuf.Buffer{}}
	s = made
	defer func() {
		if err != nil {
			made.Close() // s is nil by then
		}
	}()
	s.Logger = slog.New(slog.NewJSONHandler(s.Log, nil))
	dir := cfg.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "sandgate-stacktest-"); err != nil {
			return nil, err
		}
		s.closers = append(s.closers, func() { os.RemoveAll(dir) })
	}
	s.StateDir, s.WorkDir, s.StoreDir = filepath.Join(dir, "state"), filepath.Join(dir, "work"), filepath.Join(dir, "store")
	for _, d := range []string{s.StateDir, s.WorkDir, s.StoreDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}

	dns, err := dnstest.New()
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() { dns.Close() })
	s.DNS = dns
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
	s.UpstreamAddr = upAddr

	bin, err := gobuild.SandgateBinary()
	if err != nil {
		return nil, err
	}
	st, err := store.NewDir(s.StoreDir)
	if err != nil {
		return nil, err
	}
	urls := cfg.BaseURLs
	if urls == nil {
		urls = map[string]string{"ANTHROPIC_BASE_URL": "https://" + UpstreamHost}
	}
	mc := appliance.ManagerConfig{Version: "test", WorkDir: s.WorkDir, IdleSuspend: -1, BaseURLs: urls}
	if cfg.Manager != nil {
		cfg.Manager(&mc)
	}
	sc := cfg.Server
	if sc.Version == "" {
		sc.Version = "test"
	}
	s.InterceptCA = cfg.InterceptCA
	if !cfg.NoIntercept && s.InterceptCA == nil {
		if s.InterceptCA, err = ca.New(); err != nil {
			return nil, err
		}
	}
	s.Service, err = service.New(context.Background(), service.Config{
		DNSServers: []string{dns.Addr}, DNSTimeout: 10 * time.Second, DialTimeout: 5 * time.Second,
		AllowPrivate:  []netip.Prefix{netip.PrefixFrom(upAddr, 32)},
		UpstreamRoots: s.CA.Pool, AuditLog: s.Log, AuditFlush: cfg.AuditFlush, Modules: cfg.Modules, InterceptCA: s.InterceptCA,
		Store:    st,
		Launcher: appliance.LauncherConfig{CLI: bin, AgentBinary: bin, StateDir: s.StateDir, PrivateDir: dir, Capture: !cfg.NoCapture},
		Manager:  mc, Server: sc, Bridge: cfg.Bridge, Peers: cfg.Peers, Logger: s.Logger, NoConsole: cfg.NoConsole,
	})
	if err != nil {
		return nil, err
	}
	s.Manager, s.Launcher, s.Store, s.Audit = s.Service.Manager, s.Service.Launcher, st, s.Service.Audit
	return s, nil
}

// UpstreamSeen is the headers of every request the upstream received.
func (s *Stack) UpstreamSeen() []http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]http.Header(nil), s.seen...)
}

// DestroyAll destroys every sandbox: their processes end, and with them
// the streams (exec, audit, tunnels) an HTTP server would wait for.
func (s *Stack) DestroyAll(ctx context.Context) {
	if s.Manager == nil {
		return
	}
	infos, _ := s.Manager.List(ctx)
	for _, in := range infos {
		s.Manager.Destroy(ctx, in.ID)
	}
}

// Close shuts the service down (saving what still runs), removes the
// templates the launcher mounted (or its state could not be removed), and
// stops the rest.
func (s *Stack) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if s.Service != nil {
		s.Service.Shutdown(ctx)
	}
	if s.Launcher != nil {
		names, _ := s.Launcher.ListTemplates(ctx)
		for _, n := range names {
			s.Launcher.RemoveTemplate(ctx, n)
		}
	}
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
}

// StoreObjects calls each with the name and the whole decompressed content
// of every object in the directory store at dir (a layer's tar, a
// manifest's JSON): what a search for a secret in snapshots must read,
// since a compressed layer hides its bytes. An object removed between the
// listing and the read (the service's other sandboxes go on meanwhile) is
// skipped.
func StoreObjects(dir string, each func(name string, content []byte)) error {
	return filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) && path != dir {
			return nil // gone since it was listed: another sandbox of the service moved on
		}
		if err != nil || !d.Type().IsRegular() || strings.HasPrefix(d.Name(), ".") {
			return err // hidden: the store's lock and temporary files
		}
		f, err := os.Open(path)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		defer f.Close()
		r, err := snapshot.Decompress(f)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		defer r.Close()
		b, err := io.ReadAll(r)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		rel, _ := filepath.Rel(dir, path)
		each(rel, b)
		return nil
	})
}
