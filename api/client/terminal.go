package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"

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
// output that nobody reads holds the command back.
type Terminal struct {
	ws     *websocket.Conn
	ctx    context.Context // the connection's, ended by Close
	cancel context.CancelFunc
	out    *io.PipeReader
	done   chan struct{}

	code int
	err  error // why the end is not an exit code; set before done closes
	once sync.Once
}

// terminalEnd is the PTY route's last message.
type terminalEnd struct {
	ExitCode *int   `json:"exitCode"`
	Error    string `json:"error"`
	Status   int    `json:"status"`
}

// Terminal starts a command on a terminal of its own in the sandbox: a
// pseudo-terminal its agent allocates, so that shells, editors and
// pagers behave as at a console. ctx bounds the start only. A command
// that cannot start (a held credential in it, say) is said by Wait.
func (s *Session) Terminal(ctx context.Context, opts TerminalOptions) (*Terminal, error) {
	if opts.Command == "" {
		return nil, errors.New("TerminalOptions.Command is empty: give a command line such as \"bash -l\"")
	}
	c := s.r.sb.c
	cl := call{route: routePTY, args: []string{s.ID()}}
	_, p := cl.path()
	u := *c.base
	u.Scheme = map[string]string{"http": "ws", "https": "wss"}[u.Scheme]
	h := http.Header{}
	if err := c.authorize(ctx, h); err != nil {
		return nil, err
	}
	ws, resp, err := websocket.Dial(ctx, u.String()+p, &websocket.DialOptions{HTTPClient: c.hc, HTTPHeader: h})
	if err != nil {
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols {
			if resp.Body == nil {
				resp.Body = io.NopCloser(strings.NewReader(""))
			}
			return nil, s.notRunning(c.errorOf(cl, resp))
		}
		return nil, fmt.Errorf("%s: %w", cl, err)
	}
	ws.SetReadLimit(1 << 20)
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
	t := &Terminal{ws: ws, ctx: tctx, cancel: cancel, out: pr, done: make(chan struct{})}
	go t.read(pw, cl)
	return t, nil
}

// read hands the terminal's output on until the service's last message
// and the close after it.
func (t *Terminal) read(pw *io.PipeWriter, cl call) {
	defer close(t.done)
	ended := false
	for {
		typ, data, err := t.ws.Read(t.ctx)
		if err != nil {
			if !ended {
				t.code, t.err = -1, fmt.Errorf("%s: the connection ended before the command did: %w", cl, err)
			}
			pw.Close()
			return
		}
		switch typ {
		case websocket.MessageBinary:
			pw.Write(data) // fails only once Close dropped the output
		case websocket.MessageText:
			var end terminalEnd
			if err := json.Unmarshal(data, &end); err != nil {
				t.code, t.err, ended = -1, fmt.Errorf("%s: a message that is not the terminal's end: %q", cl, data), true
				continue
			}
			ended = true
			switch {
			case end.ExitCode != nil && end.Error == "":
				t.code = *end.ExitCode
			case end.ExitCode != nil:
				t.code, t.err = *end.ExitCode, errors.New(end.Error)
			default:
				t.code, t.err = -1, &ServiceError{Request: cl.String(), Status: end.Status, Message: end.Error}
			}
		}
	}
}

// Read reads what the terminal shows: io.EOF once the command ended and
// everything was read.
func (t *Terminal) Read(p []byte) (int, error) { return t.out.Read(p) }

// Write types p into the terminal.
func (t *Terminal) Write(p []byte) (int, error) {
	if err := t.ws.Write(t.ctx, websocket.MessageBinary, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Resize changes the terminal's size (the command gets SIGWINCH).
func (t *Terminal) Resize(rows, cols uint16) error {
	return t.ws.Write(t.ctx, websocket.MessageText, jsonBody(map[string]any{"resize": map[string]uint16{"rows": rows, "cols": cols}}))
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
		t.ws.Close(websocket.StatusNormalClosure, "")
		t.cancel()
		t.out.CloseWithError(io.ErrClosedPipe)
	})
	return nil
}
