package bridge_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"

	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/server"
)

// The contract is the OpenAPI document @cloudflare/sandbox 0.12.4's bridge
// serves (testdata/cloudflare-openapi.json, byte for byte; see
// testdata/README.md). Every request the tests below send to a bridge
// route is checked against it where it is a request the contract allows,
// and every answer against it where it documents the status, and always
// against the service's own document (which must document every status
// it sends). Every error answer is the contract's ErrorResponse.

func init() {
	openapi3filter.RegisterBodyDecoder("text/event-stream", openapi3filter.PlainBodyDecoder)
}

func loadDoc(t *testing.T, data []byte) *openapi3.T {
	t.Helper()
	doc, err := openapi3.NewLoader().LoadFromData(data)
	if err != nil {
		t.Fatalf("loading an OpenAPI document: %v", err)
	}
	if err := doc.Validate(context.Background()); err != nil {
		t.Fatalf("not a valid OpenAPI document: %v", err)
	}
	return doc
}

func contractDoc(t *testing.T) *openapi3.T {
	t.Helper()
	b, err := os.ReadFile("testdata/cloudflare-openapi.json")
	if err != nil {
		t.Fatal(err)
	}
	return loadDoc(t, b)
}

// mergedDoc is the document the service serves with a key configured.
func mergedDoc(t *testing.T) (*openapi3.T, []byte) {
	t.Helper()
	b, err := bridge.MergeOpenAPI(server.OpenAPI())
	if err != nil {
		t.Fatal(err)
	}
	return loadDoc(t, b), b
}

// validator sends requests and checks them and their answers against the
// contract and the service's document, noting which operations ran.
type validator struct {
	t              *testing.T
	c              *client
	contract, ours *openapi3.T
	seen           map[string]bool // "METHOD /spec/path"
}

// check is one request: its operation (method and documented path), the
// values of its path parameters, and what to send.
type check struct {
	method, spec string
	params       map[string]string // decoded values (file paths keep their slashes)
	query        string
	hdr          []string
	body         []byte
	noAuth       bool
	// off: the request breaks the contract on purpose (refusals); it is
	// not validated, its answer is.
	off  bool
	want int
}

var paramRe = regexp.MustCompile(`\{([a-z]+)\}`)

func (v *validator) call(ch check) (*http.Response, []byte) {
	v.t.Helper()
	path := paramRe.ReplaceAllStringFunc(ch.spec, func(m string) string { return ch.params[m[1:len(m)-1]] })
	if ch.query != "" {
		path += "?" + ch.query
	}
	c := *v.c
	if ch.noAuth {
		c.key = ""
	}
	hdr := ch.hdr
	if len(ch.body) > 0 && !slices.Contains(hdr, "Content-Type") {
		ct := "application/octet-stream"
		if json.Valid(ch.body) {
			ct = "application/json"
		}
		hdr = append([]string{"Content-Type", ct}, hdr...)
	}
	req := c.req(ch.method, path, bytes.NewReader(ch.body), hdr...)
	resp, body := c.do(req)
	what := ch.method + " " + path
	if ch.want != 0 && resp.StatusCode != ch.want {
		v.t.Errorf("%s: %d %.300s, want %d", what, resp.StatusCode, body, ch.want)
	}
	v.seen[ch.method+" "+ch.spec] = true
	for _, d := range []struct {
		name string
		doc  *openapi3.T
	}{{"the contract", v.contract}, {"the service's document", v.ours}} {
		item := d.doc.Paths.Value(ch.spec)
		if item == nil || item.GetOperation(ch.method) == nil {
			if d.doc == v.ours {
				v.t.Errorf("%s: the service's document has no %s %s", what, ch.method, ch.spec)
			}
			continue
		}
		route := &routers.Route{Spec: d.doc, Path: ch.spec, PathItem: item, Method: ch.method, Operation: item.GetOperation(ch.method)}
		vreq := httptest.NewRequest(ch.method, path, bytes.NewReader(ch.body))
		vreq.Header = req.Header.Clone()
		in := &openapi3filter.RequestValidationInput{Request: vreq, PathParams: ch.params, Route: route,
			Options: &openapi3filter.Options{AuthenticationFunc: authenticated}}
		if !ch.off && !ch.noAuth {
			if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil {
				v.t.Errorf("%s: the request does not conform to %s: %v", what, d.name, err)
			}
		}
		documented := route.Operation.Responses.Status(resp.StatusCode) != nil || route.Operation.Responses.Default() != nil
		if d.doc == v.contract && !documented {
			continue // checked below as an error, and against the service's document
		}
		out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode, Header: resp.Header,
			Options: &openapi3filter.Options{IncludeResponseStatus: true}}
		out.SetBodyBytes(body)
		if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
			v.t.Errorf("%s: the answer (%d %.200s) does not conform to %s: %v", what, resp.StatusCode, body, d.name, err)
		}
	}
	if resp.StatusCode >= 400 {
		v.errorShape(what, resp, body)
	}
	return resp, body
}

