package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/relay/audit"
)

// serveEnv is an environment for `sandgate serve` of a test's own: its
// state, store and audit log in temporary directories, no token, loopback.
func serveEnv(t *testing.T, extra ...string) []string {
	t.Helper()
	dir := t.TempDir()
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir,
		"SANDGATE_STATE_DIR=" + filepath.Join(dir, "state"), "SNAPSHOT_DIRECTORY=" + filepath.Join(dir, "store"),
		"SANDGATE_AUDIT_LOG=" + filepath.Join(dir, "audit.log"), "SANDBOX_DNS=127.0.0.1:9", "PORT=0"}
	return append(env, extra...)
}

// Bad or unsafe settings stop serve at start, naming the variable.
func TestServeRefusesBadSettings(t *testing.T) {
	t.Parallel() // a process of its own, waiting more than working
	for _, tc := range []struct {
		env  []string
		want string
	}{
		{[]string{"HOST=0.0.0.0"}, "SANDBOX_SERVICE_TOKEN"},
		{[]string{"PORT=http"}, "PORT"},
		{[]string{"K_SERVICE=svc"}, "SNAPSHOT_BUCKET is required on Cloud Run"},
		{[]string{"K_SERVICE=svc", "SNAPSHOT_BUCKET=b", "SANDBOX_ALLOW_PRIVATE_NETWORK=true"}, "refused on Cloud Run"},
		{[]string{"K_SERVICE=svc", "SNAPSHOT_BUCKET=b", "SANDBOX_ALLOW_PRIVATE=10.0.0.0/8"}, "refused on Cloud Run"},
		{[]string{"SANDBOX_ALLOW_PRIVATE_NETWORK=yes"}, "SANDBOX_ALLOW_PRIVATE_NETWORK"},
		{[]string{"SANDBOX_ALLOW_EGRESS=true"}, "SANDBOX_ALLOW_EGRESS"},
		{[]string{"SANDBOX_BASE_URLS=nokey"}, "SANDBOX_BASE_URLS"},
		{[]string{"SANDGATE_IDLE_SUSPEND=soon"}, "SANDGATE_IDLE_SUSPEND"},
		{[]string{"SANDGATE_SANDBOX_MEMORY=lots"}, "SANDGATE_SANDBOX_MEMORY"},
		{[]string{"SANDGATE_SANDBOX_CPU=lots"}, "SANDGATE_SANDBOX_CPU"},
		{[]string{"SANDGATE_SANDBOX_CPU=0.001"}, "SANDGATE_SANDBOX_CPU"},
		{[]string{"SANDGATE_SANDBOX_CPU=-2"}, "SANDGATE_SANDBOX_CPU"},
		{[]string{"SANDGATE_SANDBOX_CPU=NaN"}, "SANDGATE_SANDBOX_CPU"},
		{[]string{"SANDGATE_SANDBOX_CPU_WEIGHT=0"}, "SANDGATE_SANDBOX_CPU_WEIGHT"},
		{[]string{"SANDGATE_SANDBOX_CPU_WEIGHT=10001"}, "SANDGATE_SANDBOX_CPU_WEIGHT"},
		{[]string{"SANDGATE_SANDBOX_CPU_WEIGHT=heavy"}, "SANDGATE_SANDBOX_CPU_WEIGHT"},
		{[]string{"SANDGATE_SANDBOXES_CPU_WEIGHT=0"}, "SANDGATE_SANDBOXES_CPU_WEIGHT"},
		{[]string{"SANDGATE_SANDBOXES_CPU_WEIGHT=10001"}, "SANDGATE_SANDBOXES_CPU_WEIGHT"},
		{[]string{"SANDGATE_SANDBOX_DISK=lots"}, "SANDGATE_SANDBOX_DISK"},
		{[]string{"SANDGATE_SANDBOX_DISK=100k"}, "SANDGATE_SANDBOX_DISK"},
		{[]string{"SANDGATE_SANDBOX_DISK=0"}, "SANDGATE_SANDBOX_DISK"},
		{[]string{"SANDBOX_ALLOWED_HOSTS=bad host"}, "allowedHosts"},
		{[]string{"SANDBOX_API_KEY=short"}, "SANDBOX_API_KEY"},
		{[]string{"SANDBOX_API_KEY=" + strings.Repeat("k", 20), "HOST=0.0.0.0"}, "SANDBOX_API_KEY locks the Cloudflare bridge's routes only"},
		{[]string{"SANDGATE_BRIDGE_ALLOWED_HOSTS=bad host"}, "SANDGATE_BRIDGE_ALLOWED_HOSTS"},
		{[]string{"SANDGATE_BRIDGE_BASE_URLS=nokey"}, "SANDGATE_BRIDGE_BASE_URLS"},
		{[]string{"SANDGATE_BRIDGE_MAX_BODY=huge"}, "SANDGATE_BRIDGE_MAX_BODY"},
		{[]string{"SANDGATE_OUTPUT_BUDGET=plenty"}, "SANDGATE_OUTPUT_BUDGET"},
		{[]string{"SANDGATE_SANDBOX_LIFETIME=30s"}, "limits.lifetime 30s: give at least 1m0s"},
		{[]string{"SANDGATE_KEEP_SUSPENDED=forever"}, "SANDGATE_KEEP_SUSPENDED"},
		{[]string{"SANDGATE_AUDIT_LOG_SIZE=big"}, "SANDGATE_AUDIT_LOG_SIZE"},
		{[]string{"SANDGATE_AUDIT_LOG_KEEP=-1"}, "SANDGATE_AUDIT_LOG_KEEP"},
		{[]string{"SANDGATE_SEAL_KEY=too-short-a-key"}, "SANDGATE_SEAL_KEY"},
	} {
		cmd := exec.Command(binary(t), "serve")
		cmd.Env = serveEnv(t, tc.env...)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !(errors.As(err, &ee) && ee.ExitCode() == exitBadInput) || !strings.Contains(string(out), tc.want) {
			t.Errorf("serve with %v: %v\n%s\nwant exit 2 naming %q", tc.env, err, out, tc.want)
		}
	}
}

