package server

import (
	"bufio"
	"context"
	"errors"
	"io"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
)

// bodyEOF notes when a request body has been read to its end.
type bodyEOF struct {
	r    io.Reader
	done atomic.Bool
}

func (b *bodyEOF) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if err == io.EOF {
		b.done.Store(true)
	}
	return n, err
}

// envName is protocol 1's rule for variable names.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// readLine reads exec's first line: at most api.MaxJSONBody bytes before
// the newline (413), and a newline there must be (400).
func readLine(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		frag, err := br.ReadSlice('\n')
		line = append(line, frag...)
		n := len(line)
		if err == nil {
			n-- // the newline
		}
		if n > api.MaxJSONBody {
			return nil, errorf(http.StatusRequestEntityTooLarge, "the exec request's first line (its JSON) is over %d bytes", api.MaxJSONBody)
		}
		if err == nil {
			return line[:len(line)-1], nil
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if errors.Is(err, io.EOF) {
			return nil, badRequest("the exec request must be one line of JSON, a newline, then the command's stdin; the body ended without the newline")
		}
		return nil, badRequest("reading the exec request: %v", err)
	}
}

// exec is protocol 1's exec: one line of JSON, a newline, then stdin;
// the answer is frames (open, the output, the exit code) and the command
// outlives a stream that breaks (its exit code stays for the wait route,
// its output for the output route).
func (s *Server) exec(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	// Not running → 404, checked before the body is read.
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	body := &bodyEOF{r: r.Body}
	br := bufio.NewReaderSize(body, 64<<10)
	line, err := readLine(br)
	if err != nil {
		return err
	}
	o, err := parseObject(line)
	if err != nil {
		return err
	}
	command, err := o.required("command")
	if err != nil {
		return err
	}
	dir, _, err := o.str("workingDirectory")
	if err != nil {
		return err
	}
	own, _, err := o.strMap("env")
	if err != nil {
		return err
	}
	env := make([]string, 0, len(own))
	for _, k := range slices.Sorted(maps.Keys(own)) {
		env = append(env, k+"="+own[k])
	}
	if dir == "" {
		dir = sandboxDir(s.cfg.WorkDir, name)
	}
	// The stdin already here is looked at before anything starts: a
	// secret in it is a 400 like one in the command. What is still on its
	// way is guarded as it streams.
	head, _ := br.Peek(br.Buffered())
	head = slices.Clone(head)
	br.Discard(len(head))
	p, err := s.b.Exec(r.Context(), name, appliance.ExecRequest{
		Args: []string{"/bin/sh", "-c", command}, Env: env, Dir: dir,
		StdinHead: head, Stdin: br, MissingDirFails: true,
		// Names are checked after the credential guard, so that a refused
		// name never quotes a secret back.
		Check: func() error {
			for _, k := range slices.Sorted(maps.Keys(own)) {
				if !envName.MatchString(k) {
					return badRequest("environment variable name %q: names are letters, digits and _, not starting with a digit", k)
				}
			}
			return nil
		},
	})
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(api.HeaderProcessID, p.ID())
	rc := http.NewResponseController(w)
	rc.EnableFullDuplex() // stdin may still be arriving while output goes out
	if r.ProtoMajor == 1 && !body.done.Load() {
		// Stdin may outlive the command (or the command never started).
		// Under full duplex, Go's HTTP/1 server reads what is left of the
		// body after the handler and then panics on the connection's next
		// request (golang/go#68560); so when the handler ends, any read of
		// the body (the stdin copier's) is cut short, and the connection
		// is not reused. A body already read to its end (no stdin, or a
		// little) keeps the connection.
		w.Header().Set("Connection", "close")
		defer rc.SetReadDeadline(time.Now())
	}
	w.WriteHeader(http.StatusOK)
	if err := api.WriteFrame(w, api.FrameOpen, 0, []byte(p.ID())); err != nil {
		return nil
	}
	rc.Flush()
	// A stream that breaks leaves the process running: its output goes on
	// into the buffer, its exit code to the wait route.
	streamFrames(r.Context(), w, func() { rc.Flush() }, p, 0)
	return nil
}

// streamFrames writes a process's output from offset off as Data frames
// and, once it has exited, its Exit frame.
func streamFrames(ctx context.Context, w io.Writer, flush func(), p *appliance.Process, off int64) error {
	code, err := p.Follow(ctx, off, func(channel int, data []byte) error {
		return api.WriteData(w, uint32(channel), data)
	}, flush)
	if err != nil {
		return err
	}
	if err := api.WriteFrame(w, api.FrameExit, 0, []byte(strconv.Itoa(code))); err != nil {
		return err
	}
	flush()
	return nil
}

func (s *Server) wait(w http.ResponseWriter, r *http.Request) error {
	p, err := s.b.Process(r.PathValue("name"), r.PathValue("pid"))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.WaitTimeout)
	defer cancel()
	code, exited := p.Wait(ctx)
	if !exited {
		writeJSON(w, http.StatusOK, api.ProcessState{Running: true})
		return nil
	}
	writeJSON(w, http.StatusOK, api.ProcessState{ExitCode: &code})
	return nil
}

func (s *Server) kill(w http.ResponseWriter, r *http.Request) error {
	p, err := s.b.Process(r.PathValue("name"), r.PathValue("pid"))
	if err != nil {
		return err
	}
	if err := p.Signal(r.Context(), syscall.SIGTERM); err != nil {
		return err
	}
	noContent(w)
	return nil
}

// killAll kills every process of a running sandbox. A sandbox the
// service suspended on its own has none (they ended with the suspend):
// 204, without waking it for nothing; one its caller suspended is not
// running (404), as protocol 1 says.
func (s *Server) killAll(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := s.b.KillAll(r.Context(), name); err != nil {
		if !errors.Is(err, appliance.ErrNotRunning) {
			return err
		}
		if in, gerr := s.b.Get(r.Context(), name); gerr != nil || in.State != appliance.Suspended || !in.SuspendedBy.Wakes() {
			return err
		}
	}
	noContent(w)
	return nil
}

// output streams a process's output from byte ?offset=N (of its stdout and
// stderr together, as the Data frames carried them) in exec's frames,
// following until it exits: what a client whose exec stream broke resumes
// with.
func (s *Server) output(w http.ResponseWriter, r *http.Request) error {
	p, err := s.b.Process(r.PathValue("name"), r.PathValue("pid"))
	if err != nil {
		return err
	}
	off, err := strconv.ParseInt(r.URL.Query().Get("offset"), 10, 64)
	if q := r.URL.Query().Get("offset"); q == "" {
		off, err = 0, nil
	}
	if err != nil || off < 0 {
		return badRequest("offset %q: want the number of output bytes already received", r.URL.Query().Get("offset"))
	}
	_, end := p.Range()
	if off > end {
		return badRequest("offset %d is past the %d bytes of output process %s has written so far", off, end, p.ID())
	}
	if err := p.Available(off); err != nil {
		return err // 410, saying why and what is still kept
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(api.HeaderProcessID, p.ID())
	rc := http.NewResponseController(w)
	w.WriteHeader(http.StatusOK)
	if err := api.WriteFrame(w, api.FrameOpen, 0, []byte(p.ID())); err != nil {
		return nil
	}
	rc.Flush()
	if err := streamFrames(r.Context(), w, func() { rc.Flush() }, p, off); errors.Is(err, appliance.ErrOutputDropped) {
		s.log.Info("an output stream fell behind what is kept", "process", p.ID())
	}
	return nil
}
