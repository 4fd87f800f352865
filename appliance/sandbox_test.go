package appliance

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/internal/testkit/dnstest"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
)

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// env is one real sandbox behind a real egress proxy: a loopback DNS
// server, a CA and an HTTPS upstream on 127.x.y.z:443 that records what it
// was sent, and `sandgate sandbox` as the sandbox CLI.
type env struct {
	t  *testing.T
	sb *Sandbox
	*egress
}

// skipUnlessSandboxes skips where real sandboxes cannot run.
func skipUnlessSandboxes(t *testing.T) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("sandboxes need Linux namespaces and overlayfs")
	}
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
}

// egress is what a sandbox needs around it: a loopback DNS server, a CA
// and an HTTPS upstream for api.example.com on 127.x.y.z:443 that records
// what it was sent, the egress proxy, and `sandgate sandbox` as the
// launcher's CLI over a state directory of the test's own.
type egress struct {
	proxy    *relay.Proxy
	l        *Launcher
	rings    *audit.Rings
	ca       *tlstest.CA
	upstream netip.Addr
	state    string
	canary   string
	pol      netpolicy.Policy

	mu   sync.Mutex
	seen []string // what the upstream received: method path and credential headers
	kept string   // the first X-Api-Key it received: GET /v1/kept hands it back
}

// cliMode is the sandbox CLI a test's launcher drives.
type cliMode string

const (
	// ourCLI is `sandgate sandbox`: typed exit statuses, descriptor
	// passing, templates.
	ourCLI cliMode = "sandgate"
	// googleCLI is internal/testkit/googlecli, which behaves as Google's CLI is
	// documented to (one exit status for every failure, stdio relayed
	// through pipes, no templates), over `sandgate sandbox`: the launcher
	// drives it in Google mode.
	googleCLI cliMode = "google"
)

// cliModes are the CLIs every lifecycle test runs against.
var cliModes = []cliMode{ourCLI, googleCLI}

func newEgress(t *testing.T) *egress { return newEgressOn(t, ourCLI) }

// newEgressOn is newEgress with the launcher driving the CLI of mode.
func newEgressOn(t *testing.T, mode cliMode) *egress {
	t.Helper()
	skipUnlessSandboxes(t)
	e := &egress{state: t.TempDir()}
	var b [12]byte
	rand.Read(b[:])
	// Made at run time, so no file the sandbox can read holds it.
	e.canary = "sk-canary-" + hex.EncodeToString(b[:])

	dns := dnstest.Start(t)
	e.ca = tlstest.MustCA(t)
	srv := e.ca.Server(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		e.seen = append(e.seen, r.Method+" "+r.URL.Path+" key="+r.Header.Get("X-Api-Key"))
		if k := r.Header.Get("X-Api-Key"); e.kept == "" && k != "" {
			e.kept = k
		}
		kept := e.kept
		e.mu.Unlock()
		if r.URL.Path == "/v1/kept" {
			// An upstream that keeps a key and hands it back later.
			fmt.Fprintf(w, "the key I hold: %s", kept)
			return
		}
		fmt.Fprintf(w, "upstream saw %s %s", r.Method, r.URL.Path)
	}), "api.example.com", "tunnel.example.com")
	e.upstream = tlstest.Addr(srv)
	dns.Set("api.example.com", e.upstream)
	dns.Set("tunnel.example.com", e.upstream) // no credential rule names it
	dns.Set("denied.example.com", e.upstream)
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{dns.Addr}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Close() })
	decider := &netpolicy.Decider{Resolver: res, DialTimeout: 5 * time.Second, AllowPrivate: []netip.Prefix{netip.PrefixFrom(e.upstream, 32)}}
	e.rings = audit.NewRings(100)
	e.proxy, err = relay.New(relay.Config{Decider: decider, Audit: e.rings, UpstreamRoots: e.ca.Pool})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.proxy.Close() })

	bin := gobuild.Sandgate(t)
	cli := bin
	if mode == googleCLI {
		cli = gobuild.GoogleCLI(t)
	}
	e.l, err = NewLauncher(LauncherConfig{CLI: cli, StateDir: e.state, AgentBinary: bin})
	if err != nil {
		t.Fatal(err)
	}
	if e.l.Google() != (mode == googleCLI) {
		t.Fatalf("launcher over %s: Google() = %v", cli, e.l.Google())
	}
	if e.pol, err = netpolicy.ParsePolicy([]byte(`{"mode":"custom","allowedHosts":["api.example.com","tunnel.example.com"]}`)); err != nil {
		t.Fatal(err)
	}
	return e
}