// startServe starts `sandgate serve` and returns its base URL once it
// listens, with the process.
func startServe(t *testing.T, env []string, log *bytes.Buffer) (string, *exec.Cmd) {
	t.Helper()
	cmd := exec.Command(binary(t), "serve")
	cmd.Env = env
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			log.WriteString(line + "\n")
			if _, rest, ok := strings.Cut(line, "sandgate serving addr="); ok {
				addr <- strings.Fields(rest)[0]
			}
			if strings.Contains(line, `"message":"sandgate serving"`) {
				var m map[string]any
				json.Unmarshal([]byte(line), &m)
				addr <- fmt.Sprint(m["addr"])
			}
		}
		close(addr)
	}()
	select {
	case a, ok := <-addr:
		if !ok {
			t.Fatalf("serve ended before listening:\n%s", log.String())
		}
		return "http://" + a, cmd
	case <-time.After(2 * time.Minute):
		t.Fatalf("serve did not listen within 2m:\n%s", log.String())
	}
	return "", nil
}

func call(t *testing.T, method, url, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	req.Header.Set(api.HeaderProtocol, "1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// SANDGATE_SANDBOX_CPU and SANDGATE_SANDBOX_CPU_WEIGHT are every
// sandbox's unless it has its own: 0 is no CPU limit; a sandbox's own
// limit at create applies over them. Each reaches the sandbox's cgroup.
func TestServeSandboxCPUSettings(t *testing.T) {
	t.Parallel() // a process of its own, waiting more than working
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	env := serveEnv(t, "SANDGATE_SANDBOX_CPU=0", "SANDGATE_SANDBOX_CPU_WEIGHT=50")
	var log bytes.Buffer
	base, _ := startServe(t, env, &log)
	for name, body := range map[string]string{"dflt": `{"name":"dflt"}`, "own": `{"name":"own","limits":{"cpu":0.5}}`} {
		if code, out := call(t, "POST", base+"/v1/sandboxes", body); code != 201 {
			t.Fatalf("create %s: %d %s", name, code, out)
		}
		t.Cleanup(func() { call(t, "DELETE", base+"/v1/sandboxes/"+name, "") })
	}
	limits := func(name string) map[string]any {
		code, out := call(t, "GET", base+"/v1/sandboxes/"+name, "")
		var sb struct {
			Limits map[string]any `json:"limits"`
		}
		if err := json.Unmarshal([]byte(out), &sb); code != 200 || err != nil {
			t.Fatalf("get %s: %d %s", name, code, out)
		}
		return sb.Limits
	}
	if l := limits("dflt"); l["cpu"] != nil || l["cpuWeight"] != float64(50) {
		t.Errorf("a sandbox of the service's settings: limits %v, want no cpu and cpuWeight 50", l)
	}
	if l := limits("own"); l["cpu"] != 0.5 || l["cpuWeight"] != float64(50) {
		t.Errorf("a sandbox with its own cpu: limits %v, want cpu 0.5 and cpuWeight 50", l)
	}
	// cpuFile is the first of files in sandbox name's cpu cgroup (or in
	// sub, relative to it), its first word; "" where none is.
	cpuFile := func(name, sub string, files ...string) string {
		var state string
		for _, kv := range env {
			if v, ok := strings.CutPrefix(kv, "SANDGATE_STATE_DIR="); ok {
				state = v
			}
		}
		data, err := os.ReadFile(filepath.Join(state, "sandboxes", name, "state.json"))
		if err != nil {
			t.Fatal(err)
		}
		var st struct {
			Cgroups []string `json:"cgroups"`
		}
		json.Unmarshal(data, &st)
		for _, d := range st.Cgroups {
			if _, err := os.Stat(filepath.Join(d, "cpu.shares")); err != nil {
				if _, err := os.Stat(filepath.Join(d, "cpu.max")); err != nil {
					continue // not the cpu hierarchy's
				}
			}
			for _, f := range files {
				if b, err := os.ReadFile(filepath.Join(d, sub, f)); err == nil {
					return strings.Fields(string(b))[0]
				}
			}
		}
		return ""
	}
	quota := func(name string) string { return cpuFile(name, ".", "cpu.max", "cpu.cfs_quota_us") }
	if quota("dflt") == "" {
		t.Skip("no cpu controller on this host")
	}
	if q := quota("dflt"); q != "max" && q != "-1" {
		t.Errorf("SANDGATE_SANDBOX_CPU=0: the sandbox's quota is %s, want none", q)
	}
	if q := quota("own"); q != "50000" {
		t.Errorf("its own cpu 0.5: the sandbox's quota is %s, want 50000", q)
	}
	// Together they weigh a quarter of serve's threads beside them
	// (SANDGATE_SANDBOXES_CPU_WEIGHT's default).
	if w := cpuFile("dflt", "..", "cpu.weight", "cpu.shares"); w != "25" && w != "256" {
		t.Errorf("the sandboxes' parent cgroup weighs %s, want 25 (v1: 256 shares)", w)
	}
}

// SIGTERM saves every running sandbox, logs which, and exits 0; a new
// serve over the same state resumes it with its files.
func TestServeSavesAllOnSIGTERM(t *testing.T) {
	t.Parallel() // a process of its own, waiting more than working
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	env := serveEnv(t, "LOG_FORMAT=text")
	var log bytes.Buffer
	base, cmd := startServe(t, env, &log)
	for _, name := range []string{"one", "two"} {
		if code, out := call(t, "POST", base+"/v1/sandboxes", `{"name":"`+name+`"}`); code != 201 {
			t.Fatalf("create %s: %d %s", name, code, out)
		}
		if code, out := call(t, "POST", base+"/v1/sandboxes/"+name+"/exec", `{"command":"echo saved-`+name+` > /workspace/f; curl -sS -x $HTTPS_PROXY https://refused-`+name+`.example.com/ 2>/dev/null; true"}`+"\n"); code != 200 {
			t.Fatalf("exec: %d %s", code, out)
		}
	}
	// A follow stream of one's audit, open across the SIGTERM: it ends as
	// its sandbox is saved, it does not hold the shutdown up.
	req, _ := http.NewRequest("GET", base+"/v1/sandboxes/one/audit?follow=1", nil)
	req.Header.Set(api.HeaderProtocol, "1")
	follow, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, follow.Body)
	defer follow.Body.Close()
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve after SIGTERM: %v\n%s", err, log.String())
		}
	case <-time.After(time.Minute):
		t.Fatalf("serve did not exit within a minute of SIGTERM:\n%s", log.String())
	}
	if !strings.Contains(log.String(), "saved 2 sandboxes") {
		t.Errorf("the log does not say what was saved:\n%s", log.String())
	}
	if strings.Contains(log.String(), "were cut") {
		t.Errorf("the shutdown cut what it should have ended (an audit stream?):\n%s", log.String())
	}
	var log2 bytes.Buffer
	base2, _ := startServe(t, env, &log2)
	if code, out := call(t, "POST", base2+"/v1/sandboxes/two/resume", `{}`); code != 200 {
		t.Fatalf("resume after restart: %d %s", code, out)
	}
	code, out := call(t, "POST", base2+"/v1/sandboxes/two/exec", `{"command":"cat /workspace/f"}`+"\n")
	if code != 200 || !strings.Contains(out, "saved-two") {
		t.Errorf("after restart: %d %q", code, out)
	}
	// Each sandbox's audit came through the restart: "one" is still
	// suspended, "two" runs again.
	for _, name := range []string{"one", "two"} {
		if code, out := call(t, "GET", base2+"/v1/sandboxes/"+name+"/audit", ""); code != 200 || !strings.Contains(out, `"host":"refused-`+name+`.example.com"`) {
			t.Errorf("the audit of %s after the restart: %d %s", name, code, out)
		}
	}
	call(t, "DELETE", base2+"/v1/sandboxes/one", "")
	call(t, "DELETE", base2+"/v1/sandboxes/two", "")
}

