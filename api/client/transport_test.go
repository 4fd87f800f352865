package client_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/client"
)

// iam is a front end that lets a call through only with an identity token
// it considers valid, as Cloud Run's IAM does; its refusals carry no
// protocol header.
type iam struct {
	mu    sync.Mutex
	valid map[string]bool
	seen  []string
}

func (f *iam) handle(w http.ResponseWriter, r *http.Request, next http.Handler) {
	tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	f.mu.Lock()
	f.seen = append(f.seen, tok)
	ok := f.valid[tok]
	f.mu.Unlock()
	if !ok {
		http.Error(w, "Your client does not have permission to the requested URL", http.StatusUnauthorized)
		return
	}
	next.ServeHTTP(w, r)
}

func (f *iam) set(tok string, ok bool) {
	f.mu.Lock()
	f.valid[tok] = ok
	f.mu.Unlock()
}

// issuer is a token source whose tokens expire: each fetch is a new
// token, valid (to the front end) until the test expires it.
type issuer struct {
	front   *iam
	fetches atomic.Int32
	life    time.Duration
	gate    chan struct{} // when set, fetches wait for it
}

func (s *issuer) Token(ctx context.Context) (client.Token, error) {
	if s.gate != nil {
		select {
		case <-s.gate:
		case <-ctx.Done():
			return client.Token{}, ctx.Err()
		}
	}
	n := s.fetches.Add(1)
	tok := fmt.Sprintf("identity-%d", n)
	s.front.set(tok, true)
	return client.Token{Value: tok, Expiry: time.Now().Add(s.life)}, nil
}

// Identity tokens: cached until shortly before they expire, one fetch for
// concurrent callers, fetched anew when the front end refuses one, and
// read anew for each port endpoint.
func TestIdentityTokens(t *testing.T) {
	s := need(t)
	f := &iam{valid: map[string]bool{}}
	url := front(t, f.handle)
	ctx := ctxT(t)

	// Long-lived: one fetch for many calls, and for concurrent ones.
	src := &issuer{front: f, life: time.Hour, gate: make(chan struct{})}
	c, err := client.New(url, client.WithToken(s.Token), client.WithIdentity(src))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() { _, err := c.List(ctx); errs <- err })
	}
	close(src.gate) // every call waits for the one fetch
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.List(ctx); err != nil {
		t.Fatal(err)
	}
	if n := src.fetches.Load(); n != 1 {
		t.Errorf("%d fetches for 9 calls with a token valid for an hour, want 1", n)
	}

	// The front end stops taking it (it expired early, by its clock): the
	// call is sent again once with a new token.
	f.set("identity-1", false)
	if _, err := c.List(ctx); err != nil {
		t.Fatalf("after the token was refused: %v", err)
	}
	if n := src.fetches.Load(); n != 2 {
		t.Errorf("%d fetches, want 2: a refused token is replaced", n)
	}

	// Short-lived (under the refresh margin): a new one for every call.
	short := &issuer{front: f, life: 30 * time.Second}
	cs, err := client.New(url, client.WithToken(s.Token), client.WithIdentity(short))
	if err != nil {
		t.Fatal(err)
	}
	sess := create(t, cs, client.CreateOptions{Ports: []int{4000}})
	before := short.fetches.Load()
	for range 3 {
		ep, err := sess.PortEndpoint(ctx, 4000, "ws")
		if err != nil {
			t.Fatal(err)
		}
		if got := ep.Header.Get("Authorization"); got != fmt.Sprintf("Bearer identity-%d", short.fetches.Load()) {
			t.Errorf("endpoint's Authorization %q, want the newest token", got)
		}
	}
	if got := short.fetches.Load() - before; got != 3 {
		t.Errorf("%d fetches for 3 endpoints of tokens about to expire, want 3", got)
	}

	// A source that fails: an authentication error, nothing sent.
	bad, _ := client.New(url, client.WithIdentity(client.TokenFunc(func(context.Context) (client.Token, error) {
		return client.Token{}, errors.New("no credentials here")
	})))
	if _, err := bad.List(ctx); !errors.Is(err, client.ErrAuthentication) || !strings.Contains(err.Error(), "no credentials here") {
		t.Errorf("a failing source: %v", err)
	}
	// No identity at all where the front end wants one; and a token it
	// never takes: the messages say what to do.
	none, _ := client.New(url, client.WithToken(s.Token))
	if _, err := none.List(ctx); !errors.Is(err, client.ErrAuthentication) || !strings.Contains(err.Error(), "identity source") || strings.Contains(err.Error(), "--auth") || strings.Contains(err.Error(), "WithIdentity") {
		t.Errorf("no identity: %v", err)
	}
	never, _ := client.New(url, client.WithToken(s.Token), client.WithIdentity(client.TokenFunc(func(context.Context) (client.Token, error) {
		return client.Token{Value: "not-taken", Expiry: time.Now().Add(time.Hour)}, nil
	})))
	var se *client.ServiceError
	if _, err := never.List(ctx); !errors.Is(err, client.ErrAuthentication) || !strings.Contains(err.Error(), "roles/run.invoker") || !errors.As(err, &se) || se.Status != 401 {
		t.Errorf("a refused token: %v", err)
	}
}

