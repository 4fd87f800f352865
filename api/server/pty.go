package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/wsconn"
)

// The PTY route: a command on a terminal of its own, over a WebSocket.
//
//	client → {"command", "workingDirectory"?, "env"?, "rows"?, "cols"?}   (text, first)
//	client → terminal input                                               (binary)
//	client → {"resize": {"rows", "cols"}}                                 (text)
//	server → terminal output                                              (binary)
//	server → {"exitCode": n} or {"error": "…", "status": n}               (text, last), then a normal close
//
// The command travels in the first message, never in the URL (which front
// ends log). The 101 names the terminal (X-Sandgate-Terminal). The client
// closing the WebSocket (a close frame, 1000) before the exit hangs the
// terminal up: the command is killed. A connection that drops otherwise
// leaves the terminal running for the service's grace
// (SANDGATE_PTY_GRACE), its output kept (the last 256 KiB): the same
// route with ?terminal=<id>&offset=<bytes received> attaches again, with
// no first message, and gets the output from that byte on (after
// {"skipped": n} when n of those bytes were no longer kept). One client at
// a time: while one is attached and answers a ping, another is refused
// (409); one that does not answer is taken to be gone, and told so
// ({"error", "status": 409}) if it comes back.
const (
	// ptyStartWait bounds the wait for the first message.
	ptyStartWait = 30 * time.Second
	// ptyMaxMessage bounds a message from the client (a paste).
	ptyMaxMessage = 1 << 20
	// ptyChunk is the most output put in one message.
	ptyChunk = 32 << 10
)

// ptyStart is the first message of the PTY route.
type ptyStart struct {
	command, dir string
	env          map[string]string
	size         appliance.TermSize
}

// parsePTYStart reads the first message: sandgate's own body, so a field
// it does not know is refused by name.
func parsePTYStart(data []byte) (ptyStart, error) {
	var st ptyStart
	o, err := parseObject(data)
	if err != nil {
		return st, err
	}
	if err := o.only("the terminal's first message", "command", "workingDirectory", "env", "rows", "cols"); err != nil {
		return st, err
	}
	if st.command, err = o.required("command"); err != nil {
		return st, err
	}
	if st.dir, _, err = o.str("workingDirectory"); err != nil {
		return st, err
	}
	if st.env, _, err = o.strMap("env"); err != nil {
		return st, err
	}
	for k := range st.env {
		if !envName.MatchString(k) {
			// Not quoted: a name may be a credential (the guard, which
			// runs later, names only where it found one).
			return st, badRequest("env: a variable name is not letters, digits and _, not starting with a digit")
		}
	}
	if st.size, err = o.termSize(); err != nil {
		return st, err
	}
	return st, nil
}

// termSize reads "rows" and "cols", each absent or 0 to 65535.
func (o object) termSize() (appliance.TermSize, error) {
	var size appliance.TermSize
	for _, f := range []struct {
		name string
		v    *uint16
	}{{"rows", &size.Rows}, {"cols", &size.Cols}} {
		raw, ok := o[f.name]
		if !ok {
			continue
		}
		if err := json.Unmarshal(raw, f.v); err != nil {
			return size, badRequest("field %q must be a whole number from 0 to 65535", f.name)
		}
	}
	return size, nil
}

// ptyControl is a text message after the first: a resize.
func parsePTYControl(data []byte) (appliance.TermSize, error) {
	o, err := parseObject(data)
	if err != nil {
		return appliance.TermSize{}, err
	}
	if err := o.only("a terminal control message", "resize"); err != nil {
		return appliance.TermSize{}, err
	}
	raw, ok := o["resize"]
	if !ok || !isJSONObject(raw) {
		return appliance.TermSize{}, badRequest(`a terminal control message is {"resize": {"rows": N, "cols": N}}`)
	}
	ro, err := parseObject(raw)
	if err != nil {
		return appliance.TermSize{}, err
	}
	if err := ro.only("resize", "rows", "cols"); err != nil {
		return appliance.TermSize{}, err
	}
	return ro.termSize()
}

// ptyEnd is the last message of the PTY route.
type ptyEnd struct {
	ExitCode *int   `json:"exitCode,omitempty"`
	Error    string `json:"error,omitempty"`
	Status   int    `json:"status,omitempty"`
}

// HeaderTerminal names the terminal of a PTY route's WebSocket (in its
// 101), for a client that comes back to it (?terminal=).
const HeaderTerminal = "X-Sandgate-Terminal"

