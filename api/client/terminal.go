package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"
)

// TerminalOptions is a command to run on a terminal (Session.Terminal).
type TerminalOptions struct {
	// Command is a shell command line, run as /bin/sh -c Command on the
	// terminal ("bash -l", "vim notes.md").
	Command string
	// WorkingDirectory is where it runs; default the sandbox's.
	WorkingDirectory string
	// Env sets variables on top of what every command gets; give TERM
	// here (a terminal program needs it, and the sandbox cannot know the
	// caller's).
	Env map[string]string
	// Rows and Cols are the terminal's size; zero is the kernel's default.
	Rows, Cols uint16
}

// Terminal is a command running on a terminal of its own in the sandbox
// (Session.Terminal), over the service's PTY route: Read what the
// terminal shows (io.EOF once the command ended), Write what is typed,
// Resize it, Wait for the exit code, Close to hang up. Read it to the end:
// output that nobody reads holds the command back. A connection that
// drops is attached again (for up to ReattachWindow), from the byte the
// output had reached: nothing is lost or shown twice.
type Terminal struct {
	s      *Session
	cl     call
	id     string          // the terminal's, from the 101 (none: an older service)
	ctx    context.Context // the terminal's, ended by Close
	cancel context.CancelFunc
	out    *io.PipeReader
	done   chan struct{}

	mu  sync.Mutex
	ws  *websocket.Conn
	off int64 // output bytes received

	code int
	err  error // why the end is not an exit code; set before done closes
	once sync.Once
}

// ReattachWindow is how long a Terminal whose connection dropped tries to
// attach to its terminal again (the service keeps it for
// SANDGATE_PTY_GRACE, 30 s by default).
const ReattachWindow = 30 * time.Second

// terminalEnd is the PTY route's last message (or {"skipped": n} when
// attaching again).
type terminalEnd struct {
	ExitCode *int   `json:"exitCode"`
	Error    string `json:"error"`
	Status   int    `json:"status"`
	Skipped  *int64 `json:"skipped"`
}

// headerTerminal names the terminal in the PTY route's 101.
const headerTerminal = "X-Sandgate-Terminal"

// Terminal starts a command on a terminal of its own in the sandbox: a
// pseudo-terminal its agent allocates, so that shells, editors and
// pagers behave as at a console. ctx bounds the start only. A command
// that cannot start (a held credential in it, say) is said by Wait.
func (s *Session) Terminal(ctx context.Context, opts TerminalOptions) (*Terminal, error) {
	if opts.Command == "" {
		return nil, errors.New("TerminalOptions.Command is empty: give a command line such as \"bash -l\"")
	}
	cl := call{route: routePTY, args: []string{s.ID()}}
	ws, id, err := s.dialTerminal(ctx, cl, "")
	if err != nil {
		return nil, err
	}
	start := map[string]any{"command": opts.Command}
	if opts.WorkingDirectory != "" {
		start["workingDirectory"] = opts.WorkingDirectory
	}
	if len(opts.Env) > 0 {
		start["env"] = opts.Env
	}
	if opts.Rows > 0 && opts.Cols > 0 {
		start["rows"], start["cols"] = opts.Rows, opts.Cols
	}
	if err := ws.Write(ctx, websocket.MessageText, jsonBody(start)); err != nil {
		ws.CloseNow()
		return nil, fmt.Errorf("%s: %w", cl, err)
	}
	tctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	t := &Terminal{s: s, cl: cl, id: id, ws: ws, ctx: tctx, cancel: cancel, out: pr, done: make(chan struct{})}
	go t.read(pw)
	return t, nil
}

// dialTerminal opens the PTY route (query: "" for a new terminal), and
// says which terminal it carries.
func (s *Session) dialTerminal(ctx context.Context, cl call, query string) (*websocket.Conn, string, error) {
	c := s.r.sb.c
	_, p := cl.path()
	u := *c.base
	u.Scheme = map[string]string{"http": "ws", "https": "wss"}[u.Scheme]
	h := http.Header{}
	if err := c.authorize(ctx, h); err != nil {
		return nil, "", err
	}
	ws, resp, err := websocket.Dial(ctx, u.String()+p+query, &websocket.DialOptions{HTTPClient: c.hc, HTTPHeader: h})
	if err != nil {
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols {
			if resp.Body == nil {
				resp.Body = io.NopCloser(strings.NewReader(""))
			}
			return nil, "", s.notRunning(c.errorOf(cl, resp))
		}
		return nil, "", fmt.Errorf("%s: %w", cl, err)
	}
	ws.SetReadLimit(1 << 20)
	return ws, resp.Header.Get(headerTerminal), nil
}

