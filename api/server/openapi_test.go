package server

import (
	"context"
	"encoding/json"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/audit"
)

// The OpenAPI document (openapi.json, served at /v1/openapi.json) is
// checked three ways: it is a valid OpenAPI 3.1 document; it names exactly
// the routes the server registers, no more and no fewer; and its schemas
// accept what the handlers write (the wire types, every field set) and
// what the service answers before any route runs.
//
// How a ServeMux pattern and a documented operation correspond:
//
//   - "METHOD /a/{x}/b" is the operation METHOD of path "/a/{x}/b": a
//     ServeMux wildcard {x} (one non-empty segment) is the OpenAPI path
//     parameter {x}.
//   - A ServeMux rest-of-path wildcard {x...} (slashes included) is the
//     OpenAPI path parameter {x}; OpenAPI has no multi-segment parameter,
//     so its description says that slashes are part of it.
//   - A GET pattern also serves HEAD (ServeMux does that): HEAD is not
//     documented apart.
//   - The port tunnel is no pattern: ServeHTTP sends every request that
//     carries Upgrade to it before routing. The document describes it as
//     paths whose path item carries "x-sandgate-dispatch": "upgrade"; the
//     test checks that such a path has no route and that the tunnel's
//     target parser accepts it instead.

// loadDoc parses and validates the embedded document.
func loadDoc(t *testing.T) *openapi3.T {
	t.Helper()
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(openAPIDoc)
	if err != nil {
		t.Fatalf("openapi.json does not load: %v", err)
	}
	if err := doc.Validate(context.Background(), openapi3.EnableExamplesValidation()); err != nil {
		t.Fatalf("openapi.json is not a valid OpenAPI document: %v", err)
	}
	if !doc.IsOpenAPI31OrLater() {
		t.Fatalf("openapi.json says openapi %q, want 3.1", doc.OpenAPI)
	}
	return doc
}