// A crash (kill -9) loses at most the audit events of the last
// SANDGATE_AUDIT_FLUSH: those written before it are there after a
// restart, the sandbox's own events of its run before the crash.
func TestServeAuditSurvivesKill9(t *testing.T) {
	t.Parallel() // a process of its own, waiting more than working
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	env := serveEnv(t, "LOG_FORMAT=text", "SANDGATE_AUDIT_FLUSH=100ms")
	var storeDir string
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "SNAPSHOT_DIRECTORY="); ok {
			storeDir = v
		}
	}
	var log bytes.Buffer
	base, cmd := startServe(t, env, &log)
	if code, out := call(t, "POST", base+"/v1/sandboxes", `{"name":"crash"}`); code != 201 {
		t.Fatalf("create: %d %s", code, out)
	}
	if code, out := call(t, "POST", base+"/v1/sandboxes/crash/exec", `{"command":"curl -sS -x $HTTPS_PROXY https://before-the-crash.example.com/ 2>/dev/null; true"}`+"\n"); code != 200 {
		t.Fatalf("exec: %d %s", code, out)
	}
	// The periodic write has the event in the store: then the crash.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if storedAudit(t, filepath.Join(storeDir, "audit", "crash"), "before-the-crash.example.com") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no audit segment in the store a minute after the event (flush every 100ms):\n%s", log.String())
		}
	}
	cmd.Process.Kill()
	cmd.Wait()
	var log2 bytes.Buffer
	base2, _ := startServe(t, env, &log2)
	code, out := call(t, "GET", base2+"/v1/sandboxes/crash/audit", "")
	if code != 200 || !strings.Contains(out, `"host":"before-the-crash.example.com"`) {
		t.Errorf("the audit after kill -9 and a restart: %d %s", code, out)
	}
	call(t, "DELETE", base2+"/v1/sandboxes/crash", "")
}

