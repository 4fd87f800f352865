package service_test

import (
	"archive/tar"
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
)

const bridgeKey = "e2e-bridge-key-8d1c44b0a7e3f9"

// bridgeCall is one request of a bridge client: the key as Bearer unless
// noKey, JSON or raw bytes.
func (r *rig) bridgeCall(method, path string, body []byte, noKey bool, hdr ...string) (int, []byte, http.Header) {
	r.t.Helper()
	req, _ := http.NewRequest(method, r.hs.URL+path, bytes.NewReader(body))
	if !noKey {
		req.Header.Set("Authorization", "Bearer "+bridgeKey)
	}
	if json.Valid(body) {
		req.Header.Set("Content-Type", "application/json")
	} else if len(body) > 0 {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := (&http.Client{Timeout: 2 * time.Minute}).Do(req)
	if err != nil {
		r.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		r.t.Fatalf("%s %s: %v", method, path, err)
	}
	if bytes.Contains(out, []byte(bridgeKey)) {
		r.t.Errorf("%s %s: the key is in the answer", method, path)
	}
	return resp.StatusCode, out, resp.Header
}

func (r *rig) bridgeMust(want int, method, path string, body []byte, hdr ...string) []byte {
	r.t.Helper()
	code, out, _ := r.bridgeCall(method, path, body, false, hdr...)
	if code != want {
		r.t.Fatalf("%s %s: %d %s, want %d", method, path, code, out, want)
	}
	return out
}

// bridgeExec runs argv through the bridge's exec, reading its events as a
// client does: stdout and stderr decoded, the exit code from the one
// terminal event.
func (r *rig) bridgeExec(id string, argv []string, hdr ...string) (stdout, stderr string, exit int) {
	r.t.Helper()
	body, _ := json.Marshal(map[string]any{"argv": argv, "timeout_ms": 60000})
	code, out, h := r.bridgeCall("POST", "/v1/sandbox/"+id+"/exec", body, false, hdr...)
	if code != 200 || h.Get("Content-Type") != "text/event-stream" {
		r.t.Fatalf("exec %q: %d %s", argv, code, out)
	}
	exit = -1
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 16<<20)
	var name string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			data := strings.TrimPrefix(line, "data: ")
			switch name {
			case "stdout", "stderr":
				b, err := base64.StdEncoding.DecodeString(data)
				if err != nil {
					r.t.Fatalf("exec %q: %s data is not base64: %q", argv, name, data)
				}
				if name == "stdout" {
					stdout += string(b)
				} else {
					stderr += string(b)
				}
			case "exit":
				var x struct {
					ExitCode int `json:"exit_code"`
				}
				json.Unmarshal([]byte(data), &x)
				exit = x.ExitCode
			case "error":
				r.t.Fatalf("exec %q: error event %s", argv, data)
			}
		}
	}
	if exit < 0 {
		r.t.Fatalf("exec %q: no exit event in\n%s", argv, out)
	}
	return stdout, stderr, exit
}

// tarFiles is a tar's regular files and directories: name → content
// ("/" for a directory).
func tarFiles(t *testing.T, b []byte) map[string]string {
	t.Helper()
	out := map[string]string{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("tar: %v", err)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			out[h.Name] = "/"
		case tar.TypeReg:
			data, _ := io.ReadAll(tr)
			out[h.Name] = string(data)
		default:
			out[h.Name] = "type " + string(h.Typeflag)
		}
	}
}

