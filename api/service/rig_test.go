package service_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
	"github.com/sandgate/sandgate/internal/testkit/tlstest"
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
	stack  *stacktest.Stack
	hs     *httptest.Server
	m      *appliance.Manager
	ca     *tlstest.CA
	log    *syncbuf.Buffer
	token  string
	canary string
}

func newRig(t *testing.T, tweak func(*server.Config)) *rig {
	t.Helper()
	return newRigOn(t, stacktest.Config{}, tweak)
}

// newRigOn is newRig over a stack configured by sc (its Dir is the
// rig's).
func newRigOn(t *testing.T, sc stacktest.Config, tweak func(*server.Config)) *rig {
	t.Helper()
	if ok, why := stacktest.CanRun(); !ok {
		t.Skip(why)
	}
	sc.Dir = t.TempDir()
	token := "test-token-" + t.Name()
	sc.Server = server.Config{Token: token, EgressPort: 0, WaitTimeout: 2 * time.Second}
	if tweak != nil {
		tweak(&sc.Server)
	}
	st, err := stacktest.Start(sc)
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{t: t, stack: st, m: st.Manager, ca: st.CA, log: st.Log, token: sc.Server.Token}
	var b [12]byte
	rand.Read(b[:])
	r.canary = "sk-canary-" + hex.EncodeToString(b[:])
	r.hs = httptest.NewServer(st.Service.Handler())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		st.DestroyAll(ctx)
		r.hs.Close()
		st.Close()
		r.noCanary()
	})
	return r
}

// noCanary checks every artifact the service made: its log (the audit
// log among it, every event's line), the store's objects (audit segments
// decompressed) and the files of its state.
func (r *rig) noCanary() {
	t := r.t
	if strings.Contains(r.log.String(), r.canary) {
		t.Errorf("the canary secret is in the service's log or its audit log")
	}
	err := stacktest.StoreObjects(r.stack.StoreDir, func(name string, b []byte) {
		if bytes.Contains(b, []byte(r.canary)) {
			t.Errorf("the canary secret is in the store's %s", name)
		}
	})
	if err != nil {
		t.Errorf("reading the store: %v", err)
	}
	for _, dir := range []string{r.stack.StateDir, r.stack.WorkDir} {
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

// send sends a request with only the headers given (name, value pairs)
// and returns its status and body (none for a 101: the connection is then
// the server's, raw).
func (r *rig) send(method, path string, body io.Reader, hdr ...string) (int, string) {
	r.t.Helper()
	req, _ := http.NewRequest(method, r.hs.URL+path, body)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := (&http.Client{Timeout: 2 * time.Minute}).Do(req)
	if err != nil {
		r.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return resp.StatusCode, ""
	}
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out)
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
	out, err := api.ReadExec(rd)
	if err != nil {
		t.Fatalf("frames: %v", err)
	}
	res := execResult{pid: out.PID, stdout: string(out.Stdout), stderr: string(out.Stderr), exit: -1}
	if out.Exited {
		res.exit = out.ExitCode
	}
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
func (r *rig) upstreamSeen() []http.Header { return r.stack.UpstreamSeen() }
