// Package servetest runs a real sandgate service on loopback for tests of
// its clients: internal/testkit/stacktest's stack (the service as `sandgate serve`
// assembles it, over `sandgate sandbox`, a loopback DNS server and an
// HTTPS upstream for api.example.com that echoes the credential headers it
// received) behind an HTTP listener.
//
// It needs what sandboxes need: Linux and root. Start takes no testing.TB,
// so that a TestMain can start one service for a whole package (its
// Example functions included).
package servetest

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// UpstreamHost is the name the service's DNS server gives the HTTPS
// upstream.
const UpstreamHost = stacktest.UpstreamHost

// CanRun says whether sandboxes can run here, and if not, why.
func CanRun() (bool, string) { return stacktest.CanRun() }

// Config tweaks the service. The zero value serves with a generated token.
type Config struct {
	// Token is the service token; "" generates one. Open serves with none.
	Token string
	Open  bool
	// Tweak, when set, edits the server's configuration before it starts.
	Tweak func(*server.Config)
	// Modules, when set, compiles sandboxes' own WebAssembly modules
	// (without it, the modules route answers 501). The caller closes it
	// after Close.
	Modules *wasm.Runtime
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

	stack *stacktest.Stack
	hs    *httptest.Server
}

// Start starts a service. Close it when done.
func Start(cfg Config) (s *Service, err error) {
	token := cfg.Token
	if token == "" && !cfg.Open {
		token = fmt.Sprintf("servetest-token-%d", time.Now().UnixNano())
	}
	if cfg.Open {
		token = ""
	}
	scfg := server.Config{Token: token, EgressPort: 0, WaitTimeout: 2 * time.Second}
	if cfg.Tweak != nil {
		cfg.Tweak(&scfg)
	}
	st, err := stacktest.Start(stacktest.Config{Server: scfg, Modules: cfg.Modules})
	if err != nil {
		return nil, err
	}
	s = &Service{Token: token, Manager: st.Manager, CA: st.CA, Log: st.Log, Handler: st.Service.Handler(), stack: st}
	s.hs = httptest.NewServer(s.Handler)
	s.URL = s.hs.URL
	return s, nil
}

// UpstreamSeen is the headers of every request the upstream received.
func (s *Service) UpstreamSeen() []http.Header { return s.stack.UpstreamSeen() }

// Close destroys every sandbox and stops the service.
func (s *Service) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s.stack.DestroyAll(ctx)
	if s.hs != nil {
		s.hs.CloseClientConnections()
		s.hs.Close()
	}
	s.stack.Close()
}