// The run a client of the Cloudflare bridge makes (the Codex and OpenAI
// Agents adapters' sequence), end to end over the real service: its
// preflight, create, hydrate, a session, a streamed command, persist and
// the diff, destroy, and the pool's count; with the egress policy the
// bridge never had deciding, and auditing, what the sandbox may reach.
func TestBridgeClientRun(t *testing.T) {
	r := newRigOn(t, stacktest.Config{Bridge: bridge.Config{Key: bridgeKey}}, nil)

	// Preflight: an unauthenticated create is refused; the document is
	// major 1 and has every route the client calls.
	if code, out, _ := r.bridgeCall("POST", "/v1/sandbox", nil, true); code != 401 || !strings.Contains(string(out), `"code":"unauthorized"`) {
		t.Fatalf("create without the key: %d %s", code, out)
	}
	var doc struct {
		Info  struct{ Version string }
		Paths map[string]map[string]json.RawMessage
	}
	if err := json.Unmarshal(r.bridgeMust(200, "GET", "/v1/openapi.json", nil), &doc); err != nil {
		t.Fatal(err)
	}
	if major, _, _ := strings.Cut(doc.Info.Version, "."); major != "1" {
		t.Errorf("info.version %q: a bridge client wants major 1", doc.Info.Version)
	}
	contract, err := os.ReadFile(filepath.Join("..", "bridge", "testdata", "cloudflare-openapi.json"))
	if err != nil {
		t.Fatal(err)
	}
	var want struct {
		Paths map[string]map[string]json.RawMessage
	}
	json.Unmarshal(contract, &want)
	for path, ops := range want.Paths {
		for m := range ops {
			if _, ok := doc.Paths[path][m]; !ok {
				t.Errorf("the document lacks the contract's %s %s", strings.ToUpper(m), path)
			}
		}
	}
	var before bridge.PoolStats
	json.Unmarshal(r.bridgeMust(200, "GET", "/v1/pool/stats", nil), &before)

	// Create.
	var created struct{ ID string }
	json.Unmarshal(r.bridgeMust(200, "POST", "/v1/sandbox", nil), &created)
	id := created.ID
	var during bridge.PoolStats
	json.Unmarshal(r.bridgeMust(200, "GET", "/v1/pool/stats", nil), &during)
	if during.Assigned != before.Assigned+1 {
		t.Errorf("pool: %d assigned before create, %d after", before.Assigned, during.Assigned)
	}

	// Hydrate a tar.
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	for _, f := range []struct{ name, content string }{{"./", ""}, {"./a.txt", "alpha\n"}, {"./src/", ""}, {"./src/main.go", "package main\n"}} {
		h := &tar.Header{Name: f.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(f.content)), ModTime: time.Unix(1700000000, 0)}
		if strings.HasSuffix(f.name, "/") {
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		}
		tw.WriteHeader(h)
		tw.Write([]byte(f.content))
	}
	tw.Close()
	hydrated := in.Bytes()
	r.bridgeMust(200, "POST", "/v1/sandbox/"+id+"/hydrate", hydrated)

	// A session with env; the command streamed.
	r.bridgeMust(200, "POST", "/v1/sandbox/"+id+"/session", []byte(`{"id":"agent","cwd":"/workspace","env":{"AGENT_NAME":"codex"}}`))
	stdout, stderr, exit := r.bridgeExec(id, []string{"sh", "-c", "echo hello && echo after > /workspace/probe.txt"}, "Session-Id", "agent")
	if stdout != "hello\n" || stderr != "" || exit != 0 {
		t.Errorf("the streamed command: %q %q %d", stdout, stderr, exit)
	}
	stdout, _, _ = r.bridgeExec(id, []string{"sh", "-c", `echo "$AGENT_NAME in $PWD"; env`}, "Session-Id", "agent")
	if !strings.HasPrefix(stdout, "codex in /workspace\n") {
		t.Errorf("the session's env and cwd: %q", stdout)
	}
	if strings.Contains(stdout, bridgeKey) {
		t.Error("the key is in the sandbox's environment")
	}

	// Persist, and the diff against what was hydrated: the probe alone.
	persisted := tarFiles(t, r.bridgeMust(200, "POST", "/v1/sandbox/"+id+"/persist", nil))
	original := tarFiles(t, hydrated)
	var added, changed, removed []string
	for name, content := range persisted {
		if old, ok := original[name]; !ok {
			added = append(added, name)
		} else if old != content {
			changed = append(changed, name)
		}
	}
	for name := range original {
		if _, ok := persisted[name]; !ok {
			removed = append(removed, name)
		}
	}
	if !slices.Equal(added, []string{"./probe.txt"}) || persisted["./probe.txt"] != "after\n" || len(changed) != 0 || len(removed) != 0 {
		t.Errorf("diff: added %v changed %v removed %v (%q)", added, changed, removed, persisted["./probe.txt"])
	}

	// Egress: a base URL of the service reaches its upstream; any other
	// host is refused, and the refusal is audited for this sandbox (also
	// through sandgate's /v1 route on the same id).
	stdout, _, _ = r.bridgeExec(id, []string{"sh", "-c", `curl -sS "$ANTHROPIC_BASE_URL/v1/messages"`})
	if !strings.HasPrefix(stdout, "path=/v1/messages") {
		t.Errorf("egress through the base URL route: %q", stdout)
	}
	_, _, exit = r.bridgeExec(id, []string{"sh", "-c", `curl -sS -x "$HTTPS_PROXY" https://exfil.example.net/ >/dev/null 2>&1`})
	if exit == 0 {
		t.Error("a host outside the policy was reached")
	}
	refused := func(evs []byteEvent) bool {
		return slices.ContainsFunc(evs, func(e byteEvent) bool {
			return e.Host == "exfil.example.net" && e.Decision == "deny" && e.Sandbox == id
		})
	}
	var auditRoute struct{ Events []byteEvent }
	json.Unmarshal([]byte(r.must(200, "GET", "/v1/sandboxes/"+id+"/audit", nil)), &auditRoute)
	if !refused(auditRoute.Events) {
		t.Errorf("the /v1 audit route of %s: %+v", id, auditRoute.Events)
	}

	// A credential the proxy swaps in for this sandbox (set through /v1 on
	// the same id) never goes in through the bridge: not in a session's
	// variables, a file or a command; the placeholder does.
	r.must(204, "POST", "/v1/sandboxes/"+id+"/transformations", map[string]any{"transformations": []any{map[string]any{
		"match":     map[string]any{"host": stacktest.UpstreamHost, "headers": []any{map[string]any{"key": map[string]string{"exact": "x-api-key"}, "value": map[string]string{"exact": guardPH}}}},
		"transform": map[string]any{"headers": map[string]string{"x-api-key": r.canary}},
	}}})
	for _, tc := range []struct {
		what, method, path, body string
		want                     int
	}{
		{"a session's variable", "POST", "/v1/sandbox/" + id + "/session", `{"id":"leak","env":{"KEY":"` + r.canary + `"}}`, 400},
		{"a file", "PUT", "/v1/sandbox/" + id + "/file/workspace/key.txt", "key=" + r.canary, 400},
		{"a command", "POST", "/v1/sandbox/" + id + "/exec", `{"argv":["echo","` + r.canary + `"]}`, 400},
	} {
		code, out, _ := r.bridgeCall(tc.method, tc.path, []byte(tc.body), false)
		if code != tc.want || !strings.Contains(string(out), "Credentials stay outside the sandbox") {
			t.Errorf("the credential in %s: %d %s, want %d and the guard's refusal", tc.what, code, out, tc.want)
		}
	}
	stdout, _, _ = r.bridgeExec(id, []string{"sh", "-c", `curl -sS -H "X-Api-Key: ` + guardPH + `" "$ANTHROPIC_BASE_URL/v1/messages"`})
	if !strings.Contains(stdout, "key="+guardPH) || strings.Contains(stdout, r.canary) {
		t.Errorf("the swap through a bridge sandbox (the upstream echoes the key it got, the sandbox sees the placeholder): %q", stdout)
	}
	if hits, _ := r.sandboxFilesHolding(r.canary); len(hits) > 0 {
		t.Errorf("the credential is in the sandbox: %v", hits)
	}

	// Delete: the pool no longer counts it.
	r.bridgeMust(204, "DELETE", "/v1/sandbox/"+id, nil)
	var after bridge.PoolStats
	json.Unmarshal(r.bridgeMust(200, "GET", "/v1/pool/stats", nil), &after)
	if after.Assigned != before.Assigned || after.Total != after.Assigned {
		t.Errorf("pool after delete: %+v, before create %+v", after, before)
	}
	if _, err := r.m.Get(t.Context(), id); err == nil {
		t.Error("the sandbox is still known after delete")
	}
	if strings.Contains(r.log.String(), bridgeKey) {
		t.Error("the key is in the service's log")
	}
}