// terminalID is what ?terminal= may name.
var terminalID = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,160}$`)

// ptyAttach reads a reattaching terminal's query: ?terminal=ID and
// ?offset=N (the bytes of output received; absent: 0).
func ptyAttach(r *http.Request) (id string, offset int64, err error) {
	q := r.URL.Query()
	id = q.Get("terminal")
	if id == "" {
		return "", 0, nil
	}
	if !terminalID.MatchString(id) {
		return "", 0, badRequest("terminal %q: want the id the terminal's 101 named (X-Sandgate-Terminal)", id)
	}
	if o := q.Get("offset"); o != "" {
		if offset, err = strconv.ParseInt(o, 10, 64); err != nil || offset < 0 {
			return "", 0, badRequest("offset %q: want the number of the terminal's output bytes already received", o)
		}
	}
	return id, offset, nil
}

// pty runs a command on a terminal and carries it over a WebSocket, or
// attaches again to one whose client went away (?terminal=).
func (s *Server) pty(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		return err
	}
	if !isWebSocket(r) {
		return errorf(http.StatusUpgradeRequired, "the terminal route is a WebSocket: send a WebSocket handshake (Upgrade: websocket)")
	}
	attachID, offset, err := ptyAttach(r)
	if err != nil {
		return err
	}
	ctx := r.Context()
	var live wsconn.Liveness
	alive := live.Alive
	var term *appliance.Terminal
	if attachID != "" {
		// No wake: a suspended sandbox's terminals ended with it.
		if term, err = s.b.AttachTerminal(ctx, name, attachID, offset, alive); err != nil {
			return err
		}
		w.Header().Set(HeaderTerminal, attachID)
	} else {
		if err := s.awake(ctx, name); err != nil {
			return err
		}
		var b [12]byte
		rand.Read(b[:])
		attachID = hex.EncodeToString(b[:])
		w.Header().Set(HeaderTerminal, attachID)
	}
	// No Origin check: no browser can call this service (a token, or
	// LocalOnly, stands in front); its clients are programs.
	ws, err := websocket.Accept(w, r, &websocket.AcceptOptions{InsecureSkipVerify: true})
	if err != nil {
		if term != nil {
			term.Detach()
		}
		return nil // Accept wrote the refusal
	}
	defer ws.CloseNow()
	live.Set(ws)
	ws.SetReadLimit(ptyMaxMessage)
	end := func(e ptyEnd) {
		b, _ := json.Marshal(e)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		ws.Write(wctx, websocket.MessageText, b)
		ws.Close(websocket.StatusNormalClosure, "")
	}
	fail := func(err error) { end(ptyEnd{Error: err.Error(), Status: status(err)}) }

	if term == nil {
		sctx, cancel := context.WithTimeout(ctx, ptyStartWait)
		typ, data, err := ws.Read(sctx)
		cancel()
		if err != nil {
			return nil // gone, or silent: nothing started
		}
		if typ != websocket.MessageText {
			fail(badRequest("the terminal's first message is text: JSON {command, workingDirectory?, env?, rows?, cols?}"))
			return nil
		}
		start, err := parsePTYStart(data)
		if err != nil {
			fail(err)
			return nil
		}
		dir := start.dir
		if dir == "" {
			dir = sandboxDir(s.cfg.WorkDir, name)
		}
		env := make([]string, 0, len(start.env))
		for _, k := range slices.Sorted(maps.Keys(start.env)) {
			env = append(env, k+"="+start.env[k])
		}
		term, err = s.b.OpenTerminal(ctx, name, appliance.TerminalRequest{
			Args: []string{"/bin/sh", "-c", start.command}, Env: env, Dir: dir, Size: start.size, Key: attachID, Alive: alive,
		})
		if err != nil {
			fail(err)
			return nil
		}
	} else if n := term.Skipped(); n > 0 {
		b, _ := json.Marshal(map[string]int64{"skipped": n})
		if ws.Write(ctx, websocket.MessageText, b) != nil {
			term.Detach()
			return nil
		}
	}

	in := &terminalIn{ws: ws, term: term}
	input := make(chan struct{})
	go func() { defer close(input); in.run(ctx) }()
	sendErr := wsconn.Send(ctx, ws, term, ptyChunk)
	switch bad := in.refused(); {
	case bad != nil:
		fail(bad)
	case term.Taken():
		fail(appliance.ErrTerminalTaken)
	case sendErr != nil: // the client is gone without a word: it may come back
		term.Detach()
	case in.left():
	default: // the command ended
		code, err := term.Finish(ctx)
		if err != nil {
			end(ptyEnd{ExitCode: &code, Error: err.Error()})
		} else {
			end(ptyEnd{ExitCode: &code})
		}
	}
	ws.CloseNow()
	<-input
	return nil
}

// terminalIn carries what the client sends into the terminal, until the
// WebSocket ends: a close frame of the client's (1000) hangs the terminal
// up, a connection that ends otherwise leaves it for the client to come
// back to. A control message it cannot read hangs the terminal up too,
// and is the terminal's end.
type terminalIn struct {
	ws   *websocket.Conn
	term *appliance.Terminal

	mu   sync.Mutex
	bad  error
	gone bool // the client closed, or went away
}

func (t *terminalIn) run(ctx context.Context) {
	for {
		typ, data, err := t.ws.Read(ctx)
		if err != nil {
			t.mu.Lock()
			t.gone = true
			t.mu.Unlock()
			if websocket.CloseStatus(err) == websocket.StatusNormalClosure {
				t.term.Close()
			} else {
				t.term.Detach()
			}
			return
		}
		switch typ {
		case websocket.MessageBinary:
			// A refused credential kills the command: Wait says why.
			t.term.Write(data)
		case websocket.MessageText:
			size, err := parsePTYControl(data)
			if err != nil {
				t.mu.Lock()
				t.bad = err
				t.mu.Unlock()
				t.term.Close()
				return
			}
			t.term.Resize(size) // fails only once the command ended
		}
	}
}

// refused is the control message that ended the terminal, or nil.
func (t *terminalIn) refused() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.bad
}

// left says whether the client closed the connection or went away.
func (t *terminalIn) left() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.gone
}

// isWebSocket reports whether r asks for a WebSocket.
func isWebSocket(r *http.Request) bool {
	return strings.EqualFold(r.Header.Get("Upgrade"), "websocket")
}
