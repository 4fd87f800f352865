package e2e

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
)

// 1. A template whose setup installs a package from the registry
// (registry.npmjs.org allowed); a sandbox made from it has the package,
// and setup does not run again.
func testTemplateFromRegistry(t *testing.T, tg *target) {
	pkg, version, want := localPkg, localVersion, pkgMarker
	var setup []string
	flags := ""
	if tg.remote {
		// The real registry, reached by the deployment: a tiny package
		// with no dependencies that exports a function.
		pkg, version, want = "is-number", "7.0.0", "function"
	} else {
		// Sandboxes here run on this host's root: npm is its own.
		if _, err := exec.LookPath("npm"); err != nil {
			t.Skip("npm is not installed on this host, whose root the sandboxes share (apt-get install npm)")
		}
		// The stand-in's certificate is our CA's: npm is told to trust
		// it, as a company's registry mirror would be.
		setup = append(setup, "cat > /workspace/.e2e-ca.pem <<'EOF'\n"+string(tg.f.ca.PEM)+"EOF")
		flags = " --cafile=/workspace/.e2e-ca.pem"
	}
	setup = append(setup, "npm install"+flags+" --no-audit --no-fund --no-update-notifier --loglevel=error "+pkg+"@"+version)
	tmpl := client.Template{Identity: "sandgate-e2e-" + tg.nonce, Setup: setup, AllowedHosts: []string{registryHost}}
	var hits int64
	if !tg.remote {
		hits = tg.f.registry.hits.Load()
	}
	id, err := tg.c.EnsureTemplate(ctx(t), tmpl)
	if err != nil {
		t.Fatalf("EnsureTemplate: %v", err)
	}
	t.Cleanup(func() {
		if err := tg.c.DeleteTemplate(ctx(t), id); err != nil {
			t.Errorf("DeleteTemplate: %v", err)
		}
	})
	if id != client.TemplateID(tmpl.Identity, tmpl.Setup) {
		t.Errorf("template id %s, want %s", id, client.TemplateID(tmpl.Identity, tmpl.Setup))
	}
	if !tg.remote {
		if got := tg.f.registry.hits.Load(); got < hits+2 {
			t.Fatalf("the registry stand-in got %d requests during the build, want the package's document and tarball", got-hits)
		}
		hits = tg.f.registry.hits.Load()
	}
	if ok, err := tg.c.TemplateExists(ctx(t), id); err != nil || !ok {
		t.Fatalf("TemplateExists(%s) = %v, %v after EnsureTemplate", id, ok, err)
	}

	s := tg.create(t, tg.c, client.CreateOptions{TemplateID: id})
	got := strings.TrimSpace(run(t, s, fmt.Sprintf(`node -p 'const m = require(%q); typeof m === "string" ? m : typeof m'`, pkg)))
	if got != want {
		t.Errorf("in a sandbox of the template, require(%q) gives %q, want %q", pkg, got, want)
	}
	if got := strings.TrimSpace(run(t, s, fmt.Sprintf(`node -p 'require("%s/package.json").version'`, pkg))); got != version {
		t.Errorf("installed version %q, want %q", got, version)
	}
	if !tg.remote {
		if got := tg.f.registry.hits.Load(); got != hits {
			t.Errorf("the registry got %d requests while a sandbox was made from the template: setup ran again", got-hits)
		}
	}
}

// 2a. Exit codes come back exactly, a signal as 128+signal, and the two
// output streams apart.
func testExitCodes(t *testing.T, tg *target) {
	s := tg.create(t, tg.c, client.CreateOptions{})
	for _, tc := range []struct {
		cmd  string
		code int
	}{
		{"printf out; printf err >&2; exit 0", 0},
		{"printf out; printf err >&2; exit 1", 1},
		{"printf out; printf err >&2; exit 42", 42},
		{"printf out; printf err >&2; kill -TERM $$", 128 + 15},
		{"printf out; printf err >&2; kill -KILL $$", 128 + 9},
	} {
		res, err := s.Run(ctx(t), client.Command{Command: tc.cmd})
		if err != nil {
			t.Errorf("%s: %v", tc.cmd, err)
			continue
		}
		if res.ExitCode != tc.code || string(res.Stdout) != "out" || string(res.Stderr) != "err" {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want exit %d, \"out\", \"err\"", tc.cmd, res.ExitCode, res.Stdout, res.Stderr, tc.code)
		}
	}
}