// byteEvent is what the test reads of an audit event.
type byteEvent struct {
	Sandbox  string `json:"sandbox"`
	Host     string `json:"host"`
	Decision string `json:"decision"`
}

// Without a key the bridge's routes refuse every request, and the
// document the service serves has none of them.
func TestBridgeClosedWithoutKey(t *testing.T) {
	r := newRig(t, nil)
	for _, p := range []string{"POST /v1/sandbox", "GET /v1/pool/stats", "GET /v1/sandbox/abc/running", "POST /v1/sandbox/abc/exec"} {
		m, path, _ := strings.Cut(p, " ")
		for _, noKey := range []bool{true, false} {
			code, out, _ := r.bridgeCall(m, path, []byte(`{"argv":["true"]}`), noKey)
			if code != 401 || !strings.Contains(string(out), "SANDBOX_API_KEY") {
				t.Errorf("%s (key sent: %v) on a service without a key: %d %s", p, !noKey, code, out)
			}
		}
	}
	var doc struct{ Paths map[string]any }
	json.Unmarshal([]byte(r.must(200, "GET", "/v1/openapi.json", nil)), &doc)
	if _, ok := doc.Paths["/v1/sandbox"]; ok || len(doc.Paths) == 0 {
		t.Errorf("the document of a service without a key lists the bridge's routes (%d paths)", len(doc.Paths))
	}
	if n, _ := r.m.List(t.Context()); len(n) != 0 {
		t.Errorf("sandboxes were made: %v", n)
	}
}

