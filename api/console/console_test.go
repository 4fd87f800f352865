package console

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/relay/audit"
)

const token = "console-test-token-0123456789"

// rig is a console over a fake backend, served on loopback.
type rig struct {
	t   *testing.T
	f   *fake
	c   *Console
	hs  *httptest.Server
	now time.Time
}

func newRig(t *testing.T, tweak func(*Config)) *rig {
	t.Helper()
	r := &rig{t: t, f: newFake(), now: at}
	cfg := Config{Backend: r.f, Token: token, Version: "test", Now: func() time.Time { return r.now }}
	if tweak != nil {
		tweak(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.c = c
	r.hs = httptest.NewServer(c)
	t.Cleanup(r.hs.Close)
	return r
}

// req is one request: its headers, and a form for a POST.
type req struct {
	method, path string
	form         url.Values
	header       map[string]string
	cookie       string
}

// do sends q without following redirects, and returns the answer and its
// body.
func (r *rig) do(q req) (*http.Response, string) {
	r.t.Helper()
	if q.method == "" {
		q.method = "GET"
	}
	var body io.Reader
	if q.form != nil {
		body = strings.NewReader(q.form.Encode())
	}
	hr, err := http.NewRequest(q.method, r.hs.URL+q.path, body)
	if err != nil {
		r.t.Fatal(err)
	}
	if q.form != nil {
		hr.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range q.header {
		hr.Header.Set(k, v)
	}
	if q.cookie != "" {
		hr.Header.Set("Cookie", cookieName+"="+q.cookie)
	}
	resp, err := (&http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Do(hr)
	if err != nil {
		r.t.Fatalf("%s %s: %v", q.method, q.path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// signIn signs in with the token and returns the session cookie's value.
func (r *rig) signIn() string {
	r.t.Helper()
	resp, body := r.do(req{method: "POST", path: "/ui/signin", form: url.Values{"token": {token}, "next": {"/ui"}}})
	if resp.StatusCode != http.StatusSeeOther {
		r.t.Fatalf("signing in: %d %s", resp.StatusCode, body)
	}
	for _, c := range resp.Cookies() {
		if c.Name == cookieName {
			return c.Value
		}
	}
	r.t.Fatalf("signing in set no cookie: %v", resp.Header)
	return ""
}

// csrfOf reads the CSRF token from a page's form.
func csrfOf(t *testing.T, page string) string {
	t.Helper()
	_, rest, ok := strings.Cut(page, `name="csrf" value="`)
	if !ok {
		t.Fatalf("no CSRF token on the page:\n%s", page)
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

func running(id string) appliance.Info {
	return appliance.Info{ID: id, State: appliance.Running, Created: at.Add(-time.Hour), LastActive: at.Add(-2 * time.Minute),
		Limits: appliance.Limits{Memory: 2 << 30, Pids: 4096}}
}

// Every answer carries the console's headers; every answer with data is
// not cached.
func TestConsoleHeaders(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(running("box"))
	ck := r.signIn()
	for _, path := range []string{"/ui", "/ui/sandboxes/box", "/ui/egress.json", "/ui/egress?sandbox=box", "/ui/signin", "/ui/static/console.css", "/ui/sandboxes/nothere", "/ui/nothing"} {
		resp, _ := r.do(req{path: path, cookie: ck})
		h := resp.Header
		for k, want := range map[string]string{"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"} {
			if h.Get(k) != want {
				t.Errorf("GET %s: %s %q, want %q", path, k, h.Get(k), want)
			}
		}
		csp := h.Get("Content-Security-Policy")
		for _, want := range []string{"default-src 'self'", "script-src 'self'", "frame-ancestors 'none'", "object-src 'none'"} {
			if !strings.Contains(csp, want) {
				t.Errorf("GET %s: Content-Security-Policy %q lacks %q", path, csp, want)
			}
		}
		if strings.Contains(csp, "unsafe-inline") || strings.Contains(csp, "unsafe-eval") {
			t.Errorf("GET %s: Content-Security-Policy %q allows inline script or eval", path, csp)
		}
		if !strings.HasPrefix(path, "/ui/static/") && h.Get("Cache-Control") != "no-store" {
			t.Errorf("GET %s: Cache-Control %q, want no-store", path, h.Get("Cache-Control"))
		}
	}
}

// With a token, nothing of the console answers without it or a session
// it signed, but the sign-in and its stylesheet: not a page, a stream, a
// chart's data, a script, an action.
func TestConsoleNeedsAuth(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(running("box"))
	r.f.record("box", audit.Event{Time: at, Kind: audit.Connect, Code: "no_rule", Reason: "no rule", Host: "x.example.com", Port: 443})
	paths := []string{"/ui", "/ui/", "/ui/sandboxes/box", "/ui/sandboxes/box/events", "/ui/egress.json", "/ui/egress", "/ui/static/console.js", "/ui/static/uplot/uPlot.iife.min.js", "/ui/static/uplot/LICENSE", "/ui/nothing"}
	for _, path := range paths {
		for name, q := range map[string]req{
			"nothing":         {path: path},
			"a wrong token":   {path: path, header: map[string]string{api.HeaderToken: "wrong"}},
			"two tokens":      {path: path, header: map[string]string{api.HeaderToken: token + "," + token}},
			"a forged cookie": {path: path, cookie: "v1.9999999999.abc." + strings.Repeat("0", 64)},
			"a browser":       {path: path, header: map[string]string{"Sec-Fetch-Mode": "navigate", "Accept": "text/html"}},
		} {
			resp, body := r.do(q)
			switch {
			case resp.StatusCode == http.StatusUnauthorized:
			case resp.StatusCode == http.StatusSeeOther && strings.HasPrefix(resp.Header.Get("Location"), "/ui/signin?next="):
			default:
				t.Errorf("GET %s with %s: %d, want 401 or the sign-in", path, name, resp.StatusCode)
			}
			if strings.Contains(body, "x.example.com") || strings.Contains(body, "box") && strings.Contains(body, "running") {
				t.Errorf("GET %s with %s tells of the sandbox: %s", path, name, body)
			}
		}
		resp, _ := r.do(req{path: path, header: map[string]string{api.HeaderToken: token}})
		if want := http.StatusOK; path != "/ui/nothing" && resp.StatusCode != want && !strings.HasSuffix(path, "/events") {
			t.Errorf("GET %s with the token: %d, want %d", path, resp.StatusCode, want)
		}
	}
	for _, action := range []string{"suspend", "resume", "destroy"} {
		resp, _ := r.do(req{method: "POST", path: "/ui/sandboxes/box/" + action, form: url.Values{"confirm": {"yes"}}})
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("POST %s without auth: %d, want 401", action, resp.StatusCode)
		}
	}
	if c := r.f.called(); len(c) > 0 {
		t.Errorf("the backend was asked %q without auth", c)
	}
	for _, path := range []string{"/ui/signin", "/ui/static/console.css"} {
		if resp, _ := r.do(req{path: path}); resp.StatusCode != http.StatusOK {
			t.Errorf("GET %s without auth: %d, want 200", path, resp.StatusCode)
		}
	}
	// The sign-in goes back where the browser was going: a console path
	// only.
	resp, _ := r.do(req{path: "/ui/sandboxes/box?decision=deny", header: map[string]string{"Sec-Fetch-Mode": "navigate"}})
	if loc := resp.Header.Get("Location"); loc != "/ui/signin?next="+url.QueryEscape("/ui/sandboxes/box?decision=deny") {
		t.Errorf("the redirect to the sign-in: %q", loc)
	}
	for next, want := range map[string]string{
		"/ui/sandboxes/box": "/ui/sandboxes/box", "https://evil.example/ui": "/ui", "//evil.example/ui": "/ui",
		"/v1/sandboxes": "/ui", "/ui/../v1": "/ui", `/\evil.example`: "/ui", "/uix": "/ui", "": "/ui",
	} {
		resp, _ := r.do(req{method: "POST", path: "/ui/signin", form: url.Values{"token": {token}, "next": {next}}})
		if loc := resp.Header.Get("Location"); loc != want {
			t.Errorf("signed in with next %q: to %q, want %q", next, loc, want)
		}
	}
}

// The session cookie: HttpOnly, SameSite=Strict, Path=/ui, Secure over
// TLS; never the token; refused when forged, altered, expired, signed out,
// or made under another token.
func TestConsoleSessionCookie(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(running("box"))
	resp, body := r.do(req{method: "POST", path: "/ui/signin", form: url.Values{"token": {"wrong"}}})
	if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(body, "not the service token") || len(resp.Cookies()) > 0 {
		t.Errorf("a wrong token: %d %v\n%s", resp.StatusCode, resp.Cookies(), body)
	}
	for _, proto := range []string{"", "https"} {
		resp, _ := r.do(req{method: "POST", path: "/ui/signin", form: url.Values{"token": {token}}, header: map[string]string{"X-Forwarded-Proto": proto}})
		var ck *http.Cookie
		for _, c := range resp.Cookies() {
			if c.Name == cookieName {
				ck = c
			}
		}
		if ck == nil {
			t.Fatalf("no session cookie: %v", resp.Header)
		}
		if !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != "/ui" || ck.Secure != (proto == "https") {
			t.Errorf("the session cookie (X-Forwarded-Proto %q): %s", proto, resp.Header.Get("Set-Cookie"))
		}
		if strings.Contains(ck.Value, token) || strings.Contains(ck.Value, url.QueryEscape(token)) {
			t.Errorf("the session cookie holds the token: %s", ck.Value)
		}
	}
	ck := r.signIn()
	ok := func(value string) bool {
		resp, _ := r.do(req{path: "/ui/sandboxes/box", cookie: value})
		return resp.StatusCode == http.StatusOK
	}
	if !ok(ck) {
		t.Fatal("the session cookie does not sign in")
	}
	parts := strings.Split(ck, ".")
	flip := func(s string) string {
		b := []byte(s)
		if b[len(b)-1] == 'a' {
			b[len(b)-1] = 'b'
		} else {
			b[len(b)-1] = 'a'
		}
		return string(b)
	}
	other, _ := New(Config{Backend: r.f, Token: "another-token-0123456789", Now: func() time.Time { return r.now }})
	otherValue, _, _ := other.issue()
	for name, v := range map[string]string{
		"its mac altered":        parts[0] + "." + parts[1] + "." + parts[2] + "." + flip(parts[3]),
		"its session altered":    parts[0] + "." + parts[1] + "." + flip(parts[2]) + "." + parts[3],
		"its expiry extended":    parts[0] + ".9999999999." + parts[2] + "." + parts[3],
		"another version":        "v2." + parts[1] + "." + parts[2] + "." + parts[3],
		"cut short":              parts[0] + "." + parts[1] + "." + parts[2],
		"made under other token": otherValue,
		"the token itself":       token,
		"empty":                  "",
	} {
		if ok(v) {
			t.Errorf("a cookie with %s signs in", name)
		}
	}
	// Expired.
	r.now = at.Add(DefaultSessionTTL + time.Second)
	if ok(ck) {
		t.Error("an expired cookie signs in")
	}
	r.now = at
	// Signed out: that cookie is void, even replayed; another stays good.
	ck2 := r.signIn()
	page := func(v string) string { _, b := r.do(req{path: "/ui", cookie: v}); return b }
	resp, _ = r.do(req{method: "POST", path: "/ui/signout", cookie: ck, form: url.Values{"csrf": {csrfOf(t, page(ck))}}})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/signin" {
		t.Errorf("signing out: %d to %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	if c := resp.Cookies(); len(c) != 1 || c[0].MaxAge >= 0 {
		t.Errorf("signing out does not clear the cookie: %v", resp.Header.Values("Set-Cookie"))
	}
	if ok(ck) {
		t.Error("a signed-out cookie signs in")
	}
	if !ok(ck2) {
		t.Error("signing out one session signed out another")
	}
}

// Without a token on loopback, the console is open as the API is, with the
// same DNS-rebinding guard.
func TestConsoleLocalOnly(t *testing.T) {
	r := newRig(t, func(c *Config) { c.Token, c.LocalOnly, c.LocalHosts = "", true, []string{"sandgate.compose"} })
	r.f.add(running("box"))
	for host, want := range map[string]int{
		"localhost:8080": 200, "127.0.0.1:8080": 200, "[::1]:8080": 200, "LOCALHOST": 200, "sandgate.compose:8080": 200,
		"evil.example:8080": 403, "localhost.evil.example": 403, "127.0.0.1.nip.io": 403,
	} {
		hr, _ := http.NewRequest("GET", r.hs.URL+"/ui/sandboxes/box", nil)
		hr.Host = host
		resp, err := http.DefaultClient.Do(hr)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Host %s: %d, want %d", host, resp.StatusCode, want)
		}
		if want == 403 && (!strings.Contains(string(b), "DNS rebinding") || strings.Contains(string(b), "running")) {
			t.Errorf("Host %s refused with %s", host, b)
		}
	}
	// Open, it still asks for a CSRF token.
	resp, _ := r.do(req{method: "POST", path: "/ui/sandboxes/box/destroy", form: url.Values{"confirm": {"yes"}}})
	if resp.StatusCode != http.StatusForbidden || len(r.f.called()) > 0 {
		t.Errorf("a destroy without a CSRF token on an open console: %d, backend asked %q", resp.StatusCode, r.f.called())
	}
	// The sign-in is not needed.
	if resp, _ := r.do(req{path: "/ui/signin"}); resp.StatusCode != http.StatusSeeOther {
		t.Errorf("the sign-in of an open console: %d, want a redirect", resp.StatusCode)
	}
}

// A state change comes from the console's own page: its CSRF token, and
// the browser's word that the page is the console's (Sec-Fetch-Site, or
// the Origin of an older one); another site's script cannot read a page.
func TestConsoleCrossSite(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(running("box"))
	ck := r.signIn()
	_, page := r.do(req{path: "/ui/sandboxes/box", cookie: ck})
	csrf := csrfOf(t, page)
	post := func(form url.Values, header map[string]string) int {
		resp, _ := r.do(req{method: "POST", path: "/ui/sandboxes/box/suspend", cookie: ck, form: form, header: header})
		return resp.StatusCode
	}
	good := url.Values{"csrf": {csrf}, "confirm": {"yes"}}
	for name, c := range map[string]struct {
		form   url.Values
		header map[string]string
	}{
		"no CSRF token":         {url.Values{"confirm": {"yes"}}, nil},
		"a wrong CSRF token":    {url.Values{"csrf": {strings.Repeat("0", 32)}, "confirm": {"yes"}}, nil},
		"another session's":     {url.Values{"csrf": {csrfOf(t, func() string { _, p := r.do(req{path: "/ui", cookie: r.signIn()}); return p }())}, "confirm": {"yes"}}, nil},
		"a cross-site request":  {good, map[string]string{"Sec-Fetch-Site": "cross-site"}},
		"a same-site request":   {good, map[string]string{"Sec-Fetch-Site": "same-site"}},
		"a typed-in request":    {good, map[string]string{"Sec-Fetch-Site": "none"}},
		"another origin":        {good, map[string]string{"Origin": "https://evil.example"}},
		"a null origin":         {good, map[string]string{"Origin": "null"}},
		"another port's origin": {good, map[string]string{"Origin": "http://127.0.0.1:1"}},
	} {
		if code := post(c.form, c.header); code != http.StatusForbidden {
			t.Errorf("a suspend with %s: %d, want 403", name, code)
		}
	}
	if c := r.f.called(); len(c) > 0 {
		t.Fatalf("the backend was asked %q by refused requests", c)
	}
	if code := post(good, map[string]string{"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost:9999"}); code != http.StatusSeeOther {
		t.Errorf("a suspend from the console's page (behind a proxy that rewrote the Host): %d, want 303", code)
	}
	if code := post(good, map[string]string{"Origin": r.hs.URL}); code != http.StatusSeeOther {
		t.Errorf("a suspend with the console's own Origin: %d, want 303", code)
	}
	// Reading: a link from another site opens a page; another site's
	// script reads nothing.
	for _, path := range []string{"/ui/egress.json", "/ui/sandboxes/box/events", "/ui/sandboxes/box"} {
		resp, _ := r.do(req{path: path, cookie: ck, header: map[string]string{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}})
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("another site's script reading %s: %d, want 403", path, resp.StatusCode)
		}
	}
	resp, _ := r.do(req{path: "/ui/sandboxes/box", cookie: ck, header: map[string]string{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}})
	if resp.StatusCode != http.StatusOK {
		t.Errorf("a link from another site: %d, want 200", resp.StatusCode)
	}
}

// Every action asks first: without confirm=yes, a page that asks (a form
// that works without scripts); with it, the action, once.
func TestConsoleActionsAskFirst(t *testing.T) {
	r := newRig(t, func(c *Config) {
		c.Agent = func(name string) *agent.Config { return &agent.Config{Home: "/home/" + name} }
		c.Dirs = func(name string) []string { return []string{"/work/" + name} }
	})
	r.f.add(running("box"))
	r.f.add(appliance.Info{ID: "sleepy", State: appliance.Suspended, Created: at.Add(-time.Hour)})
	hdr := map[string]string{api.HeaderToken: token}
	for _, c := range []struct{ name, action, want string }{
		{"box", "suspend", "suspend box"}, {"sleepy", "resume", "resume sleepy"}, {"box", "destroy", "destroy box"},
	} {
		resp, body := r.do(req{method: "POST", path: "/ui/sandboxes/" + c.name + "/" + c.action, header: hdr, form: url.Values{}})
		if resp.StatusCode != http.StatusOK || !strings.Contains(body, `name="confirm" value="yes"`) || !strings.Contains(body, `action="/ui/sandboxes/`+c.name+"/"+c.action+`"`) {
			t.Errorf("%s without confirming: %d\n%s", c.action, resp.StatusCode, body)
		}
		if n := len(r.f.called()); n > 0 {
			t.Fatalf("%s acted before it was confirmed: %q", c.action, r.f.called())
		}
		resp, body = r.do(req{method: "POST", path: "/ui/sandboxes/" + c.name + "/" + c.action, header: hdr, form: url.Values{"confirm": {"yes"}}})
		if resp.StatusCode != http.StatusSeeOther || !slices.Equal(r.f.called(), []string{c.want}) {
			t.Errorf("%s confirmed: %d %s, backend asked %q", c.action, resp.StatusCode, body, r.f.called())
		}
		r.f.calls = nil
	}
	if r.f.resumed.Agent == nil || r.f.resumed.Agent.Home != "/home/sleepy" || !slices.Equal(r.f.resumed.Dirs, []string{"/work/sleepy"}) {
		t.Errorf("a resume from the console started with %+v, want the service's agent and directories", r.f.resumed)
	}
	// A resume of a running sandbox would replace its network: refused.
	r.f.add(running("awake"))
	resp, body := r.do(req{method: "POST", path: "/ui/sandboxes/awake/resume", header: hdr, form: url.Values{"confirm": {"yes"}}})
	if resp.StatusCode != http.StatusConflict || len(r.f.called()) > 0 {
		t.Errorf("resuming a running sandbox: %d %s, backend asked %q", resp.StatusCode, body, r.f.called())
	}
	// An unknown action, a bad name.
	if resp, _ := r.do(req{method: "POST", path: "/ui/sandboxes/awake/explode", header: hdr, form: url.Values{"confirm": {"yes"}}}); resp.StatusCode != http.StatusNotFound {
		t.Errorf("an unknown action: %d", resp.StatusCode)
	}
	if resp, _ := r.do(req{method: "POST", path: "/ui/sandboxes/-bad/destroy", header: hdr, form: url.Values{"confirm": {"yes"}}}); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a bad name: %d", resp.StatusCode)
	}
}

// A sandbox another shard runs: its page links to that shard's console,
// and the actions are refused here, naming it (the manager of this shard
// would not act on it).
func TestConsoleSandboxElsewhere(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(appliance.Info{ID: "far", State: appliance.Running, Shard: "other"})
	r.f.shards = []cluster.Shard{{ID: "other", URL: "https://other.example/"}}
	hdr := map[string]string{api.HeaderToken: token}
	_, page := r.do(req{path: "/ui/sandboxes/far", header: hdr})
	if !strings.Contains(page, `href="https://other.example/ui/sandboxes/far"`) || strings.Contains(page, `id="destroy"`) {
		t.Errorf("the page of a sandbox on another shard:\n%s", page)
	}
	_, list := r.do(req{path: "/ui", header: hdr})
	if !strings.Contains(list, "on other shards") || !strings.Contains(list, "running elsewhere") {
		t.Errorf("the list of a sandbox on another shard:\n%s", list)
	}
	for _, a := range []string{"suspend", "destroy"} {
		resp, body := r.do(req{method: "POST", path: "/ui/sandboxes/far/" + a, header: hdr, form: url.Values{"confirm": {"yes"}}})
		if resp.StatusCode != http.StatusConflict || !strings.Contains(body, "https://other.example/ui") {
			t.Errorf("%s of a sandbox on another shard: %d %s", a, resp.StatusCode, body)
		}
	}
	if c := r.f.called(); len(c) > 0 {
		t.Errorf("the backend was asked %q", c)
	}
}

func audited(r *rig) {
	for i, e := range []audit.Event{
		{Kind: audit.Route, Allow: true, Code: "allowed_host", Reason: "api.example.com is allowed", Host: "api.example.com", Port: 443, Method: "GET", Path: "/v1/models", Status: 200, Cmd: "node agent.js", BytesIn: 100, BytesOut: 5000},
		{Kind: audit.Connect, Code: "no_rule", Reason: "no allowedHosts rule matches denied.example.com", Host: "denied.example.com", Port: 443, Cmd: "curl https://denied.example.com/"},
		{Kind: audit.Connect, Code: "address_class", Reason: "10.0.0.1 is a private address", Host: "intranet.example.com", Port: 443, Cmd: "git fetch"},
		{Kind: audit.Route, Code: "module_refused", Reason: "wasm module guard refused the request: <script>alert(1)</script>", Host: "api.example.com", Port: 443, Method: "POST", Path: "/<b>x</b>", Module: "guard", Cmd: "python3 run.py"},
	} {
		e.Time = at.Add(-time.Duration(10-i) * time.Minute)
		r.f.record("box", e)
	}
}

// A sandbox's page: its audit newest first, filtered by decision, host,
// code and command, each refusal with its reason and fix; everything
// escaped; a bad filter named.
func TestConsoleAuditOnThePage(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(running("box"))
	audited(r)
	hdr := map[string]string{api.HeaderToken: token}
	get := func(query string) (int, string) {
		resp, body := r.do(req{path: "/ui/sandboxes/box" + query, header: hdr})
		return resp.StatusCode, body
	}
	code, page := get("")
	if code != 200 {
		t.Fatalf("the page: %d %s", code, page)
	}
	order := []string{"guard", "intranet.example.com", "denied.example.com", "/v1/models"}
	last := -1
	for _, s := range order {
		i := strings.Index(page[strings.Index(page, `id="events"`):], s)
		if i < last {
			t.Errorf("the events are not newest first (%q)", s)
		}
		last = i
	}
	for _, want := range []string{
		"Why:</b> no allowedHosts rule matches denied.example.com",
		"sandgate policy set box --allow denied.example.com",
		"SANDBOX_ALLOW_PRIVATE",
		"sandgate modules set box",
		"&lt;script&gt;alert(1)&lt;/script&gt;",
		"/&lt;b&gt;x&lt;/b&gt;",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the page does not show %q", want)
		}
	}
	if strings.Contains(page, "<script>alert") || strings.Contains(page, "<b>x</b>") {
		t.Error("the page shows an event's text unescaped")
	}
	for query, want := range map[string][]string{
		"?decision=allow":                    {"/v1/models"},
		"?decision=deny":                     {"denied.example.com", "intranet.example.com", "guard"},
		"?host=denied.example.com":           {"denied.example.com"},
		"?host=*.example.com&code=no_rule":   {"denied.example.com"},
		"?code=address_class":                {"intranet.example.com"},
		"?cmd=GIT":                           {"intranet.example.com"},
		"?decision=deny&cmd=python":          {"guard"},
		"?decision=allow&code=address_class": {},
	} {
		code, page := get(query)
		if code != 200 {
			t.Errorf("%s: %d", query, code)
			continue
		}
		events := page[strings.Index(page, `id="events"`):]
		var got []string
		for _, s := range []string{"/v1/models", "denied.example.com", "intranet.example.com", "guard"} {
			if strings.Contains(events, s) {
				got = append(got, s)
			}
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s shows %q, want %q", query, got, want)
		}
	}
	for query, field := range map[string]string{"?decision=maybe": "decision", "?host=a%20b": "host", "?code=NO-RULE": "code", "?cmd=" + strings.Repeat("x", 201): "command", "?range=2y": "range"} {
		code, page := get(query)
		if code != http.StatusBadRequest || !strings.Contains(page, field) {
			t.Errorf("%s: %d, want 400 naming %s:\n%s", query, code, field, page)
		}
	}
	resp, _ := r.do(req{path: "/ui/sandboxes/nothere", header: hdr})
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("an unknown sandbox: %d, want 404", resp.StatusCode)
	}
}

// The live stream: server-sent events of what the filter selects, from
// the page's cursor on, and "end" saying why it ended.
func TestConsoleStream(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(running("box"))
	audited(r)
	r.f.follow = make(chan []byte, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hr, _ := http.NewRequestWithContext(ctx, "GET", r.hs.URL+"/ui/sandboxes/box/events?decision=deny&cmd=curl", nil)
	hr.Header.Set(api.HeaderToken, token)
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" || resp.Header.Get("Cache-Control") != "no-store" {
		t.Fatalf("the stream: %d %v", resp.StatusCode, resp.Header)
	}
	rd := bufio.NewReader(resp.Body)
	next := func() (event string, data map[string]any) {
		t.Helper()
		for {
			line, err := rd.ReadString('\n')
			if err != nil {
				t.Fatalf("reading the stream: %v", err)
			}
			line = strings.TrimSuffix(line, "\n")
			switch {
			case strings.HasPrefix(line, "event: "):
				event = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &data)
			case line == "" && event != "":
				return event, data
			}
		}
	}
	ev, data := next()
	if ev != "audit" || data["host"] != "denied.example.com" || !strings.Contains(data["fix"].(string), "sandgate policy set box") {
		t.Errorf("the first event: %s %v", ev, data)
	}
	// A new event, as it happens; what the filter leaves out is not sent.
	for _, e := range []audit.Event{
		{Time: at, Kind: audit.Connect, Allow: true, Code: "allowed_host", Host: "api.example.com", Port: 443, Cmd: "curl a"},
		{Time: at, Kind: audit.Connect, Code: "no_rule", Reason: "no rule", Host: "new.example.com", Port: 443, Cmd: "wget b"},
		{Time: at, Kind: audit.Connect, Code: "no_rule", Reason: "no rule", Host: "later.example.com", Port: 443, Cmd: "curl c"},
	} {
		e.Sandbox = "box"
		line := audit.AppendJSON(nil, &e)
		r.f.follow <- line[:len(line)-1]
	}
	if ev, data := next(); ev != "audit" || data["host"] != "later.example.com" {
		t.Errorf("the live event: %s %v, want later.example.com (wget's filtered out)", ev, data)
	}
	cancel()

	// A stream that ends because the sandbox is gone says so.
	r.f.mu.Lock()
	r.f.follow = nil
	r.f.mu.Unlock()
	r.f.Destroy(context.Background(), "box")
	r.f.add(running("box"))
	r.f.record("box", audit.Event{Time: at, Kind: audit.Connect, Code: "no_rule", Host: "x.example.com", Port: 443})
	hr, _ = http.NewRequest("GET", r.hs.URL+"/ui/sandboxes/box/events", nil)
	hr.Header.Set(api.HeaderToken, token)
	resp2, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp2.Body)
	resp2.Body.Close()
	if !strings.Contains(string(body), "event: end") || !strings.Contains(string(body), "reload the page") {
		t.Errorf("a stream that ended: %s", body)
	}
	// HEAD would follow forever for nothing.
	if resp, _ := r.do(req{method: "HEAD", path: "/ui/sandboxes/box/events", header: map[string]string{api.HeaderToken: token}}); resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("HEAD of the stream: %d, want 405", resp.StatusCode)
	}
	// A bad cursor is named.
	resp3, body3 := r.do(req{path: "/ui/sandboxes/box/events?cursor=nonsense", header: map[string]string{api.HeaderToken: token}})
	if resp3.StatusCode != http.StatusBadRequest || !strings.Contains(body3, "cursor") {
		t.Errorf("a bad cursor: %d %s", resp3.StatusCode, body3)
	}
}

