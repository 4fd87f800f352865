package e2e

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha1"
	"crypto/sha512"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
)

// hang bounds every wait: only a hang exceeds it, never a loaded machine.
const hang = 2 * time.Minute

// Names the loopback DNS server gives the stand-ins.
const (
	registryHost = "registry.npmjs.org"
	echoHost     = "api.example.com"
	// trapHost is an allowed host whose name resolves to a private
	// (loopback) address where a server counts what reaches it.
	trapHost     = "internal.e2e.test"
	metadataHost = "metadata.google.internal"
)

// fixtures are what the local services share: the DNS server, the CA the
// stand-ins' certificates come from, and the stand-ins themselves.
type fixtures struct {
	dns    *dnstest.Server
	ca     *tlstest.CA
	caFile string
	// exempt are the stand-ins' addresses, the only private ones serve
	// may dial (SANDBOX_ALLOW_PRIVATE).
	exempt []netip.Addr

	registry *registry
	echo     *echoUpstream
	trap     *trap
}

func newFixtures(t *testing.T) *fixtures {
	t.Helper()
	f := &fixtures{dns: dnstest.Start(t), ca: tlstest.MustCA(t)}
	var err error
	if f.caFile, err = f.ca.WritePEM(t.TempDir()); err != nil {
		t.Fatal(err)
	}
	f.registry = newRegistry(t)
	reg := f.ca.Server(t, f.registry, registryHost)
	f.echo = &echoUpstream{}
	echo := f.ca.Server(t, f.echo, echoHost)
	f.trap = &trap{}
	trapSrv := f.ca.Server(t, f.trap, trapHost)
	trapSrv.Config.ConnState = f.trap.connState
	for name, srv := range map[string]*httptest.Server{registryHost: reg, echoHost: echo, trapHost: trapSrv} {
		f.dns.Set(name, tlstest.Addr(srv))
	}
	f.exempt = []netip.Addr{tlstest.Addr(reg), tlstest.Addr(echo)}
	f.trap.addr = tlstest.Addr(trapSrv)
	f.dns.Set(metadataHost, netip.MustParseAddr("169.254.169.254"))
	return f
}

// registry is a stand-in for the npm registry: one tiny package, its
// document and its tarball, as registry.npmjs.org serves them.
type registry struct {
	doc, tgz []byte
	hits     atomic.Int64
}

const (
	localPkg     = "sandgate-e2e-pkg"
	localVersion = "1.0.0"
	// pkgMarker is what the package's module exports.
	pkgMarker = "sandgate-e2e-pkg says hello"
)

func newRegistry(t *testing.T) *registry {
	t.Helper()
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	files := []struct{ name, body string }{
		{"package/package.json", fmt.Sprintf(`{"name":%q,"version":%q,"main":"index.js"}`, localPkg, localVersion)},
		{"package/index.js", fmt.Sprintf("module.exports = %q;\n", pkgMarker)},
	}
	for _, f := range files {
		if err := tw.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.body)), ModTime: time.Unix(1e9, 0), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(f.body))
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := gz.Close(); err != nil {
		t.Fatal(err)
	}
	r := &registry{tgz: buf.Bytes()}
	s512 := sha512.Sum512(r.tgz)
	s1 := sha1.Sum(r.tgz)
	version := map[string]any{
		"name": localPkg, "version": localVersion, "main": "index.js",
		"dist": map[string]any{
			"tarball":   fmt.Sprintf("https://%s/%s/-/%s-%s.tgz", registryHost, localPkg, localPkg, localVersion),
			"integrity": "sha512-" + base64.StdEncoding.EncodeToString(s512[:]),
			"shasum":    hex.EncodeToString(s1[:]),
		},
	}
	doc, err := json.Marshal(map[string]any{
		"name": localPkg, "dist-tags": map[string]string{"latest": localVersion},
		"versions": map[string]any{localVersion: version},
	})
	if err != nil {
		t.Fatal(err)
	}
	r.doc = doc
	return r
}

func (r *registry) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r.hits.Add(1)
	switch req.URL.Path {
	case "/" + localPkg:
		w.Header().Set("Content-Type", "application/json")
		w.Write(r.doc)
	case fmt.Sprintf("/%s/-/%s-%s.tgz", localPkg, localPkg, localVersion):
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(r.tgz)
	default:
		http.NotFound(w, req)
	}
}

// echoUpstream is a model API of our own: it echoes the credential it got
// in its body, and keeps every value it got.
type echoUpstream struct {
	mu   sync.Mutex
	keys []string
}

func (e *echoUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	e.keys = append(e.keys, r.Header.Get("X-Api-Key"))
	e.mu.Unlock()
	fmt.Fprintf(w, "path=%s key=%s", r.URL.Path, r.Header.Get("X-Api-Key"))
}

func (e *echoUpstream) seen() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.keys...)
}

// trap counts the connections that reach it: none may.
type trap struct {
	addr  netip.Addr
	conns atomic.Int64
}