// rules are the credential rules: X-Api-Key swapped for the canary.
func (e *egress) rules(t *testing.T) *transforms.RuleSet {
	t.Helper()
	rules, err := transforms.ParseRules([]byte(`[{"match":{"host":"api.example.com"},"transform":{"headers":{"X-Api-Key":{"env":"TEST_KEY","placeholder":"sandgate-placeholder-key"}}}}]`),
		func(string) (string, bool) { return e.canary, true })
	if err != nil {
		t.Fatal(err)
	}
	return transforms.NewRuleSet(rules...)
}

// seenByUpstream is what the upstream received so far.
func (e *egress) seenByUpstream() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.seen)
}

func newEnv(t *testing.T) *env { return newEnvOn(t, ourCLI) }

// newEnvOn is newEnv with the launcher driving the CLI of mode.
func newEnvOn(t *testing.T, mode cliMode) *env {
	t.Helper()
	g := newEgressOn(t, mode)
	e := &env{t: t, egress: g}
	proxy, pol, rs := g.proxy, g.pol, g.rules(t)
	var err error
	id := "t-" + strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(id) > 40 {
		id = id[:40]
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	e.sb, err = Create(ctx, e.l, proxy, id, Options{
		Policy:     pol,
		Transforms: rs,
		Agent:      agent.Config{BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := e.sb.Destroy(ctx); err != nil {
			t.Errorf("Destroy: %v", err)
		}
		e.assertGone(id)
	})
	return e
}

// assertGone checks that a destroyed sandbox left no state, mount or
// process.
func (e *env) assertGone(id string) {
	t := e.t
	if ents, _ := os.ReadDir(e.state); len(ents) > 0 {
		var names []string
		for _, d := range ents {
			names = append(names, d.Name())
		}
		t.Errorf("state left after Destroy: %v", names)
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if bytes.Contains(mi, []byte(e.state)) {
		t.Errorf("a mount under the state directory survived Destroy")
	}
}

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	e.t.Cleanup(cancel)
	return ctx
}

// sh runs a shell command in the sandbox and returns its status and output.
func (e *env) sh(script string, envv ...string) (agent.ExitStatus, string, string) {
	e.t.Helper()
	var out, errb bytes.Buffer
	st, err := e.sb.Run(e.ctx(), agent.Cmd{Args: []string{"/bin/sh", "-c", script}, Env: envv, Stdout: &out, Stderr: &errb})
	if err != nil {
		e.t.Fatalf("run %q: %v", script, err)
	}
	return st, out.String(), errb.String()
}

func TestCommandOutputAndExitCode(t *testing.T) {
	e := newEnv(t)
	st, out, errs := e.sh("echo out; echo err >&2; exit 7")
	if st.Code != 7 || out != "out\n" || errs != "err\n" {
		t.Errorf("got %v %q %q, want exit 7, out, err", st, out, errs)
	}
	st, _, _ = e.sh("kill -TERM $$")
	if st.Signal.String() != "terminated" {
		t.Errorf("a command killed by SIGTERM reported %v", st)
	}
}

func TestProcessTreeKilled(t *testing.T) {
	e := newEnv(t)
	p, err := e.sb.Spawn(e.ctx(), agent.Cmd{Args: []string{"/bin/sh", "-c", "sleep 300 & sleep 301 & wait"}})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both sleeps running", func() bool {
		_, out, _ := e.sh("pgrep -c -x sleep || true")
		return strings.TrimSpace(out) == "2"
	})
	if err := p.Kill(e.ctx()); err != nil {
		t.Fatal(err)
	}
	if st, err := p.Wait(e.ctx()); err != nil || st.Signal == 0 {
		t.Errorf("killed command: %v %v", st, err)
	}
	waitFor(t, "every sleep gone", func() bool {
		st, _, _ := e.sh("pgrep -x sleep")
		return st.Code == 1
	})

	// kill-all stops everything but the agent, which keeps serving.
	if _, err := e.sb.Spawn(e.ctx(), agent.Cmd{Args: []string{"/bin/sh", "-c", "setsid sleep 302 & sleep 303"}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "new sleeps running", func() bool {
		_, out, _ := e.sh("pgrep -c -x sleep || true")
		return strings.TrimSpace(out) == "2"
	})
	if n, err := e.sb.KillAll(e.ctx()); err != nil || n < 2 {
		t.Errorf("KillAll = %d, %v; want at least the two sleeps", n, err)
	}
	waitFor(t, "kill-all took effect", func() bool {
		st, _, _ := e.sh("pgrep -x sleep")
		return st.Code == 1
	})
}

func TestFilesAndWorkspace(t *testing.T) {
	e := newEnv(t)
	ctx := e.ctx()
	want := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	if _, err := e.sb.WriteFile(ctx, "/work/deep/file.bin", bytes.NewReader(want), agent.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	r, fi, err := e.sb.ReadFile(ctx, "/work/deep/file.bin")
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(r)
	r.Close()
	if err != nil || !bytes.Equal(got, want) || fi.Size() != int64(len(want)) {
		t.Errorf("file round trip: %d bytes (stat %d), err %v", len(got), fi.Size(), err)
	}
	if _, _, err := e.sb.ReadFile(ctx, "/work/missing"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("reading a missing file: %v, want fs.ErrNotExist", err)
	}

	// A workspace in as a tar and back out.
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	files := map[string]string{"src/main.go": "package main\n", "README": "hello\n"}
	for name, body := range files {
		tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
		io.WriteString(tw, body)
	}
	tw.Close()
	if err := e.sb.TarIn(ctx, "/workspace", &in, agent.TarOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, out, _ := e.sh("cat /workspace/src/main.go /workspace/README"); out != "package main\nhello\n" {
		t.Errorf("seeded workspace reads %q", out)
	}
	var out bytes.Buffer
	if err := e.sb.TarOut(ctx, "/workspace", &out); err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(&out)
	found := map[string]string{}
	for range 100 {
		h, err := tr.Next()
		if err != nil {
			break
		}
		if h.Typeflag == tar.TypeReg {
			b, _ := io.ReadAll(tr)
			found[strings.TrimPrefix(h.Name, "./")] = string(b)
		}
	}
	for name, body := range files {
		if found[name] != body {
			t.Errorf("collected workspace: %s = %q, want %q (have %v)", name, found[name], body, found)
		}
	}
}

func TestPortDial(t *testing.T) {
	e := newEnv(t)
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("the port test serves with /usr/bin/python3, which this machine lacks")
	}
	server := `import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8765)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.sendall(b"hello from inside " + c.recv(100)); c.close()`
	ready := newLineSignal()
	p, err := e.sb.Spawn(e.ctx(), agent.Cmd{Args: []string{"/usr/bin/python3", "-c", server}, Stdout: ready})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-ready.ch:
	case <-time.After(20 * time.Second):
		t.Fatal("the server inside never became ready")
	}
	c, err := e.sb.DialPort(e.ctx(), 8765)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "the service")
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, _ := io.ReadAll(c)
	if string(b) != "hello from inside the service" {
		t.Errorf("port dial read %q", b)
	}
	p.Wait(e.ctx())
}