// The service token: missing or wrong is an authentication error naming
// the option.
func TestServiceToken(t *testing.T) {
	s := need(t)
	ctx := ctxT(t)
	none, _ := client.New(s.URL)
	var se *client.ServiceError
	if _, err := none.List(ctx); !errors.Is(err, client.ErrAuthentication) || !strings.Contains(err.Error(), "SANDBOX_SERVICE_TOKEN") || !errors.As(err, &se) || se.Status != 401 {
		t.Errorf("no token: %v", err)
	}
	wrong, _ := client.New(s.URL, client.WithToken("wrong"))
	if _, err := wrong.List(ctx); !errors.Is(err, client.ErrAuthentication) || !strings.Contains(err.Error(), "refused the service token") {
		t.Errorf("a wrong token: %v", err)
	}
}

// A service that speaks another protocol is named as such.
func TestProtocolMismatch(t *testing.T) {
	s := need(t)
	url := front(t, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		w.Header().Set(api.HeaderProtocol, "2")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"error":"this service speaks protocol 2"}`)
	})
	c, _ := client.New(url, client.WithToken(s.Token))
	var pe *client.ProtocolError
	_, err := c.List(ctxT(t))
	if !errors.Is(err, client.ErrProtocolMismatch) || !errors.As(err, &pe) || pe.Service != "2" || pe.Client != "1" || !strings.Contains(err.Error(), "protocol 2") {
		t.Errorf("protocol 2: %v", err)
	}
}

// Calls that are safe to repeat are repeated after failures that may
// pass; others are not, unless nothing was sent.
func TestRetries(t *testing.T) {
	s := need(t)
	ctx := ctxT(t)
	var fails atomic.Int32
	var creates atomic.Int32
	url := front(t, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if r.Method == "POST" && r.URL.Path == "/v1/sandboxes" {
			creates.Add(1)
		}
		if fails.Add(-1) >= 0 {
			w.Header().Set(api.HeaderProtocol, "1")
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, `{"error":"busy"}`)
			return
		}
		next.ServeHTTP(w, r)
	})
	c, _ := client.New(url, client.WithToken(s.Token))
	fails.Store(2)
	if _, err := c.List(ctx); err != nil {
		t.Errorf("a list after two 503s: %v", err)
	}
	fails.Store(10)
	var se *client.ServiceError
	if _, err := c.List(ctx); !errors.As(err, &se) || se.Status != 503 || se.Message != "busy" {
		t.Errorf("after the retries ran out: %v", err)
	}
	fails.Store(1)
	if _, err := c.Create(ctx, client.CreateOptions{}); !errors.As(err, &se) || se.Status != 503 || creates.Load() != 1 {
		t.Errorf("a create is not repeated after a 503: %v, %d creates", err, creates.Load())
	}
	fails.Store(0)
	nr, _ := client.New(url, client.WithToken(s.Token), client.WithRetries(0))
	fails.Store(1)
	if _, err := nr.List(ctx); !errors.As(err, &se) || se.Status != 503 {
		t.Errorf("without retries: %v", err)
	}
	fails.Store(0)

	// A connection refused before anything was sent: even a create is
	// sent again.
	var dials atomic.Int32
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		if dials.Add(1) == 1 {
			return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	rc, _ := client.New(s.URL, client.WithToken(s.Token), client.WithHTTPClient(&http.Client{Transport: tr}))
	sess, err := rc.Create(ctx, client.CreateOptions{})
	if err != nil {
		t.Fatalf("a create after a refused connection: %v", err)
	}
	sess.Destroy(ctx)
	// Nothing listening at all: bounded, then the dial's error.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := "http://" + ln.Addr().String()
	ln.Close()
	dc, _ := client.New(dead, client.WithRetries(2))
	if _, err := dc.List(ctx); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("no service: %v", err)
	}
}

// Preflight: the real service passes; an open one, a stale one and one of
// another protocol do not.
func TestPreflight(t *testing.T) {
	s := need(t)
	ctx := ctxT(t)
	c := newClient(t)
	rep, err := c.Preflight(ctx)
	if err != nil || rep.Protocol != 1 || rep.Refused != "service token" || rep.Routes != len(client.Routes()) || rep.Version != "test" {
		t.Errorf("preflight: %+v %v", rep, err)
	}
	// Every route the client calls is in the repository's document too.
	doc, err := os.ReadFile(filepath.Join("..", "server", "openapi.json"))
	if err != nil {
		t.Fatal(err)
	}
	var paths struct {
		Paths map[string]map[string]any `json:"paths"`
	}
	json.Unmarshal(doc, &paths)
	for _, r := range client.Routes() {
		m, p, _ := strings.Cut(r, " ")
		if paths.Paths[p][strings.ToLower(m)] == nil {
			t.Errorf("route %s is not in api/server/openapi.json", r)
		}
	}

	// A front end that adds the token itself: the service is open.
	open := front(t, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		r.Header.Set(api.HeaderToken, s.Token)
		next.ServeHTTP(w, r)
	})
	oc, _ := client.New(open, client.WithToken(s.Token))
	if _, err := oc.Preflight(ctx); !errors.Is(err, client.ErrOpenService) {
		t.Errorf("an open service: %v", err)
	}
	// A client with no credentials at all, of an open service on
	// loopback: a local service, accepted as such.
	local, _ := client.New(open)
	if rep, err := local.Preflight(ctx); err != nil || rep.Refused != "" {
		t.Errorf("an open service on loopback, no credentials: %+v %v", rep, err)
	}
	// An older service, without a route the client calls.
	stale := front(t, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if r.URL.Path == "/v1/openapi.json" {
			rec := httptest.NewRecorder()
			next.ServeHTTP(rec, r)
			var d map[string]any
			json.Unmarshal(rec.Body.Bytes(), &d)
			delete(d["paths"].(map[string]any), "/v1/templates")
			w.Header().Set(api.HeaderProtocol, "1")
			json.NewEncoder(w).Encode(d)
			return
		}
		next.ServeHTTP(w, r)
	})
	sc, _ := client.New(stale, client.WithToken(s.Token))
	if _, err := sc.Preflight(ctx); !errors.Is(err, client.ErrCapabilityUnsupported) || !strings.Contains(err.Error(), "GET /v1/templates") {
		t.Errorf("a stale service: %v", err)
	}
	// Another protocol.
	other := front(t, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		w.Header().Set(api.HeaderProtocol, "1")
		io.WriteString(w, `{"status":"ok","protocol":2,"version":"future"}`)
	})
	pc, _ := client.New(other, client.WithToken(s.Token))
	if _, err := pc.Preflight(ctx); !errors.Is(err, client.ErrProtocolMismatch) {
		t.Errorf("protocol 2 in /health: %v", err)
	}
}

// jwt makes an unsigned JWT with an exp claim.
func jwt(exp time.Time) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"none"}`)) + "." + enc([]byte(fmt.Sprintf(`{"exp":%d,"aud":"x"}`, exp.Unix()))) + ".sig"
}

