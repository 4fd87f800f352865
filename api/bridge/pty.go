package bridge

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"math"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/wsconn"
)

// The contract's terminal: GET /v1/sandbox/{id}/pty?cols=&rows=&shell=
// (and the session in Session-Id or ?session=), a WebSocket carrying
//
//	server → {"type":"ready"}                       (text, once the shell runs)
//	client → input                                  (binary; text that is not a control message too)
//	client → {"type":"resize","cols":N,"rows":N}    (text)
//	server → output                                 (binary)
//	server → {"type":"exit","code":N}               (text, last), then a normal close
//	server → {"type":"error","message":"…"}         (text, when the terminal fails)
//
// As in the contract's container, the shell outlives a WebSocket that
// goes away, for a while (pty's doc says how long, and what is replayed).
const (
	// ptyMaxMessage bounds a message from the client (a paste).
	ptyMaxMessage = 1 << 20
	// ptyChunk is the most output put in one message.
	ptyChunk = 32 << 10
	// ptyDefaultCols and ptyDefaultRows are the contract's defaults.
	ptyDefaultCols, ptyDefaultRows = 80, 24
)

// shellPattern is what ?shell= may name: a program, by path or name,
// without arguments.
var shellPattern = regexp.MustCompile(`^[A-Za-z0-9_./+-]{1,256}$`)

// defaultShell is the contract's shell, bash, where the image has it.
var defaultShell = []string{"/bin/sh", "-c", "command -v bash >/dev/null 2>&1 && exec bash; exec sh", "sh"}

// ptyQuery is what the terminal's URL asks for.
type ptyQuery struct {
	session string
	size    appliance.TermSize
	shell   []string
}