func (tr *trap) connState(_ net.Conn, s http.ConnState) {
	if s == http.StateNew {
		tr.conns.Add(1)
	}
}

func (tr *trap) ServeHTTP(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "trapped") }

// serve is one `sandgate serve` process.
type serve struct {
	env []string
	url string
	cmd *exec.Cmd
	log *syncbuf.Buffer
	// exited is closed once cmd.Wait returned; err is what it returned.
	exited chan struct{}
	err    error
}

// serveEnv is the environment of a serve over dir (its state and store),
// resolving with the fixtures' DNS server and driving cli ("" for
// `sandgate sandbox`).
func serveEnv(f *fixtures, dir, token, cli string) []string {
	var exempt []string
	for _, a := range f.exempt {
		exempt = append(exempt, netip.PrefixFrom(a, 32).String())
	}
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir,
		"PORT=0", "LOG_FORMAT=text", "SANDBOX_SERVICE_TOKEN=" + token,
		"SANDGATE_STATE_DIR=" + filepath.Join(dir, "state"), "SNAPSHOT_DIRECTORY=" + filepath.Join(dir, "store"),
		"SANDGATE_AUDIT_LOG=" + filepath.Join(dir, "audit.log"),
		"SANDBOX_DNS=" + f.dns.Addr, "SANDBOX_ALLOW_PRIVATE=" + strings.Join(exempt, ","),
		"SANDGATE_UPSTREAM_CA=" + f.caFile,
		"SANDGATE_IDLE_SUSPEND=0", "SANDGATE_SHUTDOWN_GRACE=" + hang.String(),
	}
	if cli != "" {
		env = append(env, "SANDBOX_CLI="+cli)
	}
	return env
}

// startServe starts serve with env and waits until it listens.
func startServe(t *testing.T, env []string) *serve {
	t.Helper()
	s := &serve{env: env, log: &syncbuf.Buffer{}, exited: make(chan struct{})}
	s.cmd = exec.Command(gobuild.Sandgate(t), "serve")
	s.cmd.Env = env
	stderr, err := s.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	s.cmd.Stdout = s.log // the audit log goes to a file; anything else here
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		sent := false
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(s.log, line)
			if _, rest, ok := strings.Cut(line, "sandgate serving addr="); ok && !sent {
				addr <- strings.Fields(rest)[0]
				sent = true
			}
		}
		s.err = s.cmd.Wait()
		close(s.exited)
		close(addr)
	}()
	t.Cleanup(func() { s.stop(t) })
	select {
	case a, ok := <-addr:
		if !ok {
			t.Fatalf("serve ended before listening: %v\n%s", s.err, s.log.String())
		}
		s.url = "http://" + a
	case <-time.After(hang):
		t.Fatalf("serve did not listen within %v:\n%s", hang, s.log.String())
	}
	return s
}

// terminate sends SIGTERM and waits for serve to exit; it returns what
// serve exited with.
func (s *serve) terminate(t *testing.T) error {
	t.Helper()
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
		return s.err
	case <-time.After(hang):
		s.cmd.Process.Kill()
		<-s.exited
		t.Fatalf("serve did not exit within %v of SIGTERM:\n%s", hang, s.log.String())
		return nil
	}
}

// stop ends serve if it still runs, and removes the templates `sandgate
// sandbox` keeps mounted under its state, which outlive the process.
func (s *serve) stop(t *testing.T) {
	select {
	case <-s.exited:
	default:
		s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
		case <-time.After(hang):
			s.cmd.Process.Kill()
			<-s.exited
		}
	}
	state := ""
	for _, e := range s.env {
		if v, ok := strings.CutPrefix(e, "SANDGATE_STATE_DIR="); ok {
			state = filepath.Join(v, "sandboxes")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	box := func(args ...string) ([]byte, error) {
		cmd := exec.CommandContext(ctx, gobuild.Sandgate(t), append([]string{"sandbox"}, args...)...)
		cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "SANDGATE_STATE_DIR=" + state}
		return cmd.CombinedOutput()
	}
	// Sandboxes a failed test left running (SIGTERM saved them: they are
	// stopped, but a crash may leave one).
	if out, err := box("list"); err == nil {
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] != "ID" {
				box("delete", "--force", f[0])
			}
		}
	}
	if out, err := box("template", "ls"); err == nil {
		for _, n := range strings.Fields(string(out)) {
			if out, err := box("template", "rm", n); err != nil {
				t.Errorf("removing template %s: %v\n%s", n, err, out)
			}
		}
	}
}

// newClient is a client of a local serve: with the service token, and an
// identity token of its own making (a canary: no server in a sandbox may
// receive it).
func newClient(t *testing.T, url, token, identity string) *client.Client {
	t.Helper()
	c, err := client.New(url, client.WithToken(token), client.WithIdentity(client.TokenFunc(func(context.Context) (client.Token, error) {
		return client.Token{Value: identity, Expiry: time.Now().Add(time.Hour)}, nil
	})))
	if err != nil {
		t.Fatal(err)
	}
	return c
}