// 2b. Binary files round trip: bytes written come back equal (NULs and
// all), and a file made inside is read out equal to the digest computed
// inside.
func testBinaryFiles(t *testing.T, tg *target) {
	s := tg.create(t, tg.c, client.CreateOptions{})
	data := make([]byte, 3<<20+7)
	rand.Read(data)
	copy(data[1000:], make([]byte, 4096)) // a run of NULs
	data[0], data[len(data)-1] = 0, 0
	if err := s.WriteFile(ctx(t), "bin/in.dat", bytes.NewReader(data)); err != nil {
		t.Fatalf("WriteFile: %v", err)
	}
	if got := readAll(t, s, "bin/in.dat"); !bytes.Equal(got, data) {
		t.Errorf("read back %d bytes, not the %d written (equal: false)", len(got), len(data))
	}
	sum := sha256.Sum256(data)
	if inside := strings.Fields(run(t, s, "sha256sum bin/in.dat"))[0]; inside != hex.EncodeToString(sum[:]) {
		t.Errorf("inside, the file written has sha256 %s, want %s", inside, hex.EncodeToString(sum[:]))
	}

	inside := strings.Fields(run(t, s, "head -c 2000001 /dev/urandom > bin/out.dat && printf '\\000\\000\\377' >> bin/out.dat && sha256sum bin/out.dat"))[0]
	got := readAll(t, s, "bin/out.dat")
	gotSum := sha256.Sum256(got)
	if len(got) != 2000004 || hex.EncodeToString(gotSum[:]) != inside {
		t.Errorf("read out %d bytes with sha256 %x; inside: 2000004 bytes with sha256 %s", len(got), gotSum, inside)
	}
}