func (t *Terminal) conn() *websocket.Conn {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ws
}

// read hands the terminal's output on until the service's last message
// and the close after it, attaching again when the connection drops.
func (t *Terminal) read(pw *io.PipeWriter) {
	defer close(t.done)
	ended := false
	for {
		typ, data, err := t.conn().Read(t.ctx)
		if err != nil {
			if !ended && t.ctx.Err() == nil && t.id != "" && websocket.CloseStatus(err) == -1 && t.reattach() {
				continue
			}
			if !ended {
				t.code, t.err = -1, fmt.Errorf("%s: the connection ended before the command did: %w", t.cl, err)
			}
			pw.Close()
			return
		}
		switch typ {
		case websocket.MessageBinary:
			t.mu.Lock()
			t.off += int64(len(data))
			t.mu.Unlock()
			pw.Write(data) // fails only once Close dropped the output
		case websocket.MessageText:
			var end terminalEnd
			if err := json.Unmarshal(data, &end); err != nil {
				t.code, t.err, ended = -1, fmt.Errorf("%s: a message that is not the terminal's end: %q", t.cl, data), true
				continue
			}
			if end.Skipped != nil && end.ExitCode == nil && end.Error == "" {
				// Output lost while the connection was down (older than
				// what the service keeps): not an end.
				continue
			}
			ended = true
			switch {
			case end.ExitCode != nil && end.Error == "":
				t.code = *end.ExitCode
			case end.ExitCode != nil:
				t.code, t.err = *end.ExitCode, errors.New(end.Error)
			default:
				t.code, t.err = -1, &ServiceError{Request: t.cl.String(), Status: end.Status, Message: end.Error}
			}
		}
	}
}

// reattach attaches to the terminal again after its connection dropped,
// from the output byte reached, retrying (with backoff) for up to
// ReattachWindow while the service may still keep it.
func (t *Terminal) reattach() bool {
	giveUp := time.Now().Add(ReattachWindow)
	for wait := 100 * time.Millisecond; time.Now().Before(giveUp); wait = min(2*wait, 5*time.Second) {
		t.mu.Lock()
		query := fmt.Sprintf("?terminal=%s&offset=%d", url.QueryEscape(t.id), t.off)
		t.mu.Unlock()
		ctx, cancel := context.WithTimeout(t.ctx, 30*time.Second)
		ws, _, err := t.s.dialTerminal(ctx, t.cl, query)
		cancel()
		if err == nil {
			t.mu.Lock()
			t.ws = ws
			t.mu.Unlock()
			return true
		}
		var se *ServiceError
		if errors.As(err, &se) || t.ctx.Err() != nil {
			return false // the service answered: gone, or taken by another client
		}
		select {
		case <-time.After(wait):
		case <-t.ctx.Done():
			return false
		}
	}
	return false
}

// Read reads what the terminal shows: io.EOF once the command ended and
// everything was read.
func (t *Terminal) Read(p []byte) (int, error) { return t.out.Read(p) }

// Write types p into the terminal.
func (t *Terminal) Write(p []byte) (int, error) {
	if err := t.conn().Write(t.ctx, websocket.MessageBinary, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Resize changes the terminal's size (the command gets SIGWINCH).
func (t *Terminal) Resize(rows, cols uint16) error {
	return t.conn().Write(t.ctx, websocket.MessageText, jsonBody(map[string]any{"resize": map[string]uint16{"rows": rows, "cols": cols}}))
}

// Wait waits for the command's end and returns its exit code (128+N for
// a signal N). The error says why there is none, or why the service
// ended the command (its input held a credential: 137): a command that
// could not start is a *ServiceError with the status the service gave.
// If ctx ends first, Wait returns its cause and the command keeps running.
func (t *Terminal) Wait(ctx context.Context) (int, error) {
	select {
	case <-t.done:
		return t.code, t.err
	case <-ctx.Done():
		return -1, context.Cause(ctx)
	}
}

// Close hangs the terminal up: a command still running is killed by the
// service.
func (t *Terminal) Close() error {
	t.once.Do(func() {
		t.conn().Close(websocket.StatusNormalClosure, "")
		t.cancel()
		t.out.CloseWithError(io.ErrClosedPipe)
	})
	return nil
}