// authenticated is what the documents' security asks: the key as Bearer
// (or ?token= where the document allows it).
func authenticated(_ context.Context, in *openapi3filter.AuthenticationInput) error {
	r := in.RequestValidationInput.Request
	switch {
	case in.SecurityScheme.Type == "http" && strings.HasPrefix(r.Header.Get("Authorization"), "Bearer "):
		return nil
	case in.SecurityScheme.Type == "apiKey" && in.SecurityScheme.In == "query" && r.URL.Query().Get(in.SecurityScheme.Name) != "":
		return nil
	case in.SecurityScheme.Type == "apiKey" && in.SecurityScheme.In == "header" && r.Header.Get(in.SecurityScheme.Name) != "":
		return nil
	}
	return errNoCredential
}

var errNoCredential = &openapi3filter.SecurityRequirementsError{}

// contractCodes are the contract's error codes: its ErrorResponse enum, and
// payload_too_large, which its bridge sends (a file over its cap) and its
// enum omits.
func (v *validator) contractCodes() []string {
	codes := []string{"payload_too_large"}
	for _, c := range v.contract.Components.Schemas["ErrorResponse"].Value.Properties["code"].Value.Enum {
		codes = append(codes, c.(string))
	}
	return codes
}

// errorShape fails unless an error answer is the contract's.
func (v *validator) errorShape(what string, resp *http.Response, body []byte) {
	v.t.Helper()
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		v.t.Errorf("%s: error %d has Content-Type %q, want application/json", what, resp.StatusCode, ct)
	}
	var e map[string]any
	if err := json.Unmarshal(body, &e); err != nil {
		v.t.Errorf("%s: error %d is no JSON object: %.200s", what, resp.StatusCode, body)
		return
	}
	msg, _ := e["error"].(string)
	code, _ := e["code"].(string)
	if msg == "" || !slices.Contains(v.contractCodes(), code) || len(e) != 2 {
		v.t.Errorf("%s: error %d is not {\"error\", \"code\"} with a contract code: %s", what, resp.StatusCode, body)
	}
}

