package server

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/transforms"
)

// process is a command started by exec: its agent process, the recent
// output (for the exec stream and for resumable output) and its exit code.
type process struct {
	id    string
	agent *agent.Process // nil for a command that could not start

	mu        sync.Mutex
	cond      *sync.Cond
	chunks    []chunk // kept output, oldest first
	start     int64   // output offset of chunks[0]
	end       int64   // output bytes so far
	kept      int     // bytes in chunks
	limit     int
	followers map[*follower]struct{}
	exit      *int
	exited    time.Time
}

type chunk struct {
	channel uint32
	data    []byte
}

// follower is a stream attached to a process's output: while one is
// attached, the command is held back rather than output it has not sent
// being dropped.
type follower struct{ off int64 }

func newProcess(id string, limit int) *process {
	p := &process{id: id, limit: limit, followers: map[*follower]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	return p
}

// outputWriter is a process's stdout or stderr.
type outputWriter struct {
	p       *process
	channel uint32
}

func (w outputWriter) Write(b []byte) (int, error) {
	p := w.p
	p.mu.Lock()
	defer p.mu.Unlock()
	// Backpressure while a stream is attached and behind by the limit.
	for p.behind() {
		p.cond.Wait()
	}
	p.chunks = append(p.chunks, chunk{channel: w.channel, data: slices.Clone(b)})
	p.end += int64(len(b))
	p.kept += len(b)
	for p.kept > p.limit && len(p.chunks) > 1 {
		p.kept -= len(p.chunks[0].data)
		p.start += int64(len(p.chunks[0].data))
		p.chunks = p.chunks[1:]
	}
	p.cond.Broadcast()
	return len(b), nil
}

// behind reports whether an attached stream lags the output by the limit.
func (p *process) behind() bool {
	for f := range p.followers {
		if p.end-f.off >= int64(p.limit) {
			return true
		}
	}
	return false
}

func (p *process) finish(code int) {
	p.mu.Lock()
	p.exit = &code
	p.exited = time.Now()
	p.cond.Broadcast()
	p.mu.Unlock()
}

// state returns the exit code, or nil while it runs.
func (p *process) state() *int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exit
}

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

// ErrOutputDropped is a resume from an offset older than what is kept.
var errOutputDropped = errors.New("output dropped")

