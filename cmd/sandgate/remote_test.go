package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/servetest"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// One service for the client verbs' tests (with a module runtime, for
// the modules verbs), started by the first that needs it and stopped by
// TestMain.
var (
	remoteOnce    sync.Once
	remoteSvc     *servetest.Service
	remoteModules *wasm.Runtime
	remoteErr     error
)

func remoteService(t *testing.T) *servetest.Service {
	t.Helper()
	if ok, why := servetest.CanRun(); !ok {
		t.Skip(why)
	}
	remoteOnce.Do(func() {
		remoteModules, remoteErr = wasm.NewRuntime(context.Background(), wasm.Config{CacheDir: gobuild.WasmCache(t)})
		if remoteErr == nil {
			remoteSvc, remoteErr = servetest.Start(servetest.Config{Modules: remoteModules})
		}
	})
	if remoteErr != nil {
		t.Fatal(remoteErr)
	}
	return remoteSvc
}

func closeRemoteService() {
	if remoteSvc != nil {
		remoteSvc.Close()
	}
	if remoteModules != nil {
		remoteModules.Close(context.Background())
	}
}

// verb runs a client verb against the test service, with stdin, and
// returns its exit status, stdout and stderr.
func verb(t *testing.T, ctx context.Context, stdin io.Reader, args ...string) (int, string, string) {
	t.Helper()
	s := remoteService(t)
	var out, errb bytes.Buffer
	app := newApp(&out, &errb)
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	app.Reader = stdin
	// The service's flags after the verb's own words (before a command's
	// "--"), as a user writes them.
	service := []string{"--url", s.URL, "--token", s.Token}
	full := []string{"sandgate"}
	if i := slices.Index(args, "--"); i >= 0 {
		full = append(append(append(full, args[:i]...), service...), args[i:]...)
	} else {
		full = append(append(full, args...), service...)
	}
	code := execute(ctx, app, full)
	return code, out.String(), errb.String()
}