// gcloud's token is used for *.run.app by default, and its expiry is read
// from the token itself.
func TestGcloudIdentity(t *testing.T) {
	dir := t.TempDir()
	count := filepath.Join(dir, "count")
	tok := jwt(time.Now().Add(time.Hour))
	script := "#!/bin/sh\necho x >> " + count + "\n[ \"$1 $2\" = 'auth print-identity-token' ] || exit 3\necho " + tok + "\n"
	if err := os.WriteFile(filepath.Join(dir, "gcloud"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	var got []string
	var mu sync.Mutex
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Get("Authorization")+" "+r.Host)
		mu.Unlock()
		w.Header().Set(api.HeaderProtocol, "1")
		io.WriteString(w, `{"sandboxes":[]}`)
	}))
	defer hs.Close()
	// sandgate-abc.a.run.app, reached on loopback.
	tr := &http.Transport{DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, hs.Listener.Addr().String())
	}}
	c, err := client.New("http://sandgate-abc.a.run.app", client.WithHTTPClient(&http.Client{Transport: tr}))
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	for range 3 {
		if _, err := c.List(ctx); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := os.ReadFile(count)
	if len(got) != 3 || got[0] != "Bearer "+tok+" sandgate-abc.a.run.app" || strings.Count(string(b), "x") != 1 {
		t.Errorf("requests %q, gcloud ran %d times (want once: the token lasts an hour)", got, strings.Count(string(b), "x"))
	}
	// gcloud failing: its message and what to do.
	os.WriteFile(filepath.Join(dir, "gcloud"), []byte("#!/bin/sh\necho 'ERROR: (gcloud.auth.print-identity-token) You do not currently have an active account selected.' >&2\nexit 1\n"), 0o755)
	c2, _ := client.New("http://sandgate-abc.a.run.app", client.WithHTTPClient(&http.Client{Transport: tr}))
	if _, err := c2.List(ctx); !errors.Is(err, client.ErrAuthentication) || !strings.Contains(err.Error(), "active account") || !strings.Contains(err.Error(), "gcloud auth login") {
		t.Errorf("gcloud failing: %v", err)
	}
	// Elsewhere, no identity by default.
	c3, _ := client.New(hs.URL)
	if _, err := c3.List(ctx); err != nil || !strings.HasPrefix(got[len(got)-1], " ") {
		t.Errorf("a service not on run.app got an identity token: %q %v", got[len(got)-1], err)
	}
}