// storedAudit reports whether a segment in dir (a sandbox's audit in a
// directory store) holds want.
func storedAudit(t *testing.T, dir, want string) bool {
	t.Helper()
	segs, _ := filepath.Glob(filepath.Join(dir, "*.jsonl.zst"))
	for _, p := range segs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		lines, err := audit.DecodeSegment(b)
		if err == nil && bytes.Contains(lines, []byte(want)) {
			return true
		}
	}
	return false
}

// The binary built exactly as the Dockerfile builds it starts serve with
// Cloud Run's environment: it listens on 0.0.0.0:$PORT without a token
// (IAM is in front), logs JSON lines with severity, message and time, uses
// the bucket, and stops on SIGTERM with exit 0.
func TestImageServesWithCloudRunEnvironment(t *testing.T) {
	t.Parallel()
	bin, _, _ := imageBinary(t)
	srv, _ := gcstest.Start(t, "sandgate-snapshots")
	dir := t.TempDir()
	cmd := exec.Command(bin, "serve")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir,
		"K_SERVICE=sandgate", "K_REVISION=sandgate-00001-abc", "PORT=0",
		"SNAPSHOT_BUCKET=sandgate-snapshots", "STORAGE_EMULATOR_HOST=" + strings.TrimPrefix(srv.URL(), "http://"),
		"SANDGATE_STATE_DIR=" + filepath.Join(dir, "state"), "SANDBOX_DNS=127.0.0.1:9"}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	sc := bufio.NewScanner(stderr)
	var serving map[string]any
	var lines []string
	for serving == nil && sc.Scan() {
		lines = append(lines, sc.Text())
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("a log line that is not JSON on Cloud Run: %q", sc.Text())
		}
		if m["severity"] == nil || m["message"] == nil || m["time"] == nil {
			t.Errorf("a log line without severity, message and time: %q", sc.Text())
		}
		if m["message"] == "sandgate serving" {
			serving = m
		}
	}
	if serving == nil {
		t.Fatalf("serve did not start:\n%s", strings.Join(lines, "\n"))
	}
	addr := fmt.Sprint(serving["addr"])
	if !strings.HasPrefix(addr, "[::]:") && !strings.HasPrefix(addr, "0.0.0.0:") {
		t.Errorf("on Cloud Run it listens on %s, want every address", addr)
	}
	if serving["store"] != "gs://sandgate-snapshots" || serving["image_id"] != "sandgate-00001-abc" || serving["cloud_run"] != true {
		t.Errorf("serving with %v", serving)
	}
	port := addr[strings.LastIndex(addr, ":")+1:]
	if code, body := call(t, "GET", "http://127.0.0.1:"+port+"/health", ""); code != 200 || !strings.Contains(body, `"protocol":1`) {
		t.Errorf("health: %d %s", code, body)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	go func() { io.Copy(io.Discard, stderr) }()
	if err := cmd.Wait(); err != nil {
		t.Errorf("after SIGTERM: %v", err)
	}
}

