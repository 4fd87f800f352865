package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
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

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// rig is a real service on loopback: the HTTP server over a Manager over
// `sandgate sandbox`, the egress proxy with a loopback DNS server, and an
// HTTPS upstream for api.example.com that echoes the credential headers
// it received.
type rig struct {
	t      *testing.T
	srv    *Server
	hs     *httptest.Server
	m      *appliance.Manager
	st     store.Store
	rings  *audit.Rings
	ca     *tlstest.CA
	state  string // the launcher's state directory
	work   string
	log    *syncbuf.Buffer
	token  string
	canary string

	mu   sync.Mutex
	seen []http.Header // what the upstream received
}

func skipUnlessSandboxes(t *testing.T) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("sandboxes need Linux namespaces and overlayfs")
	}
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
}

func newRig(t *testing.T, tweak func(*Config)) *rig {
	t.Helper()
	skipUnlessSandboxes(t)
	r := &rig{t: t, state: t.TempDir(), work: t.TempDir(), log: &syncbuf.Buffer{}, token: "test-token-" + t.Name()}
	var b [12]byte
	rand.Read(b[:])
	r.canary = "sk-canary-" + hex.EncodeToString(b[:])
	logger := slog.New(slog.NewJSONHandler(r.log, nil))

	dns := dnstest.Start(t)
	r.ca = tlstest.MustCA(t)
	up := r.ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.seen = append(r.seen, req.Header.Clone())
		r.mu.Unlock()
		// Echoes what it was sent: the scrub must hide the secret again.
		fmt.Fprintf(w, "path=%s auth=%s key=%s", req.URL.Path, req.Header.Get("Authorization"), req.Header.Get("X-Api-Key"))
	}), "api.example.com")
	upAddr := tlstest.Addr(up)
	dns.Set("api.example.com", upAddr)
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{dns.Addr}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Close() })
	r.rings = audit.NewRings(100)
	proxy, err := relay.New(relay.Config{
		Decider:       &netpolicy.Decider{Resolver: res, DialTimeout: 5 * time.Second, AllowPrivate: []netip.Prefix{netip.PrefixFrom(upAddr, 32)}},
		Audit:         audit.Multi{r.rings, audit.Logger{L: logger}},
		UpstreamRoots: r.ca.Pool,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	bin := gobuild.Sandgate(t)
	l, err := appliance.NewLauncher(appliance.LauncherConfig{CLI: bin, AgentBinary: bin, StateDir: r.state})
	if err != nil {
		t.Fatal(err)
	}
	if r.st, err = store.NewDir(t.TempDir()); err != nil {
		t.Fatal(err)
	}
	r.m, err = appliance.NewManager(context.Background(), appliance.ManagerConfig{
		Launcher: l, Proxy: proxy, Store: r.st, Version: "test", WorkDir: r.work, IdleSuspend: -1, Logger: logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		Manager: r.m, Token: r.token, Version: "test", Audit: r.rings, Logger: logger,
		BaseURLs:   map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"},
		EgressPort: 0, WaitTimeout: 2 * time.Second,
	}
	if tweak != nil {
		tweak(&cfg)
	}
	if r.srv, err = New(cfg); err != nil {
		t.Fatal(err)
	}
	r.hs = httptest.NewServer(r.srv)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		// Sandboxes first: their processes end, and with them the streams
		// (exec, audit, tunnels) the HTTP server would wait for.
		infos, _ := r.m.List(ctx)
		for _, in := range infos {
			r.m.Destroy(ctx, in.ID)
		}
		r.hs.Close()
		r.srv.Close()
		r.m.Close(ctx)
		names, _ := l.ListTemplates(ctx) // mounted images: removed, or the state could not be
		for _, n := range names {
			l.RemoveTemplate(ctx, n)
		}
		r.noCanary()
	})
	return r
}