// must runs a verb that must succeed and returns its stdout.
func must(t *testing.T, args ...string) string {
	t.Helper()
	code, out, errOut := verb(t, testCtx(t), nil, args...)
	if code != 0 {
		t.Fatalf("sandgate %s: exit %d\n%s%s", strings.Join(args, " "), code, out, errOut)
	}
	return out
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// The lifecycle verbs, exec and policy set, end to end.
func TestRemoteVerbs(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "verbs-box", "--allow", "api.example.com", "--base-url", "OPENAI_BASE_URL=https://api.example.com/v1", "--setup", "echo set-up > /workspace/setup"))
	if name != "verbs-box" {
		t.Fatalf("create printed %q", name)
	}
	t.Cleanup(func() { verb(t, context.Background(), nil, "destroy", name) })
	if out := must(t, "create"); !strings.HasPrefix(out, "ai-sdk-") {
		t.Errorf("create without a name printed %q", out)
	} else {
		must(t, "rm", strings.TrimSpace(out))
	}
	if code, _, errOut := verb(t, ctx, nil, "create", "verbs-box"); code != 1 || !strings.Contains(errOut, "exists") {
		t.Errorf("create of a taken name: %d %q", code, errOut)
	}
	if code, _, errOut := verb(t, ctx, nil, "create", "Bad_Name"); code == 0 || !strings.Contains(errOut, "invalid sandbox name") {
		t.Errorf("a bad name: %d %q", code, errOut)
	}

	// exec: output, exit code, stdin, env, working directory.
	if out := must(t, "exec", name, "--", "cat", "/workspace/setup"); out != "set-up\n" {
		t.Errorf("setup: %q", out)
	}
	code, out, errOut := verb(t, ctx, nil, "exec", name, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
	if code != 7 || out != "out\n" || errOut != "err\n" {
		t.Errorf("exec exit: %d %q %q", code, out, errOut)
	}
	code, out, _ = verb(t, ctx, strings.NewReader("piped in"), "exec", "-e", "X=it's", "-w", "/tmp", name, "--", "sh", "-c", `printf '%s %s ' "$X" "$(pwd)"; cat`)
	if code != 0 || out != "it's /tmp piped in" {
		t.Errorf("exec with stdin, env, workdir: %d %q", code, out)
	}
	if out := must(t, "exec", name, "--", "echo", "a b", "$HOME", "'q'"); out != "a b $HOME 'q'\n" {
		t.Errorf("arguments quoted: %q", out)
	}
	if code, _, errOut := verb(t, ctx, nil, "exec", "no-such-box", "--", "true"); code != 1 || !strings.Contains(errOut, `no sandbox "no-such-box"`) {
		t.Errorf("exec in nothing: %d %q", code, errOut)
	}
	if code, _, _ := verb(t, ctx, nil, "exec", name); code != 2 {
		t.Errorf("exec without a command: %d", code)
	}

	// policy set.
	caPath := filepath.Join(t.TempDir(), "ca.pem")
	os.WriteFile(caPath, remoteService(t).CA.PEM, 0o644)
	must(t, "cp", caPath, name+":/etc/test-ca.pem")
	connect := func() string {
		_, out, _ := verb(t, ctx, nil, "exec", name, "--", "sh", "-c", "curl -sS -o /dev/null -w '%{http_code}' --cacert /etc/test-ca.pem https://api.example.com/x 2>&1 || true")
		return out
	}
	if got := connect(); got != "200" {
		t.Errorf("an allowed host: %q", got)
	}
	must(t, "policy", "set", name, "deny-all")
	if got := connect(); got == "200" {
		t.Errorf("under deny-all: %q", got)
	}
	must(t, "policy", "set", name, "--allow", "api.example.com", "--deny-cidr", "203.0.113.0/24")
	if got := connect(); got != "200" {
		t.Errorf("under a custom policy: %q", got)
	}
	pol := filepath.Join(t.TempDir(), "policy.json")
	os.WriteFile(pol, []byte(`{"mode":"deny-all"}`), 0o644)
	must(t, "policy", "set", name, "--file", pol)
	if got := connect(); got == "200" {
		t.Errorf("under the policy file's deny-all: %q", got)
	}
	if code, _, _ := verb(t, ctx, nil, "policy", "set", name, "open-all"); code != 2 {
		t.Errorf("policy set open-all: %d", code)
	}
	if code, _, _ := verb(t, ctx, nil, "policy", "set", name); code != 2 {
		t.Errorf("policy set without a policy: %d", code)
	}

	// audit: the kept events, and followed ones.
	if out := must(t, "audit", name, "--json"); !strings.Contains(out, `"host":"api.example.com"`) {
		t.Errorf("audit: %q", out)
	}
	fctx, stop := context.WithCancel(ctx)
	pr, pw := io.Pipe()
	followed := make(chan int, 1)
	go func() {
		app := newApp(pw, io.Discard)
		s := remoteService(t)
		followed <- execute(fctx, app, []string{"sandgate", "audit", "-f", "--json", name, "--url", s.URL, "--token", s.Token})
		pw.Close()
	}()
	sc := bufio.NewScanner(pr)
	// Through the client, not the CLI: urfave/cli's global help flag is
	// not safe for two apps running at once in one process.
	s := remoteService(t)
	cl, err := client.New(s.URL, client.WithToken(s.Token))
	if err != nil {
		t.Fatal(err)
	}
	sess, err := cl.Attach(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sess.Run(ctx, client.Command{Command: "curl -sS -x $HTTPS_PROXY https://followed.example.com/ >/dev/null 2>&1 || true"}); err != nil {
		t.Fatal(err)
	}
	found := false
	for !found && sc.Scan() {
		found = strings.Contains(sc.Text(), `"host":"followed.example.com"`)
	}
	stop()
	go io.Copy(io.Discard, pr)
	if code := <-followed; !found || code != 0 {
		t.Errorf("audit -f: found %v, exit %d", found, code)
	}

	// list, suspend, resume, destroy.
	var infos []client.SandboxInfo
	if err := json.Unmarshal([]byte(must(t, "list", "--json")), &infos); err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(infos, func(in client.SandboxInfo) bool { return in.Name == name && in.State == "running" }) {
		t.Errorf("list --json: %+v", infos)
	}
	if out := must(t, "suspend", name); out != name+"\n" {
		t.Errorf("suspend printed %q", out)
	}
	if out := must(t, "ls"); !strings.Contains(out, "NAME") || !strings.Contains(out, name) || !strings.Contains(out, "suspended") {
		t.Errorf("ls:\n%s", out)
	}
	if code, _, errOut := verb(t, ctx, nil, "exec", name, "--", "true"); code != 1 || !strings.Contains(errOut, "suspended") {
		t.Errorf("exec in a suspended sandbox: %d %q", code, errOut)
	}
	must(t, "resume", name, "--allow", "api.example.com")
	if out := must(t, "exec", name, "--", "cat", "setup"); out != "set-up\n" {
		t.Errorf("after resume: %q", out)
	}
	if code, _, _ := verb(t, ctx, nil, "resume", "no-such-box"); code != 1 {
		t.Errorf("resume of nothing: %d", code)
	}
	if out := must(t, "destroy", name); out != name+"\n" {
		t.Errorf("destroy printed %q", out)
	}
	if code, _, _ := verb(t, ctx, nil, "suspend"); code != 2 {
		t.Errorf("suspend without a name: %d", code)
	}
}

// cp: files and directories, both ways, and tars on standard input and
// output.
func TestRemoteCp(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "cp-box"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "destroy", name) })
	local := t.TempDir()
	os.MkdirAll(filepath.Join(local, "src", "sub"), 0o755)
	big := bytes.Repeat([]byte("0123456789abcdef"), 512<<10) // 8 MiB
	os.WriteFile(filepath.Join(local, "src", "big.bin"), big, 0o644)
	os.WriteFile(filepath.Join(local, "src", "sub", "run.sh"), []byte("#!/bin/sh\necho ran\n"), 0o755)
	os.Symlink("sub/run.sh", filepath.Join(local, "src", "link"))

	// A file in, onto a directory and to a name; out again.
	must(t, "cp", filepath.Join(local, "src", "big.bin"), name+":")
	must(t, "cp", filepath.Join(local, "src", "sub", "run.sh"), name+":/opt/tools/run")
	if out := must(t, "exec", name, "--", "sh", "-c", "wc -c < big.bin; /opt/tools/run"); out != fmt.Sprintf("%d\nran\n", len(big)) {
		t.Errorf("files in: %q", out)
	}
	must(t, "cp", name+":big.bin", filepath.Join(local, "back.bin"))
	if b, _ := os.ReadFile(filepath.Join(local, "back.bin")); !bytes.Equal(b, big) {
		t.Errorf("a file out: %d bytes", len(b))
	}
	must(t, "cp", name+":/opt/tools/run", local)
	if b, _ := os.ReadFile(filepath.Join(local, "run")); string(b) != "#!/bin/sh\necho ran\n" {
		t.Errorf("a file out into a directory: %q", b)
	}

	// A directory in: a new name, then into an existing directory.
	must(t, "cp", filepath.Join(local, "src"), name+":copy")
	must(t, "cp", filepath.Join(local, "src"), name+":copy")
	out := must(t, "exec", name, "--", "sh", "-c", "cd copy && wc -c < big.bin && sub/run.sh && readlink link && ls src")
	if out != fmt.Sprintf("%d\nran\nsub/run.sh\nbig.bin\nlink\nsub\n", len(big)) {
		t.Errorf("a directory in: %q", out)
	}
	// Out: a new name, then into an existing directory.
	must(t, "cp", name+":copy", filepath.Join(local, "out"))
	must(t, "cp", name+":copy", filepath.Join(local, "out"))
	for _, p := range []string{"out/big.bin", "out/copy/big.bin", "out/src/big.bin"} {
		if b, err := os.ReadFile(filepath.Join(local, p)); err != nil || !bytes.Equal(b, big) {
			t.Errorf("%s: %d bytes, %v", p, len(b), err)
		}
	}
	if l, err := os.Readlink(filepath.Join(local, "out", "link")); err != nil || l != "sub/run.sh" {
		t.Errorf("the link came out as %q %v", l, err)
	}
	if fi, err := os.Stat(filepath.Join(local, "out", "sub", "run.sh")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("modes out: %v %v", fi, err)
	}

	// A directory whose links lead out: nothing is written outside.
	must(t, "exec", name, "--", "sh", "-c", "mkdir -p evil && ln -s /etc evil/etc && ln -s ../../../.. evil/up && echo x > evil/plain")
	must(t, "cp", name+":evil", filepath.Join(local, "evil"))
	if b, err := os.ReadFile(filepath.Join(local, "evil", "plain")); err != nil || string(b) != "x\n" {
		t.Errorf("evil/plain: %q %v", b, err)
	}

	// Tars on standard input and output.
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	tw.WriteHeader(&tar.Header{Name: "from-stdin.txt", Mode: 0o644, Size: 5, Typeflag: tar.TypeReg})
	tw.Write([]byte("hello"))
	tw.Close()
	if code, _, errOut := verb(t, ctx, bytes.NewReader(tb.Bytes()), "cp", "-", name+":tarred"); code != 0 {
		t.Fatalf("cp - : %d %s", code, errOut)
	}
	code, tarOut, errOut := verb(t, ctx, nil, "cp", name+":tarred", "-")
	if code != 0 {
		t.Fatalf("cp to -: %d %s", code, errOut)
	}
	tr := tar.NewReader(strings.NewReader(tarOut))
	var names []string
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name)
	}
	if strings.Join(names, " ") != "tarred/ tarred/from-stdin.txt" {
		t.Errorf("the tar out: %q", names)
	}

	// Refusals.
	for _, args := range [][]string{{"cp", "a", "b"}, {"cp", name + ":a", name + ":b"}, {"cp", "only-one"}} {
		if code, _, _ := verb(t, ctx, nil, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
	}
	if code, _, errOut := verb(t, ctx, nil, "cp", name+":missing", local); code != 1 || !strings.Contains(errOut, "does not exist") {
		t.Errorf("a missing source: %d %q", code, errOut)
	}
}