// At startup serve removes what puts interrupted by a crash left in its
// directory store, and nothing a put may still be writing.
func TestServeRemovesUnfinishedUploads(t *testing.T) {
	t.Parallel()
	env := serveEnv(t)
	var storeDir string
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "SNAPSHOT_DIRECTORY="); ok {
			storeDir = v
		}
	}
	snaps := filepath.Join(storeDir, "snapshots", "sb-1")
	if err := os.MkdirAll(snaps, 0o755); err != nil {
		t.Fatal(err)
	}
	stale, fresh := filepath.Join(snaps, ".tmp-x.tar.zst-01"), filepath.Join(snaps, ".tmp-y.tar.zst-02")
	os.WriteFile(stale, []byte("half a layer"), 0o644)
	os.WriteFile(fresh, []byte("being written"), 0o644)
	long := time.Now().Add(-2 * staleUploadAge)
	if err := os.Chtimes(stale, long, long); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	startServe(t, env, &log)
	deadline := time.Now().Add(time.Minute)
	for {
		if _, err := os.Stat(stale); errors.Is(err, fs.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("serve did not remove the unfinished upload within a minute of listening")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Errorf("serve removed a temporary file a put may still be writing: %v", err)
	}
}

// A second serve on the state directory of a running one refuses to
// start, naming the holder; the sandbox CLI's own commands keep working.
func TestServeRefusesASecondOnItsStateDirectory(t *testing.T) {
	t.Parallel() // processes of their own, waiting more than working
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	env := serveEnv(t, "LOG_FORMAT=text")
	var log bytes.Buffer
	_, first := startServe(t, env, &log)
	cmd := exec.Command(binary(t), "serve")
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	want := fmt.Sprintf("in use by sandgate serve (pid %d)", first.Process.Pid)
	if !(errors.As(err, &ee) && ee.ExitCode() == exitBadInput) || !strings.Contains(string(out), want) {
		t.Errorf("a second serve on the same state directory: %v\n%s\nwant exit 2 saying %q", err, out, want)
	}
	ls := exec.Command(binary(t), "sandbox", "list")
	ls.Env = env
	if out, err := ls.CombinedOutput(); err != nil {
		t.Errorf("sandgate sandbox list beside a serve: %v\n%s", err, out)
	}
}

