package bridge_test

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
)

// testKey is the stack's SANDBOX_API_KEY, serviceToken its protocol 1
// token.
const (
	testKey      = "bridge-test-key-5f0c2a9e7d"
	serviceToken = "service-token-for-bridge-tests"
	testMaxBody  = 1 << 20
)

// shared is one real stack for the package's tests: `sandgate sandbox`,
// the egress proxy, the manager and the whole service (protocol 1 and the
// bridge) behind an httptest server.
var shared struct {
	once  sync.Once
	err   error
	stack *stacktest.Stack
	hs    *httptest.Server
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.stack != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		shared.stack.DestroyAll(ctx)
		cancel()
		shared.hs.Close()
		shared.stack.Close()
	}
	gobuild.Cleanup()
	os.Exit(code)
}

// stack starts (once) and returns the shared stack, or skips where
// sandboxes cannot run.
func stack(t *testing.T) (*stacktest.Stack, string) {
	t.Helper()
	if ok, why := stacktest.CanRun(); !ok {
		t.Skip(why)
	}
	shared.once.Do(func() {
		shared.stack, shared.err = stacktest.Start(stacktest.Config{
			// A terminal's client that comes back finds it, however
			// loaded the machine.
			Manager: func(mc *appliance.ManagerConfig) { mc.TerminalGrace = 10 * time.Minute },
			Server:  server.Config{Token: serviceToken},
			Bridge: bridge.Config{Key: testKey, MaxBody: testMaxBody,
				Network: appliance.NetworkSpec{AllowedHosts: []string{"bridge-allowed.example.com"}}},
		})
		if shared.err == nil {
			shared.hs = httptest.NewServer(shared.stack.Service.Handler())
		}
	})
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	return shared.stack, shared.hs.URL
}

// client is a bridge client as the contract's clients are: Bearer key,
// JSON bodies, SSE for exec.
type client struct {
	t    *testing.T
	base string
	key  string
}

