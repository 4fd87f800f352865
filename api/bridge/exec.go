package bridge

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/transforms"
)

// HeaderProcessID names the process an exec stream carries: its output
// can be read again from GET /v1/sandbox/{id}/exec/{pid}?offset=N.
const HeaderProcessID = "X-Process-Id"

// keepAlive is how long an exec stream may be silent before it carries an
// SSE comment, so that no proxy on the way takes it for dead.
const keepAlive = 25 * time.Second

// exec runs a command and streams its output as the contract's SSE
// events: stdout and stderr (base64), then exit {"exit_code":N}, or error
// {"error","code"}. The command outlives the stream: closing it does not
// stop the command (DELETE /v1/sandbox/{id} does), and its output stays
// readable from its X-Process-Id. With a Session-Id it runs in that
// session's shell (made on first use in /workspace, as the contract's
// container makes it), after the session's command before it: a stream
// that must wait for its turn starts at once, and keeps alive meanwhile.
func (b *Bridge) exec(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	sid, err := sessionHeader(r)
	if err != nil {
		return err
	}
	data, err := io.ReadAll(io.LimitReader(r.Body, maxJSON+1))
	if err != nil {
		return invalid("Could not read request body: %v", err)
	}
	if len(data) > maxJSON {
		return invalid("the exec request is over %d bytes", maxJSON)
	}
	req, err := parseExecBody(data)
	if err != nil {
		return err
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	ereq := appliance.ExecRequest{Args: shellArgs(req.argv), Dir: Workspace, MissingDirFails: true, Timeout: req.timeout}
	if req.cwd != "" {
		ereq.Dir = req.cwd
	}
	var s *sseStream
	stopWait := func() {}
	if sid != "" {
		// A session not created yet is made with the defaults, as the
		// contract's container makes it on demand.
		if _, err := b.b.Session(r.Context(), id, sid); errors.Is(err, appliance.ErrNotFound) {
			if err := b.b.CreateSession(r.Context(), id, sid, appliance.Session{Dir: Workspace}); err != nil && !errors.Is(err, appliance.ErrExists) {
				return err
			}
		} else if err != nil {
			return err
		}
		ereq.Args, ereq.Dir, ereq.Session = req.argv, req.cwd, sid
		ereq.Queued = func() {
			s = startSSE(w)
			stopWait = s.keepAlive(keepAlive)
		}
	}
	p, err := b.b.Exec(r.Context(), id, ereq)
	stopWait()
	if err != nil && callerFault(err) && s == nil {
		return err
	}
	if s == nil {
		if p != nil {
			w.Header().Set(HeaderProcessID, p.ID())
		}
		s = startSSE(w)
	} else if p != nil {
		// The headers went out while it waited: the process id travels
		// as a comment, which the contract's clients skip.
		s.comment(HeaderProcessID + ": " + p.ID())
	}
	if err != nil {
		code := codeExecTransport
		if callerFault(err) {
			code = codeInvalid
		}
		s.event("error", errorEvent("exec failed: "+err.Error(), code))
		return nil
	}
	b.follow(r.Context(), s, p, 0)
	return nil
}

// callerFault says whether an exec's failure to start is the request's
// (answered before the stream, as a 400) rather than the service's (an
// error event in the stream, as the contract sends its transport errors).
func callerFault(err error) bool {
	var ae *apiError
	return errors.As(err, &ae) || errors.Is(err, transforms.ErrCredential) || errors.Is(err, appliance.ErrBadInput) ||
		errors.Is(err, fs.ErrInvalid) || errors.Is(err, appliance.ErrCapacity) || errors.Is(err, appliance.ErrClosed)
}

// execOutput streams a process's output again, from byte ?offset=N of its
// stdout and stderr together (what the events before carried, decoded),
// in the same events: what a client whose stream broke resumes with.
// sandgate's own route beside the contract's.
func (b *Bridge) execOutput(w http.ResponseWriter, r *http.Request) error {
	p, err := b.b.Process(r.PathValue("id"), r.PathValue("pid"))
	if errors.Is(err, appliance.ErrNotFound) || errors.Is(err, appliance.ErrNotRunning) {
		return fail(http.StatusNotFound, codeInvalid, "%v", err)
	}
	if err != nil {
		return err
	}
	q := r.URL.Query().Get("offset")
	off, err := strconv.ParseInt(q, 10, 64)
	if q == "" {
		off, err = 0, nil
	}
	if err != nil || off < 0 {
		return invalid("offset %q: want the number of output bytes already received", q)
	}
	_, end := p.Range()
	if off > end {
		return invalid("offset %d is past the %d bytes of output process %s has written so far", off, end, p.ID())
	}
	if err := p.Available(off); err != nil {
		return fail(http.StatusGone, codeExec, "%v", err)
	}
	w.Header().Set(HeaderProcessID, p.ID())
	if r.Method == http.MethodHead {
		w.Header().Set("Content-Type", "text/event-stream")
		return nil
	}
	b.follow(r.Context(), startSSE(w), p, off)
	return nil
}

// follow writes p's output from off as events, then its exit. A stream
// whose caller went away just ends: the command goes on.
func (b *Bridge) follow(ctx context.Context, s *sseStream, p *appliance.Process, off int64) {
	stop := s.keepAlive(keepAlive)
	defer stop()
	code, err := p.Follow(ctx, off, func(channel int, data []byte) error {
		name := "stdout"
		if channel == appliance.Stderr {
			name = "stderr"
		}
		return s.event(name, []byte(base64.StdEncoding.EncodeToString(data)))
	}, s.flush)
	switch {
	case err == nil:
		data, _ := json.Marshal(map[string]int{"exit_code": code})
		s.event("exit", data)
	case ctx.Err() != nil:
	case errors.Is(err, appliance.ErrOutputDropped):
		s.event("error", errorEvent("exec failed: the stream fell behind the output kept: "+err.Error(), codeExec))
	default:
		s.event("error", errorEvent("exec failed: "+err.Error(), codeExec))
	}
	s.flush()
}

func errorEvent(msg, code string) []byte {
	data, _ := json.Marshal(ErrorBody{Error: msg, Code: code})
	return data
}

// sseStream writes server-sent events as the contract frames them:
// "event: NAME", one "data: LINE" per line of the data, a blank line.
// Writes are serialised (the keep-alive writes from its own goroutine).
type sseStream struct {
	w  http.ResponseWriter
	rc *http.ResponseController

	mu     sync.Mutex
	broken bool
}

// startSSE sends an event stream's status and headers.
func startSSE(w http.ResponseWriter) *sseStream {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("X-Accel-Buffering", "no") // nginx and its kin: do not hold events back
	w.WriteHeader(http.StatusOK)
	s := &sseStream{w: w, rc: http.NewResponseController(w)}
	s.flush()
	return s
}

// event writes one event; a broken stream stays broken.
func (s *sseStream) event(name string, data []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broken {
		return io.ErrClosedPipe
	}
	_, err := s.w.Write(appendEvent(nil, name, data))
	if err != nil {
		s.broken = true
	}
	return err
}

// appendEvent frames one event.
func appendEvent(b []byte, name string, data []byte) []byte {
	b = append(append(append(b, "event: "...), name...), '\n')
	for _, line := range strings.Split(string(data), "\n") {
		b = append(append(append(b, "data: "...), line...), '\n')
	}
	return append(b, '\n')
}

func (s *sseStream) flush() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.broken && s.rc.Flush() != nil {
		s.broken = true
	}
}

// keepAlive writes a comment every d while the stream is otherwise
// silent, until stop.
// comment writes an SSE comment line.
func (s *sseStream) comment(text string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.broken {
		if _, err := io.WriteString(s.w, ": "+text+"\n\n"); err != nil || s.rc.Flush() != nil {
			s.broken = true
		}
	}
}

func (s *sseStream) keepAlive(d time.Duration) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(d)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				s.comment("keep-alive")
			}
		}
	}()
	return func() { close(done); <-finished }
}