// A start that fails after the store was opened touches nothing in it and
// says only why it failed: the clean-up of unfinished uploads ran beside
// the start and, once the start failed and closed the store, logged
// "openat .: file already closed".
func TestServeFailedStartLeavesTheStore(t *testing.T) {
	t.Parallel()
	env := serveEnv(t, "SANDBOX_DNS=256.1.1.1")
	var storeDir string
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "SNAPSHOT_DIRECTORY="); ok {
			storeDir = v
		}
	}
	stale := filepath.Join(storeDir, "snapshots", "sb-1", ".tmp-x.tar.zst-01")
	os.MkdirAll(filepath.Dir(stale), 0o755)
	os.WriteFile(stale, []byte("half a layer"), 0o644)
	long := time.Now().Add(-2 * staleUploadAge)
	os.Chtimes(stale, long, long)
	cmd := exec.Command(binary(t), "serve")
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitBadInput || !strings.Contains(string(out), "SANDBOX_DNS") {
		t.Errorf("serve with a bad DNS server: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "closed") || strings.Count(strings.TrimSpace(string(out)), "\n") > 0 {
		t.Errorf("a failed start said more than why:\n%s", out)
	}
	if _, err := os.Stat(stale); err != nil {
		t.Errorf("a start that failed cleaned the store: %v", err)
	}
}

// Where a disk quota per sandbox cannot be applied (here: no mke2fs on
// serve's PATH), serve says so at start, with what to do, and does not run
// sandboxes without one; SANDGATE_SANDBOX_DISK=none runs them without,
// saying so in its log.
func TestServeRefusesToRunWithoutDiskQuotas(t *testing.T) {
	t.Parallel() // processes of their own, waiting more than working
	noTools := "PATH=" + t.TempDir()
	cmd := exec.Command(binary(t), "serve")
	cmd.Env = append(serveEnv(t), noTools)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	for _, want := range []string{"SANDGATE_SANDBOX_DISK", "cannot be applied on this host", "mke2fs", "SANDGATE_SANDBOX_DISK=none"} {
		if !errors.As(err, &ee) || !strings.Contains(string(out), want) {
			t.Errorf("serve where mke2fs is missing: %v\n%s\nwant a failed start saying %q", err, out, want)
		}
	}
	var log bytes.Buffer
	startServe(t, append(serveEnv(t, "LOG_FORMAT=text", "SANDGATE_SANDBOX_DISK=none"), noTools), &log)
	if !strings.Contains(log.String(), "without a disk quota (SANDGATE_SANDBOX_DISK=none)") {
		t.Errorf("serve without disk quotas did not say so:\n%s", log.String())
	}
}