// stream writes the process's output from offset off to w as Data frames
// and, once it has exited, its Exit frame. It returns when the process has
// exited and everything is written, when ctx ends, or when w fails.
func (p *process) stream(ctx context.Context, w io.Writer, flush func(), off int64) error {
	f := &follower{off: off}
	p.mu.Lock()
	if off < p.start {
		start := p.start
		p.mu.Unlock()
		return fmt.Errorf("%w: bytes before %d are no longer kept (the last %d bytes of a process's output are)", errOutputDropped, start, p.limit)
	}
	p.followers[f] = struct{}{}
	p.mu.Unlock()
	stop := context.AfterFunc(ctx, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	defer stop()
	defer func() {
		p.mu.Lock()
		delete(p.followers, f)
		p.cond.Broadcast()
		p.mu.Unlock()
	}()
	for {
		p.mu.Lock()
		for f.off >= p.end && p.exit == nil && ctx.Err() == nil {
			p.cond.Wait()
		}
		if ctx.Err() != nil {
			p.mu.Unlock()
			return ctx.Err()
		}
		var out []chunk
		pos := p.start
		for _, c := range p.chunks {
			if next := pos + int64(len(c.data)); next > f.off {
				skip := max(0, f.off-pos)
				out = append(out, chunk{channel: c.channel, data: c.data[skip:]})
			}
			pos += int64(len(c.data))
		}
		end, exit := p.end, p.exit
		p.mu.Unlock()
		for _, c := range out {
			if err := api.WriteData(w, c.channel, c.data); err != nil {
				return err
			}
		}
		p.mu.Lock()
		f.off = end
		p.cond.Broadcast() // a writer held back may go on
		p.mu.Unlock()
		if exit != nil && f.off >= end {
			if err := api.WriteFrame(w, api.FrameExit, 0, []byte(strconv.Itoa(*exit))); err != nil {
				return err
			}
			flush()
			return nil
		}
		flush()
	}
}

// missingDir reports whether dir is certainly not a directory of the
// sandbox (the cause of a start that failed as not found).
func missingDir(ctx context.Context, sb *appliance.Sandbox, dir string) bool {
	fi, err := sb.Stat(ctx, dir)
	return errors.Is(err, fs.ErrNotExist) || (err == nil && !fi.IsDir())
}

// envName is protocol 1's rule for variable names.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

func newID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

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

// commandEnv is what a command is given on top of what the agent gives
// every command (PATH, HOME, LANG, the proxy variables, ...): the
// sandbox's base URLs, then the command's own variables, a base URL
// variable it sets being routed too.
func commandEnv(relay string, baseURLs, own map[string]string) ([]string, error) {
	env := map[string]string{}
	for k, v := range baseURLs {
		env[k] = agent.RouteBaseURL(relay, v)
	}
	for k, v := range own {
		if _, isBase := baseURLs[k]; isBase {
			v = agent.RouteBaseURL(relay, v)
		}
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for _, k := range slices.Sorted(maps.Keys(env)) {
		if !envName.MatchString(k) {
			return nil, badRequest("environment variable name %q: names are letters, digits and _, not starting with a digit", k)
		}
		out = append(out, k+"="+env[k])
	}
	return out, nil
}

// What the credential guard names when it refuses part of an exec.
const (
	whereCommand = "the command"
	whereDir     = "the working directory"
	whereEnv     = "the command's environment (a variable's name or value)"
	whereStdin   = "the command's stdin"
)

// startEnv checks a command's start against the credential guard and
// returns its variables (commandEnv). The caller's own variables, names
// and values, are guarded before anything else reads them, so that no
// error (a bad name is quoted) can carry a secret back; the variables as
// the sandbox gets them (base URLs routed) are guarded too.
func startEnv(g *transforms.Guard, relay string, baseURLs map[string]string, command, dir string, own map[string]string) ([]string, error) {
	if err := g.Check(whereCommand, command); err != nil {
		return nil, err
	}
	if err := g.Check(whereDir, dir); err != nil {
		return nil, err
	}
	for k, v := range own {
		if err := g.Check(whereEnv, k+"="+v); err != nil {
			return nil, err
		}
	}
	env, err := commandEnv(relay, baseURLs, own)
	if err != nil {
		return nil, err
	}
	if err := g.Check(whereEnv, env...); err != nil {
		return nil, err
	}
	return env, nil
}

// guardedStdin is a command's stdin through the credential guard, for the
// bytes that arrive once it runs. When a held secret comes, nothing of it
// goes in: the command is killed first, so that it cannot take the bytes
// before the secret for the whole of its input and act on them, and only
// then does its stdin end. Its exit code is then 137 and its stderr says
// why (the 200 and the process id are out by then: protocol 1 has no
// other place to say it).
type guardedStdin struct {
	r    io.Reader           // the guard's reader over the request body
	proc chan *agent.Process // the command, once Spawn returned it

	mu  sync.Mutex
	err error // the refusal, once a secret came
}

// stdinKillWait bounds how long a refused stdin waits for its command to
// be known and killed.
const stdinKillWait = 10 * time.Second

func (s *guardedStdin) Read(b []byte) (int, error) {
	n, err := s.r.Read(b)
	if errors.Is(err, transforms.ErrCredential) {
		s.mu.Lock()
		s.err = err
		s.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), stdinKillWait)
		defer cancel()
		select {
		case ap := <-s.proc: // the copier runs only once Spawn has it
			ap.Kill(ctx)
		case <-ctx.Done():
		}
	}
	return n, err
}

// refused is the guard's refusal of the command's stdin, or nil (also for
// a nil guardedStdin: no guard).
func (s *guardedStdin) refused() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// exitCode is a status as protocol 1 reports it: 128+n for a signal.
func exitCode(st agent.ExitStatus) int {
	if st.Signal != 0 {
		return 128 + int(st.Signal)
	}
	return st.Code
}