// The metadata server's identity endpoint, for the service's URL as the
// audience (google.golang.org/api/idtoken, pointed at a loopback metadata
// server by GCE_METADATA_HOST).
func TestMetadataIdentity(t *testing.T) {
	var audiences []string
	var mu sync.Mutex
	md := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Metadata-Flavor") != "Google" || r.URL.Path != "/computeMetadata/v1/instance/service-accounts/default/identity" {
			http.NotFound(w, r)
			return
		}
		mu.Lock()
		audiences = append(audiences, r.URL.Query().Get("audience"))
		mu.Unlock()
		w.Header().Set("Metadata-Flavor", "Google")
		io.WriteString(w, "metadata-token")
	}))
	defer md.Close()
	t.Setenv("GCE_METADATA_HOST", strings.TrimPrefix(md.URL, "http://"))
	t.Setenv("GOOGLE_APPLICATION_CREDENTIALS", "")
	t.Setenv("HOME", t.TempDir()) // no gcloud application default credentials
	var auth string
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth = r.Header.Get("Authorization")
		w.Header().Set(api.HeaderProtocol, "1")
		io.WriteString(w, `{"sandboxes":[]}`)
	}))
	defer hs.Close()
	c, err := client.New(hs.URL, client.WithIdentity(client.MetadataIdentity("")))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.List(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if auth != "Bearer metadata-token" || len(audiences) != 1 || audiences[0] != hs.URL {
		t.Errorf("Authorization %q, audiences %q (want the service's URL)", auth, audiences)
	}
}

// Attach refused a sandbox the service had suspended on its own (idle),
// so `sandgate exec` failed on it while the call itself would have woken
// it. Now it attaches to one that wakes; one its caller suspended is
// still ErrSandboxNotRunning.
func TestAttachToASandboxTheServiceSuspended(t *testing.T) {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(api.HeaderProtocol, "1")
		by := strings.TrimPrefix(r.URL.Path, "/v1/sandboxes/")
		fmt.Fprintf(w, `{"name":%q,"state":"suspended","suspendedBy":%q,"created":"2026-01-01T00:00:00Z","layerBytes":1,"home":"/home/agent","workingDirectory":"/workspace"}`, by, by)
	}))
	defer hs.Close()
	c, err := client.New(hs.URL)
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	if s, err := c.Attach(ctx, "idle"); err != nil || s.ID() != "idle" {
		t.Errorf("attaching to a sandbox suspended idle: %v", err)
	}
	for _, by := range []string{"caller", "x"} {
		if _, err := c.Attach(ctx, by); !errors.Is(err, client.ErrSandboxNotRunning) {
			t.Errorf("attaching to a sandbox suspended by %q: %v, want ErrSandboxNotRunning", by, err)
		}
	}
}