// port-forward: a local listener through the TCP bridge to an HTTP
// server in the sandbox.
func TestRemotePortForward(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "pf-box"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "destroy", name) })
	s := remoteService(t)
	c, err := client.New(s.URL, client.WithToken(s.Token))
	if err != nil {
		t.Fatal(err)
	}
	sess, err := c.Attach(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := sess.WriteTextFile(ctx, "site/index.html", "forwarded\n"); err != nil {
		t.Fatal(err)
	}
	if _, err := sess.Spawn(ctx, client.Command{Command: "exec python3 -m http.server 8000 --bind 127.0.0.1 --directory site", Stdout: io.Discard, Stderr: io.Discard}); err != nil {
		t.Fatal(err)
	}
	if res, err := sess.Run(ctx, client.Command{Command: `for i in $(seq 400); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8000))' 2>/dev/null && exit 0; sleep 0.05; done; exit 1`}); err != nil || res.ExitCode != 0 {
		t.Fatalf("the server in the sandbox did not start: %v %+v", err, res)
	}

	fctx, stop := context.WithCancel(ctx)
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- execute(fctx, newApp(pw, io.Discard), []string{"sandgate", "port-forward", name, "0:8000", "--url", s.URL, "--token", s.Token})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	go io.Copy(io.Discard, pr)
	var addr string
	if _, err2 := fmt.Sscanf(line, "Forwarding from %s -> 8000", &addr); err != nil || err2 != nil {
		t.Fatalf("port-forward said %q %v", line, err)
	}
	for range 2 { // two connections, one after the other
		resp, err := http.Get("http://" + addr + "/index.html")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(body) != "forwarded\n" {
			t.Errorf("through port-forward: %d %q", resp.StatusCode, body)
		}
	}
	stop()
	if code := <-done; code != 0 {
		t.Errorf("port-forward exited %d", code)
	}
	if code, _, _ := verb(t, ctx, nil, "port-forward", name, "99999"); code != 2 {
		t.Errorf("a bad port: %d", code)
	}
}