// TestEgressOnlyThroughTheRelay: curl in the sandbox reaches an allowed
// upstream through the relay (tunnel and base-URL route, the placeholder
// swapped for the secret outside), is refused a tunnel to the host of its
// credential rule (no interception CA here: its answers could not be
// scrubbed) and a denied host, with the audit events to show, and has no
// route out without the relay.
func TestEgressOnlyThroughTheRelay(t *testing.T) {
	e := newEnv(t)
	if _, err := os.Stat("/usr/bin/curl"); err != nil {
		t.Skip("the egress test runs /usr/bin/curl in the sandbox, which this machine lacks")
	}
	ca, err := e.ca.WritePEM(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	pem, _ := os.ReadFile(ca)
	if _, err := e.sb.WriteFile(e.ctx(), "/tmp/ca.pem", bytes.NewReader(pem), agent.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	// A tunnel (HTTPS_PROXY is set by the agent).
	st, out, errs := e.sh("curl -sS --cacert /tmp/ca.pem https://tunnel.example.com/tunnel")
	if !st.Success() || out != "upstream saw GET /tunnel" {
		t.Errorf("curl through the tunnel: %v %q %q", st, out, errs)
	}
	// A tunnel to the host of its credential rule.
	st, out, errs = e.sh("curl -sS -w '%{http_connect}' --cacert /tmp/ca.pem https://api.example.com/tunnel")
	if st.Success() || out != "403" {
		t.Errorf("curl through a tunnel to the credential's host: %v %q %q, want the CONNECT refused", st, out, errs)
	}
	if ev := waitEvent(t, e.rings, e.sb.ID(), func(ev audit.Event) bool { return ev.Host == "api.example.com" && ev.Kind == audit.Connect }); ev.Allow || ev.Code != relay.CodeCredentialHost {
		t.Errorf("audit event of the tunnel to the credential's host: %+v", ev)
	}
	// A base-URL route: the placeholder goes out as the secret.
	st, out, errs = e.sh(`curl -sS -H "X-Api-Key: sandgate-placeholder-key" "$ANTHROPIC_BASE_URL/v1/messages"`)
	if !st.Success() || out != "upstream saw GET /v1/messages" {
		t.Errorf("curl on the route: %v %q %q", st, out, errs)
	}
	e.mu.Lock()
	seen := strings.Join(e.seen, "\n")
	e.mu.Unlock()
	if !strings.Contains(seen, "GET /v1/messages key="+e.canary) {
		t.Errorf("the upstream did not get the secret for the placeholder: %s", seen)
	}
	// A denied host.
	st, _, _ = e.sh("curl -sS --cacert /tmp/ca.pem https://denied.example.com/")
	if st.Success() {
		t.Errorf("curl to a denied host succeeded")
	}
	ev := waitEvent(t, e.rings, e.sb.ID(), func(ev audit.Event) bool { return ev.Host == "denied.example.com" })
	if ev.Allow {
		t.Errorf("audit event for the denied host says allowed: %+v", ev)
	}
	// No route out without the relay: straight to the upstream's address.
	st, _, _ = e.sh(fmt.Sprintf("curl -sS --noproxy '*' --max-time 5 --cacert /tmp/ca.pem --resolve api.example.com:443:%s https://api.example.com/direct", e.upstream))
	if st.Success() {
		t.Errorf("a direct connection to the upstream's address worked from inside the sandbox")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, s := range e.seen {
		if strings.Contains(s, "/direct") {
			t.Errorf("the upstream got a request that bypassed the relay: %s", s)
		}
	}
}

// TestContainment: the host's processes, interfaces and files are out of
// sight or out of reach; mount, module loading and raw sockets fail.
func TestContainment(t *testing.T) {
	e := newEnv(t)
	if _, out, _ := e.sh("ls /proc | grep -c '^[0-9]*$'"); atoiOr(out, 1000) > 20 {
		t.Errorf("the sandbox sees %s processes: the host's are visible", strings.TrimSpace(out))
	}
	if _, out, _ := e.sh("ls /sys/class/net 2>/dev/null || cat /proc/net/dev"); strings.Contains(out, "eth") || strings.Contains(out, "ens") {
		t.Errorf("a host network interface is visible: %q", out)
	}
	// A host file seen through the read-only image: a write lands in the
	// sandbox's own layer, never on the host.
	host := filepath.Join(t.TempDir(), "host-file") // under /tmp: not even visible
	os.WriteFile(host, []byte("host"), 0o644)
	if st, _, _ := e.sh("cat " + host); st.Success() {
		t.Errorf("the host's /tmp is visible in the sandbox")
	}
	before, _ := os.ReadFile("/etc/hostname")
	e.sh("echo sandbox-was-here > /etc/hostname")
	if after, _ := os.ReadFile("/etc/hostname"); !bytes.Equal(before, after) {
		t.Errorf("a write to /etc/hostname in the sandbox changed the host's")
	}
	for _, c := range []struct{ what, script string }{
		{"mount", "mount -t tmpfs none /mnt"},
		{"module loading", "insmod /nonexistent.ko 2>&1 || modprobe dummy"},
		{"raw sockets", "/usr/bin/python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)'"},
	} {
		if st, out, errs := e.sh(c.script); st.Success() {
			t.Errorf("%s worked inside the sandbox: %q %q", c.what, out, errs)
		}
	}
}

// TestCanaryStaysOutside: the secret set as a transformation is in no
// environment, file or exported layer of the sandbox.
func TestCanaryStaysOutside(t *testing.T) {
	e := newEnv(t)
	// Use the route once, so the secret has been swapped in.
	e.sh(`curl -sS -H "X-Api-Key: sandgate-placeholder-key" "$ANTHROPIC_BASE_URL/v1/x" > /root/response.txt`)
	if _, out, _ := e.sh("env; cat /proc/1/environ /proc/self/environ | tr '\\0' '\\n'"); strings.Contains(out, e.canary) {
		t.Errorf("the canary secret is in the sandbox's environment")
	}
	// What the sandbox wrote: the response it saved and its tmpfs. (Its
	// whole writable layer is checked below; /root itself is the host's,
	// read-only underneath, and far too large to grep.)
	if st, out, _ := e.sh("grep -rl " + e.canary + " /root/response.txt /tmp 2>/dev/null"); st.Success() {
		t.Errorf("the canary secret is in files in the sandbox: %s", out)
	}
	layer := filepath.Join(t.TempDir(), "layer.tar")
	if err := e.sb.ExportLayer(e.ctx(), layer); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(layer)
	if err != nil || len(b) == 0 {
		t.Fatalf("exported layer: %d bytes, %v", len(b), err)
	}
	if !bytes.Contains(b, []byte("response.txt")) {
		t.Errorf("the exported layer lacks the file the sandbox wrote")
	}
	if bytes.Contains(b, []byte(e.canary)) {
		t.Errorf("the canary secret is in the exported layer")
	}
}

// TestAgentRestarted: when the agent's link drops, the handle starts a new
// agent and the next operation works.
func TestAgentRestarted(t *testing.T) {
	e := newEnv(t)
	e.sb.mu.Lock()
	k := e.sb.curLink
	e.sb.mu.Unlock()
	k.cmd.Process.Kill() // the CLI carrying the link dies
	waitFor(t, "a new agent", func() bool {
		e.sb.mu.Lock()
		defer e.sb.mu.Unlock()
		return e.sb.curLink != nil && e.sb.curLink != k
	})
	if st, out, _ := e.sh("echo again"); !st.Success() || out != "again\n" {
		t.Errorf("after the restart: %v %q", st, out)
	}
}

// waitFor polls ok until it holds, for up to two minutes: longer than any
// bound of the code under test (an agent's hello waits 30 s, its CLI 5 s
// more), so that only a hang fails it.
func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if ok() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func waitEvent(t *testing.T, rings *audit.Rings, id string, match func(audit.Event) bool) audit.Event {
	t.Helper()
	var ev audit.Event
	waitFor(t, "the audit event", func() bool {
		for _, e := range rings.Events(id) {
			if match(e) {
				ev = e
				return true
			}
		}
		return false
	})
	return ev
}

func atoiOr(s string, def int) int {
	var n int
	if _, err := fmt.Sscan(strings.TrimSpace(s), &n); err != nil {
		return def
	}
	return n
}

// lineSignal closes ch at the first newline written to it.
type lineSignal struct {
	once sync.Once
	ch   chan struct{}
}

func newLineSignal() *lineSignal { return &lineSignal{ch: make(chan struct{})} }

func (l *lineSignal) Write(p []byte) (int, error) {
	if bytes.IndexByte(p, '\n') >= 0 {
		l.once.Do(func() { close(l.ch) })
	}
	return len(p), nil
}