func (c *client) req(method, path string, body io.Reader, hdr ...string) *http.Request {
	c.t.Helper()
	req, err := http.NewRequest(method, c.base+path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	if c.key != "" {
		req.Header.Set("Authorization", "Bearer "+c.key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return req
}

// do sends a request and reads the whole answer.
func (c *client) do(req *http.Request) (*http.Response, []byte) {
	c.t.Helper()
	hc := &http.Client{Timeout: 2 * time.Minute, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := hc.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", req.Method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatalf("%s %s: reading the answer: %v", req.Method, req.URL.Path, err)
	}
	return resp, b
}

// must sends a request and fails unless its status is want.
func (c *client) must(want int, method, path string, body []byte, hdr ...string) []byte {
	c.t.Helper()
	resp, b := c.do(c.req(method, path, bytes.NewReader(body), hdr...))
	if resp.StatusCode != want {
		c.t.Fatalf("%s %s: %d %s, want %d", method, path, resp.StatusCode, b, want)
	}
	return b
}

// create is POST /v1/sandbox.
func (c *client) create() string {
	c.t.Helper()
	var out struct{ ID string }
	if err := json.Unmarshal(c.must(200, "POST", "/v1/sandbox", nil), &out); err != nil || out.ID == "" {
		c.t.Fatalf("create: %v %+v", err, out)
	}
	return out.ID
}

// event is one server-sent event.
type event struct{ name, data string }

// readSSE parses an event stream strictly as the contract frames it:
// "event: NAME\n", "data: LINE\n" (one or more), a blank line; comment
// lines (":") are allowed between events. Anything else fails.
func readSSE(t *testing.T, body []byte) []event {
	t.Helper()
	var out []event
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	var cur *event
	for sc.Scan() {
		line := sc.Text()
		switch {
		case cur == nil && line == "":
		case cur == nil && strings.HasPrefix(line, ":"):
		case cur == nil && strings.HasPrefix(line, "event: "):
			cur = &event{name: strings.TrimPrefix(line, "event: ")}
		case cur != nil && strings.HasPrefix(line, "data: "):
			if cur.data != "" {
				cur.data += "\n"
			}
			cur.data += strings.TrimPrefix(line, "data: ")
		case cur != nil && line == "":
			out = append(out, *cur)
			cur = nil
		default:
			t.Fatalf("SSE: line %q is not the contract's framing:\n%s", line, body)
		}
	}
	if cur != nil {
		t.Fatalf("SSE: the stream ends inside event %q", cur.name)
	}
	return out
}

// execResult is what an exec stream carried.
type execResult struct {
	stdout, stderr string
	exit           int // -1: no exit event
	errEvent       *bridge.ErrorBody
	pid            string
}

// parseExec checks an exec stream: stdout and stderr events of base64,
// then exactly one terminal event, last.
func parseExec(t *testing.T, body []byte) execResult {
	t.Helper()
	res := execResult{exit: -1}
	events := readSSE(t, body)
	for i, e := range events {
		switch e.name {
		case "stdout", "stderr":
			b, err := base64.StdEncoding.DecodeString(e.data)
			if err != nil {
				t.Fatalf("event %d (%s): data is not base64: %q", i, e.name, e.data)
			}
			if e.name == "stdout" {
				res.stdout += string(b)
			} else {
				res.stderr += string(b)
			}
		case "exit":
			var x struct {
				ExitCode *int `json:"exit_code"`
			}
			if err := json.Unmarshal([]byte(e.data), &x); err != nil || x.ExitCode == nil {
				t.Fatalf("exit event %q", e.data)
			}
			res.exit = *x.ExitCode
		case "error":
			var eb bridge.ErrorBody
			if err := json.Unmarshal([]byte(e.data), &eb); err != nil || eb.Error == "" || eb.Code == "" {
				t.Fatalf("error event %q", e.data)
			}
			res.errEvent = &eb
		default:
			t.Fatalf("event %q: not one of the contract's", e.name)
		}
		if (e.name == "exit" || e.name == "error") != (i == len(events)-1) {
			t.Fatalf("event %d of %d is %q: exactly one terminal event, last", i+1, len(events), e.name)
		}
	}
	if len(events) == 0 {
		t.Fatal("SSE: no events")
	}
	return res
}

// exec runs argv and parses its stream.
func (c *client) exec(id string, body any, hdr ...string) execResult {
	c.t.Helper()
	b, _ := json.Marshal(body)
	resp, out := c.do(c.req("POST", "/v1/sandbox/"+id+"/exec", bytes.NewReader(b), hdr...))
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		c.t.Fatalf("exec %s: %d %s %s", b, resp.StatusCode, resp.Header.Get("Content-Type"), out)
	}
	res := parseExec(c.t, out)
	res.pid = resp.Header.Get(bridge.HeaderProcessID)
	return res
}

// tarOf builds a tar of name → content ("->target" for a symbolic link,
// a trailing / for a directory).
func tarOf(t *testing.T, files ...string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := 0; i+1 < len(files); i += 2 {
		name, content := files[i], files[i+1]
		hdr := &tar.Header{Name: name, Mode: 0o644, Size: int64(len(content)), Typeflag: tar.TypeReg, ModTime: time.Unix(1700000000, 0)}
		switch {
		case strings.HasSuffix(name, "/"):
			hdr.Typeflag, hdr.Mode, hdr.Size = tar.TypeDir, 0o755, 0
		case strings.HasPrefix(content, "->"):
			hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeSymlink, strings.TrimPrefix(content, "->"), 0
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if hdr.Typeflag == tar.TypeReg {
			tw.Write([]byte(content))
		}
	}
	tw.Close()
	return buf.Bytes()
}

// tarEntry is one entry of a tar, read back.
type tarEntry struct {
	typ      byte
	link     string
	content  string
	mode     int64
	hasXattr bool
}

// readTar reads a tar into its entries by name.
func readTar(t *testing.T, b []byte) (map[string]tarEntry, []string) {
	t.Helper()
	out := map[string]tarEntry{}
	var order []string
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("reading the tar: %v", err)
		}
		data, _ := io.ReadAll(tr)
		out[hdr.Name] = tarEntry{typ: hdr.Typeflag, link: hdr.Linkname, content: string(data), mode: hdr.Mode, hasXattr: len(hdr.PAXRecords) > 0 && hasXattr(hdr.PAXRecords)}
		order = append(order, hdr.Name)
	}
	return out, order
}

func hasXattr(pax map[string]string) bool {
	for k := range pax {
		if strings.HasPrefix(k, "SCHILY.xattr.") {
			return true
		}
	}
	return false
}

// waitFor polls f (bounded: 200 tries, 50 ms apart) until it is true.
func waitFor(t *testing.T, what string, f func() bool) {
	t.Helper()
	for i := 0; i < 200; i++ {
		if f() {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("waited 10 s for %s", what)
}
