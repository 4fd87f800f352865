package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"regexp"
	"strconv"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api"
)

// sandbox is what every view of one sandbox shares: its name, the
// service, its directories, and the processes started through it.
type sandbox struct {
	c       *Client
	id      string
	home    string
	workDir string

	mu    sync.Mutex
	procs map[string]*Process
}

// resolve makes a sandbox path absolute against the working directory.
func (sb *sandbox) resolve(p string) string {
	if p == "" {
		return sb.workDir
	}
	if !path.IsAbs(p) {
		p = path.Join(sb.workDir, p)
	}
	return path.Clean(p)
}

// killOwn stops the processes started through this sandbox's views that
// may still run.
func (sb *sandbox) killOwn(ctx context.Context) error {
	sb.mu.Lock()
	procs := make([]*Process, 0, len(sb.procs))
	for _, p := range sb.procs {
		procs = append(procs, p)
	}
	sb.mu.Unlock()
	var errs []error
	for _, p := range procs {
		if err := p.Kill(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// outputLimit is how much unread output a Process holds per stream before
// it stops reading the service's stream (which then holds the command
// back): the service keeps as much.
const outputLimit = 8 << 20

// Process is a command started by Spawn. Its output streams in as it is
// written; its exit code comes from Wait.
type Process struct {
	sb *sandbox
	id string

	// Stdout and Stderr stream the command's output as it arrives; nil
	// for a stream the Command sent to a writer of its own. Read both (or
	// close one you will not read): a stream holds at most 8 MiB unread,
	// and then the command is held back until it is read, as the service
	// holds it back.
	Stdout, Stderr io.ReadCloser

	done     chan struct{}
	code     int
	err      error
	stopCtx  func() bool // ends the kill-on-cancel hook
	canceled error       // the spawn context's cause, when it killed the process

	kmu    sync.Mutex
	killed bool
}

// ID is the process's id in the service.
func (p *Process) ID() string { return p.id }

// Wait waits for the command to exit and returns its exit code (128+n for
// signal n: 143 when it was killed). A non-zero exit is no error. The
// error is ctx's when it ends first, the spawn context's cause when its
// end killed the command, and otherwise a failure to learn the exit code
// (a service gone for good, or ErrOutputLost with the code when output
// was lost).
func (p *Process) Wait(ctx context.Context) (int, error) {
	select {
	case <-p.done:
		return p.code, p.err
	case <-ctx.Done():
		return -1, context.Cause(ctx)
	}
}

// Kill stops the command and everything it started (SIGTERM to its
// process group). Killing a process that has exited, or again, is no error.
func (p *Process) Kill(ctx context.Context) error {
	p.kmu.Lock()
	defer p.kmu.Unlock()
	if p.killed {
		return nil
	}
	select {
	case <-p.done:
		p.killed = true
		return nil
	default:
	}
	c := p.sb.c
	_, err := c.doJSON(ctx, call{route: routeKill, args: []string{p.sb.id, p.id}, idempotent: true, ok: []int{http.StatusNotFound}}, nil)
	if err != nil {
		return err
	}
	p.killed = true
	return nil
}

// spawn starts cmd and follows its output.
func (sb *sandbox) spawn(ctx context.Context, cmd Command) (*Process, error) {
	if err := context.Cause(ctx); ctx.Err() != nil {
		return nil, err
	}
	for k := range cmd.Env {
		if !envName.MatchString(k) {
			return nil, fmt.Errorf("environment variable name %q: names are letters, digits and _, not starting with a digit", k)
		}
	}
	line, err := json.Marshal(api.ExecRequest{Command: cmd.Command, WorkingDirectory: sb.resolve(cmd.WorkingDirectory), Env: cmd.Env})
	if err != nil {
		return nil, err
	}
	line = append(line, '\n')
	cl := call{route: routeExec, args: []string{sb.id}, raw: true}
	if cmd.Stdin != nil {
		cl.body = io.MultiReader(bytes.NewReader(line), cmd.Stdin)
	} else {
		cl.body = line
	}
	resp, err := sb.c.do(ctx, cl)
	if err != nil {
		if statusOf(err) == http.StatusNotFound {
			return nil, categorize(ErrSandboxNotFound, err, "sandbox %q is not running", sb.id)
		}
		return nil, err
	}
	p := &Process{sb: sb, id: resp.Header.Get(api.HeaderProcessID), done: make(chan struct{})}
	stdout, stderr := cmd.Stdout, cmd.Stderr
	if stdout == nil {
		pipe := newOutPipe()
		p.Stdout, stdout = pipe, pipe
	}
	if stderr == nil {
		pipe := newOutPipe()
		p.Stderr, stderr = pipe, pipe
	}
	sb.mu.Lock()
	sb.procs[p.id] = p
	sb.mu.Unlock()
	// Cancelling the spawn context kills the command.
	p.stopCtx = context.AfterFunc(ctx, func() {
		kctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		p.kmu.Lock()
		p.canceled = context.Cause(ctx)
		p.kmu.Unlock()
		p.Kill(kctx)
	})
	f := &follower{p: p, stdout: stdout, stderr: stderr}
	go f.run(context.WithoutCancel(ctx), resp)
	return p, nil
}

// follower reads a process's frames to its outputs, resuming a stream
// that breaks from the byte it reached, until the exit code.
type follower struct {
	p              *Process
	stdout, stderr io.Writer
	off            int64 // output bytes received, stdout and stderr together
	werr           error // the first error of a caller's writer
}

// resumeWindow is how long a broken stream is resumed (with backoff)
// without getting a byte or an answer before the process is given up:
// long enough for a service to restart.
const resumeWindow = 2 * time.Minute

func (f *follower) run(ctx context.Context, resp *http.Response) {
	p := f.p
	c := p.sb.c
	code, exited, streamErr := f.read(resp.Body)
	resp.Body.Close()
	failures := 0
	giveUp := time.Now().Add(resumeWindow)
	var lost error
	for !exited {
		// The stream broke: resume it from the byte it reached.
		if failures > 0 {
			if time.Now().After(giveUp) {
				streamErr = fmt.Errorf("process %s: its output stream broke at byte %d, and resuming it failed for %s: %w", p.id, f.off, resumeWindow, streamErr)
				exited, code = true, -1
				continue
			}
			sleepCtx(ctx, backoff(failures-1, 0))
		}
		q := url.Values{"offset": {strconv.FormatInt(f.off, 10)}}
		r, err := c.do(ctx, call{route: routeOutput, args: []string{p.sb.id, p.id}, query: q})
		if err != nil {
			switch st := statusOf(err); {
			case st == http.StatusGone:
				// What the stream missed is no longer kept: the exit code
				// still is.
				lost = categorize(ErrOutputLost, err, "process %s: its output stream broke at byte %d, and the service no longer keeps those bytes", p.id, f.off)
				code, exited, streamErr = f.waitExit(ctx)
				continue
			case st != 0 && st != http.StatusBadGateway && st != http.StatusServiceUnavailable && st != http.StatusGatewayTimeout:
				// The service answered and cannot resume it (the process
				// or the sandbox is gone).
				streamErr = fmt.Errorf("process %s: its output stream broke at byte %d (%v), and resuming it failed: %w", p.id, f.off, streamErr, err)
				exited, code = true, -1
				continue
			}
			failures++
			streamErr = err
			continue
		}
		before := f.off
		code, exited, streamErr = f.read(r.Body)
		r.Body.Close()
		if f.off > before {
			failures = 0
			giveUp = time.Now().Add(resumeWindow)
		} else {
			failures++ // answered, but broke again before any byte
		}
	}
	err := streamErr
	if err == nil {
		err = lost
	}
	f.finish(code, err)
}

// waitExit polls the wait route until the process exits.
func (f *follower) waitExit(ctx context.Context) (int, bool, error) {
	p := f.p
	giveUp := time.Now().Add(resumeWindow)
	for failures := 0; ; {
		var st api.ProcessState
		_, err := p.sb.c.doJSON(ctx, call{route: routeWait, args: []string{p.sb.id, p.id}, idempotent: true}, &st)
		switch {
		case err == nil && st.ExitCode != nil:
			return *st.ExitCode, true, nil
		case err == nil:
			failures, giveUp = 0, time.Now().Add(resumeWindow)
			continue // still running: ask again
		}
		if failures++; time.Now().After(giveUp) || statusOf(err) == http.StatusNotFound {
			return -1, true, fmt.Errorf("process %s: waiting for its exit code: %w", p.id, err)
		}
		sleepCtx(ctx, backoff(failures-1, 0))
	}
}

// read copies the frames of one stream to the outputs; exited says the
// Exit frame came, with the code.
func (f *follower) read(body io.Reader) (code int, exited bool, err error) {
	fr := api.NewFrameReader(body)
	for {
		fm, err := fr.Next()
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF // ended without its Exit frame
			}
			return 0, false, err
		}
		switch {
		case fm.Type == api.FrameData && (fm.Channel == api.ChannelStdout || fm.Channel == api.ChannelStderr):
			w := f.stdout
			if fm.Channel == api.ChannelStderr {
				w = f.stderr
			}
			if f.werr == nil {
				if _, werr := w.Write(fm.Payload); werr != nil {
					f.werr = werr // the rest of that output is dropped
				}
			}
			f.off += int64(len(fm.Payload))
		case fm.Type == api.FrameExit:
			n, err := strconv.Atoi(string(fm.Payload))
			if err != nil {
				return 0, false, fmt.Errorf("an Exit frame with %q", fm.Payload)
			}
			return n, true, nil
		}
	}
}

func (f *follower) finish(code int, err error) {
	p := f.p
	if err == nil {
		err = f.werr
	}
	for _, w := range []io.Writer{f.stdout, f.stderr} {
		if pipe, ok := w.(*outPipe); ok {
			pipe.closeWrite(err)
		}
	}
	p.stopCtx()
	p.kmu.Lock()
	if p.canceled != nil && err == nil {
		err = p.canceled
	}
	p.kmu.Unlock()
	p.code, p.err = code, err
	p.sb.mu.Lock()
	delete(p.sb.procs, p.id)
	p.sb.mu.Unlock()
	close(p.done)
}

// outPipe is a stream of a process's output: the follower writes, the
// caller reads. It holds up to outputLimit bytes unread.
type outPipe struct {
	mu     sync.Mutex
	cond   *sync.Cond
	buf    bytes.Buffer
	closed bool  // the writer is done
	err    error // what the reader gets at the end (nil: EOF)
	gone   bool  // the reader closed: output is dropped
}

func newOutPipe() *outPipe {
	p := &outPipe{}
	p.cond = sync.NewCond(&p.mu)
	return p
}

func (p *outPipe) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.buf.Len() >= outputLimit && !p.gone {
		p.cond.Wait()
	}
	if !p.gone {
		p.buf.Write(b)
		p.cond.Broadcast()
	}
	return len(b), nil
}

func (p *outPipe) Read(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.buf.Len() == 0 && !p.closed && !p.gone {
		p.cond.Wait()
	}
	if p.buf.Len() > 0 {
		n, _ := p.buf.Read(b)
		p.cond.Broadcast()
		return n, nil
	}
	if p.gone {
		return 0, io.ErrClosedPipe
	}
	if p.err != nil {
		return 0, p.err
	}
	return 0, io.EOF
}

// Close says the caller will read no more: what comes is dropped.
func (p *outPipe) Close() error {
	p.mu.Lock()
	p.gone = true
	p.buf.Reset()
	p.cond.Broadcast()
	p.mu.Unlock()
	return nil
}

func (p *outPipe) closeWrite(err error) {
	p.mu.Lock()
	p.closed, p.err = true, err
	p.cond.Broadcast()
	p.mu.Unlock()
}