// noCanary checks every artifact the service made: its log, the audit
// events, the store's objects and the files of its state.
func (r *rig) noCanary() {
	t := r.t
	if strings.Contains(r.log.String(), r.canary) {
		t.Errorf("the canary secret is in the service's log")
	}
	for _, id := range []string{"box", "other", "copy"} {
		for _, e := range r.rings.Events(id) {
			if b, _ := json.Marshal(e); bytes.Contains(b, []byte(r.canary)) {
				t.Errorf("the canary secret is in an audit event: %s", b)
			}
		}
	}
	for _, dir := range []string{r.state, r.work} {
		filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				if b, _ := os.ReadFile(p); bytes.Contains(b, []byte(r.canary)) {
					t.Errorf("the canary secret is in %s", p)
				}
			}
			return nil
		})
	}
}

// do sends a request with the protocol and token headers and returns the
// status, the body and the response.
func (r *rig) do(method, path string, body any) (int, string, *http.Response) {
	r.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		js, _ := json.Marshal(b)
		rd = bytes.NewReader(js)
	}
	req, _ := http.NewRequest(method, r.hs.URL+path, rd)
	req.Header.Set(api.HeaderProtocol, "1")
	req.Header.Set(api.HeaderToken, r.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		r.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.Header.Get(api.HeaderProtocol) != "1" {
		r.t.Errorf("%s %s: no %s: 1 on the response", method, path, api.HeaderProtocol)
	}
	if bytes.Contains(out, []byte(r.canary)) {
		r.t.Errorf("%s %s: the canary secret is in the response", method, path)
	}
	return resp.StatusCode, string(out), resp
}

// must is do, failing unless the status is want.
func (r *rig) must(want int, method, path string, body any) string {
	r.t.Helper()
	code, out, _ := r.do(method, path, body)
	if code != want {
		r.t.Fatalf("%s %s: %d %s, want %d", method, path, code, out, want)
	}
	return out
}

// execResult is what an exec stream carried.
type execResult struct {
	pid            string
	stdout, stderr string
	exit           int // -1 when the stream had no Exit frame
}

// exec runs a command through the exec route and reads its frames.
func (r *rig) exec(name, command string, stdin []byte, extra ...string) execResult {
	r.t.Helper()
	line, _ := json.Marshal(map[string]any{"command": command})
	if len(extra) > 0 {
		line = []byte(extra[0])
	}
	code, out, resp := r.do("POST", "/v1/sandboxes/"+name+"/exec", append(append(line, '\n'), stdin...))
	if code != http.StatusOK {
		r.t.Fatalf("exec %q: %d %s", command, code, out)
	}
	res := readFrames(r.t, strings.NewReader(out))
	if res.pid != resp.Header.Get(api.HeaderProcessID) {
		r.t.Errorf("Open frame %q, x-process-id %q", res.pid, resp.Header.Get(api.HeaderProcessID))
	}
	return res
}

func readFrames(t *testing.T, rd io.Reader) execResult {
	t.Helper()
	res := execResult{exit: -1}
	var o, e strings.Builder
	fr := api.NewFrameReader(rd)
	for {
		f, err := fr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("frames: %v", err)
		}
		switch {
		case f.Type == api.FrameOpen:
			res.pid = string(f.Payload)
		case f.Type == api.FrameData && f.Channel == api.ChannelStdout:
			o.Write(f.Payload)
		case f.Type == api.FrameData && f.Channel == api.ChannelStderr:
			e.Write(f.Payload)
		case f.Type == api.FrameExit:
			res.exit, _ = strconv.Atoi(string(f.Payload))
		default:
			t.Fatalf("unexpected frame %+v", f)
		}
	}
	res.stdout, res.stderr = o.String(), e.String()
	return res
}

// create makes sandbox name with the network body given.
func (r *rig) create(name string, body map[string]any) {
	r.t.Helper()
	if body == nil {
		body = map[string]any{}
	}
	body["name"] = name
	out := r.must(http.StatusCreated, "POST", "/v1/sandboxes", body)
	var d api.Description
	if json.Unmarshal([]byte(out), &d) != nil || d.Name != name || d.Home != "/home/agent" || d.WorkingDirectory != "/workspace" {
		r.t.Fatalf("create answered %s", out)
	}
}

// upstreamSeen is what the upstream received so far.
func (r *rig) upstreamSeen() []http.Header {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]http.Header(nil), r.seen...)
}