// template ls and rm, and preflight.
func TestRemoteTemplatesAndPreflight(t *testing.T) {
	ctx := testCtx(t)
	s := remoteService(t)
	c, err := client.New(s.URL, client.WithToken(s.Token))
	if err != nil {
		t.Fatal(err)
	}
	id, err := c.EnsureTemplate(ctx, client.Template{Identity: "verbs-test", Setup: []string{"echo t > /opt/t"}})
	if err != nil {
		t.Fatal(err)
	}
	if out := must(t, "template", "ls"); !strings.Contains(out, "ID") || !strings.Contains(out, id) {
		t.Errorf("template ls:\n%s", out)
	}
	name := strings.TrimSpace(must(t, "create", "--template", id))
	if out := must(t, "exec", name, "--", "cat", "/opt/t"); out != "t\n" {
		t.Errorf("created from the template: %q", out)
	}
	must(t, "rm", name)
	if out := must(t, "template", "rm", id); out != id+"\n" {
		t.Errorf("template rm printed %q", out)
	}
	if out := must(t, "template", "ls", "--json"); strings.Contains(out, id) {
		t.Errorf("after rm: %s", out)
	}
	if code, _, errOut := verb(t, ctx, nil, "create", "--template", id); code != 1 || !strings.Contains(errOut, "template") {
		t.Errorf("create from a removed template: %d %q", code, errOut)
	}

	if out := must(t, "preflight"); !strings.HasSuffix(out, "ok\n") || !strings.Contains(out, "protocol 1") || !strings.Contains(out, "service token") {
		t.Errorf("preflight:\n%s", out)
	}
	var out, errb bytes.Buffer
	if code := execute(ctx, newApp(&out, &errb), []string{"sandgate", "preflight", "--url", s.URL}); code != 1 || !strings.Contains(errb.String(), "SANDBOX_SERVICE_TOKEN") {
		t.Errorf("preflight without the token: %d %q", code, errb.String())
	}
	if code := execute(ctx, newApp(&out, &errb), []string{"sandgate", "list"}); code != 2 {
		t.Errorf("a verb without --url: %d", code)
	}
	if code := execute(ctx, newApp(&out, &errb), []string{"sandgate", "list", "--url", s.URL, "--auth", "kerberos"}); code != 2 {
		t.Errorf("--auth kerberos: %d", code)
	}
}