func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	sb, err := s.m.Sandbox(name)
	if err != nil {
		writeError(w, errNoSandbox(name))
		return
	}
	done := sb.Use()
	defer done()
	body := &bodyEOF{r: r.Body}
	br := bufio.NewReaderSize(body, 64<<10)
	line, err := readLine(br)
	if err != nil {
		writeError(w, err)
		return
	}
	o, err := parseObject(line)
	if err != nil {
		writeError(w, err)
		return
	}
	command, err := o.required("command")
	if err != nil {
		writeError(w, err)
		return
	}
	dir, _, err := o.str("workingDirectory")
	if err != nil {
		writeError(w, err)
		return
	}
	own, _, err := o.strMap("env")
	if err != nil {
		writeError(w, err)
		return
	}
	st := s.state(name)
	st.mu.Lock()
	baseURLs, g := s.effectiveBaseURLs(st.baseURLs), st.guard
	st.mu.Unlock()
	env, err := startEnv(g, sb.RelayAddr(), baseURLs, command, dir, own)
	if err != nil {
		writeError(w, err)
		return
	}
	if dir == "" {
		dir = sandboxDir(s.cfg.WorkDir, name)
	}
	// The stdin already here is looked at before anything starts: a
	// secret in it is a 400 like one in the command. What is still on its
	// way is guarded as it streams (guardedStdin).
	if b, _ := br.Peek(br.Buffered()); len(b) > 0 {
		if _, err := g.Scanner(whereStdin).Write(b); err != nil {
			writeError(w, err)
			return
		}
	}
	p := newProcess(newID(), s.cfg.OutputBytes)
	stdin := io.Reader(br)
	var gs *guardedStdin
	if !g.Empty() {
		gs = &guardedStdin{r: g.Reader(br, whereStdin), proc: make(chan *agent.Process, 1)}
		stdin = gs
	}
	ap, err := sb.Spawn(sb.Context(), agent.Cmd{
		Args: []string{"/bin/sh", "-c", command}, Env: env, Dir: dir,
		Stdin: stdin, Stdout: outputWriter{p, api.ChannelStdout}, Stderr: outputWriter{p, api.ChannelStderr},
	})
	switch {
	case err != nil && errors.Is(err, fs.ErrNotExist) && missingDir(r.Context(), sb, dir):
		// The working directory is not there: the command "runs" and
		// fails as a shell would, with code 2.
		outputWriter{p, api.ChannelStderr}.Write([]byte(fmt.Sprintf("sandgate: working directory %s: no such directory\n", dir)))
		p.finish(2)
	case err != nil:
		writeError(w, err)
		return
	default:
		p.agent = ap
		if gs != nil {
			gs.proc <- ap
		}
		go func() {
			status, err := ap.Wait(context.WithoutCancel(r.Context()))
			code := exitCode(status)
			if err != nil {
				code = 255
				outputWriter{p, api.ChannelStderr}.Write([]byte("sandgate: " + err.Error() + "\n"))
			}
			if refused := gs.refused(); refused != nil {
				outputWriter{p, api.ChannelStderr}.Write([]byte("sandgate: the command was killed and its stdin cut short: " + refused.Error() + "\n"))
			}
			p.finish(code)
		}()
	}
	st.pmu.Lock()
	st.procs[p.id] = p
	st.pmu.Unlock()
	s.met.execs.Inc()

	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(api.HeaderProcessID, p.id)
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
	flush := func() { rc.Flush() }
	if err := api.WriteFrame(w, api.FrameOpen, 0, []byte(p.id)); err != nil {
		return
	}
	flush()
	// A stream that breaks leaves the process running: its output goes on
	// into the buffer, its exit code to the wait route.
	p.stream(r.Context(), w, flush, 0)
}