// With the bridge's key set, a request that presents a bridge key that is
// wrong gets the bridge's 401 on every route, protocol 1's and sandgate's
// included: it never falls through to what they answer without a key (on
// loopback without a service token, everything), so a bridge client's
// preflight cannot pass with a wrong key. An identity token (a JWT, which
// protocol 1's clients send for Cloud Run's IAM) is no bridge key, and the
// right key or none reaches the rest as before.
func TestWrongBridgeKeyIsRefusedOnEveryRoute(t *testing.T) {
	r := newRigOn(t, stacktest.Config{Bridge: bridge.Config{Key: bridgeKey}}, func(c *server.Config) { c.Token, c.LocalOnly = "", true })
	call := func(method, target, auth string) (int, string) {
		if auth == "" {
			return r.send(method, target, strings.NewReader(`{}`))
		}
		return r.send(method, target, strings.NewReader(`{}`), "Authorization", auth)
	}
	for _, tc := range []struct{ method, target, auth string }{
		{"GET", "/v1/openapi.json", "Bearer wrong-key-0123456789abcdef"},
		{"GET", "/v1/openapi.json", "bearer " + bridgeKey + "x"},
		{"GET", "/v1/openapi.json?token=wrong-key-0123456789abcdef", ""},
		{"GET", "/v1/sandboxes", "Bearer wrong-key-0123456789abcdef"},
		{"POST", "/v1/sandboxes", "Bearer wrong-key-0123456789abcdef"},
		{"GET", "/health", "Bearer wrong-key-0123456789abcdef"},
		{"GET", "/v1/no/such/route", "Bearer wrong-key-0123456789abcdef"},
	} {
		code, out := call(tc.method, tc.target, tc.auth)
		var e bridge.ErrorBody
		if code != http.StatusUnauthorized || json.Unmarshal([]byte(out), &e) != nil || e.Code != "unauthorized" || !strings.HasPrefix(e.Error, "Unauthorized") {
			t.Errorf("%s %s with %q: %d %.200s, want the bridge's 401", tc.method, tc.target, tc.auth, code, out)
		}
	}
	for _, tc := range []struct{ target, auth string }{
		{"/v1/openapi.json", "Bearer " + bridgeKey},
		{"/v1/openapi.json?token=" + bridgeKey, ""},
		{"/v1/openapi.json", ""},
		{"/v1/openapi.json", "Bearer eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJ4In0.c2ln"},
		{"/v1/sandboxes", "Bearer " + bridgeKey},
		{"/health", ""},
	} {
		if code, out := call("GET", tc.target, tc.auth); code != 200 {
			t.Errorf("GET %s with %q: %d %.200s, want 200", tc.target, tc.auth, code, out)
		}
	}
}