// TestDocuments: the service's one document is valid; the bridge's routes
// are exactly the paths tagged cloudflare-bridge; every operation of the
// contract is in it; those it adds are marked as sandgate's.
func TestDocuments(t *testing.T) {
	contract := contractDoc(t)
	ours, raw := mergedDoc(t)
	if ours.Info.Version != "1.0.0" || contract.Info.Version != "1.0.0" {
		t.Errorf("info.version: ours %q, the contract's %q; want 1.0.0", ours.Info.Version, contract.Info.Version)
	}
	if !strings.HasPrefix(ours.Info.Version, "1.") {
		t.Errorf("info.version %q: a bridge client reads major 1", ours.Info.Version)
	}
	b, err := bridge.New(bridge.Config{Backend: nopBackend{}, Key: testKey})
	if err != nil {
		t.Fatal(err)
	}
	served := map[string]bool{} // "METHOD /spec/path"
	for _, p := range b.Patterns() {
		m, path, ok := strings.Cut(p, " ")
		if !ok { // every method
			path, m = p, "*"
		}
		path = strings.ReplaceAll(path, "{path...}", "{path}")
		path = strings.ReplaceAll(path, "{rest...}", "{rest}")
		served[m+" "+path] = true
	}
	documented := map[string]bool{}
	for path, item := range ours.Paths.Map() {
		for m, op := range item.Operations() {
			if !slices.Contains(op.Tags, "cloudflare-bridge") {
				continue
			}
			key := m + " " + path
			if item.Extensions["x-sandgate-methods"] == "any" {
				key = "* " + path
			}
			documented[key] = true
			if contract.Paths.Value(path) == nil || contract.Paths.Value(path).GetOperation(m) == nil {
				if op.Extensions["x-sandgate-extension"] != true && item.Extensions["x-sandgate-methods"] != "any" {
					t.Errorf("%s %s is documented but in no contract: mark it x-sandgate-extension", m, path)
				}
			}
		}
	}
	for k := range served {
		if !documented[k] {
			t.Errorf("route %s is not in the document", k)
		}
	}
	for k := range documented {
		if !served[k] {
			t.Errorf("the document has %s, which the bridge does not route", k)
		}
	}
	for path, item := range contract.Paths.Map() {
		for m := range item.Operations() {
			if ours.Paths.Value(path) == nil || ours.Paths.Value(path).GetOperation(m) == nil {
				t.Errorf("the contract's %s %s is not in the service's document", m, path)
			}
		}
	}
	// The service serves that document, to the bridge's key and to the
	// service token alike.
	_, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	got := c.must(200, "GET", "/v1/openapi.json", nil)
	if !bytes.Equal(got, raw) {
		t.Error("GET /v1/openapi.json with the key is not the merged document")
	}
	c.key = ""
	if got := c.must(200, "GET", "/v1/openapi.json?token="+testKey, nil); !bytes.Equal(got, raw) {
		t.Error("GET /v1/openapi.json?token= is not the merged document")
	}
	if got := c.must(200, "GET", "/v1/openapi.json", nil, "X-Ai-Sdk-Sandbox-Token", serviceToken); !bytes.Equal(got, raw) {
		t.Error("GET /v1/openapi.json with the service token is not the merged document")
	}
	c.must(401, "GET", "/v1/openapi.json", nil)
	c.must(401, "GET", "/v1/openapi.json?token=wrong-key-0123456789", nil)
	c.must(401, "GET", "/v1/openapi.json", nil, "Authorization", "Bearer wrong-key-0123456789")
}

// nopBackend is no backend: TestDocuments only lists routes.
type nopBackend struct{ bridge.Backend }