// process finds a process of a running sandbox.
func (s *Server) process(name, pid string) (*appliance.Sandbox, *process, error) {
	sb, err := s.m.Sandbox(name)
	if err != nil {
		return nil, nil, errNoSandbox(name)
	}
	st := s.state(name)
	st.pmu.Lock()
	p := st.procs[pid]
	st.pmu.Unlock()
	if p == nil {
		return nil, nil, errorf(http.StatusNotFound, "no process %q in sandbox %q (processes are forgotten %s after they exit)", pid, name, s.cfg.ProcessRetention)
	}
	return sb, p, nil
}

func (s *Server) wait(w http.ResponseWriter, r *http.Request) {
	_, p, err := s.process(r.PathValue("name"), r.PathValue("pid"))
	if err != nil {
		writeError(w, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.WaitTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	defer stop()
	p.mu.Lock()
	for p.exit == nil && ctx.Err() == nil {
		p.cond.Wait()
	}
	exit := p.exit
	p.mu.Unlock()
	if exit == nil {
		writeJSON(w, http.StatusOK, api.ProcessState{Running: true})
		return
	}
	writeJSON(w, http.StatusOK, api.ProcessState{ExitCode: exit})
}

func (s *Server) kill(w http.ResponseWriter, r *http.Request) {
	_, p, err := s.process(r.PathValue("name"), r.PathValue("pid"))
	if err != nil {
		writeError(w, err)
		return
	}
	if p.agent != nil && p.state() == nil {
		if err := p.agent.Signal(r.Context(), syscall.SIGTERM); err != nil && p.state() == nil {
			writeError(w, err)
			return
		}
	}
	noContent(w)
}

func (s *Server) killAll(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	sb, err := s.m.Sandbox(name)
	if err != nil {
		writeError(w, errNoSandbox(name))
		return
	}
	if _, err := sb.KillAll(r.Context()); err != nil {
		writeError(w, err)
		return
	}
	noContent(w)
}

// output streams a process's output from byte ?offset=N (of its stdout and
// stderr together, as the Data frames carried them) in exec's frames,
// following until it exits: what a client whose exec stream broke resumes
// with.
func (s *Server) output(w http.ResponseWriter, r *http.Request) {
	_, p, err := s.process(r.PathValue("name"), r.PathValue("pid"))
	if err != nil {
		writeError(w, err)
		return
	}
	off, err := strconv.ParseInt(r.URL.Query().Get("offset"), 10, 64)
	if q := r.URL.Query().Get("offset"); q == "" {
		off, err = 0, nil
	}
	if err != nil || off < 0 {
		writeError(w, badRequest("offset %q: want the number of output bytes already received", r.URL.Query().Get("offset")))
		return
	}
	p.mu.Lock()
	start, end := p.start, p.end
	p.mu.Unlock()
	if off > end {
		writeError(w, badRequest("offset %d is past the %d bytes of output process %s has written so far", off, end, p.id))
		return
	}
	if off < start {
		writeError(w, errorf(http.StatusGone, "bytes before %d of process %s's output are no longer kept (the last %d bytes are)", start, p.id, s.cfg.OutputBytes))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(api.HeaderProcessID, p.id)
	rc := http.NewResponseController(w)
	w.WriteHeader(http.StatusOK)
	if err := api.WriteFrame(w, api.FrameOpen, 0, []byte(p.id)); err != nil {
		return
	}
	rc.Flush()
	p.stream(r.Context(), w, func() { rc.Flush() }, off)
}

// janitor forgets processes that exited more than ProcessRetention ago.
func (s *Server) janitor() {
	tick := time.NewTicker(min(s.cfg.ProcessRetention/4, time.Minute))
	defer tick.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
		s.mu.Lock()
		boxes := slices.Collect(maps.Values(s.boxes))
		s.mu.Unlock()
		for _, st := range boxes {
			st.pmu.Lock()
			for id, p := range st.procs {
				p.mu.Lock()
				old := p.exit != nil && time.Since(p.exited) > s.cfg.ProcessRetention && len(p.followers) == 0
				p.mu.Unlock()
				if old {
					delete(st.procs, id)
				}
			}
			st.pmu.Unlock()
		}
	}
}