// The charts' data: the audit in buckets, per sandbox or for the service,
// refusals by code; the read capped, and the cap said.
func TestConsoleCharts(t *testing.T) {
	r := newRig(t, nil)
	r.f.add(running("box"))
	r.f.add(running("two"))
	audited(r)
	r.f.record("two", audit.Event{Time: at.Add(-30 * time.Minute), Kind: audit.Connect, Code: "no_rule", Host: "y.example.com", Port: 443, BytesIn: 7})
	r.f.record("two", audit.Event{Time: at.Add(-2 * time.Hour), Kind: audit.Connect, Code: "no_rule", Host: "old.example.com", Port: 443})
	get := func(q string) egress {
		t.Helper()
		resp, body := r.do(req{path: "/ui/egress.json" + q, header: map[string]string{api.HeaderToken: token}})
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", q, resp.StatusCode, body)
		}
		var e egress
		if err := json.Unmarshal([]byte(body), &e); err != nil {
			t.Fatal(err)
		}
		return e
	}
	e := get("?sandbox=box&range=1h")
	if e.Events != 4 || e.Step != 60 || len(e.Times) != chartBuckets || e.Capped {
		t.Errorf("one sandbox's chart: %d events, step %d, %d buckets, capped %v", e.Events, e.Step, len(e.Times), e.Capped)
	}
	sum := e.Sum()
	if sum.Allowed != 1 || sum.Refused != 3 || sum.Sent != 100 || sum.Received != 5000 {
		t.Errorf("its totals: %+v", sum)
	}
	var codes []string
	for _, s := range e.Refusals {
		codes = append(codes, s.Code)
	}
	if len(codes) != 3 {
		t.Errorf("its refusals by code: %q", codes)
	}
	e = get("?range=1h")
	if e.Events != 5 || e.Sandboxes != 2 || e.Refusals[0].Code != "no_rule" || e.Refusals[0].Total != 2 {
		t.Errorf("the service's chart: %d events from %d sandboxes, refusals %+v", e.Events, e.Sandboxes, e.Refusals)
	}
	if e := get("?range=6h"); e.Events != 6 {
		t.Errorf("the service's chart over 6h: %d events, want 6", e.Events)
	}
	// Capped.
	r2 := newRig(t, func(c *Config) { c.MaxChartEvents = 2 })
	r2.f.add(running("box"))
	r2.f.add(running("two"))
	audited(r2)
	resp, body := r2.do(req{path: "/ui/egress.json?range=1h", header: map[string]string{api.HeaderToken: token}})
	var capped egress
	json.Unmarshal([]byte(body), &capped)
	if resp.StatusCode != 200 || !capped.Capped {
		t.Errorf("a chart past the cap: %d %s", resp.StatusCode, body)
	}
	if _, page := r2.do(req{path: "/ui/egress?range=1h", header: map[string]string{api.HeaderToken: token}}); !strings.Contains(page, "Capped") {
		t.Errorf("the table of a chart past the cap does not say so:\n%s", page)
	}
	if resp, _ := r.do(req{path: "/ui/egress.json?sandbox=nothere", header: map[string]string{api.HeaderToken: token}}); resp.StatusCode != http.StatusNotFound {
		t.Errorf("the chart of an unknown sandbox: %d", resp.StatusCode)
	}
}