// untarSafe takes a tar the sandbox made, which a hostile agent may have
// crafted (it can replace the sandbox's tar): nothing lands outside the
// directory, whatever the names and links say.
func TestUntarSafe(t *testing.T) {
	outside := t.TempDir()
	for _, tc := range []struct {
		name    string
		entries []tar.Header
		ok      bool
	}{
		{"a link out, then a file through it", []tar.Header{{Name: "out", Typeflag: tar.TypeSymlink, Linkname: outside}, {Name: "out/pwned", Typeflag: tar.TypeReg, Mode: 0o644}}, false},
		{"a relative link out, then a file through it", []tar.Header{{Name: "up", Typeflag: tar.TypeSymlink, Linkname: "../../../../../../../../" + outside}, {Name: "up/pwned", Typeflag: tar.TypeReg, Mode: 0o644}}, false},
		{"a name with ..", []tar.Header{{Name: "../pwned", Typeflag: tar.TypeReg, Mode: 0o644}}, false},
		{"a hard link to a file outside", []tar.Header{{Name: "hl", Typeflag: tar.TypeLink, Linkname: outside + "/sentinel"}}, false},
		{"an absolute name stays inside", []tar.Header{{Name: "/inside", Typeflag: tar.TypeReg, Mode: 0o4755}}, true},
		{"a device is not made", []tar.Header{{Name: "null", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3, Mode: 0o666}}, true},
	} {
		os.WriteFile(filepath.Join(outside, "sentinel"), []byte("safe"), 0o644)
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range tc.entries {
			if h.Typeflag == tar.TypeReg {
				h.Size = 5
			}
			tw.WriteHeader(&h)
			if h.Typeflag == tar.TypeReg {
				tw.Write([]byte("pwned"))
			}
		}
		tw.Close()
		dir := filepath.Join(t.TempDir(), "dst")
		err := untarSafe(&b, dir)
		if (err == nil) != tc.ok {
			t.Errorf("%s: %v", tc.name, err)
		}
		if _, err := os.Stat(filepath.Join(outside, "pwned")); err == nil {
			t.Errorf("%s: a file was written outside", tc.name)
		}
		if b, _ := os.ReadFile(filepath.Join(outside, "sentinel")); string(b) != "safe" {
			t.Errorf("%s: the file outside changed", tc.name)
		}
		if fi, err := os.Stat(filepath.Join(dir, "inside")); err == nil && fi.Mode()&os.ModeSetuid != 0 {
			t.Errorf("%s: a setuid bit was kept", tc.name)
		}
		if _, err := os.Lstat(filepath.Join(dir, "null")); err == nil {
			t.Errorf("%s: a device was made", tc.name)
		}
	}
}

// A transfer shows the progress bar once it passes a few MB, and a small
// one never does.
func TestTransferBar(t *testing.T) {
	var buf bytes.Buffer
	b := &transferBar{p: &progress{w: &buf, verb: "cp", total: 10 << 20, start: time.Now()}}
	b.set(1 << 20)
	b.set(3 << 20)
	if buf.Len() != 0 {
		t.Errorf("drawn under %d bytes: %q", progressMin, buf.String())
	}
	small := &transferBar{p: &progress{w: &buf, verb: "cp", total: 1 << 20, start: time.Now()}}
	small.set(1 << 20)
	small.finish()
	if buf.Len() != 0 {
		t.Errorf("a small transfer drew: %q", buf.String())
	}
	b.set(5 << 20)
	b.finish()
	if out := buf.String(); !strings.Contains(out, "cp  5.0 MiB / 10.0 MiB") || !strings.HasSuffix(out, "\n") {
		t.Errorf("progress: %q", out)
	}
}
