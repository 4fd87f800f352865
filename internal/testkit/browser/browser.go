// Package browser drives a headless Chromium (Debian's `chromium`
// package) over the Chrome DevTools Protocol, for tests of the web
// console in a real browser: open a page at a viewport, evaluate script,
// click, answer confirm() dialogs, and take screenshots. It speaks the
// protocol over a WebSocket (github.com/coder/websocket, already a
// dependency), so no driver binary or module is needed.
//
// Each Browser is one Chromium process with a new, empty profile, started
// in a process group of its own and killed with it by Close.
package browser

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/coder/websocket"
)

// ErrNoChromium is returned by Find when no Chromium is installed.
var ErrNoChromium = errors.New("no Chromium found: install Debian's package (apt-get install -y chromium), or name one in SANDGATE_CHROMIUM")

// Find returns the Chromium to run: $SANDGATE_CHROMIUM, else the first of
// chromium, chromium-browser, google-chrome on PATH.
func Find() (string, error) {
	if p := os.Getenv("SANDGATE_CHROMIUM"); p != "" {
		return p, nil
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", ErrNoChromium
}

// Browser is a running headless Chromium.
type Browser struct {
	cmd  *exec.Cmd
	dir  string
	conn *websocket.Conn
	log  *os.File

	next    atomic.Int64
	mu      sync.Mutex
	pending map[int64]chan reply
	pages   map[string]*Page // by session id
	done    chan struct{}
	readErr error
}

type reply struct {
	Result json.RawMessage
	Err    *cdpError
}

type cdpError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Data    string `json:"data"`
}

func (e *cdpError) Error() string {
	return fmt.Sprintf("devtools: %s (%d) %s", e.Message, e.Code, e.Data)
}