// TestConformance drives every route of the bridge once or more, valid
// and refused requests, and checks them all.
func TestConformance(t *testing.T) {
	_, base := stack(t)
	v := &validator{t: t, c: &client{t: t, base: base, key: testKey}, contract: contractDoc(t), seen: map[string]bool{}}
	v.ours, _ = mergedDoc(t)
	c := v.c

	// Auth: refused without the key, with a wrong one, sent twice; any
	// letter case of the scheme.
	v.call(check{method: "POST", spec: "/v1/sandbox", noAuth: true, want: 401})
	v.call(check{method: "POST", spec: "/v1/sandbox", off: true, hdr: []string{"Authorization", "Bearer not-the-key-at-all"}, want: 401})
	v.call(check{method: "GET", spec: "/v1/pool/stats", off: true, hdr: []string{"Authorization", "bearer " + testKey}, want: 200})
	v.call(check{method: "GET", spec: "/v1/pool/stats", off: true, hdr: []string{"Authorization", "Basic " + testKey}, want: 401})
	{
		req := c.req("GET", "/v1/pool/stats", nil)
		req.Header.Add("Authorization", "Bearer "+testKey)
		if resp, body := c.do(req); resp.StatusCode != 401 {
			t.Errorf("Authorization sent twice: %d %s, want 401", resp.StatusCode, body)
		}
	}
	for _, p := range []string{"/v1/sandbox/abc/running", "/v1/sandbox/ABC/running", "/v1/pool/stats", "/v1/sandbox/abc/exec"} {
		resp, body := (&client{t: t, base: base}).do((&client{t: t, base: base}).req("GET", p, nil))
		if resp.StatusCode != 401 {
			t.Errorf("GET %s without the key: %d %s, want 401", p, resp.StatusCode, body)
		}
	}

	// Create: a fresh id of the contract's form, running at once.
	_, body := v.call(check{method: "POST", spec: "/v1/sandbox", want: 200})
	var created struct{ ID string }
	json.Unmarshal(body, &created)
	id := created.ID
	if !regexp.MustCompile(`^[a-z2-7]{26}$`).MatchString(id) {
		t.Fatalf("created id %q", id)
	}
	P := map[string]string{"id": id}
	with := func(kv ...string) map[string]string {
		m := map[string]string{"id": id}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	_, body = v.call(check{method: "GET", spec: "/v1/sandbox/{id}/running", params: P, want: 200})
	if string(body) != `{"running":true}` {
		t.Errorf("running: %s", body)
	}
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/running", params: map[string]string{"id": "ABC"}, off: true, want: 400})
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/running", params: map[string]string{"id": strings.Repeat("a", 64)}, off: true, want: 400})

	// Exec: SSE, base64 output, one terminal event, the exit code.
	execBody := func(x any) []byte { b, _ := json.Marshal(x); return b }
	resp, body := v.call(check{method: "POST", spec: "/v1/sandbox/{id}/exec", params: P, want: 200,
		body: execBody(map[string]any{"argv": []string{"sh", "-c", "printf 'out\\n'; printf 'err\\n' >&2; printf '\\377\\000bin'; exit 3"}, "timeout_ms": 20000})})
	if resp.Header.Get("Cache-Control") != "no-cache" || resp.Header.Get(bridge.HeaderProcessID) == "" {
		t.Errorf("exec headers: %v", resp.Header)
	}
	res := parseExec(t, body)
	if res.stdout != "out\n\xff\x00bin" || res.stderr != "err\n" || res.exit != 3 {
		t.Errorf("exec: %+v", res)
	}
	// Numbers in argv are words; cwd inside /workspace; a missing cwd
	// fails as a shell would; a timeout is 124.
	res = c.exec(id, map[string]any{"argv": []any{"echo", 42, "a b", "it's", ""}, "cwd": "."})
	if res.stdout != "42 a b it's \n" || res.exit != 0 {
		t.Errorf("argv words: %+v", res)
	}
	res = c.exec(id, map[string]any{"argv": []string{"pwd"}, "cwd": "/workspace/../workspace/"})
	if res.stdout != "/workspace\n" {
		t.Errorf("cwd: %+v", res)
	}
	res = c.exec(id, map[string]any{"argv": []string{"pwd"}, "cwd": "no/such/dir"})
	if res.exit != 2 || !strings.Contains(res.stderr, "/workspace/no/such/dir") {
		t.Errorf("missing cwd: %+v", res)
	}
	res = c.exec(id, map[string]any{"argv": []string{"sleep", "30"}, "timeout_ms": 300})
	if res.exit != 124 || !strings.Contains(res.stderr, "timed out after 300ms") {
		t.Errorf("timeout: %+v", res)
	}
	for _, tc := range []struct {
		body string
		hdr  []string
		want int
	}{
		{`not json`, nil, 400},
		{`[]`, nil, 400},
		{`{}`, nil, 400},
		{`{"argv":[]}`, nil, 400},
		{`{"argv":"ls"}`, nil, 400},
		{`{"argv":[{"x":1}]}`, nil, 400},
		{`{"argv":["a\u0000b"]}`, nil, 400},
		{`{"argv":["pwd"],"cwd":"/tmp"}`, nil, 403},
		{`{"argv":["pwd"],"cwd":"../etc"}`, nil, 403},
		{`{"argv":["pwd"]}`, []string{"Session-Id", "a/b"}, 400},
		{`{"argv":["pwd"]}`, []string{"Session-Id", ".."}, 400},
	} {
		v.call(check{method: "POST", spec: "/v1/sandbox/{id}/exec", params: P, body: []byte(tc.body), hdr: tc.hdr, off: true, want: tc.want})
	}

	// The output again, from an offset.
	_, body = v.call(check{method: "GET", spec: "/v1/sandbox/{id}/exec/{pid}", params: with("pid", res.pid), query: "offset=6", want: 200})
	if again := parseExec(t, body); again.exit != 124 {
		t.Errorf("the output again: %+v", again)
	}
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/exec/{pid}", params: with("pid", "no-such-process"), want: 404})
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/exec/{pid}", params: with("pid", res.pid), query: "offset=999999", off: true, want: 400})

	// Sessions: cwd and env; a duplicate or a bad one is session_error.
	c.must(200, "PUT", "/v1/sandbox/"+id+"/file/workspace/sub/.keep", nil)
	_, body = v.call(check{method: "POST", spec: "/v1/sandbox/{id}/session", params: P, want: 200,
		body: []byte(`{"id":"s1","cwd":"sub","env":{"FOO":"bar baz"}}`)})
	if string(body) != `{"id":"s1"}` {
		t.Errorf("session: %s", body)
	}
	res = c.exec(id, map[string]any{"argv": []string{"sh", "-c", `pwd; echo "$FOO"`}}, "Session-Id", "s1")
	if res.stdout != "/workspace/sub\nbar baz\n" {
		t.Errorf("exec in a session: %+v", res)
	}
	res = c.exec(id, map[string]any{"argv": []string{"sh", "-c", `pwd; echo "${FOO-unset}"`}}, "Session-Id", "not-made-yet")
	if res.stdout != "/workspace\nunset\n" {
		t.Errorf("exec in a session not created: %+v", res)
	}
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/session", params: P, body: []byte(`{"id":"s1"}`), want: 502})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/session", params: P, body: []byte(`{"id":"s2","cwd":"/etc"}`), off: true, want: 502})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/session", params: P, body: []byte(`{"id":"s3","env":{"1BAD":"x"}}`), off: true, want: 502})
	_, body = v.call(check{method: "POST", spec: "/v1/sandbox/{id}/session", params: P, body: []byte(`not json`), off: true, want: 200})
	if !strings.Contains(string(body), `"session-`) {
		t.Errorf("a session with a default id: %s", body)
	}
	v.call(check{method: "DELETE", spec: "/v1/sandbox/{id}/session/{sid}", params: with("sid", "s1"), want: 200})
	v.call(check{method: "DELETE", spec: "/v1/sandbox/{id}/session/{sid}", params: with("sid", "s1"), want: 502})

	// Files: bytes in and out, 404, 403, 400, the size limit, a directory.
	data := make([]byte, 200<<10)
	rand.Read(data)
	v.call(check{method: "PUT", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace/dir/b.bin"), body: data,
		hdr: []string{"Content-Type", "application/octet-stream"}, want: 200})
	_, body = v.call(check{method: "GET", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace/dir/b.bin"), want: 200})
	if !bytes.Equal(body, data) {
		t.Errorf("read back %d bytes, wrote %d", len(body), len(data))
	}
	_, body = v.call(check{method: "GET", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace/missing.txt"), want: 404})
	if !strings.Contains(string(body), `"workspace_read_not_found"`) {
		t.Errorf("missing: %s", body)
	}
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "etc/passwd"), want: 403})
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace/%2e%2e/etc/passwd"), off: true, want: 403})
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace"), want: 502})
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", ""), off: true, want: 400})
	v.call(check{method: "PUT", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace/dir"), body: []byte("x"), want: 502})
	v.call(check{method: "PUT", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "tmp/x"), body: []byte("x"), want: 403})
	v.call(check{method: "PUT", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace/big"), body: make([]byte, testMaxBody+1), want: 413})
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/file/{path}", params: with("path", "workspace/big"), want: 404})

	// Hydrate: merged into /workspace; empty, hostile or too large is 400.
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/hydrate", params: P, want: 200, hdr: []string{"Content-Type", "application/octet-stream"},
		body: tarOf(t, "./", "", "a.txt", "alpha\n", "d/", "", "d/c.txt", "gamma\n", "link", "->a.txt", "out", "->/etc/passwd")})
	if got := c.must(200, "GET", "/v1/sandbox/"+id+"/file/workspace/d/c.txt", nil); string(got) != "gamma\n" {
		t.Errorf("hydrated file: %q", got)
	}
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/hydrate", params: P, off: true, want: 400})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/hydrate", params: P, off: true, want: 400, body: tarOf(t, "../escape.txt", "x")})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/hydrate", params: P, off: true, want: 400, body: tarOf(t, "big", string(make([]byte, testMaxBody)))})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/hydrate", params: P, off: true, want: 400, body: []byte("not a tar at all, not compressed either")})

	// Persist: ./ names, excludes, links as links, no device.
	_, body = v.call(check{method: "POST", spec: "/v1/sandbox/{id}/persist", params: P, query: "excludes=dir,./sub", want: 200})
	ents, order := readTar(t, body)
	if len(order) == 0 || order[0] != "./" {
		t.Errorf("persisted tar starts %v, want ./", order)
	}
	for _, want := range []string{"./a.txt", "./d/", "./d/c.txt", "./link", "./out"} {
		if _, ok := ents[want]; !ok {
			t.Errorf("persisted tar lacks %s: %v", want, order)
		}
	}
	for _, gone := range []string{"./dir/", "./dir/b.bin", "./sub/", "./sub/.keep"} {
		if _, ok := ents[gone]; ok {
			t.Errorf("persisted tar has %s, which excludes name", gone)
		}
	}
	if e := ents["./out"]; e.typ != '2' || e.link != "/etc/passwd" || e.content != "" {
		t.Errorf("a link out of /workspace: %+v, want the link, never the bytes", e)
	}
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/persist", params: P, query: "excludes=a,../etc", want: 400})

	// Tunnels: the port must answer; the route carries HTTP to it.
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/tunnel/{port}", params: with("port", "8080"), want: 502})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/tunnel/{port}", params: with("port", "80"), off: true, want: 400})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/tunnel/{port}", params: with("port", "8080"), body: []byte(`{"name":"Not A Label"}`), off: true, want: 400})
	startEchoServer(t, c, id, 8080)
	_, body = v.call(check{method: "POST", spec: "/v1/sandbox/{id}/tunnel/{port}", params: with("port", "8080"), body: []byte(`{"name":"app"}`), want: 200})
	var tun bridge.Tunnel
	json.Unmarshal(body, &tun)
	if tun.Port != 8080 || tun.Name != "app" || !strings.HasSuffix(tun.URL, "/v1/sandbox/"+id+"/tunnel/8080/") {
		t.Errorf("tunnel: %s", body)
	}
	_, body = v.call(check{method: "GET", spec: "/v1/sandbox/{id}/tunnel/{port}/{rest}", params: with("port", "8080", "rest", "some/path"), query: "q=1",
		hdr: []string{"X-Custom", "kept", "X-Serverless-Authorization", "Bearer idtoken", "X-Ai-Sdk-Sandbox-Token", "svc"}, want: 200})
	got := string(body)
	for _, want := range []string{"GET /some/path?q=1", "X-Custom: kept", "Host: 127.0.0.1:8080"} {
		if !strings.Contains(got, want) {
			t.Errorf("the server in the sandbox got no %q:\n%s", want, got)
		}
	}
	for _, gone := range []string{testKey, "Authorization", "idtoken", "svc"} {
		if strings.Contains(got, gone) {
			t.Errorf("the server in the sandbox got %q:\n%s", gone, got)
		}
	}
	v.call(check{method: "DELETE", spec: "/v1/sandbox/{id}/tunnel/{port}", params: with("port", "8080"), want: 204})
	upgradeThroughTunnel(t, c, id)

	// Not supported: mount, unmount. The PTY without a WebSocket handshake
	// (the terminal itself: pty_test.go).
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/mount", params: P, want: 502,
		body: []byte(`{"bucket":"b","mountPath":"/mnt/data","options":{"endpoint":"https://example.com"}}`)})
	v.call(check{method: "POST", spec: "/v1/sandbox/{id}/unmount", params: P, want: 502, body: []byte(`{"mountPath":"/mnt/data"}`)})
	v.call(check{method: "GET", spec: "/v1/sandbox/{id}/pty", params: P, want: 400})

	// The pool.
	_, body = v.call(check{method: "GET", spec: "/v1/pool/stats", want: 200})
	var ps bridge.PoolStats
	json.Unmarshal(body, &ps)
	if ps.Assigned < 1 || ps.Total != ps.Assigned || ps.Warm != 0 || ps.MaxInstances == nil {
		t.Errorf("pool stats: %s", body)
	}
	v.call(check{method: "POST", spec: "/v1/pool/prime", want: 200})
	v.call(check{method: "POST", spec: "/v1/pool/shutdown-prewarmed", want: 200})
	v.call(check{method: "GET", spec: "/v1/openapi.json", want: 200})

	// No route, and another method: the contract's error shape.
	for _, p := range []string{"/v1/sandbox/" + id + "/nope", "/v1/pool/nope"} {
		resp, body := c.do(c.req("GET", p, nil))
		if resp.StatusCode != 404 {
			t.Errorf("GET %s: %d", p, resp.StatusCode)
		}
		v.errorShape("GET "+p, resp, body)
	}
	resp, body = c.do(c.req("PUT", "/v1/sandbox/"+id+"/exec", nil))
	if resp.StatusCode != 405 || resp.Header.Get("Allow") == "" {
		t.Errorf("PUT exec: %d %v", resp.StatusCode, resp.Header)
	}
	v.errorShape("PUT exec", resp, body)

	// Destroy: 204, and again 204; an id used without create is created.
	v.call(check{method: "DELETE", spec: "/v1/sandbox/{id}", params: P, want: 204})
	v.call(check{method: "DELETE", spec: "/v1/sandbox/{id}", params: P, want: 204})
	_, body = v.call(check{method: "GET", spec: "/v1/sandbox/{id}/running", params: P, want: 200})
	if string(body) != `{"running":false}` {
		t.Errorf("running after destroy: %s", body)
	}
	res = c.exec("mychosenid", map[string]any{"argv": []string{"true"}})
	if res.exit != 0 {
		t.Errorf("exec on an id never created: %+v", res)
	}
	v.call(check{method: "DELETE", spec: "/v1/sandbox/{id}", params: map[string]string{"id": "mychosenid"}, want: 204})

	// Every operation of the service's document ran.
	for path, item := range v.ours.Paths.Map() {
		for m, op := range item.Operations() {
			if !slices.Contains(op.Tags, "cloudflare-bridge") || (item.Extensions["x-sandgate-methods"] == "any" && m != "GET") {
				continue
			}
			if !v.seen[m+" "+path] {
				t.Errorf("%s %s was not exercised", m, path)
			}
		}
	}
}

