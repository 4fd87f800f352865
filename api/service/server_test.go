package service_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// Protocol 1 §1: the checks before routing, and the header on every reply.
func TestEveryRequest(t *testing.T) {
	r := newRig(t, nil)
	get := func(path string, hdr map[string]string) (int, string, http.Header) {
		req, _ := http.NewRequest("GET", r.hs.URL+path, nil)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		b.ReadFrom(resp.Body)
		if resp.Header.Get(api.HeaderProtocol) != "1" {
			t.Errorf("GET %s: no protocol header on the reply", path)
		}
		return resp.StatusCode, b.String(), resp.Header
	}
	// /health: no checks, whatever the headers.
	if code, body, _ := get("/health", map[string]string{api.HeaderProtocol: "2"}); code != 200 || body != `{"status":"ok","protocol":1,"version":"test","ok":true}`+"\n" {
		t.Errorf("health: %d %q", code, body)
	}
	if code, _, _ := r.do("POST", "/health", nil); code != http.StatusMethodNotAllowed {
		t.Errorf("POST /health: %d, want 405", code)
	}
	// The protocol header, then the token.
	if code, body, _ := get("/v1/sandboxes", map[string]string{api.HeaderProtocol: "2", api.HeaderToken: r.token}); code != 400 || !strings.Contains(body, `"error"`) {
		t.Errorf("protocol 2: %d %s", code, body)
	}
	if code, _, _ := get("/v1/sandboxes", map[string]string{api.HeaderProtocol: "2"}); code != 400 {
		t.Errorf("protocol 2 without token: %d, want 400 (the protocol is checked first)", code)
	}
	if code, _, _ := get("/v1/sandboxes", nil); code != 401 {
		t.Errorf("no token: %d, want 401", code)
	}
	if code, _, _ := get("/v1/sandboxes", map[string]string{api.HeaderToken: "wrong"}); code != 401 {
		t.Errorf("wrong token: %d, want 401", code)
	}
	if code, _, _ := get("/v1/sandboxes", map[string]string{api.HeaderToken: r.token}); code != 200 {
		t.Errorf("no protocol header (accepted): %d", code)
	}
	// A header sent twice is refused (400), not read as its first value:
	// the right token and a wrong one, the right token twice, and the
	// protocol header twice.
	twice := func(hdr http.Header) (int, string) {
		req, _ := http.NewRequest("GET", r.hs.URL+"/v1/sandboxes", nil)
		req.Header = hdr
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, tc := range []struct {
		what string
		hdr  http.Header
	}{
		{"the token, then another", http.Header{api.HeaderToken: {r.token, "wrong"}}},
		{"a wrong token, then the token", http.Header{api.HeaderToken: {"wrong", r.token}}},
		{"the token twice", http.Header{api.HeaderToken: {r.token, r.token}}},
		{"the protocol twice", http.Header{api.HeaderToken: {r.token}, api.HeaderProtocol: {"1", "1"}}},
		{"the protocol twice, differing", http.Header{api.HeaderToken: {r.token}, api.HeaderProtocol: {"1", "2"}}},
	} {
		if code, body := twice(tc.hdr); code != http.StatusBadRequest || !strings.Contains(body, "times") || strings.Contains(body, r.token) {
			t.Errorf("%s: %d %s, want 400 saying it was sent twice (and never the token)", tc.what, code, body)
		}
	}
	// Routing: 404 and 405, JSON errors.
	if code, body, _ := r.do("GET", "/v1/nothing", nil); code != 404 || !strings.HasPrefix(body, `{"error":`) {
		t.Errorf("no route: %d %s", code, body)
	}
	if code, body, resp := r.do("PATCH", "/v1/sandboxes/x", nil); code != 405 || !strings.HasPrefix(body, `{"error":`) || resp.Header.Get("Allow") == "" {
		t.Errorf("wrong method: %d %s", code, body)
	}
	// JSON bodies.
	for _, tc := range []struct {
		body any
		code int
		want string
	}{
		{"not json", 400, "not JSON"},
		{"[1]", 400, "object"},
		{"null", 400, "null"},
		{`{"name":5}`, 400, `field \"name\"`},
		{`{"name":"a","allowedHosts":"x"}`, 400, `field \"allowedHosts\"`},
		{`{"name":"a","baseUrls":{"X":1}}`, 400, `field \"baseUrls\"`},
		{`{"name":"a","template":7}`, 400, `field \"template\"`},
		{`{}`, 400, "invalid sandbox name"},
		{`{"name":"Bad_Name"}`, 400, "invalid sandbox name"},
		{`{"name":"ok","template":"Bad!"}`, 400, "invalid template name"},
		{`{"name":"ok","template":"none-such"}`, 404, "no such template"},
		{`{"name":"` + strings.Repeat("a", 64) + `"}`, 400, "invalid sandbox name"},
		{`{"name":"big","pad":"` + strings.Repeat("x", api.MaxJSONBody) + `"}`, 413, "over"},
	} {
		if code, body, _ := r.do("POST", "/v1/sandboxes", tc.body); code != tc.code || !strings.Contains(body, tc.want) {
			t.Errorf("create with %.60v: %d %s, want %d and %q", tc.body, code, body, tc.code, tc.want)
		}
	}
}

// Create, resume, suspend, destroy, with their statuses.
func TestLifecycleRoutes(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	if code, body, _ := r.do("POST", "/v1/sandboxes", map[string]any{"name": "box"}); code != 409 {
		t.Errorf("create again: %d %s, want 409", code, body)
	}
	if res := r.exec("box", "echo kept > /workspace/f; test -d /home/agent && echo home-exists; echo $HOME", nil); res.exit != 0 || res.stdout != "home-exists\n/home/agent\n" {
		t.Errorf("first command: %+v", res)
	}
	out := r.must(200, "POST", "/v1/sandboxes/box/resume", map[string]any{})
	if !strings.Contains(out, `"name":"box"`) {
		t.Errorf("resume of a running sandbox: %s", out)
	}
	r.must(204, "POST", "/v1/sandboxes/box/suspend", nil)
	r.must(204, "POST", "/v1/sandboxes/box/suspend", nil)        // idempotent
	r.must(204, "POST", "/v1/sandboxes/Not_A_Name/suspend", nil) // no name check
	if code, _, _ := r.do("POST", "/v1/sandboxes/box/exec", "{\"command\":\"true\"}\n"); code != 404 {
		t.Errorf("exec in a suspended sandbox: %d, want 404", code)
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes", map[string]any{"name": "box"}); code != 409 {
		t.Errorf("create over a suspended sandbox: %d, want 409", code)
	}
	list := r.must(200, "GET", "/v1/sandboxes", nil)
	if !strings.Contains(list, `"name":"box","state":"suspended"`) {
		t.Errorf("list: %s", list)
	}
	r.must(200, "POST", "/v1/sandboxes/box/resume", map[string]any{"allowedHosts": []string{"api.example.com"}})
	if res := r.exec("box", "cat /workspace/f", nil); res.stdout != "kept\n" {
		t.Errorf("after resume: %+v", res)
	}
	r.must(204, "DELETE", "/v1/sandboxes/box", nil)
	r.must(204, "DELETE", "/v1/sandboxes/box", nil)
	if code, _, _ := r.do("DELETE", "/v1/sandboxes/Bad_Name", nil); code != 400 {
		t.Errorf("destroy with a bad name: %d, want 400", code)
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes/box/resume", nil); code != 404 {
		t.Errorf("resume after destroy: %d, want 404", code)
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes/Bad_Name/resume", nil); code != 400 {
		t.Errorf("resume with a bad name: %d, want 400", code)
	}
}

// Exec: frames, exit codes, stdin byte for byte, the working directory,
// the environment, and its refusals.
func TestExec(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", map[string]any{"baseUrls": map[string]string{"OPENAI_BASE_URL": "https://api.openai.com/v1/"}})
	res := r.exec("box", "echo out; echo err >&2; exit 5", nil)
	if res.stdout != "out\n" || res.stderr != "err\n" || res.exit != 5 || res.pid == "" {
		t.Errorf("exec: %+v", res)
	}
	// Stdin passes byte for byte, as the client's file writes use it.
	blob := make([]byte, 3<<20)
	for i := range blob {
		blob[i] = byte(i * 7)
	}
	if res := r.exec("box", `sh -c 'mkdir -p "$(dirname "$0")" && cat > "$0"' '/workspace/deep/blob.bin'`, blob); res.exit != 0 {
		t.Fatalf("write through stdin: %+v", res)
	}
	if res := r.exec("box", "cat /workspace/deep/blob.bin", nil); res.stdout != string(blob) {
		t.Errorf("read back: %d bytes, want %d identical", len(res.stdout), len(blob))
	}
	if res := r.exec("box", "pwd", nil, `{"command":"pwd","workingDirectory":"/nowhere"}`); res.exit != 2 || !strings.Contains(res.stderr, "/nowhere") {
		t.Errorf("missing working directory: %+v", res)
	}
	if res := r.exec("box", "", nil, `{"command":"pwd","workingDirectory":"/home/agent"}`); res.stdout != "/home/agent\n" {
		t.Errorf("working directory: %+v", res)
	}
	if res := r.exec("box", "kill -TERM $$", nil); res.exit != 143 {
		t.Errorf("a command ended by SIGTERM: exit %d, want 143", res.exit)
	}
	// The environment of protocol 1 §6.
	res = r.exec("box", "", nil, `{"command":"env","env":{"MINE":"1","ANTHROPIC_BASE_URL":"https://other.example.com/x/"}}`)
	for _, want := range []string{"LANG=C.UTF-8", "IS_SANDBOX=1", "NODE_USE_ENV_PROXY=1", "NO_PROXY=localhost,127.0.0.1", "pnpm_config_side_effects_cache=false",
		"HOME=/home/agent", "MINE=1", "/https/api.openai.com/v1\n", "ANTHROPIC_BASE_URL=http://127.0.0.1:", "/https/other.example.com/x\n"} {
		if !strings.Contains(res.stdout, want) {
			t.Errorf("env lacks %q:\n%s", want, res.stdout)
		}
	}
	// npm (where the image has it) warns of no setting it does not know:
	// it said "Unknown env config side-effects-cache" on every command.
	if res := r.exec("box", "command -v npm >/dev/null || exit 0; npm config get registry 2>&1", nil); res.exit != 0 || strings.Contains(res.stdout, "warn") {
		t.Errorf("npm in a sandbox: %+v", res)
	}
	// Refusals before anything starts.
	for _, tc := range []struct {
		body string
		code int
	}{
		{`{"command":"true"}`, 400},   // no newline
		{`not json` + "\n", 400},      // not JSON
		{`["x"]` + "\n", 400},         // not an object
		{`{"command":5}` + "\n", 400}, // wrong type
		{`{}` + "\n", 400},            // no command
		{`{"command":"true","env":{"BAD-NAME":"x"}}` + "\n", 400},
		{`{"command":"true","env":{"X":5}}` + "\n", 400},
		{strings.Repeat("x", api.MaxJSONBody+10), 413},
	} {
		if code, body, _ := r.do("POST", "/v1/sandboxes/box/exec", tc.body); code != tc.code {
			t.Errorf("exec %.40q: %d %s, want %d", tc.body, code, body, tc.code)
		}
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes/none/exec", "{\"command\":\"true\"}\n"); code != 404 {
		t.Errorf("exec in no sandbox: %d", code)
	}
}

// Processes: wait, kill one, kill all; and a stream that broke is resumed
// from the byte it reached, with nothing lost.
func TestProcesses(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	// A long command, its stream dropped after the first line.
	req, _ := http.NewRequest("POST", r.hs.URL+"/v1/sandboxes/box/exec",
		strings.NewReader(`{"command":"echo first; for i in 2 3 4; do sleep 0.1; echo line$i; done; exit 9"}`+"\n"))
	req.Header.Set(api.HeaderToken, r.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	pid := resp.Header.Get(api.HeaderProcessID)
	fr := api.NewFrameReader(resp.Body)
	var got int64
	for got == 0 {
		f, err := fr.Next()
		if err != nil {
			t.Fatal(err)
		}
		if f.Type == api.FrameData {
			got += int64(len(f.Payload))
		}
	}
	resp.Body.Close() // the stream breaks; the process runs on
	code, out, _ := r.do("GET", fmt.Sprintf("/v1/sandboxes/box/processes/%s/output?offset=%d", pid, got), nil)
	res := readFrames(t, strings.NewReader(out))
	if full := "first\nline2\nline3\nline4\n"; code != 200 || res.stdout != full[got:] || res.exit != 9 {
		t.Errorf("resumed output from %d: %d %+v", got, code, res)
	}
	if out := r.must(200, "GET", "/v1/sandboxes/box/processes/"+pid, nil); out != `{"exitCode":9}`+"\n" {
		t.Errorf("wait: %s", out)
	}
	// Still running when the wait runs out (2 s here): running true.
	long := r.startDetached("box", "sleep 300")
	if out := r.must(200, "GET", "/v1/sandboxes/box/processes/"+long, nil); out != `{"running":true}`+"\n" {
		t.Errorf("wait on a running process: %s", out)
	}
	r.must(204, "DELETE", "/v1/sandboxes/box/processes/"+long, nil)
	if out := r.must(200, "GET", "/v1/sandboxes/box/processes/"+long, nil); out != `{"exitCode":143}`+"\n" {
		t.Errorf("after kill: %s", out)
	}
	r.must(204, "DELETE", "/v1/sandboxes/box/processes/"+long, nil) // killing an exited one is fine
	if code, _, _ := r.do("DELETE", "/v1/sandboxes/box/processes/nope", nil); code != 404 {
		t.Errorf("kill of an unknown process: %d", code)
	}
	if code, _, _ := r.do("GET", "/v1/sandboxes/box/processes/nope", nil); code != 404 {
		t.Errorf("wait on an unknown process: %d", code)
	}
	other := r.startDetached("box", "sleep 301")
	r.must(204, "DELETE", "/v1/sandboxes/box/processes", nil)
	if out := r.must(200, "GET", "/v1/sandboxes/box/processes/"+other, nil); !strings.Contains(out, "exitCode") {
		t.Errorf("after kill-all: %s", out)
	}
	if code, _, _ := r.do("DELETE", "/v1/sandboxes/none/processes", nil); code != 404 {
		t.Errorf("kill-all in no sandbox: %d", code)
	}
	if code, _, _ := r.do("GET", "/v1/sandboxes/box/processes/"+pid+"/output?offset=-1", nil); code != 400 {
		t.Errorf("a negative offset: %d", code)
	}
}

// startDetached starts a command through exec and leaves its stream at
// once, returning its process id.
func (r *rig) startDetached(name, command string) string {
	r.t.Helper()
	req, _ := http.NewRequest("POST", r.hs.URL+"/v1/sandboxes/"+name+"/exec", strings.NewReader(`{"command":"`+command+`"}`+"\n"))
	req.Header.Set(api.HeaderToken, r.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		r.t.Fatal(err)
	}
	resp.Body.Close()
	return resp.Header.Get(api.HeaderProcessID)
}

// Credentials: the swap on the way out, the placeholder back when the
// upstream echoes the secret, the guard on commands, and routes opened by
// the transformations' hosts only.
func TestTransformations(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	ph := "aisdkhc_placeholder_0123456789"
	tf := func(secret string) map[string]any {
		return map[string]any{"transformations": []any{map[string]any{
			"match":     map[string]any{"host": "api.example.com", "headers": []any{map[string]any{"key": map[string]string{"exact": "x-api-key"}, "value": map[string]string{"exact": ph}}}},
			"transform": map[string]any{"headers": map[string]string{"x-api-key": secret}},
		}}}
	}
	r.must(204, "POST", "/v1/sandboxes/box/transformations", tf(r.canary))
	res := r.exec("box", `curl -sS -H "X-Api-Key: `+ph+`" "$ANTHROPIC_BASE_URL/v1/messages"`, nil)
	if res.exit != 0 || res.stdout != "path=/v1/messages auth= key="+ph {
		t.Errorf("route with the placeholder: %+v; want the upstream's echo of the secret scrubbed back to the placeholder", res)
	}
	seen := r.upstreamSeen()
	if len(seen) == 0 || seen[len(seen)-1].Get("X-Api-Key") != r.canary {
		t.Errorf("the upstream did not get the credential")
	}
	// The guard: the secret in a command or its variables is refused.
	if code, _, _ := r.do("POST", "/v1/sandboxes/box/exec", `{"command":"echo `+r.canary+`"}`+"\n"); code != 400 {
		t.Errorf("the secret in a command: %d, want 400", code)
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes/box/exec", `{"command":"true","env":{"K":"Bearer `+r.canary+`"}}`+"\n"); code != 400 {
		t.Errorf("the secret in a variable: %d, want 400", code)
	}
	// Validation (§7.1).
	for _, body := range []string{`{}`, `{"transformations":{}}`, `{"transformations":[{"transform":{"headers":{}}}]}`,
		`{"transformations":[{"match":{"host":5},"transform":{"headers":{}}}]}`,
		`{"transformations":[{"match":{"host":"a.example"},"transform":{"headers":{"x":1}}}]}`,
		`{"transformations":[{"match":{"host":"a.example","path":{"regex":"("}},"transform":{"headers":{"x":"y"}}}]}`} {
		if code, out, _ := r.do("PUT", "/v1/sandboxes/box/transformations", body); code != 400 {
			t.Errorf("transformations %s: %d %s, want 400", body, code, out)
		}
	}
	// PUT replaces: an empty list clears, and the route closes again; the
	// credential replaced stays one of the sandbox's (scrubbed, refused)
	// for its life.
	r.must(204, "PUT", "/v1/sandboxes/box/transformations", map[string]any{"transformations": []any{}})
	if code, _, _ := r.do("POST", "/v1/sandboxes/box/exec", `{"command":": `+r.canary+`"}`+"\n"); code != 400 {
		t.Errorf("the replaced credential in a command: %d, want 400", code)
	}
	if code, _, _ := r.do("PUT", "/v1/sandboxes/none/transformations", map[string]any{"transformations": []any{}}); code != 404 {
		t.Errorf("transformations of no sandbox: %d", code)
	}
}

// The network route: allowed hosts replaced (CONNECT follows), and the
// whole harness policy with CIDRs.
func TestNetwork(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", map[string]any{"baseUrls": map[string]string{}})
	r.must(204, "PUT", "/v1/sandboxes/box/files/etc/test-ca.pem", string(r.ca.PEM))
	connect := func() string {
		return r.exec("box", "curl -sS -o /dev/null -w '%{http_code}' --cacert /etc/test-ca.pem https://api.example.com/x 2>&1 || true", nil).stdout
	}
	if got := connect(); !strings.Contains(got, "403") && !strings.Contains(got, "CONNECT") {
		t.Errorf("CONNECT to a host not allowed: %q", got)
	}
	r.must(204, "PUT", "/v1/sandboxes/box/network", map[string]any{"allowedHosts": []string{"api.example.com"}})
	if got := connect(); got != "200" {
		t.Errorf("CONNECT after allowing the host: %q", got)
	}
	r.must(204, "PUT", "/v1/sandboxes/box/network", map[string]any{"policy": map[string]any{"mode": "deny-all"}})
	if got := connect(); got == "200" {
		t.Errorf("CONNECT under deny-all: %q", got)
	}
	if code, _, _ := r.do("PUT", "/v1/sandboxes/box/network", map[string]any{"policy": map[string]any{"mode": "custom", "allowedCIDRs": []string{"nonsense"}}}); code != 400 {
		t.Errorf("a bad policy: %d", code)
	}
	if code, _, _ := r.do("PUT", "/v1/sandboxes/box/network", map[string]any{"allowedHosts": []string{"bad host"}}); code != 400 {
		t.Errorf("a bad host: %d", code)
	}
	if code, _, _ := r.do("PUT", "/v1/sandboxes/none/network", map[string]any{}); code != 404 {
		t.Errorf("network of no sandbox: %d", code)
	}
	info := r.must(200, "GET", "/v1/sandboxes/box", nil)
	if !strings.Contains(info, `"state":"running"`) || !strings.Contains(info, `"mode":"deny-all"`) {
		t.Errorf("get: %s", info)
	}
}

// Templates: saved from a running sandbox, found, used, deleted.
func TestTemplateRoutes(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	r.exec("box", "echo tool > /workspace/tool", nil)
	for _, tc := range []struct {
		body any
		code int
	}{{map[string]any{}, 400}, {map[string]any{"id": 5}, 400}, {map[string]any{"id": "Bad!"}, 400}} {
		if code, _, _ := r.do("POST", "/v1/sandboxes/box/template", tc.body); code != tc.code {
			t.Errorf("template %v: %d", tc.body, code)
		}
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes/none/template", map[string]any{"id": "t1"}); code != 404 {
		t.Errorf("template of no sandbox: %d", code)
	}
	if out := r.must(200, "GET", "/v1/templates", nil); out != `{"templates":[]}`+"\n" {
		t.Errorf("no templates yet: %s", out)
	}
	r.must(204, "POST", "/v1/sandboxes/box/template", map[string]any{"id": "t1"})
	if out := r.must(200, "GET", "/v1/templates/t1", nil); out != `{"id":"t1"}`+"\n" {
		t.Errorf("exists: %s", out)
	}
	var list api.TemplateList
	if out := r.must(200, "GET", "/v1/templates", nil); json.Unmarshal([]byte(out), &list) != nil || len(list.Templates) != 1 ||
		list.Templates[0].ID != "t1" || list.Templates[0].LayerBytes <= 0 || list.Templates[0].Created.IsZero() {
		t.Errorf("list: %s", out)
	}
	r.create("other", map[string]any{"template": "t1"})
	if res := r.exec("other", "cat /workspace/tool", nil); res.stdout != "tool\n" {
		t.Errorf("from the template: %+v", res)
	}
	r.must(204, "DELETE", "/v1/templates/t1", nil)
	r.must(204, "DELETE", "/v1/templates/t1", nil)
	if out := r.must(200, "GET", "/v1/templates", nil); out != `{"templates":[]}`+"\n" {
		t.Errorf("after delete, list: %s", out)
	}
	if code, _, _ := r.do("GET", "/v1/templates/t1", nil); code != 404 {
		t.Errorf("after delete: %d", code)
	}
	if code, _, _ := r.do("GET", "/v1/templates/Bad!", nil); code != 400 {
		t.Errorf("bad template name: %d", code)
	}
}

// Files and the workspace, streamed both ways without the 32 MiB cap.
func TestFilesAndWorkspace(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	// No body cap of the service's own (Cloud Run's front end caps HTTP/1
	// requests at 32 MiB; h2c lifts it there): a body over 1 MiB, the
	// JSON cap, goes through.
	big := bytes.Repeat([]byte("0123456789abcdef"), 256<<10) // 4 MiB
	r.must(204, "PUT", "/v1/sandboxes/box/files/workspace/a/big.bin", big)
	if got := r.must(200, "GET", "/v1/sandboxes/box/files/workspace/a/big.bin", nil); got != string(big) {
		t.Errorf("read back %d bytes", len(got))
	}
	if code, _, _ := r.do("GET", "/v1/sandboxes/box/files/workspace/missing", nil); code != 404 {
		t.Errorf("missing file: %d", code)
	}
	if code, _, _ := r.do("GET", "/v1/sandboxes/box/files/workspace/a", nil); code != 400 {
		t.Errorf("a directory: %d", code)
	}
	req, _ := http.NewRequest("GET", r.hs.URL+"/v1/sandboxes/box/workspace", nil)
	req.Header.Set(api.HeaderToken, r.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var tarball bytes.Buffer
	tarball.ReadFrom(resp.Body)
	resp.Body.Close()
	if d := resp.Trailer.Get(api.HeaderLayerDigest); !strings.HasPrefix(d, "sha256:") || d != sha256Hex(tarball.Bytes()) {
		t.Errorf("workspace digest trailer %q does not match the tar", d)
	}
	r.create("other", nil)
	r.must(204, "PUT", "/v1/sandboxes/other/workspace", tarball.Bytes())
	if res := r.exec("other", "wc -c < /workspace/a/big.bin", nil); strings.TrimSpace(res.stdout) != fmt.Sprint(len(big)) {
		t.Errorf("workspace copied: %+v", res)
	}
}

// Fork through the API: the copy runs with the source's files.
func TestForkRoute(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	r.exec("box", "echo original > /workspace/f", nil)
	out := r.must(201, "POST", "/v1/sandboxes/box/fork", map[string]any{"name": "copy"})
	if !strings.Contains(out, `"state":"running"`) {
		t.Errorf("fork: %s", out)
	}
	if res := r.exec("copy", "cat /workspace/f", nil); res.stdout != "original\n" {
		t.Errorf("the copy: %+v", res)
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes/box/fork", map[string]any{"name": "copy"}); code != 409 {
		t.Errorf("fork onto a taken name: %d", code)
	}
	if code, _, _ := r.do("POST", "/v1/sandboxes/box/fork", map[string]any{}); code != 400 {
		t.Errorf("fork without a name: %d", code)
	}
}

// The audit route, kept and followed.
func TestAuditRoute(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	req, _ := http.NewRequest("GET", r.hs.URL+"/v1/sandboxes/box/audit?follow=1", nil)
	req.Header.Set(api.HeaderToken, r.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r.exec("box", "curl -sS https://denied.example.com/ -x $HTTPS_PROXY >/dev/null 2>&1 || true", nil)
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.Contains(line, `"host":"denied.example.com"`) || !strings.Contains(line, `"decision":"deny"`) {
		t.Errorf("followed event: %q %v", line, err)
	}
	out := r.must(200, "GET", "/v1/sandboxes/box/audit", nil)
	var got struct{ Events []json.RawMessage }
	if json.Unmarshal([]byte(out), &got) != nil || len(got.Events) == 0 {
		t.Errorf("kept events: %s", out)
	}
}

// The port tunnel: raw bytes to the sandbox's server, the caller's
// credentials stripped, the checks answered on the raw connection.
func TestPortTunnel(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	// A server in the sandbox that answers with the head it received.
	server := `import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 4000)); s.listen(4)
while True:
    c, _ = s.accept(); head = b""
    while b"\r\n\r\n" not in head: head += c.recv(4096)
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n" + head)
    rest = head.split(b"\r\n\r\n", 1)[1]
    while True:
        b = c.recv(4096)
        if not b: break
        c.sendall(b)
    c.close()`
	r.must(204, "PUT", "/v1/sandboxes/box/files/workspace/srv.py", server)
	r.startDetached("box", "python3 /workspace/srv.py")
	dial := func(target string, hdr string) (net.Conn, *bufio.Reader, string) {
		c, err := net.Dial("tcp", r.hs.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\nUpgrade: echo\r\nConnection: Upgrade\r\n%s\r\n", target, hdr)
		br := bufio.NewReader(c)
		status, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("tunnel %s: %v", target, err)
		}
		return c, br, status
	}
	auth := api.HeaderToken + ": " + r.token + "\r\n"
	var c net.Conn
	var br *bufio.Reader
	var status string
	for i := 0; ; i++ { // until the server in the sandbox listens
		c, br, status = dial("/v1/sandboxes/box/ports/4000/echo/path?q=1", auth+"Authorization: Bearer idtoken\r\nX-Forwarded-For: 1.2.3.4\r\nX-Custom: kept\r\n")
		if strings.HasPrefix(status, "HTTP/1.1 101") || i == 200 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.HasPrefix(status, "HTTP/1.1 101") {
		t.Fatalf("tunnel: %q", status)
	}
	var head strings.Builder
	for !strings.HasSuffix(head.String(), "\r\n\r\n") || strings.Count(head.String(), "\r\n\r\n") < 2 {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		head.WriteString(line)
	}
	got := head.String()
	for _, want := range []string{"GET /echo/path?q=1 HTTP/1.1\r\n", "Host: 127.0.0.1:4000\r\n", "X-Custom: kept\r\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("the sandbox got no %q:\n%s", want, got)
		}
	}
	for _, gone := range []string{"Authorization", "X-Forwarded-For", r.token} {
		if strings.Contains(got, gone) {
			t.Errorf("the sandbox got %q:\n%s", gone, got)
		}
	}
	c.Write([]byte("ping"))
	buf := make([]byte, 4)
	if _, err := ioReadFull(br, buf); err != nil || string(buf) != "ping" {
		t.Errorf("raw bytes through the tunnel: %q %v", buf, err)
	}
	// Refusals on the raw connection: token, path, port, sandbox.
	for _, tc := range []struct{ target, hdr, want string }{
		{"/v1/sandboxes/box/ports/4000/", "", "HTTP/1.1 401"},
		{"/v1/sandboxes/box/ports/4000/", auth + auth, "HTTP/1.1 400"}, // the token twice
		{"/v1/sandboxes/box/ports/0/", auth, "HTTP/1.1 404"},
		{"/v1/sandboxes/box/ports/70000/", auth, "HTTP/1.1 404"},
		{"/v1/sandboxes/none/ports/4000/", auth, "HTTP/1.1 404"},
		{"/v1/elsewhere", auth, "HTTP/1.1 404"},
	} {
		if _, _, status := dial(tc.target, tc.hdr); !strings.HasPrefix(status, tc.want) {
			t.Errorf("tunnel %s: %q, want %q", tc.target, status, tc.want)
		}
	}
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func ioReadFull(r io.Reader, b []byte) (int, error) { return io.ReadFull(r, b) }

// The TCP bridge: raw bytes to a port of the sandbox over a WebSocket.
func TestTCPBridge(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	r.must(204, "PUT", "/v1/sandboxes/box/files/workspace/echo.py", `import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 5000)); s.listen(1)
c, _ = s.accept()
while True:
    b = c.recv(4096)
    if not b: break
    c.sendall(b.upper())`)
	r.startDetached("box", "python3 /workspace/echo.py")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var ws *websocket.Conn
	for i := 0; ; i++ {
		c, resp, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(r.hs.URL, "http")+"/v1/sandboxes/box/tcp/5000",
			&websocket.DialOptions{HTTPHeader: http.Header{api.HeaderToken: {r.token}, api.HeaderProtocol: {"1"}}})
		if err == nil {
			ws = c
			break
		}
		if i == 1200 || (resp != nil && resp.StatusCode != http.StatusBadGateway) {
			t.Fatalf("bridge: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	conn := websocket.NetConn(ctx, ws, websocket.MessageBinary)
	defer conn.Close()
	conn.Write([]byte("hello bridge"))
	buf := make([]byte, 12)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "HELLO BRIDGE" {
		t.Errorf("through the bridge: %q %v", buf, err)
	}
	info := r.must(200, "GET", "/v1/sandboxes/box", nil)
	if !strings.Contains(info, `"ports":[5000]`) {
		t.Errorf("the open port is not in the description: %s", info)
	}
}

// When the server in the sandbox ends a connection, the bridge ends the
// WebSocket with a close frame, every time: the caller reads the stream's
// end, not a connection cut under it (coder/websocket's NetConn Close could
// cut it before the frame went out).
func TestTCPBridgeEndsWithCloseFrame(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	r.must(204, "PUT", "/v1/sandboxes/box/files/workspace/bye.py", `import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 5001)); s.listen(8)
while True:
    c, _ = s.accept()
    c.sendall(b"bye\n")
    c.close()`)
	r.startDetached("box", "python3 /workspace/bye.py")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dial := func() (*websocket.Conn, error) {
		for i := 0; ; i++ {
			c, resp, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(r.hs.URL, "http")+"/v1/sandboxes/box/tcp/5001",
				&websocket.DialOptions{HTTPHeader: http.Header{api.HeaderToken: {r.token}, api.HeaderProtocol: {"1"}}})
			if err == nil || i == 1200 || (resp != nil && resp.StatusCode != http.StatusBadGateway) {
				return c, err
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	for i := range 30 {
		ws, err := dial()
		if err != nil {
			t.Fatalf("bridge %d: %v", i, err)
		}
		conn := websocket.NetConn(ctx, ws, websocket.MessageBinary)
		got, err := io.ReadAll(conn)
		conn.Close()
		if err != nil || string(got) != "bye\n" {
			t.Fatalf("bridge %d: read %q, %v; want the message, then the end of the stream", i, got, err)
		}
	}
}

// A sandbox's own WebAssembly module runs on its routes, is listed in its
// description, and survives a suspend and resume.
func TestModulesRoute(t *testing.T) {
	rt, err := wasm.NewRuntime(context.Background(), wasm.Config{CacheDir: gobuild.WasmCache(t), CallTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rt.Close(context.Background()) })
	r := newRigOn(t, stacktest.Config{Modules: rt}, nil)
	r.create("box", nil)
	mod, err := os.ReadFile(gobuild.Wasm(t, "github.com/sandgate/sandgate/wasm-examples/deny-path"))
	if err != nil {
		t.Fatal(err)
	}
	body := map[string]any{"modules": []any{map[string]string{"name": "deny-path", "wasm": base64.StdEncoding.EncodeToString(mod), "config": "^/admin"}}}
	r.must(204, "PUT", "/v1/sandboxes/box/modules", body)
	curl := func(path string) string {
		return r.exec("box", `curl -sS -o /dev/null -w '%{http_code}' "$ANTHROPIC_BASE_URL`+path+`"`, nil).stdout
	}
	listed := func() []api.Module {
		var in api.Sandbox
		if err := json.Unmarshal([]byte(r.must(200, "GET", "/v1/sandboxes/box", nil)), &in); err != nil {
			t.Fatal(err)
		}
		return in.Modules
	}
	if got := curl("/admin/x"); got != "403" {
		t.Errorf("a path the module denies: %q", got)
	}
	if got := curl("/v1/ok"); got != "200" {
		t.Errorf("a path it lets through: %q", got)
	}
	if m := listed(); len(m) != 1 || m[0].Name != "deny-path" || !strings.HasPrefix(m[0].Digest, "sha256:") || m[0].Bytes != len(mod) {
		t.Errorf("the sandbox's description lists modules %+v; want deny-path", m)
	}
	// Suspended, the module is kept with the sandbox; resumed, it runs.
	r.must(204, "POST", "/v1/sandboxes/box/suspend", nil)
	if m := listed(); len(m) != 1 || m[0].Name != "deny-path" {
		t.Errorf("a suspended sandbox's modules: %+v", m)
	}
	r.must(200, "POST", "/v1/sandboxes/box/resume", map[string]any{})
	if got := curl("/admin/x"); got != "403" {
		t.Errorf("after suspend and resume, a path the module denies: %q", got)
	}
	bad := map[string]any{"modules": []any{map[string]string{"name": "x", "wasm": base64.StdEncoding.EncodeToString([]byte("not wasm"))}}}
	if code, _, _ := r.do("PUT", "/v1/sandboxes/box/modules", bad); code != 400 {
		t.Errorf("a module that does not load: %d", code)
	}
	r.must(204, "PUT", "/v1/sandboxes/box/modules", map[string]any{"modules": []any{}})
	if got := curl("/admin/x"); got != "200" {
		t.Errorf("after removing the module: %q", got)
	}
	if m := listed(); len(m) != 0 {
		t.Errorf("after removing the module, the description lists %+v", m)
	}
}

// TestExecStdinNotReadDoesNotBreakTheConnection: an exec whose command
// ended (or never started) before its stdin did left the request body
// unread, or being read by the stdin copier, when the handler returned;
// under full duplex Go's server then read the body after the handler and
// panicked ("invalid concurrent Body.Read call", golang/go#68560) on the
// connection's next request, which a client saw as a reset connection.
func TestExecStdinNotReadDoesNotBreakTheConnection(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	var serverLog syncbuf.Buffer
	hs := httptest.NewUnstartedServer(r.stack.Service.Handler())
	hs.Config.ErrorLog = log.New(&serverLog, "", 0)
	hs.Start()
	defer hs.Close()
	hc := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
	exec := func(line string, stdin io.Reader) string {
		t.Helper()
		body := io.MultiReader(strings.NewReader(line+"\n"), stdin) // chunked: stdin streamed
		req, _ := http.NewRequest("POST", hs.URL+"/v1/sandboxes/box/exec", body)
		req.Header.Set(api.HeaderToken, r.token)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("exec %s: %v", line, err)
		}
		defer resp.Body.Close()
		res := readFrames(t, resp.Body)
		return fmt.Sprintf("%d %s", res.exit, res.stdout+res.stderr)
	}
	for i := range 20 {
		// The working directory is missing: the command never starts and
		// its stdin is never read.
		if out := exec(`{"command":"cat","workingDirectory":"/nowhere"}`, strings.NewReader(strings.Repeat("x", i*100))); !strings.HasPrefix(out, "2 ") {
			t.Fatalf("missing directory: %q", out)
		}
	}
	// The command exits while its stdin is still arriving.
	pr, pw := io.Pipe()
	go pw.Write([]byte("some stdin"))
	if out := exec(`{"command":"echo quick"}`, pr); out != "0 quick\n" {
		t.Errorf("a command that does not read its stdin: %q", out)
	}
	pw.Write([]byte("stdin after the command ended"))
	pw.Close()
	// And one that reads it all, and the next one.
	if out := exec(`{"command":"cat"}`, strings.NewReader("read")); out != "0 read" {
		t.Errorf("cat: %q", out)
	}
	if out := exec(`{"command":"echo last"}`, strings.NewReader("")); out != "0 last\n" {
		t.Errorf("the last: %q", out)
	}
	if strings.Contains(serverLog.String(), "panic") {
		t.Errorf("the server panicked:\n%.2000s", serverLog.String())
	}
}

// TestLocalOnlyRefusesWebPagesAndRebinding checks the tokenless loopback
// service's two refusals, and that SANDGATE_LOCAL_HOSTNAMES names more
// hosts it answers for.
func TestLocalOnlyRefusesWebPagesAndRebinding(t *testing.T) {
	r := newRig(t, func(c *server.Config) { c.Token, c.LocalOnly, c.LocalHosts = "", true, []string{"Sandgate.Compose"} })
	ask := func(host string, hdr map[string]string) (int, string) {
		req, _ := http.NewRequest("GET", r.hs.URL+"/v1/sandboxes", nil)
		req.Host = host
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		b.ReadFrom(resp.Body)
		return resp.StatusCode, b.String()
	}
	for _, host := range []string{"localhost", "127.0.0.1", "[::1]:8080", "sandgate.compose:8080"} {
		if code, body := ask(host, nil); code != 200 {
			t.Errorf("Host %s: %d %s; want 200", host, code, body)
		}
	}
	if code, body := ask("rebound.example", nil); code != 403 || !strings.Contains(body, "SANDGATE_LOCAL_HOSTNAMES") {
		t.Errorf("a rebinding host: %d %s; want 403 naming SANDGATE_LOCAL_HOSTNAMES", code, body)
	}
	if code, body := ask("localhost", map[string]string{"Origin": "https://evil.example"}); code != 403 || !strings.Contains(body, "Origin") {
		t.Errorf("a web page's request: %d %s; want 403", code, body)
	}
}