// parsePTYQuery reads the terminal's query and Session-Id. cols and rows
// are numbers as the contract reads them (a number of cells, rounded
// down; absent or empty means the default), within a terminal's range.
func parsePTYQuery(r *http.Request) (ptyQuery, error) {
	q := ptyQuery{shell: defaultShell}
	sid, err := sessionHeader(r)
	if err != nil {
		return q, err
	}
	if sid == "" {
		if s := r.URL.Query().Get("session"); s != "" {
			if err := checkSessionID(s); err != nil {
				return q, err
			}
			sid = s
		}
	}
	q.session = sid
	dim := func(name string, def uint16) (uint16, error) {
		v := strings.TrimSpace(r.URL.Query().Get(name))
		if v == "" {
			return def, nil
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || math.IsNaN(f) || f < 1 || f > math.MaxUint16 {
			return 0, invalid("cols and rows must be valid numbers (1 to 65535): %s is %q", name, v)
		}
		return uint16(f), nil
	}
	if q.size.Cols, err = dim("cols", ptyDefaultCols); err != nil {
		return q, err
	}
	if q.size.Rows, err = dim("rows", ptyDefaultRows); err != nil {
		return q, err
	}
	if sh := r.URL.Query().Get("shell"); sh != "" {
		if !shellPattern.MatchString(sh) || strings.Contains(sh, "..") {
			return q, invalid("shell must name a program (a path or a name: letters, digits and ._/+-), without arguments")
		}
		q.shell = []string{sh}
	}
	return q, nil
}

// ptyMessage is a text message of the terminal, either way.
type ptyMessage struct {
	Type    string `json:"type"`
	Code    *int   `json:"code,omitempty"`
	Message string `json:"message,omitempty"`
	Cols    *int   `json:"cols,omitempty"`
	Rows    *int   `json:"rows,omitempty"`
}

// resize reads a resize control message; ok is false for text that is
// not one (typed input).
func parseResize(data []byte) (size appliance.TermSize, ok bool) {
	var m ptyMessage
	if json.Unmarshal(data, &m) != nil || m.Type != "resize" || m.Cols == nil || m.Rows == nil {
		return size, false
	}
	clamp := func(v int) uint16 { return uint16(min(max(v, 1), math.MaxUint16)) }
	return appliance.TermSize{Cols: clamp(*m.Cols), Rows: clamp(*m.Rows)}, true
}

// ptyKey names a session's terminal (the sandbox's own terminal without
// one), as the contract's container keeps one per session.
func ptyKey(session string) string {
	if session == "" {
		return "bridge"
	}
	return "bridge-session:" + session
}

// pty runs a shell on a terminal in the sandbox (made on first use, as
// every route under an id) and carries it over a WebSocket. The shell
// starts in the session's directory with its variables (/workspace
// without one), TERM=xterm-256color unless the session sets it. A
// session's terminal (the sandbox's own without a session) outlives a
// client that goes away for the service's grace (SANDGATE_PTY_GRACE):
// a client that connects again within it gets what the terminal kept of
// its output (the last 256 KiB) in one message before ready, and the
// terminal from there on; past it, the shell is hung up, and the next
// connection gets a new one.
func (b *Bridge) pty(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
		return invalid("WebSocket upgrade required")
	}
	q, err := parsePTYQuery(r)
	if err != nil {
		return err
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	ctx := r.Context()
	var live wsconn.Liveness
	alive := live.Alive
	key := ptyKey(q.session)
	term, err := b.b.AttachTerminal(ctx, id, key, 0, alive)
	back := err == nil
	for range 2 {
		if !errors.Is(err, appliance.ErrNotFound) {
			break
		}
		if term, err = b.openTerminal(ctx, id, key, q, alive); errors.Is(err, appliance.ErrExists) {
			// Another connection made it meanwhile: attach to it.
			term, err = b.b.AttachTerminal(ctx, id, key, 0, alive)
			back = err == nil
		}
	}
	if err != nil {
		return err
	}
	// No Origin check: the key stands in front, and a browser page cannot
	// send it in a WebSocket handshake.
	ws, err := websocket.Accept(w, r, &websocket.AcceptOptions{InsecureSkipVerify: true})
	if err != nil {
		term.Detach()
		return nil // Accept wrote the refusal
	}
	defer ws.CloseNow()
	live.Set(ws)
	ws.SetReadLimit(ptyMaxMessage)
	send := func(m ptyMessage) error {
		data, _ := json.Marshal(m)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return ws.Write(wctx, websocket.MessageText, data)
	}
	if back {
		// What the terminal kept, in one message, then ready: what the
		// contract's xterm add-on draws again after it cleared its screen.
		if data := term.Replay(); len(data) > 0 && ws.Write(ctx, websocket.MessageBinary, data) != nil {
			term.Detach()
			return nil
		}
	}
	if send(ptyMessage{Type: "ready"}) != nil {
		term.Detach()
		return nil
	}

	var left atomic.Bool
	input := make(chan struct{})
	go func() {
		defer close(input)
		for {
			typ, data, err := ws.Read(ctx)
			if err != nil {
				left.Store(true)
				term.Detach() // the client is gone: it may come back
				return
			}
			if typ == websocket.MessageText {
				if size, ok := parseResize(data); ok {
					term.Resize(size) // fails only once the shell ended
					continue
				}
			}
			// A refused credential kills the shell: Wait says why.
			if _, err := term.Write(data); err != nil {
				return
			}
		}
	}()
	sendErr := wsconn.Send(ctx, ws, term, ptyChunk)
	switch {
	case term.Taken():
		send(ptyMessage{Type: "error", Message: "terminal failed: " + appliance.ErrTerminalTaken.Error()})
		ws.Close(websocket.StatusNormalClosure, "")
	case sendErr != nil:
		term.Detach()
	case left.Load():
	default: // the shell ended: the next connection gets a new one
		code, err := term.Finish(ctx)
		if err != nil {
			send(ptyMessage{Type: "error", Message: "terminal failed: " + err.Error()})
		}
		if send(ptyMessage{Type: "exit", Code: &code}) == nil {
			ws.Close(websocket.StatusNormalClosure, "")
		}
	}
	ws.CloseNow()
	<-input
	return nil
}

// openTerminal starts the shell of a session's terminal.
func (b *Bridge) openTerminal(ctx context.Context, id, key string, q ptyQuery, alive func(context.Context) error) (*appliance.Terminal, error) {
	var sess appliance.Session
	if q.session != "" {
		var err error
		if sess, err = b.b.Session(ctx, id, q.session); err != nil && !errors.Is(err, appliance.ErrNotFound) {
			return nil, err
		}
	}
	dir := Workspace
	if sess.Dir != "" {
		dir = sess.Dir
	}
	env := make([]string, 0, len(sess.Env)+1)
	if _, ok := sess.Env["TERM"]; !ok {
		env = append(env, "TERM=xterm-256color")
	}
	for _, k := range slices.Sorted(maps.Keys(sess.Env)) {
		env = append(env, k+"="+sess.Env[k])
	}
	return b.b.OpenTerminal(ctx, id, appliance.TerminalRequest{Args: q.shell, Env: env, Dir: dir, Size: q.size, Key: key, Alive: alive})
}