// startEchoServer runs, in the sandbox, an HTTP server on port that
// answers every request with its request line and headers.
func startEchoServer(t *testing.T, c *client, id string, port int) {
	t.Helper()
	srv := `import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.requestline + "\n" + str(self.headers)).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", PORT), H).serve_forever()
`
	srv = strings.Replace(srv, "PORT", strconv.Itoa(port), 1)
	c.must(200, "PUT", "/v1/sandbox/"+id+"/file/workspace/srv.py", []byte(srv))
	// Detached: the stream is closed at once, the server goes on.
	req := c.req("POST", "/v1/sandbox/"+id+"/exec", strings.NewReader(`{"argv":["python3","/workspace/srv.py"]}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	waitFor(t, "the server in the sandbox", func() bool {
		resp, _ := c.do(c.req("GET", "/v1/sandbox/"+id+"/tunnel/"+strconv.Itoa(port)+"/", nil))
		return resp.StatusCode == 200
	})
}

// upgradeThroughTunnel: an Upgrade request through the tunnel route gets
// the sandbox's server's 101, and then raw bytes flow both ways.
func upgradeThroughTunnel(t *testing.T, c *client, id string) {
	t.Helper()
	srv := `import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 8081)); s.listen(4)
while True:
    c, _ = s.accept(); head = b""
    while b"\r\n\r\n" not in head: head += c.recv(4096)
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
    while True:
        b = c.recv(4096)
        if not b: break
        c.sendall(b)
    c.close()
`
	c.must(200, "PUT", "/v1/sandbox/"+id+"/file/workspace/up.py", []byte(srv))
	resp, err := http.DefaultClient.Do(c.req("POST", "/v1/sandbox/"+id+"/exec", strings.NewReader(`{"argv":["python3","/workspace/up.py"]}`)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	u, _ := url.Parse(c.base)
	var conn net.Conn
	var br *bufio.Reader
	waitFor(t, "the upgrade server in the sandbox", func() bool {
		if conn != nil {
			conn.Close()
		}
		if conn, err = net.Dial("tcp", u.Host); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "GET /v1/sandbox/%s/tunnel/8081/ws HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n", id, c.key)
		br = bufio.NewReader(conn)
		status, _ := br.ReadString('\n')
		return strings.HasPrefix(status, "HTTP/1.1 101")
	})
	defer conn.Close()
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if line == "\r\n" {
			break
		}
	}
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	conn.Write([]byte("ping"))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(br, buf); err != nil || string(buf) != "ping" {
		t.Errorf("bytes through the upgraded tunnel: %q %v", buf, err)
	}
}