func readAll(t *testing.T, s *client.Session, name string) []byte {
	t.Helper()
	rc, err := s.ReadFile(ctx(t), name)
	if err != nil {
		t.Fatalf("ReadFile %s: %v", name, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("reading %s: %v", name, err)
	}
	return b
}

// 3. A credential is swapped in on the way out: the upstream gets the
// real one, while nothing inside the sandbox (environment, files, /proc of
// its processes, the answer the command reads) ever holds it.
func testCredentialSwappedOutside(t *testing.T, tg *target) {
	if tg.echoURL == "" {
		t.Skip("no upstream of ours to echo a credential: set SANDGATE_E2E_ECHO_URL to an HTTPS upstream you run that echoes the X-Api-Key it receives")
	}
	canary := "sk-e2e-canary-" + nonce() + nonce() + nonce()
	placeholder := "sk-e2e-placeholder-" + nonce()
	host := hostOf(t, tg.echoURL)
	s := tg.create(t, tg.c, client.CreateOptions{BaseURLs: map[string]string{"E2E_API_BASE_URL": tg.echoURL}})
	err := s.SetRequestTransformations(ctx(t), []client.RequestTransformation{{
		Match:     client.Match{Host: host, Headers: []client.KeyValueMatcher{{Key: client.Exact("x-api-key"), Value: client.Exact(placeholder)}}},
		Transform: client.Transform{Headers: map[string]string{"X-Api-Key": canary}},
	}})
	if err != nil {
		t.Fatalf("SetRequestTransformations: %v", err)
	}
	// The agent's way: the placeholder in its environment and a config
	// file, the base URL variable for the API.
	runWith(t, s, client.Command{Command: `mkdir -p "$HOME/.config" && printf '%s' "$E2E_KEY" > "$HOME/.config/key"`, Env: map[string]string{"E2E_KEY": placeholder}})
	call := `curl -sS -H "X-Api-Key: $(cat "$HOME/.config/key")" "$E2E_API_BASE_URL/v1/messages"`
	out := runWith(t, s, client.Command{Command: call + ` | tee /workspace/answer.txt`})
	if !strings.Contains(out, "key="+placeholder) {
		t.Errorf("the command read %q, want the echoed credential scrubbed back to its placeholder", out)
	}
	if strings.Contains(out, canary) {
		t.Errorf("the command read the real credential: %q", out)
	}
	if !tg.remote {
		seen := tg.f.echo.seen()
		if len(seen) == 0 || !contains(seen, canary) || contains(seen, placeholder) {
			t.Errorf("the upstream got X-Api-Key %q, want the real credential and never the placeholder", seen)
		}
	}
	// A process that made the call still runs, its environment in /proc.
	p, err := s.Spawn(ctx(t), client.Command{Command: call + ` > /tmp/answer2.txt; exec sleep 600`, Env: map[string]string{"E2E_KEY": placeholder}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Kill(ctx(t)) })
	waitFor(t, "the second call's answer", func() bool {
		res, err := s.Run(ctx(t), client.Command{Command: "grep -q key= /tmp/answer2.txt"})
		return err == nil && res.ExitCode == 0
	})
	// Everything the sandbox holds comes out here, to be searched outside:
	// the canary never goes in, not even to grep for it.
	dump := runWith(t, s, client.Command{Command: `env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do cat "$f"; echo; done 2>/dev/null;
		tar -cf - /workspace "$HOME" /tmp 2>/dev/null`,
		Env: map[string]string{"E2E_DUMP_MARK": placeholder}})
	// The dump reaches what it must: the placeholder is in the dumping
	// command's environment, in the process's, and in the files.
	if n := strings.Count(dump, placeholder); n < 4 {
		t.Errorf("the dump holds the placeholder %d times; it does not cover the environment, /proc and the files", n)
	}
	if strings.Contains(dump, canary) {
		i := strings.Index(dump, canary)
		t.Errorf("the real credential is inside the sandbox: …%q…", dump[max(0, i-200):i])
	}
	// The service refuses to start anything holding it.
	res, err := s.Run(ctx(t), client.Command{Command: "true", Env: map[string]string{"LEAK": canary}})
	if err == nil {
		t.Errorf("a command with the real credential in its environment ran (exit %d); want it refused", res.ExitCode)
	} else if strings.Contains(err.Error(), canary) {
		t.Errorf("the refusal names the credential: %v", err)
	}
	if !tg.remote {
		if strings.Contains(tg.srv.log.String(), canary) {
			t.Errorf("the service's log holds the real credential")
		}
		dir := ""
		for _, e := range tg.srv.env {
			if v, ok := strings.CutPrefix(e, "SANDGATE_AUDIT_LOG="); ok {
				dir = v
			}
		}
		b, err := os.ReadFile(dir)
		if err != nil || !bytes.Contains(b, []byte(host)) {
			t.Errorf("the audit log %s does not record the calls: %v", filepath.Base(dir), err)
		}
		if bytes.Contains(b, []byte(canary)) {
			t.Errorf("the audit log holds the real credential")
		}
		// The layer the sandbox is saved as: suspended, every object in
		// the store, decompressed, holds what the sandbox wrote (the
		// placeholder in its files) and never the real credential.
		p.Kill(ctx(t))
		if err := tg.c.Suspend(ctx(t), s.ID()); err != nil {
			t.Fatalf("suspend: %v", err)
		}
		var store string
		for _, e := range tg.srv.env {
			if v, ok := strings.CutPrefix(e, "SNAPSHOT_DIRECTORY="); ok {
				store = v
			}
		}
		placeholders := 0
		err = stacktest.StoreObjects(store, func(name string, b []byte) {
			placeholders += bytes.Count(b, []byte(placeholder))
			if bytes.Contains(b, []byte(canary)) {
				t.Errorf("the snapshot store's %s holds the real credential", name)
			}
		})
		if err != nil {
			t.Fatalf("reading the snapshot store: %v", err)
		}
		if placeholders == 0 {
			t.Errorf("no object in the snapshot store %s holds the placeholder the sandbox wrote to its files: the search does not cover the saved layer", store)
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// 4. The metadata server and private addresses are out of reach, through
// the egress proxy (CONNECT and routes) and directly, even when the policy
// lists them and for an allowed host whose name resolves to one.
func testPrivateOutOfReach(t *testing.T, tg *target) {
	servicePort := "8080"
	allowed := []string{metadataHost}
	positive := "https://" + registryHost + "/"
	if !tg.remote {
		u, _ := url.Parse(tg.srv.url)
		servicePort = u.Port()
		allowed = append(allowed, trapHost, echoHost)
		positive = "https://" + echoHost + "/ok"
	} else {
		allowed = append(allowed, registryHost)
	}
	policy := &client.NetworkPolicy{Mode: client.ModeCustom, AllowedHosts: allowed,
		AllowedCIDRs: []string{"10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "192.168.0.0/16", "::1/128"}}
	s := tg.create(t, tg.c, client.CreateOptions{NetworkPolicy: policy})

	type probe struct{ name, args string }
	via := func(name, u string) []probe { // through the proxy: CONNECT, then the route
		pu, _ := url.Parse(u)
		return []probe{
			{"connect " + name, "-k " + u},
			{"route " + name, `"$HTTPS_PROXY/https/` + pu.Host + pu.Path + `"`},
		}
	}
	var probes []probe
	for name, u := range map[string]string{
		"metadata name": "https://" + metadataHost + "/computeMetadata/v1/",
		"metadata IP":   "https://169.254.169.254/computeMetadata/v1/",
		"10.0.0.1":      "https://10.0.0.1/",
		"127.0.0.2":     "https://127.0.0.2/",
		"192.168.1.1":   "https://192.168.1.1/",
		"::1":           "https://[::1]/",
	} {
		probes = append(probes, via(name, u)...)
	}
	probes = append(probes,
		probe{"route http metadata", `"$HTTPS_PROXY/http/` + metadataHost + `/computeMetadata/v1/"`},
		probe{"plain http metadata", "http://" + metadataHost + "/computeMetadata/v1/"},
		probe{"direct metadata IP", "--noproxy '*' http://169.254.169.254/computeMetadata/v1/"},
		probe{"direct 10.0.0.1", "--noproxy '*' http://10.0.0.1/"},
		probe{"direct 192.168.1.1", "--noproxy '*' http://192.168.1.1/"},
		probe{"direct service port", "--noproxy '*' http://127.0.0.1:" + servicePort + "/health"},
		probe{"direct service port v6", "--noproxy '*' http://[::1]:" + servicePort + "/health"},
	)
	if !tg.remote {
		probes = append(probes, via("allowed host resolving to loopback", "https://"+trapHost+"/")...)
		probes = append(probes, via("its address", "https://"+tg.f.trap.addr.String()+"/")...)
	}
	var script strings.Builder
	for i, p := range probes {
		fmt.Fprintf(&script, "r=$(curl -sS -o /dev/null -m 30 -H 'Metadata-Flavor: Google' -w '%%{http_code} %%{http_connect}' %s 2>/dev/null); echo \"%d $? $r\"\n", p.args, i)
	}
	fmt.Fprintf(&script, "r=$(curl -sS -o /dev/null -m 30 -k -w '%%{http_code} %%{http_connect}' %s); echo \"ok $? $r\"\n", positive)
	out := run(t, s, script.String())
	seen := 0
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 4 {
			t.Errorf("probe output %q", sc.Text())
			continue
		}
		if f[0] == "ok" {
			if f[1] != "0" || f[2] != "200" {
				t.Errorf("the allowed host %s was not reached (curl exit %s, status %s, CONNECT %s): the probes prove nothing", positive, f[1], f[2], f[3])
			}
			continue
		}
		i, _ := strconv.Atoi(f[0])
		p := probes[i]
		seen++
		code, _ := strconv.Atoi(f[2])
		if f[3] == "200" || (code >= 200 && code < 400) {
			t.Errorf("%s (curl %s) reached: curl exit %s, status %s, CONNECT status %s", p.name, p.args, f[1], f[2], f[3])
		}
		if strings.HasPrefix(p.name, "route") && code != http.StatusForbidden {
			t.Errorf("%s: status %d, want 403 from the proxy", p.name, code)
		}
	}
	if seen != len(probes) {
		t.Errorf("%d probes reported, want %d:\n%s", seen, len(probes), out)
	}
	if !tg.remote {
		if n := tg.f.trap.conns.Load(); n != 0 {
			t.Errorf("the server at %s (%s) got %d connections", tg.f.trap.addr, trapHost, n)
		}
	}
}

// 5. A port of the sandbox reached through the service: an HTTP server in
// the sandbox answers through the port tunnel (PortEndpoint) and the TCP
// bridge (DialPort), and never receives the caller's credentials.
func testPort(t *testing.T, tg *target) {
	const port = 8000
	s := tg.create(t, tg.c, client.CreateOptions{Ports: []int{port}})
	const server = `import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = (self.requestline + "\n" + str(self.headers)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
`
	if err := s.WriteTextFile(ctx(t), "srv.py", server); err != nil {
		t.Fatal(err)
	}
	p, err := s.Spawn(ctx(t), client.Command{Command: fmt.Sprintf("exec python3 srv.py %d", port)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Kill(ctx(t)) })
	run(t, s, fmt.Sprintf("for i in $(seq 1200); do curl -s -o /dev/null http://127.0.0.1:%d/ && exit 0; sleep 0.1; done; exit 1", port))

	ep, err := s.PortEndpoint(ctx(t), port, "http")
	if err != nil {
		t.Fatal(err)
	}
	var secrets []string
	for _, k := range []string{"Authorization", "X-Ai-Sdk-Sandbox-Token"} {
		v := ep.Header.Get(k)
		if v == "" && !(tg.remote && k == "X-Ai-Sdk-Sandbox-Token") {
			t.Fatalf("the endpoint's headers carry no %s: the test would prove nothing (%v)", k, ep.Header)
		}
		if v != "" {
			secrets = append(secrets, strings.TrimPrefix(v, "Bearer "))
		}
	}
	req, err := http.NewRequestWithContext(ctx(t), "GET", ep.URL+"/hello?q=1", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header = ep.Header.Clone()
	// The tunnel carries requests that upgrade the connection (protocol 1
	// §5); the server in the sandbox answers as it likes.
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "websocket")
	req.Header.Set("Sec-WebSocket-Version", "13")
	req.Header.Set("Sec-WebSocket-Key", "ZTJlLXR1bm5lbC1rZXkhIQ==")
	req.Header.Set("X-E2E-Probe", "tunnel")
	resp, err := (&http.Client{Timeout: hang}).Do(req)
	if err != nil {
		t.Fatalf("through the port tunnel: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(string(body), "GET /hello?q=1 ") || !strings.Contains(strings.ToLower(string(body)), "x-e2e-probe: tunnel") {
		t.Fatalf("through the port tunnel: %d %q", resp.StatusCode, body)
	}
	checkNoCredentials(t, "the tunnel", string(body), secrets)

	conn, err := s.DialPort(ctx(t), port)
	if err != nil {
		t.Fatalf("DialPort: %v", err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(hang))
	fmt.Fprint(conn, "GET /bridge HTTP/1.0\r\nX-E2E-Probe: bridge\r\n\r\n")
	got, err := io.ReadAll(conn)
	if err != nil || !strings.Contains(string(got), "GET /bridge HTTP/1.0") || !strings.Contains(string(got), "X-E2E-Probe: bridge") {
		t.Fatalf("through the TCP bridge: %v %q", err, got)
	}
	checkNoCredentials(t, "the TCP bridge", string(got), secrets)
}

func checkNoCredentials(t *testing.T, via, got string, secrets []string) {
	t.Helper()
	low := strings.ToLower(got)
	for _, h := range []string{"authorization:", "x-ai-sdk-sandbox-token:", "x-serverless-authorization:"} {
		if strings.Contains(low, "\n"+h) {
			t.Errorf("through %s the server in the sandbox got a %s header:\n%s", via, h, got)
		}
	}
	for _, s := range secrets {
		if strings.Contains(got, s) {
			t.Errorf("through %s the server in the sandbox got the caller's credential", via)
		}
	}
}

// 6. Files survive Stop and Resume.
func testSuspendResume(t *testing.T, tg *target) {
	s := tg.create(t, tg.c, client.CreateOptions{})
	files := writeFiles(t, s)
	if err := s.Stop(ctx(t)); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if in, err := tg.c.Info(ctx(t), s.ID()); err != nil || in.State != "suspended" {
		t.Fatalf("after Stop: %+v, %v; want suspended", in, err)
	}
	if _, err := s.Run(ctx(t), client.Command{Command: "true"}); err == nil {
		t.Errorf("a command ran in a suspended sandbox")
	}
	r, err := tg.c.Resume(ctx(t), s.ID(), client.ResumeOptions{})
	if err != nil {
		t.Fatalf("Resume: %v", err)
	}
	checkFiles(t, r, files)
}

// writeFiles writes files into a sandbox, by the file API and by a
// command, in its working directory and its home, and returns them.
func writeFiles(t *testing.T, s *client.Session) map[string][]byte {
	t.Helper()
	data := make([]byte, 256<<10)
	rand.Read(data)
	files := map[string][]byte{
		"notes/a.txt": []byte("written before the sleep " + nonce() + "\n"),
		"blob.bin":    data,
	}
	for name, b := range files {
		if err := s.WriteFile(ctx(t), name, bytes.NewReader(b)); err != nil {
			t.Fatalf("WriteFile %s: %v", name, err)
		}
	}
	mark := "made by a command " + nonce()
	run(t, s, fmt.Sprintf(`echo %q > "$HOME/made.txt" && mkdir -p deep/er && echo %q > deep/er/x`, mark, mark))
	home := s.Home()
	files[home+"/made.txt"] = []byte(mark + "\n")
	files["deep/er/x"] = []byte(mark + "\n")
	return files
}

func checkFiles(t *testing.T, s *client.Session, files map[string][]byte) {
	t.Helper()
	for name, want := range files {
		if got := readAll(t, s, name); !bytes.Equal(got, want) {
			t.Errorf("%s after resume: %d bytes, want the %d written (equal: false)", name, len(got), len(want))
		}
	}
	run(t, s, "true") // it runs commands again
}

// 7. SIGTERM to serve saves every running sandbox; a serve started again
// over the same store resumes each with its files.
func testSIGTERMSavesAll(t *testing.T, tg *target) {
	if tg.remote {
		t.Skip("SIGTERM needs the service's process: this scenario runs against a serve of the test's own (unset CLOUD_RUN_SANDBOX_URL)")
	}
	// A serve of its own: it is stopped and started again.
	env := serveEnv(tg.f, t.TempDir(), tg.token, tg.cli)
	srv := startServe(t, env)
	c := newClient(t, srv.url, tg.token, tg.identity)
	names := []string{tg.sandboxName(t, "a"), tg.sandboxName(t, "b")}
	files := map[string]map[string][]byte{}
	for _, n := range names {
		s, err := c.Create(ctx(t), client.CreateOptions{ID: n})
		if err != nil {
			t.Fatal(err)
		}
		files[n] = writeFiles(t, s)
		if _, err := s.Spawn(ctx(t), client.Command{Command: "exec sleep 600"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := srv.terminate(t); err != nil {
		t.Fatalf("serve after SIGTERM: %v (want exit 0)\n%s", err, srv.log.String())
	}
	if !strings.Contains(srv.log.String(), "saved 2 sandboxes") {
		t.Errorf("serve's log does not say it saved both:\n%s", srv.log.String())
	}
	srv2 := startServe(t, env)
	c2 := newClient(t, srv2.url, tg.token, tg.identity)
	for _, n := range names {
		t.Cleanup(func() { destroy(t, c2, n) })
		in, err := c2.Info(ctx(t), n)
		if err != nil || in.State != "suspended" {
			t.Errorf("%s after the restart: %+v, %v; want suspended", n, in, err)
		}
		s, err := c2.Resume(ctx(t), n, client.ResumeOptions{})
		if err != nil {
			t.Fatalf("Resume %s after the restart: %v", n, err)
		}
		checkFiles(t, s, files[n])
	}
}

// 9. What protocol 1's own client sends and sandgate once refused: a
// single-label host rule and an http base URL are accepted at create; the
// http route is refused per request at an address nobody opened, saying
// why in the words that client's tests match; a plain route that is not a
// route is 403.
func testProtocol1Fidelity(t *testing.T, tg *target) {
	s := tg.create(t, tg.c, client.CreateOptions{AllowedHosts: []string{"localhost"},
		BaseURLs: map[string]string{"MODEL_BASE_URL": "http://127.0.0.1:9/api"}})
	out := run(t, s, `echo "route=$MODEL_BASE_URL"
echo "model=$(curl -sS "$MODEL_BASE_URL/v1" | tr '\n' ' ')"
echo "notaroute=$(curl -sS -o /dev/null -w '%{http_code}' "$HTTP_PROXY/not-a-route")"`)
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok {
			got[k] = v
		}
	}
	if !strings.HasSuffix(got["route"], "/http/127.0.0.1:9/api") {
		t.Errorf("MODEL_BASE_URL in the sandbox: %q; want its relay route", got["route"])
	}
	if !strings.Contains(got["model"], "127.0.0.1 is not reachable from the sandbox") {
		t.Errorf("the http route to loopback: %q; want the refusal", got["model"])
	}
	if got["notaroute"] != "403" {
		t.Errorf("$HTTP_PROXY/not-a-route: %q; want 403", got["notaroute"])
	}
}

// testEgressWithoutProxy: a process that ignores the proxy variables is
// captured and judged as CONNECT where the sandbox's link passes sockets
// (sandgate sandbox); where it does not (Google's CLI) its lookups fail at
// once (NXDOMAIN) and are audited as a direct connection attempted.
func testEgressWithoutProxy(t *testing.T, tg *target) {
	s := tg.create(t, tg.c, client.CreateOptions{AllowedHosts: []string{echoHost}})
	res, err := s.Run(ctx(t), client.Command{Command: "getent hosts " + echoHost})
	if err != nil {
		t.Fatal(err)
	}
	captured := res.ExitCode == 0 && strings.HasPrefix(string(res.Stdout), "198.1")
	switch {
	case tg.name == "sandgate-sandbox" && !captured:
		t.Fatalf("no capture with sandgate sandbox: getent says %q (exit %d)", res.Stdout, res.ExitCode)
	case tg.name == "google-cli" && captured:
		t.Fatalf("capture over Google's CLI, whose link passes no sockets: %q", res.Stdout)
	}
	want := func(ok func(client.AuditEvent) bool) client.AuditEvent {
		t.Helper()
		var found client.AuditEvent
		waitFor(t, "the audit event", func() bool {
			page, err := s.Audit(ctx(t), client.AuditQuery{})
			for _, e := range page.Events {
				if ok(e) {
					found = e
					return true
				}
			}
			return err != nil
		})
		return found
	}
	if !captured {
		ev := want(func(e client.AuditEvent) bool { return e.Kind == "dns" && e.Host == echoHost })
		if ev.Allow() || ev.Code != "direct_lookup" || ev.Reason == "" {
			t.Errorf("the lookup's event: %+v", ev)
		}
		return
	}
	if tg.remote {
		return // the upstream's CA is not ours to give
	}
	if err := s.WriteFile(ctx(t), "/tmp/e2e-ca.pem", bytes.NewReader(tg.f.ca.PEM)); err != nil {
		t.Fatal(err)
	}
	out := run(t, s, "curl -sS --noproxy '*' --cacert /tmp/e2e-ca.pem https://"+echoHost+"/captured")
	if !strings.HasPrefix(out, "path=/captured") {
		t.Errorf("a captured request got %q", out)
	}
	ev := want(func(e client.AuditEvent) bool { return e.Kind == "capture" && e.Host == echoHost })
	if !ev.Allow() || ev.Port != 443 || ev.Code != "allowed_host" {
		t.Errorf("the captured connection's event: %+v", ev)
	}
}