// No page or stream shows a value a sandbox was given: credential rules by
// host and header names, sessions by variable names.
func TestConsoleShowsNoValue(t *testing.T) {
	const canary = "sk-console-canary-5f3a9e"
	r := newRig(t, nil)
	r.f.add(running("box"))
	r.f.rules["box"] = []appliance.RuleInfo{{Host: "api.example.com", Headers: []string{"X-Api-Key", "Authorization"}}}
	r.f.sessions["box"] = map[string]appliance.Session{"dev": {Dir: "/workspace", Env: map[string]string{"API_KEY": canary}}}
	audited(r)
	hdr := map[string]string{api.HeaderToken: token}
	for _, path := range []string{"/ui", "/ui/sandboxes/box", "/ui/sandboxes/box/events", "/ui/egress.json?sandbox=box", "/ui/egress?sandbox=box"} {
		_, body := r.do(req{path: path, header: hdr})
		if strings.Contains(body, canary) {
			t.Errorf("GET %s shows a session variable's value", path)
		}
		if path == "/ui/sandboxes/box" {
			for _, want := range []string{"api.example.com", "X-Api-Key", "Authorization", "dev", "API_KEY"} {
				if !strings.Contains(body, want) {
					t.Errorf("the page does not show %q", want)
				}
			}
		}
	}
}