// testServer builds a Server with no manager: routes are registered and
// the checks before routing run, but no handler that needs a sandbox may
// be called. Close it with the returned func.
func testServer(t *testing.T, token string) *Server {
	t.Helper()
	s, err := New(Config{Backend: newFakeBackend(), Token: token, Version: "test", Metrics: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func TestOpenAPIValid(t *testing.T) {
	doc := loadDoc(t)
	if doc.Info.Version != "1" {
		t.Errorf("info.version %q, want the protocol version 1", doc.Info.Version)
	}
}

// wildcard is a ServeMux wildcard: {name} or {name...}.
var wildcard = regexp.MustCompile(`\{([A-Za-z_][A-Za-z0-9_]*)(\.\.\.)?\}`)

// operationOf maps a ServeMux pattern to the operation that documents it:
// its method and its OpenAPI path.
func operationOf(t *testing.T, pattern string) (method, path string) {
	t.Helper()
	method, path, ok := strings.Cut(pattern, " ")
	if !ok || method == "" || !strings.HasPrefix(path, "/") || strings.Contains(path, "{$}") {
		t.Fatalf("pattern %q: the test maps only \"METHOD /path\" patterns with {x} and {x...} wildcards", pattern)
	}
	return method, wildcard.ReplaceAllString(path, "{$1}")
}

// sample fills an OpenAPI path's parameters with values a request could
// carry, returning the concrete path and what each parameter became.
func sample(path string) (string, map[string]string) {
	values := map[string]string{"name": "box-1", "pid": "0b7c7c4e-3e5f-4d3a-9c1e-6f1d2a3b4c5d", "id": "tpl-1",
		"port": "4000", "path": "workspace/src/main.go", "subpath": "socket/io"}
	used := map[string]string{}
	out := wildcard.ReplaceAllStringFunc(path, func(m string) string {
		name := wildcard.FindStringSubmatch(m)[1]
		v, ok := values[name]
		if !ok {
			v = "x"
		}
		used[name] = v
		return v
	})
	return out, used
}

type operation struct{ method, path string }

// upgradeOnly reports whether a documented path is reached only by an
// Upgrade request (the port tunnel), not by routing.
func upgradeOnly(item *openapi3.PathItem) bool {
	return item.Extensions["x-sandgate-dispatch"] == "upgrade"
}

// TestOpenAPIMatchesRoutes fails on any difference, either way, between
// the routes the server registers and the operations the document has.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	doc := loadDoc(t)
	s := testServer(t, "")

	registered := map[operation]string{} // → pattern
	for _, p := range s.Patterns() {
		m, path := operationOf(t, p)
		op := operation{m, path}
		if prev, dup := registered[op]; dup {
			t.Errorf("patterns %q and %q are one operation %s %s", prev, p, m, path)
		}
		registered[op] = p
	}
	documented := map[operation]bool{}
	var tunnels []operation
	for path, item := range doc.Paths.Map() {
		for m := range item.Operations() {
			op := operation{m, path}
			if upgradeOnly(item) {
				tunnels = append(tunnels, op)
				continue
			}
			documented[op] = true
		}
	}
	for _, op := range slices.SortedFunc(maps.Keys(registered), cmpOp) {
		if !documented[op] {
			t.Errorf("route %q is not in openapi.json: document %s %s", registered[op], op.method, op.path)
		}
	}
	for _, op := range slices.SortedFunc(maps.Keys(documented), cmpOp) {
		if _, ok := registered[op]; !ok {
			t.Errorf("openapi.json documents %s %s, which the server does not route", op.method, op.path)
		}
	}

	// Each documented operation, sent as a request, reaches its own route
	// (and not another that shadows it).
	for op := range documented {
		pattern, ok := registered[op]
		if !ok {
			continue
		}
		path, _ := sample(op.path)
		r := httptest.NewRequest(op.method, path, nil)
		if _, got := s.mux.Handler(r); got != pattern {
			t.Errorf("%s %s reaches route %q, want %q", op.method, path, got, pattern)
		}
		wsRoute := strings.HasPrefix(op.path, "/v1/sandboxes/{name}/tcp/") || op.path == "/v1/sandboxes/{name}/pty"
		if wsRoute != isWebSocketRoute(path) {
			t.Errorf("%s %s: isWebSocketRoute says %v", op.method, path, isWebSocketRoute(path))
		}
	}

	// The tunnel's paths: no route, and the tunnel's own parser takes them.
	if len(tunnels) == 0 {
		t.Error("openapi.json does not document the port tunnel (a path item with x-sandgate-dispatch: upgrade)")
	}
	for _, op := range tunnels {
		path, used := sample(op.path)
		target := path + "?q=1"
		for _, m := range []string{http.MethodGet, http.MethodPost} {
			if _, pattern := s.mux.Handler(httptest.NewRequest(m, target, nil)); pattern != "" {
				t.Errorf("tunnel path %s is also route %q: an Upgrade request would never reach it", op.path, pattern)
			}
		}
		if isWebSocketRoute(path) {
			t.Errorf("tunnel path %s is taken for one of sandgate's WebSocket routes", op.path)
		}
		name, port, sub, query, ok := parseTunnelTarget(target)
		wantSub := ""
		if used["subpath"] != "" {
			wantSub = "/" + used["subpath"]
		}
		if !ok || name != used["name"] || port != 4000 || sub != wantSub || query != "?q=1" {
			t.Errorf("parseTunnelTarget(%q) = %q %d %q %q %v: the documented tunnel path is not the tunnel's", target, name, port, sub, query, ok)
		}
	}
}

func cmpOp(a, b operation) int {
	if c := strings.Compare(a.path, b.path); c != 0 {
		return c
	}
	return strings.Compare(a.method, b.method)
}

// TestOpenAPIResponses checks what every operation must say: the
// protocol header on every reply, 401 wherever the token check applies,
// and 400/413 wherever a JSON body is read.
func TestOpenAPIResponses(t *testing.T) {
	doc := loadDoc(t)
	for path, item := range doc.Paths.Map() {
		for m, op := range item.Operations() {
			where := m + " " + path
			if op.OperationID == "" || op.Summary == "" {
				t.Errorf("%s: no operationId or summary", where)
			}
			if op.Responses == nil || op.Responses.Len() == 0 {
				t.Errorf("%s: no responses", where)
				continue
			}
			for code, ref := range op.Responses.Map() {
				resp := ref.Value
				if resp == nil {
					t.Errorf("%s %s: unresolved response", where, code)
					continue
				}
				// The tunnel's answers are raw: the server in the sandbox's,
				// or a bare status line without the protocol header.
				if upgradeOnly(item) {
					if resp.Headers["x-ai-sdk-sandbox-protocol"] != nil {
						t.Errorf("%s %s: a raw tunnel reply documents the protocol header", where, code)
					}
					continue
				}
				if resp.Headers["x-ai-sdk-sandbox-protocol"] == nil {
					t.Errorf("%s %s: does not document the x-ai-sdk-sandbox-protocol header every reply carries", where, code)
				}
				if code >= "400" && code != "426" {
					mt := resp.Content.Get("application/json")
					if mt == nil || mt.Schema == nil || mt.Schema.Ref != "#/components/schemas/Error" {
						t.Errorf("%s %s: an error reply's body must be the Error schema", where, code)
					}
				}
			}
			if path != "/health" && op.Responses.Value("401") == nil {
				t.Errorf("%s: the token check applies, but 401 is not documented", where)
			}
			if path == "/health" && (op.Security == nil || len(*op.Security) != 0) {
				t.Errorf("%s: /health skips the token check: want security: []", where)
			}
			if rb := op.RequestBody; rb != nil && rb.Value.Content.Get("application/json") != nil {
				for _, code := range []string{"400", "413"} {
					if op.Responses.Value(code) == nil {
						t.Errorf("%s reads a JSON body but does not document %s", where, code)
					}
				}
			}
		}
	}
}

// schemaCheck validates a Go value, as JSON, against a component schema.
func schemaCheck(t *testing.T, doc *openapi3.T, name string, v any) {
	t.Helper()
	ref := doc.Components.Schemas[name]
	if ref == nil || ref.Value == nil {
		t.Fatalf("no schema %q in openapi.json", name)
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var data any
	if err := json.Unmarshal(b, &data); err != nil {
		t.Fatal(err)
	}
	if err := ref.Value.VisitJSON(data, openapi3.EnableJSONSchema2020(), openapi3.EnableFormatValidation()); err != nil {
		t.Errorf("schema %s refuses %s: %v", name, b, err)
	}
}

// allSet fails unless every field of struct v is set: a sample with a
// field left zero would let a field the schema does not know slip by (the
// schemas refuse unknown properties).
func allSet(t *testing.T, v any) {
	t.Helper()
	rv := reflect.ValueOf(v)
	for i := range rv.NumField() {
		if rv.Field(i).IsZero() {
			t.Errorf("the %T sample leaves %s zero: set it, and document it if the schema lacks it", v, rv.Type().Field(i).Name)
		}
	}
}

// TestOpenAPISchemasMatchWire validates what the handlers write against
// the document's schemas, every field set.
func TestOpenAPISchemasMatchWire(t *testing.T) {
	doc := loadDoc(t)
	now := time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)
	policy, err := netpolicy.ParsePolicy([]byte(`{"mode":"custom","allowedHosts":["api.example.com","*.pypi.org"],"allowedCIDRs":["140.82.112.0/20"],"deniedCIDRs":["140.82.121.4/32"],"intercept":["api.example.com"]}`))
	if err != nil {
		t.Fatal(err)
	}
	schemaCheck(t, doc, "Policy", policy)
	schemaCheck(t, doc, "Policy", netpolicy.Policy{Mode: netpolicy.AllowAll})

	health := api.Health{Status: "ok", Protocol: api.ProtocolVersion, Version: "v1.2.3", OK: true}
	allSet(t, health)
	schemaCheck(t, doc, "Health", health)
	desc := api.Description{Name: "box", Home: "/home/agent", WorkingDirectory: "/workspace",
		Network: &api.KeptNetwork{Kept: true, Policy: policy, BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.anthropic.com"}}}
	allSet(t, desc)
	schemaCheck(t, doc, "Description", desc)
	schemaCheck(t, doc, "Error", api.Error{Error: "no"})
	code := 0
	schemaCheck(t, doc, "ProcessState", api.ProcessState{ExitCode: &code})
	schemaCheck(t, doc, "ProcessState", api.ProcessState{Running: true})
	req := api.ExecRequest{Command: "true", WorkingDirectory: "/workspace", Env: map[string]string{"A": "1"}}
	allSet(t, req)
	schemaCheck(t, doc, "ExecRequest", req)

	// A sandbox as the server describes it, from the manager's Info.
	s := &Server{cfg: Config{}.withDefaults()}
	info := appliance.Info{ID: "box", State: appliance.Running, Created: now, LastActive: now.Add(time.Minute), LayerBytes: 4096,
		Template: "tpl", Policy: &policy, BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.anthropic.com"},
		Modules:   []appliance.ModuleInfo{{Name: "deny-path", Digest: "sha256:" + strings.Repeat("ab", 32), Bytes: 4096}},
		OpenPorts: []int{4000}, Shard: "shard-0", SuspendedBy: appliance.SuspendedIdle,
		Limits: appliance.Limits{CPU: 1, CPUWeight: 100, Memory: 1 << 30, Pids: 100, Disk: 1 << 30, Lifetime: time.Hour, KeepSuspended: time.Hour},
		Usage:  &appliance.Usage{CPUSeconds: 1.5, MemoryBytes: 64 << 20, MemoryPeakBytes: 128 << 20, DiskBytes: 8192, DiskQuotaBytes: 1 << 30, Processes: 12}}
	allSet(t, info)
	allSet(t, *info.Usage)
	sb := s.sandboxInfo(info)
	allSet(t, sb)
	allSet(t, *sb.Usage)
	schemaCheck(t, doc, "Sandbox", sb)
	bare := s.sandboxInfo(appliance.Info{ID: "gone", State: appliance.Suspended, Created: now})
	schemaCheck(t, doc, "Sandbox", bare)
	schemaCheck(t, doc, "SandboxList", api.SandboxList{Sandboxes: []api.Sandbox{sb, bare}})
	schemaCheck(t, doc, "SandboxList", api.SandboxList{Sandboxes: []api.Sandbox{}})
	tpl := api.Template{ID: "ai-sdk-harness-template-0123456789abcdef01234567", Created: now, LayerBytes: 4096}
	allSet(t, tpl)
	schemaCheck(t, doc, "Template", tpl)
	schemaCheck(t, doc, "TemplateList", api.TemplateList{Templates: []api.Template{tpl}})
	schemaCheck(t, doc, "TemplateList", api.TemplateList{Templates: []api.Template{}})
	for _, st := range []appliance.State{appliance.Starting, appliance.Running, appliance.Suspending, appliance.Suspended} {
		schemaCheck(t, doc, "Sandbox", s.sandboxInfo(appliance.Info{ID: "b", State: st, Created: now}))
	}

	ev := audit.Event{Time: now, Sandbox: "box", Kind: audit.Route, Host: "api.example.com", Port: 443, PID: 42, Cmd: "npm install", Method: "POST", Path: "/v1/messages",
		Allow: true, Code: "allowed_host", Reason: "api.example.com matched allowed host rule api.example.com", Rule: "api.example.com",
		Addr: "203.0.113.7:443", Status: 200, BytesIn: 10, BytesOut: 20, Duration: time.Millisecond, DNSTime: time.Microsecond,
		Transforms: []string{"0"}, Module: "deny-path", Notes: []string{"deny-path: ok"}, NotesDropped: 1, Error: "upstream reset",
		InterceptRule: "api.example.com"}
	allSet(t, ev)
	schemaCheck(t, doc, "AuditEvent", ev)
	for _, k := range []audit.Kind{audit.Connect, audit.Route, audit.Refused, audit.Capture, audit.Intercept, audit.DNS} {
		schemaCheck(t, doc, "AuditEvent", audit.Event{Time: now, Sandbox: "box", Kind: k, Code: "no_rule", Reason: "no rule"})
	}
	schemaCheck(t, doc, "AuditEvents", map[string]any{"events": []audit.Event{ev}, "cursor": "20250601T120000.000000000Z-0a1b2c3d/0", "more": true})

	prog := api.Progress{Step: appliance.StepSave, Bytes: 1 << 20, Total: 4 << 20}
	allSet(t, prog)
	schemaCheck(t, doc, "ProgressLine", api.ProgressLine{Progress: &prog})
	schemaCheck(t, doc, "ProgressLine", api.ProgressLine{Progress: &api.Progress{Step: appliance.StepFetch}})
	schemaCheck(t, doc, "ProgressLine", api.ProgressLine{Status: 200, Result: desc})
	schemaCheck(t, doc, "ProgressLine", api.ProgressLine{Status: 404, Error: "no sandbox"})
	code137 := 137
	end := ptyEnd{ExitCode: &code137, Error: "the command was killed", Status: 400}
	allSet(t, end)
	schemaCheck(t, doc, "TerminalEnd", end)
}

// TestOpenAPIServedReplies checks the replies the service writes before
// any handler runs (/health, the token check, 404, 405, a refused tunnel)
// against the document, and that /v1/openapi.json serves the document.
func TestOpenAPIServedReplies(t *testing.T) {
	doc := loadDoc(t)
	srv := httptest.NewServer(testServer(t, "the-token"))
	defer srv.Close()
	do := func(method, path, token string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequest(method, srv.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set(api.HeaderProtocol, "1")
		if token != "" {
			req.Header.Set(api.HeaderToken, token)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		if resp.Header.Get(api.HeaderProtocol) != "1" {
			t.Errorf("%s %s: no %s: 1 header", method, path, api.HeaderProtocol)
		}
		return resp, body
	}
	check := func(what string, resp *http.Response, body []byte, status int, schema string) {
		t.Helper()
		if resp.StatusCode != status {
			t.Errorf("%s: status %d, want %d (%s)", what, resp.StatusCode, status, body)
			return
		}
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s: content type %q", what, ct)
		}
		var v any
		if err := json.Unmarshal(body, &v); err != nil {
			t.Errorf("%s: %v: %s", what, err, body)
			return
		}
		schemaCheck(t, doc, schema, v)
	}

	resp, body := do(http.MethodGet, "/health", "")
	check("GET /health", resp, body, http.StatusOK, "Health")
	resp, body = do(http.MethodGet, "/v1/sandboxes", "")
	check("no token", resp, body, http.StatusUnauthorized, "Error")
	resp, body = do(http.MethodGet, "/v1/nothing-here", "the-token")
	check("no route", resp, body, http.StatusNotFound, "Error")
	resp, body = do(http.MethodPatch, "/v1/sandboxes", "the-token")
	check("wrong method", resp, body, http.StatusMethodNotAllowed, "Error")
	if allow := resp.Header.Get("Allow"); !strings.Contains(allow, "GET") || !strings.Contains(allow, "POST") {
		t.Errorf("405 Allow %q, want GET and POST", allow)
	}
	resp, body = do(http.MethodGet, "/v1/openapi.json", "the-token")
	if resp.StatusCode != http.StatusOK || string(body) != string(openAPIDoc) || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("GET /v1/openapi.json: %d %q, not the document", resp.StatusCode, resp.Header.Get("Content-Type"))
	}

	// A tunnel refused for its token: the bare status line the document
	// describes (RawRefusal). An Upgrade to /health is a tunnel request
	// like any other, without /health's exemption.
	for _, target := range []string{"/v1/sandboxes/box/ports/4000/ws", "/health"} {
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(time.Minute))
		io.WriteString(conn, "GET "+target+" HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		raw, err := io.ReadAll(conn) // the service closes the connection
		conn.Close()
		if err != nil {
			t.Fatal(err)
		}
		if want := "HTTP/1.1 401 Unauthorized\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"; string(raw) != want {
			t.Errorf("tunnel to %s without the token: got %q, want the bare %q", target, raw, want)
		}
	}
	refusal := doc.Components.Responses["RawRefusal"]
	if refusal == nil || refusal.Value.Headers["Connection"] == nil || refusal.Value.Headers["Content-Length"] == nil {
		t.Error("openapi.json has no RawRefusal response with Connection and Content-Length")
	}
}
