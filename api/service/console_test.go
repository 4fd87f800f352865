package service_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/browser"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
)

// startBrowser starts a headless Chromium for t, or skips t where none can
// run: never in CI, where .ci/run installs it.
func startBrowser(t *testing.T) *browser.Browser {
	t.Helper()
	path, err := browser.Find()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%v (.ci/run installs it)", err)
		}
		t.Skipf("the console's browser tests need Chromium: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	b, err := browser.Start(ctx, path, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

// screenshots is the folder a test writes its screenshots to:
// $SANDGATE_SCREENSHOTS/<test> when set, else a temporary one (named in
// the test's log).
func screenshots(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if d := os.Getenv("SANDGATE_SCREENSHOTS"); d != "" {
		dir = filepath.Join(d, strings.ReplaceAll(t.Name(), "/", "_"))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("screenshots in %s", dir)
	return dir
}

// The console in a real browser against a real service: the sign-in the
// service's token asks for, the list showing a created sandbox, its page
// (rules by host and header name, never the value), a refusal in its live
// audit stream as it happens, with its reason and fix, the charts drawn
// with no script error or policy refusal, a phone's width, a destroy
// through the UI once confirmed, and the sign-out.
func TestConsoleInBrowser(t *testing.T) {
	r := newRig(t, nil)
	b := startBrowser(t)
	shots := screenshots(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	r.create("web", map[string]any{"allowedHosts": []string{"api.example.com"}})
	r.must(204, "POST", "/v1/sandboxes/web/transformations", map[string]any{"transformations": []any{map[string]any{
		"match":     map[string]any{"host": "api.example.com"},
		"transform": map[string]any{"headers": map[string]string{"x-api-key": r.canary}},
	}}})
	if err := r.m.CreateSession(ctx, "web", "dev", appliance.Session{Dir: "/workspace", Env: map[string]string{"PROJECT": "demo"}}); err != nil {
		t.Fatal(err)
	}
	r.exec("web", "curl -sS -o /dev/null $ANTHROPIC_BASE_URL/v1/models", nil) // an allowed request, for the charts

	p, err := b.NewPage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	shot := func(name string) {
		t.Helper()
		if err := p.Screenshot(ctx, filepath.Join(shots, name+".png")); err != nil {
			t.Errorf("screenshot %s: %v", name, err)
		}
	}
	html := func() string {
		t.Helper()
		var s string
		if err := p.Eval(ctx, "document.documentElement.outerHTML", &s); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(s, r.canary) {
			t.Errorf("the canary secret is on a page of the console")
		}
		return s
	}
	if err := p.Viewport(ctx, 1280, 800, false); err != nil {
		t.Fatal(err)
	}

	// Without the token, the console is the sign-in.
	if err := p.Navigate(ctx, r.hs.URL+"/ui/sandboxes/web"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `location.pathname === "/ui/signin" && document.querySelector("#token")`); err != nil {
		t.Fatalf("the console without a sign-in: %v\n%s", err, html())
	}
	shot("01-signin")
	if strings.Contains(html(), "web") && strings.Contains(html(), "running") {
		t.Errorf("the sign-in page shows a sandbox")
	}
	if err := p.Eval(ctx, `document.querySelector("#token").value = "wrong"; document.querySelector("form").submit()`, nil); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `document.querySelector(".error") && document.querySelector(".error").innerText.includes("not the service token")`); err != nil {
		t.Fatalf("a wrong token: %v", err)
	}
	p.ClearProblems() // the wrong token's 401
	if err := p.Eval(ctx, `document.querySelector("#token").value = `+jsString(r.token)+`; document.querySelector("form").submit()`, nil); err != nil {
		t.Fatal(err)
	}
	// Back where it was going.
	if err := p.WaitFor(ctx, `location.pathname === "/ui/sandboxes/web" && document.querySelector("#live")`); err != nil {
		t.Fatalf("after signing in: %v\n%s", err, html())
	}
	cookies, err := p.Cookies(ctx, r.hs.URL+"/ui")
	if err != nil {
		t.Fatal(err)
	}
	if len(cookies) != 1 || strings.Contains(cookies[0], r.token) {
		t.Errorf("the console's cookies: %q; want one, without the token", cookies)
	}

	// The list shows the sandbox.
	if err := p.Navigate(ctx, r.hs.URL+"/ui"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `document.querySelector('#sandboxes tr[data-sandbox="web"]') && document.querySelectorAll(".uplot").length >= 2`); err != nil {
		t.Fatalf("the list: %v\n%s", err, html())
	}
	row, _ := p.Text(ctx, `#sandboxes tr[data-sandbox="web"]`)
	if !strings.Contains(row, "running") {
		t.Errorf("the list's row of web: %q, want it running", row)
	}
	shot("02-list-laptop")

	// Its page: policy, rules without values, sessions, modules; the
	// stream open.
	if err := p.Navigate(ctx, r.hs.URL+"/ui/sandboxes/web"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `document.querySelector("#live-text") && document.querySelector("#live-text").innerText === "live" && document.querySelectorAll(".uplot").length >= 2`); err != nil {
		t.Fatalf("the sandbox's page, its stream and charts: %v\n%s", err, html())
	}
	page := html()
	for _, want := range []string{"api.example.com", "X-Api-Key", "dev", "PROJECT", "/workspace"} {
		if !strings.Contains(page, want) {
			t.Errorf("the sandbox's page does not show %q", want)
		}
	}
	if strings.Contains(page, "demo") {
		t.Errorf("the sandbox's page shows a session variable's value")
	}

	// A refusal shows in the stream as it happens, with its reason and fix.
	start := time.Now()
	r.exec("web", "curl -sS -x $HTTPS_PROXY https://denied.example.com/ 2>&1; true", nil)
	wait, stop := context.WithTimeout(ctx, 5*time.Second) // the store's flush is 10 s: only the live stream is this quick
	err = p.WaitFor(wait, `[...document.querySelectorAll("#events li.deny")].some(li => li.innerText.includes("denied.example.com"))`)
	stop()
	if err != nil {
		t.Fatalf("the refusal in the live stream: %v\n%s", err, html())
	}
	t.Logf("the refusal showed in the stream %v after the request was sent (the command's run included)", time.Since(start).Round(time.Millisecond))
	ev, _ := p.Text(ctx, `#events li.deny`)
	for _, want := range []string{"denied.example.com", "no_rule", "Why:", "no allowedHosts rule matches denied.example.com", "Fix:", "sandgate policy set web --allow denied.example.com", "curl"} {
		if !strings.Contains(ev, want) {
			t.Errorf("the refusal's row does not say %q:\n%s", want, ev)
		}
	}
	shot("03-sandbox-laptop")

	// A phone's width.
	if err := p.Viewport(ctx, 390, 844, true); err != nil {
		t.Fatal(err)
	}
	if err := p.Navigate(ctx, r.hs.URL+"/ui"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `document.querySelectorAll(".uplot").length >= 2`); err != nil {
		t.Fatal(err)
	}
	var overflow bool
	if err := p.Eval(ctx, `document.documentElement.scrollWidth > window.innerWidth + 1`, &overflow); err != nil {
		t.Fatal(err)
	}
	if overflow {
		t.Errorf("the list is wider than a phone's screen")
	}
	shot("04-list-phone")
	if err := p.Navigate(ctx, r.hs.URL+"/ui/sandboxes/web"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `document.querySelector("#events li.deny") && document.querySelectorAll(".uplot").length >= 2`); err != nil {
		t.Fatal(err)
	}
	if err := p.Eval(ctx, `document.documentElement.scrollWidth > window.innerWidth + 1`, &overflow); err != nil {
		t.Fatal(err)
	}
	if overflow {
		t.Errorf("the sandbox's page is wider than a phone's screen")
	}
	shot("05-sandbox-phone")
	if err := p.Viewport(ctx, 1280, 800, false); err != nil {
		t.Fatal(err)
	}

	// Destroy asks first: cancelled, nothing happens.
	p.AcceptDialogs(false)
	if err := p.Click(ctx, "#destroy"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `location.pathname === "/ui/sandboxes/web"`); err != nil {
		t.Fatal(err)
	}
	if d := p.Dialogs(); len(d) != 1 || !strings.Contains(d[0], "Destroy web?") {
		t.Fatalf("the dialogs: %q, want one asking to destroy web", d)
	}
	if _, err := r.m.Get(ctx, "web"); err != nil {
		t.Fatalf("a cancelled destroy: %v", err)
	}
	// Confirmed, it is gone, and the list no longer shows it.
	p.AcceptDialogs(true)
	if err := p.Click(ctx, "#destroy"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `location.pathname === "/ui" && !document.querySelector('#sandboxes tr[data-sandbox="web"]')`); err != nil {
		t.Fatalf("after the destroy: %v\n%s", err, html())
	}
	if _, err := r.m.Get(ctx, "web"); !errors.Is(err, appliance.ErrNotFound) {
		t.Errorf("the sandbox after a destroy through the console: %v, want it gone", err)
	}
	shot("06-list-after-destroy")
	if pr := p.Problems(); len(pr) > 0 {
		t.Errorf("the pages reported problems (script errors, policy refusals):\n%s", strings.Join(pr, "\n"))
	}

	// Signed out, the console is the sign-in again.
	if err := p.Click(ctx, `form[action="/ui/signout"] button`); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `location.pathname === "/ui/signin"`); err != nil {
		t.Fatal(err)
	}
	if err := p.Navigate(ctx, r.hs.URL+"/ui"); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitFor(ctx, `location.pathname === "/ui/signin"`); err != nil {
		t.Errorf("after signing out: %v", err)
	}
}

// Nothing of the console answers without the service's token but its
// sign-in (and the stylesheet that page uses); with it, every answer has
// the console's headers.
func TestConsoleNeedsTheToken(t *testing.T) {
	r := newRig(t, nil)
	r.create("unseen-box", nil)
	get := func(path string, token string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest("GET", r.hs.URL+path, nil)
		if token != "" {
			req.Header.Set(api.HeaderToken, token)
		}
		resp, err := (&http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode == 200 && strings.HasSuffix(path, "/events") {
			resp.Body.Close() // a stream: open is enough
			return resp
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(body), "unseen-box") && resp.StatusCode != 200 {
			t.Errorf("GET %s refused, yet its body names the sandbox: %s", path, body)
		}
		return resp
	}
	for _, path := range []string{"/ui", "/ui/", "/ui/sandboxes/unseen-box", "/ui/sandboxes/unseen-box/events", "/ui/egress.json", "/ui/egress", "/ui/static/console.js", "/ui/static/uplot/uPlot.iife.min.js"} {
		for _, token := range []string{"", "wrong"} {
			resp := get(path, token)
			if resp.StatusCode != http.StatusUnauthorized && !(resp.StatusCode == http.StatusSeeOther && strings.HasPrefix(resp.Header.Get("Location"), "/ui/signin")) {
				t.Errorf("GET %s with token %q: %d, want 401 or a redirect to the sign-in", path, token, resp.StatusCode)
			}
		}
		resp := get(path, r.token)
		if resp.StatusCode != 200 {
			t.Errorf("GET %s with the token: %d", path, resp.StatusCode)
		}
		if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "frame-ancestors 'none'") || !strings.Contains(csp, "default-src 'self'") {
			t.Errorf("GET %s: Content-Security-Policy %q", path, csp)
		}
		if !strings.HasPrefix(path, "/ui/static/") && resp.Header.Get("Cache-Control") != "no-store" {
			t.Errorf("GET %s: Cache-Control %q, want no-store", path, resp.Header.Get("Cache-Control"))
		}
	}
	if resp := get("/ui/signin", ""); resp.StatusCode != 200 {
		t.Errorf("the sign-in page: %d", resp.StatusCode)
	}
}

// Turned off (SANDGATE_CONSOLE=false), /ui is the API's: no route.
func TestConsoleOff(t *testing.T) {
	r := newRigOn(t, stacktest.Config{NoConsole: true}, nil)
	for _, path := range []string{"/ui", "/ui/signin", "/ui/static/console.css"} {
		code, body, _ := r.do("GET", path, nil)
		if code != http.StatusNotFound || !strings.Contains(body, "no route") {
			t.Errorf("GET %s with the console off: %d %s", path, code, body)
		}
	}
}

// jsString is s as a JavaScript string literal (JSON's is one).
func jsString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