type message struct {
	ID        int64           `json:"id,omitempty"`
	Method    string          `json:"method,omitempty"`
	Params    json.RawMessage `json:"params,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	Error     *cdpError       `json:"error,omitempty"`
	SessionID string          `json:"sessionId,omitempty"`
}

// Start starts Chromium (path from Find) with a new profile under dir,
// headless, and connects to it. ctx bounds the start.
func Start(ctx context.Context, path, dir string) (_ *Browser, err error) {
	profile := filepath.Join(dir, "profile")
	if err := os.MkdirAll(profile, 0o700); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "chromium.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(path,
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--disable-dev-shm-usage", "--no-default-browser-check", "--mute-audio", "--hide-scrollbars",
		"--disable-features=Translate,MediaRouter,OptimizationHints",
		"--user-data-dir="+profile, "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
		"about:blank")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", path, err)
	}
	b := &Browser{cmd: cmd, dir: dir, log: logf, pending: map[int64]chan reply{}, pages: map[string]*Page{}, done: make(chan struct{})}
	defer func() {
		if err != nil {
			b.Close()
		}
	}()
	// Chromium writes its port and the browser's path once it listens.
	portFile := filepath.Join(profile, "DevToolsActivePort")
	var ws string
	for ws == "" {
		if data, err := os.ReadFile(portFile); err == nil {
			lines := strings.Split(strings.TrimSpace(string(data)), "\n")
			if len(lines) == 2 {
				if _, err := strconv.Atoi(lines[0]); err == nil {
					ws = "ws://127.0.0.1:" + lines[0] + lines[1]
					break
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("chromium did not start (its log: %s): %w", b.Log(), context.Cause(ctx))
		case <-time.After(50 * time.Millisecond):
		}
	}
	conn, _, err := websocket.Dial(ctx, ws, nil)
	if err != nil {
		return nil, fmt.Errorf("connecting to chromium at %s: %w", ws, err)
	}
	conn.SetReadLimit(256 << 20) // screenshots
	b.conn = conn
	go b.read()
	return b, nil
}

// Log is what Chromium printed so far (for a failure's message).
func (b *Browser) Log() string {
	data, _ := os.ReadFile(filepath.Join(b.dir, "chromium.log"))
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(data)
}

// read delivers replies to their callers and events to their pages until
// the connection ends.
func (b *Browser) read() {
	defer close(b.done)
	for {
		_, data, err := b.conn.Read(context.Background())
		if err != nil {
			b.mu.Lock()
			b.readErr = err
			for id, ch := range b.pending {
				close(ch)
				delete(b.pending, id)
			}
			b.mu.Unlock()
			return
		}
		var m message
		if json.Unmarshal(data, &m) != nil {
			continue
		}
		if m.ID != 0 {
			b.mu.Lock()
			ch := b.pending[m.ID]
			delete(b.pending, m.ID)
			b.mu.Unlock()
			if ch != nil {
				ch <- reply{Result: m.Result, Err: m.Error}
			}
			continue
		}
		b.mu.Lock()
		p := b.pages[m.SessionID]
		b.mu.Unlock()
		if p != nil {
			p.event(m.Method, m.Params)
		}
	}
}

// call sends one command (to a page's session, or the browser's when
// session is "") and waits for its result under ctx.
func (b *Browser) call(ctx context.Context, session, method string, params any, result any) error {
	id := b.next.Add(1)
	raw, err := json.Marshal(params)
	if err != nil {
		return err
	}
	if params == nil {
		raw = []byte("{}")
	}
	data, _ := json.Marshal(message{ID: id, Method: method, Params: raw, SessionID: session})
	ch := make(chan reply, 1)
	b.mu.Lock()
	if b.readErr != nil {
		b.mu.Unlock()
		return fmt.Errorf("%s: the browser is gone: %w", method, b.readErr)
	}
	b.pending[id] = ch
	b.mu.Unlock()
	if err := b.conn.Write(ctx, websocket.MessageText, data); err != nil {
		return fmt.Errorf("%s: %w", method, err)
	}
	select {
	case r, ok := <-ch:
		if !ok {
			return fmt.Errorf("%s: the browser is gone", method)
		}
		if r.Err != nil {
			return fmt.Errorf("%s: %w", method, r.Err)
		}
		if result != nil {
			return json.Unmarshal(r.Result, result)
		}
		return nil
	case <-ctx.Done():
		b.mu.Lock()
		delete(b.pending, id)
		b.mu.Unlock()
		return fmt.Errorf("%s: %w", method, context.Cause(ctx))
	}
}

// Close ends the browser: its connection, then its whole process group.
func (b *Browser) Close() {
	if b.conn != nil {
		b.conn.Close(websocket.StatusNormalClosure, "")
	}
	if b.cmd.Process != nil {
		syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
		b.cmd.Wait()
	}
	b.log.Close()
}

// Page is one tab.
type Page struct {
	b       *Browser
	session string

	mu       sync.Mutex
	dialogs  []string // the messages of the dialogs answered
	accept   bool
	problems []string // console errors, exceptions, CSP refusals
}

// NewPage opens a tab with its own session; its dialogs are accepted until
// told otherwise (AcceptDialogs).
func (b *Browser) NewPage(ctx context.Context) (*Page, error) {
	var t struct {
		TargetID string `json:"targetId"`
	}
	if err := b.call(ctx, "", "Target.createTarget", map[string]any{"url": "about:blank"}, &t); err != nil {
		return nil, err
	}
	var s struct {
		SessionID string `json:"sessionId"`
	}
	if err := b.call(ctx, "", "Target.attachToTarget", map[string]any{"targetId": t.TargetID, "flatten": true}, &s); err != nil {
		return nil, err
	}
	p := &Page{b: b, session: s.SessionID, accept: true}
	b.mu.Lock()
	b.pages[s.SessionID] = p
	b.mu.Unlock()
	for _, domain := range []string{"Page.enable", "Runtime.enable", "Log.enable"} {
		if err := b.call(ctx, p.session, domain, nil, nil); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// event handles a page's event: dialogs are answered, problems kept.
func (p *Page) event(method string, params json.RawMessage) {
	switch method {
	case "Page.javascriptDialogOpening":
		var d struct {
			Message string `json:"message"`
		}
		json.Unmarshal(params, &d)
		p.mu.Lock()
		p.dialogs = append(p.dialogs, d.Message)
		accept := p.accept
		p.mu.Unlock()
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			p.b.call(ctx, p.session, "Page.handleJavaScriptDialog", map[string]any{"accept": accept}, nil)
		}()
	case "Runtime.exceptionThrown":
		var e struct {
			Details struct {
				Text      string `json:"text"`
				Exception struct {
					Description string `json:"description"`
				} `json:"exception"`
			} `json:"exceptionDetails"`
		}
		json.Unmarshal(params, &e)
		p.problem("exception: " + e.Details.Text + " " + e.Details.Exception.Description)
	case "Runtime.consoleAPICalled":
		var c struct {
			Type string `json:"type"`
			Args []struct {
				Value any `json:"value"`
			} `json:"args"`
		}
		json.Unmarshal(params, &c)
		if c.Type == "error" || c.Type == "assert" {
			p.problem(fmt.Sprintf("console.%s: %v", c.Type, c.Args))
		}
	case "Log.entryAdded":
		var l struct {
			Entry struct {
				Level  string `json:"level"`
				Text   string `json:"text"`
				Source string `json:"source"`
				URL    string `json:"url"`
			} `json:"entry"`
		}
		json.Unmarshal(params, &l)
		if l.Entry.Level == "error" || strings.Contains(l.Entry.Text, "Content Security Policy") {
			p.problem(l.Entry.Source + ": " + l.Entry.Text + " " + l.Entry.URL)
		}
	}
}

func (p *Page) problem(s string) {
	p.mu.Lock()
	p.problems = append(p.problems, s)
	p.mu.Unlock()
}

// Problems are the console errors, uncaught exceptions and Content
// Security Policy refusals the page reported so far.
func (p *Page) Problems() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.problems...)
}

// ClearProblems forgets the problems reported so far.
func (p *Page) ClearProblems() {
	p.mu.Lock()
	p.problems = nil
	p.mu.Unlock()
}

// Dialogs are the messages of the dialogs (alert, confirm) the page opened.
func (p *Page) Dialogs() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.dialogs...)
}

// AcceptDialogs says whether the page's next dialogs are accepted (OK) or
// dismissed (Cancel).
func (p *Page) AcceptDialogs(accept bool) {
	p.mu.Lock()
	p.accept = accept
	p.mu.Unlock()
}

// Viewport sets the page's size in CSS pixels; mobile emulates a phone
// (its viewport meta tag, touch).
func (p *Page) Viewport(ctx context.Context, width, height int, mobile bool) error {
	scale := 1.0
	if mobile {
		scale = 2
	}
	return p.b.call(ctx, p.session, "Emulation.setDeviceMetricsOverride",
		map[string]any{"width": width, "height": height, "deviceScaleFactor": scale, "mobile": mobile}, nil)
}

// Navigate loads url and waits until its document is complete.
func (p *Page) Navigate(ctx context.Context, url string) error {
	var r struct {
		ErrorText string `json:"errorText"`
	}
	if err := p.b.call(ctx, p.session, "Page.navigate", map[string]any{"url": url}, &r); err != nil {
		return err
	}
	if r.ErrorText != "" {
		return fmt.Errorf("navigating to %s: %s", url, r.ErrorText)
	}
	return p.WaitFor(ctx, `document.readyState === "complete" && location.href !== "about:blank"`)
}

// Eval evaluates a JavaScript expression (a promise is awaited) and
// stores its value, as JSON, into out (nil: dropped).
func (p *Page) Eval(ctx context.Context, expr string, out any) error {
	var r struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		Exception *struct {
			Text      string `json:"text"`
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	err := p.b.call(ctx, p.session, "Runtime.evaluate", map[string]any{"expression": expr, "returnByValue": true, "awaitPromise": true}, &r)
	if err != nil {
		return err
	}
	if r.Exception != nil {
		return fmt.Errorf("evaluating %q: %s %s", expr, r.Exception.Text, r.Exception.Exception.Description)
	}
	if out != nil && len(r.Result.Value) > 0 {
		return json.Unmarshal(r.Result.Value, out)
	}
	return nil
}

// WaitFor evaluates expr until it is true, every 50 ms, until ctx ends
// (the caller's bound). A page between documents (a navigation) is
// waited out.
func (p *Page) WaitFor(ctx context.Context, expr string) error {
	var last error
	for {
		var ok bool
		err := p.Eval(ctx, "Boolean("+expr+")", &ok)
		if err == nil && ok {
			return nil
		}
		if err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			if last != nil {
				return fmt.Errorf("waiting for %s: %w (last error: %v)", expr, context.Cause(ctx), last)
			}
			return fmt.Errorf("waiting for %s: %w", expr, context.Cause(ctx))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Text is the text of the first element selector matches ("" for none).
func (p *Page) Text(ctx context.Context, selector string) (string, error) {
	var s string
	err := p.Eval(ctx, fmt.Sprintf(`(document.querySelector(%q) || {}).innerText || ""`, selector), &s)
	return s, err
}

// Click clicks the first element selector matches, as a user would.
func (p *Page) Click(ctx context.Context, selector string) error {
	var found bool
	if err := p.Eval(ctx, fmt.Sprintf(`(() => { const e = document.querySelector(%q); if (!e) return false; e.click(); return true; })()`, selector), &found); err != nil {
		return err
	}
	if !found {
		return fmt.Errorf("no element %s on the page", selector)
	}
	return nil
}

// Screenshot writes the whole page (beyond the viewport) as a PNG to path.
func (p *Page) Screenshot(ctx context.Context, path string) error {
	var m struct {
		Content struct {
			Width  float64 `json:"width"`
			Height float64 `json:"height"`
		} `json:"cssContentSize"`
	}
	if err := p.b.call(ctx, p.session, "Page.getLayoutMetrics", nil, &m); err != nil {
		return err
	}
	var r struct {
		Data string `json:"data"`
	}
	params := map[string]any{"format": "png", "captureBeyondViewport": true}
	if m.Content.Width > 0 && m.Content.Height > 0 {
		params["clip"] = map[string]any{"x": 0, "y": 0, "width": m.Content.Width, "height": min(m.Content.Height, 8000), "scale": 1}
	}
	if err := p.b.call(ctx, p.session, "Page.captureScreenshot", params, &r); err != nil {
		return err
	}
	png, err := base64.StdEncoding.DecodeString(r.Data)
	if err != nil {
		return err
	}
	return os.WriteFile(path, png, 0o644)
}

// Cookies are the browser's cookies for url, "name=value" each.
func (p *Page) Cookies(ctx context.Context, url string) ([]string, error) {
	var r struct {
		Cookies []struct {
			Name, Value string
		} `json:"cookies"`
	}
	if err := p.b.call(ctx, p.session, "Network.getCookies", map[string]any{"urls": []string{url}}, &r); err != nil {
		return nil, err
	}
	var out []string
	for _, c := range r.Cookies {
		out = append(out, c.Name+"="+c.Value)
	}
	return out, nil
}
