package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"
)

// ClientOptions configures the service side of a link.
type ClientOptions struct {
	// Config is sent to the agent in the hello exchange.
	Config Config
	// Egress is called, each in its own goroutine, with every connection
	// a sandbox process makes to the relay listener and the process the
	// agent says made it (zero when it could not tell): hand it to
	// relay.Proxy.ServePeer under this sandbox's identity. The handler owns
	// the conn and must close it. Nil refuses egress (each connection is
	// closed at once).
	Egress func(net.Conn, Peer)
	// Captured is called, each in its own goroutine, with every
	// connection captured in the sandbox (see CaptureListener), where the
	// process was going (to: host:port, the name the sandbox's DNS
	// responder gave the address it dialed, or that address) and the
	// process, as for Egress: hand it to relay.Proxy.ServeCaptured. Like
	// to, it is the sandbox's word: a CONNECT line's worth. The handler
	// owns the conn. Nil refuses them.
	Captured func(conn net.Conn, to string, peer Peer)
	// Lookup is called with each name the sandbox's DNS responder
	// refused (no capture in place) and the query type, for the audit.
	// Nil drops them. The agent limits how often it reports; it is the
	// sandbox's word, so the caller limits too.
	Lookup func(name, qtype string)
	// Logger receives operational messages. Nil discards.
	Logger *slog.Logger

	version int           // ProtocolVersion when zero; tests play other releases
	fdTTL   time.Duration // how long a passed socket waits for its request; requestTimeout when zero
}

// Info is what the agent said about itself in the hello exchange.
type Info struct {
	Version   int    // its protocol version (always ProtocolVersion)
	RelayAddr string // the relay listener's bound address inside the sandbox
	PID       int    // the agent's pid, as the sandbox sees it
	// FDPass reports that the agent hands egress connections over as
	// sockets (SCM_RIGHTS) instead of copying their bytes over the link:
	// both ends of the link are one unix stream socket. See README.md.
	FDPass bool
	// DNSError says why the DNS responder (Config.DNS) did not start;
	// empty when it runs or was not asked for.
	DNSError string
}

// Client is the service side of an agent link: every operation opens a
// stream on one yamux session. It is safe for concurrent use. Every method
// that waits takes a context; when it ends, the operation is cut (a command
// Run under it is killed).
type Client struct {
	sess   *yamux.Session
	opts   ClientOptions
	log    *slog.Logger
	info   Info
	closed atomic.Bool // Close was called

	fds     *fdTable        // sockets the agent passed; nil unless the link is a unix socket
	linkCtx context.Context // ends when the link is down
}

// NewClient starts the service side of a link on conn (in production, the
// stdio of `sandbox exec <id> -- sandgate agent`) and performs the hello
// exchange under ctx. An agent of another protocol version is refused with
// an error matching ErrVersionMismatch. On error conn is closed.
//
// When conn is a *net.UnixConn (a stream socket whose other end is the
// agent's stdin and stdout), the client also asks the agent to pass egress
// connections as sockets (Info.FDPass); any other conn, or an agent that
// cannot, carries their bytes over the link.
func NewClient(ctx context.Context, conn io.ReadWriteCloser, opts ClientOptions) (*Client, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var fds *fdTable
	if uc, ok := conn.(*net.UnixConn); ok && unixStream(uc) {
		ttl := opts.fdTTL
		if ttl <= 0 {
			ttl = requestTimeout
		}
		fds = newFDTable(log, ttl)
		conn = &fdReceiver{uc: uc, oob: make([]byte, fdOOBBytes), tab: fds}
	}
	sess, err := yamux.Client(conn, yamuxConfig(log))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("agent link: %w", err)
	}
	c := &Client{sess: sess, opts: opts, log: log, fds: fds, linkCtx: linkContext(sess.CloseChan())}
	if fds != nil {
		go fds.janitor(sess.CloseChan())
	}
	if c.opts.version == 0 {
		c.opts.version = ProtocolVersion
	}
	cfg := opts.Config
	o, resp, err := c.open(ctx, request{Op: "hello", Version: c.opts.version, Config: &cfg})
	if err != nil {
		sess.Close()
		return nil, err
	}
	o.close()
	if resp.Version != c.opts.version {
		sess.Close()
		return nil, &Error{Op: "hello", Code: codeVersion, Message: fmt.Sprintf("the agent speaks protocol %d and the service %d: run the sandgate agent of the service's own release in the sandbox", resp.Version, c.opts.version)}
	}
	c.info = Info{Version: resp.Version, RelayAddr: resp.RelayAddr, PID: resp.PID, DNSError: resp.DNSError}
	if fds != nil {
		// An agent of an older release answers "unknown op": its egress
		// then goes over the link, as does any agent whose stdio is not
		// this socket.
		r, err := c.call(ctx, request{Op: "fdpass"})
		switch {
		case err == nil:
			c.info.FDPass = r.FDPass
		case sess.IsClosed() || ctx.Err() != nil:
			sess.Close()
			return nil, err
		default:
			log.Debug("agent: the agent does not pass sockets; egress goes over the link", "err", err)
		}
	}
	// Egress streams opened before this wait in yamux's accept backlog.
	go c.acceptLoop()
	return c, nil
}

// Info returns what the agent reported in the hello exchange.
func (c *Client) Info() Info { return c.info }

// Done is closed when the link is down: the agent exited, its stdio
// closed, keep-alives failed, or Close was called. The launcher watches it
// to restart the agent.
func (c *Client) Done() <-chan struct{} { return c.sess.CloseChan() }

// Err returns nil while the link is up, and an error matching ErrLinkDown
// once it is down.
func (c *Client) Err() error {
	if !c.sess.IsClosed() {
		return nil
	}
	if c.closed.Load() {
		return fmt.Errorf("%w: closed by Client.Close", ErrLinkDown)
	}
	return fmt.Errorf("%w: the agent or its stdio went away", ErrLinkDown)
}

// Close closes the link. The agent then kills every command it started and
// exits.
func (c *Client) Close() error {
	c.closed.Store(true)
	return c.sess.Close()
}

// acceptLoop serves the streams the agent opens: egress connections.
// Streams the agent opens are untrusted (code in the sandbox can take the
// agent over): their first message is small, and only so many may be
// waiting for it at once; past that a new stream is reset. Connections
// already handed to Egress are bounded by the relay's own per-sandbox cap.
const (
	maxIncomingMsg     = 4 << 10
	maxIncomingPending = 64
)

func (c *Client) acceptLoop() {
	pending := make(chan struct{}, maxIncomingPending)
	for {
		st, err := c.sess.AcceptStream()
		if err != nil {
			return
		}
		select {
		case pending <- struct{}{}:
			go c.incoming(st, func() { <-pending })
		default:
			c.log.Warn("agent: too many streams opened by the agent await their first message; resetting one")
			st.SetDeadline(timeZero1)
			st.Close()
		}
	}
}

func (c *Client) incoming(st *yamux.Stream, release func()) {
	var buf []byte
	var req request
	st.SetReadDeadline(time.Now().Add(requestTimeout))
	kind, p, err := readFrameMax(st, &buf, maxIncomingMsg)
	if err == nil && kind == kindMsg {
		req, err = decodeRequest(p)
	} else if err == nil {
		err = errProtocol
	}
	st.SetReadDeadline(time.Time{})
	if err == nil && req.Op == "lookup" {
		release()
		st.Close()
		if c.opts.Lookup != nil {
			c.opts.Lookup(req.Name, req.QType)
		}
		return
	}
	if err != nil || req.Op != "egress" {
		release()
		if err != nil {
			c.log.Warn("agent: bad stream from the agent", "err", err)
		}
		st.SetDeadline(timeZero1)
		st.Close()
		return
	}
	if req.FD != 0 {
		// The stream only named the socket: it has nothing more to carry.
		st.Close()
		conn, err := c.claimEgress(req.FD) // holds its pending slot while it waits
		release()
		if err != nil {
			c.log.Warn("agent: refused a socket the agent passed for egress", "fd", req.FD, "from", req.From, "err", err)
			return
		}
		// As on the stream path, the link going down cuts the connection.
		stop := context.AfterFunc(c.linkCtx, func() { conn.Close() })
		defer stop()
		c.handOver(conn, req.To, req.peer())
		return
	}
	release()
	if (req.To == "" && c.opts.Egress == nil) || (req.To != "" && c.opts.Captured == nil) {
		st.SetDeadline(timeZero1)
		st.Close()
		return
	}
	c.handOver(&streamConn{Stream: st, local: Addr{c.info.RelayAddr}, remote: Addr{req.From}}, req.To, req.peer())
}

// handOver gives an egress connection to its handler: Egress for one made
// to the relay listener, Captured for one captured going to to.
func (c *Client) handOver(conn net.Conn, to string, peer Peer) {
	switch {
	case to == "" && c.opts.Egress != nil:
		c.opts.Egress(conn, peer)
	case to != "" && c.opts.Captured != nil:
		c.opts.Captured(conn, to, peer)
	default:
		conn.Close()
	}
}

// CaptureListener asks the agent for its capture listener: a listening
// TCP socket in the sandbox's network namespace, passed over the link
// (Info.FDPass must be true), whose connections the agent passes on to
// Captured. The caller owns the returned descriptor (close it once it
// steered the sandbox's connections to it: internal/netcapture). Once per
// link.
func (c *Client) CaptureListener(ctx context.Context) (int, error) {
	if c.fds == nil || !c.info.FDPass {
		return -1, &Error{Op: "capture", Code: codeRefused, Message: "the link does not pass sockets, so nothing can be captured on it"}
	}
	resp, err := c.call(ctx, request{Op: "capture"})
	if err != nil {
		return -1, err
	}
	if resp.FD == 0 {
		return -1, &Error{Op: "capture", Code: codeFailed, Message: "the agent passed no listener"}
	}
	return c.fds.claim(resp.FD, c.fds.ttl)
}

// SetDNSCapture switches the sandbox's DNS responder to capture mode:
// every name gets an address of prefix, which the caller has steered to
// the capture listener.
func (c *Client) SetDNSCapture(ctx context.Context, prefix netip.Prefix) error {
	_, err := c.call(ctx, request{Op: "dnsmode", Prefix: prefix.String()})
	return err
}

// claimEgress takes the socket the agent passed as number seq and checks
// that it is a connected TCP socket.
func (c *Client) claimEgress(seq uint64) (net.Conn, error) {
	if c.fds == nil {
		return nil, errors.New("the link is not a unix socket and cannot carry sockets")
	}
	fd, err := c.fds.claim(seq, c.fds.ttl)
	if err != nil {
		return nil, err
	}
	return egressConn(fd)
}

// opStream is one operation's stream on the client side.
type opStream struct {
	st   *yamux.Stream
	f    *framer
	buf  []byte
	stop func() bool // detaches the context
}

func (o *opStream) close() {
	o.stop()
	o.st.Close()
}

// abort cuts the stream both ways.
func (o *opStream) abort() {
	o.stop()
	o.st.SetDeadline(timeZero1)
	o.st.Close()
}

// open starts an operation: a stream, its request and the agent's first
// response. While the returned stream is attached, ctx ending cuts it.
func (c *Client) open(ctx context.Context, req request) (*opStream, response, error) {
	var resp response
	if err := ctx.Err(); err != nil {
		return nil, resp, fmt.Errorf("agent %s: %w", req.Op, context.Cause(ctx))
	}
	st, err := c.sess.OpenStream()
	if err != nil {
		return nil, resp, c.fail(ctx, req.Op, err)
	}
	o := &opStream{st: st, f: newFramer(st)}
	o.stop = context.AfterFunc(ctx, func() { st.SetDeadline(timeZero1) })
	if err := o.f.msg(req); err != nil {
		o.abort()
		return nil, resp, c.fail(ctx, req.Op, err)
	}
	if err := readMsg(st, &o.buf, &resp); err != nil {
		o.abort()
		return nil, resp, c.fail(ctx, req.Op, err)
	}
	if resp.Error != nil {
		o.close()
		return nil, resp, resp.Error.toError(req.Op)
	}
	return o, resp, nil
}

// call is a request with one response and nothing after.
func (c *Client) call(ctx context.Context, req request) (response, error) {
	o, resp, err := c.open(ctx, req)
	if err != nil {
		return resp, err
	}
	o.close()
	return resp, nil
}

// fail explains an error on an operation's stream: the context's cause,
// the link being down, or what went wrong on the stream.
func (c *Client) fail(ctx context.Context, op string, err error) error {
	var ae *Error
	switch {
	case errors.As(err, &ae):
		if ae.Op == "" {
			ae.Op = op
		}
		return ae
	case ctx.Err() != nil:
		return fmt.Errorf("agent %s: %w", op, context.Cause(ctx))
	case c.sess.IsClosed():
		return fmt.Errorf("agent %s: %w", op, c.Err())
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("agent %s: the agent ended the stream without an answer", op)
	}
	return fmt.Errorf("agent %s: %w", op, err)
}

// Ping checks that the agent answers (not just the link: the agent's
// dispatcher) and returns the round-trip time.
func (c *Client) Ping(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	_, err := c.call(ctx, request{Op: "ping"})
	return time.Since(start), err
}

// ---- commands ----

// Cmd is a command to run in the sandbox.
type Cmd struct {
	// Args is the program and its arguments. A program without a slash is
	// looked up in the command's own PATH.
	Args []string
	// Env is what the command sets, as KEY=VALUE (later entries win), on
	// top of the sandbox's environment; see README.md for what every
	// command gets and what it cannot change.
	Env []string
	// BaseURLs, when not nil, are the base URL variables the command gets
	// (routed through the relay, RouteBaseURL) instead of the agent's
	// configured ones: the service passes the sandbox's current ones.
	BaseURLs map[string]string
	// Dir is the working directory (absolute); empty means HOME.
	Dir string
	// Stdin, when set, is copied to the command's stdin, then EOF. Nil
	// gives an empty stdin (/dev/null), unless StdinPipe is set.
	Stdin io.Reader
	// StdinPipe (with Stdin nil) makes Spawn return a Process whose Stdin
	// writes to the command's stdin; closing it sends EOF.
	StdinPipe bool
	// Stdout and Stderr receive the command's output as it comes; nil
	// discards it. A slow writer slows the command (no buffering without
	// bound). They are called from one goroutine, never concurrently.
	Stdout, Stderr io.Writer
	// WaitDelay is how long output is still read after the command's own
	// process exits (background processes may hold its stdout); zero
	// means DefaultWaitDelay.
	WaitDelay time.Duration
	// TTY, when set, runs the command on a terminal of this size (a PTY
	// the agent allocates, the controlling terminal of a session of the
	// command's own): its stdout and stderr are the terminal's output,
	// delivered to Stdout; Stdin or StdinPipe is typed into it (its end is
	// no EOF: a terminal ends when the command does, or is killed);
	// Process.Resize changes its size. A zero size is the kernel's default.
	TTY *WinSize
}

// WinSize is a terminal's size in character cells.
type WinSize struct {
	Rows, Cols uint16
}

// ExitStatus is how a command ended: an exit code, or the signal that
// killed it.
type ExitStatus struct {
	// Code is the exit code, or -1 when a signal ended the command.
	Code int
	// Signal is the signal that ended the command, or 0.
	Signal syscall.Signal
}

// Success reports whether the command exited with code 0.
func (e ExitStatus) Success() bool { return e.Code == 0 && e.Signal == 0 }

func (e ExitStatus) String() string {
	if e.Signal != 0 {
		return "signal: " + e.Signal.String()
	}
	return "exit status " + strconv.Itoa(e.Code)
}

// Process is a command started by Spawn. Its output is delivered to the
// Cmd's writers from the moment it starts; Wait for its end, or Signal it.
// A Process must be waited for (or killed): an unread command blocks once
// its output fills the link's window.
type Process struct {
	// ID is the agent's handle for the command; PID its pid in the sandbox.
	ID  uint64
	PID int
	// Stdin writes to the command's stdin when Cmd.StdinPipe was set (nil
	// otherwise). Close sends EOF.
	Stdin io.WriteCloser

	c      *Client
	o      *opStream
	done   chan struct{}
	status ExitStatus
	err    error
	tty    bool // runs on a terminal (Cmd.TTY)
}

// Spawn starts a command and returns once it runs. ctx bounds the start
// only: the command outlives it (stop it with Signal).
func (c *Client) Spawn(ctx context.Context, cmd Cmd) (*Process, error) {
	if cmd.Stdin != nil && cmd.StdinPipe {
		return nil, &Error{Op: "exec", Code: codeInvalid, Message: "Cmd.Stdin and Cmd.StdinPipe both set: choose one"}
	}
	req := request{Op: "exec", Args: cmd.Args, Env: cmd.Env, Dir: cmd.Dir,
		Stdin: cmd.Stdin != nil || cmd.StdinPipe, WaitDelayMS: cmd.WaitDelay.Milliseconds(),
		BaseURLs: cmd.BaseURLs, HasBaseURLs: cmd.BaseURLs != nil}
	if cmd.WaitDelay > 0 && req.WaitDelayMS == 0 {
		req.WaitDelayMS = 1
	}
	if cmd.TTY != nil {
		req.TTY = &wireSize{Rows: cmd.TTY.Rows, Cols: cmd.TTY.Cols}
	}
	o, resp, err := c.open(ctx, req)
	if err != nil {
		return nil, err
	}
	o.stop() // the command outlives ctx
	p := &Process{ID: resp.ID, PID: resp.PID, c: c, o: o, done: make(chan struct{}), tty: cmd.TTY != nil}
	switch {
	case cmd.Stdin != nil:
		go stdinCopier{f: o.f, r: cmd.Stdin}.run()
	case cmd.StdinPipe:
		p.Stdin = &stdinWriter{f: o.f}
	default:
		o.f.msg(response{End: true})
	}
	go p.read(cmd.Stdout, cmd.Stderr)
	return p, nil
}

// stdinCopier copies a Cmd's Stdin to the command, then sends End. It is a
// named type so stack traces say what a goroutine is doing.
type stdinCopier struct {
	f *framer
	r io.Reader
}

func (s stdinCopier) run() {
	buf := make([]byte, dataChunk)
	// A source that fails ends the command's stdin too: EOF is all a
	// stdin can say.
	io.CopyBuffer(dataWriter{s.f, kindData}, s.r, buf)
	s.f.msg(response{End: true})
}

// stdinWriter is a Process's Stdin.
type stdinWriter struct {
	f      *framer
	closed atomic.Bool
}

func (w *stdinWriter) Write(p []byte) (int, error) {
	if w.closed.Load() {
		return 0, fs.ErrClosed
	}
	return dataWriter{w.f, kindData}.Write(p)
}

func (w *stdinWriter) Close() error {
	if w.closed.Swap(true) {
		return nil
	}
	return w.f.msg(response{End: true})
}

// read delivers output until the exit message. A writer that fails is
// dropped (its error is reported by Wait) and the rest of its output is
// discarded, so the command is not blocked by it.
func (p *Process) read(stdout, stderr io.Writer) {
	defer close(p.done)
	defer p.o.close()
	var werr error
	write := func(w *io.Writer, b []byte) {
		if *w == nil {
			return
		}
		if _, err := (*w).Write(b); err != nil {
			if werr == nil {
				werr = fmt.Errorf("agent exec: writing the command's output: %w", err)
			}
			*w = nil
		}
	}
	for {
		kind, payload, err := readFrame(p.o.st, &p.o.buf)
		if err != nil {
			p.err = p.c.fail(context.Background(), "exec", err)
			p.status.Code = -1
			return
		}
		switch kind {
		case kindData:
			write(&stdout, payload)
		case kindStderr:
			write(&stderr, payload)
		case kindMsg:
			var m response
			if err := decodeMsg(payload, &m); err != nil {
				p.err, p.status.Code = p.c.fail(context.Background(), "exec", err), -1
				return
			}
			switch {
			case m.Error != nil:
				p.err, p.status.Code = m.Error.toError("exec"), -1
			case m.Exit != nil:
				p.status = ExitStatus{Code: m.Exit.Code, Signal: syscall.Signal(m.Exit.Signal)}
				p.err = werr
			default:
				p.err, p.status.Code = p.c.fail(context.Background(), "exec", fmt.Errorf("%w: unexpected message", errProtocol)), -1
			}
			return
		}
	}
}

// Wait waits for the command to end and returns how it ended. The error
// is nil for any exit code or signal; it is set when the end could not be
// known (the link went down: ErrLinkDown) or an output writer failed. If
// ctx ends first, Wait returns its cause and the command keeps running.
func (p *Process) Wait(ctx context.Context) (ExitStatus, error) {
	select {
	case <-p.done:
		return p.status, p.err
	case <-ctx.Done():
		return ExitStatus{Code: -1}, fmt.Errorf("agent exec: %w", context.Cause(ctx))
	}
}

// Done is closed when the command has ended (or its end is lost).
func (p *Process) Done() <-chan struct{} { return p.done }

// Signal sends sig to the command's whole process group (setpgid), so the
// processes it started go too. Signalling a command that has ended returns
// an error matching os.ErrProcessDone.
func (p *Process) Signal(ctx context.Context, sig syscall.Signal) error {
	_, err := p.c.call(ctx, request{Op: "signal", ID: p.ID, Signal: int(sig)})
	return err
}

// Resize changes the size of the terminal of a command started with
// Cmd.TTY. It is an error for any other.
func (p *Process) Resize(size WinSize) error {
	if !p.tty {
		return &Error{Op: "exec", Code: codeInvalid, Message: "Resize of a command without a terminal (Cmd.TTY)"}
	}
	select {
	case <-p.done:
		return &Error{Op: "exec", Code: codeDone, Message: fmt.Sprintf("process %d has exited", p.ID)}
	default:
	}
	return p.o.f.msg(response{Size: &wireSize{Rows: size.Rows, Cols: size.Cols}})
}

// Kill is Signal(ctx, SIGKILL).
func (p *Process) Kill(ctx context.Context) error { return p.Signal(ctx, syscall.SIGKILL) }

// killWait bounds the wait for a killed command's exit in Run.
const killWait = 10 * time.Second

// Run runs a command and waits for it. The error is nil for any exit code
// or signal (read ExitStatus); it is set when the command could not start
// (a missing program matches fs.ErrNotExist), when its end is unknown, or
// when ctx ended: then the command's process group is killed and the
// status is how it ended.
func (c *Client) Run(ctx context.Context, cmd Cmd) (ExitStatus, error) {
	p, err := c.Spawn(ctx, cmd)
	if err != nil {
		return ExitStatus{Code: -1}, err
	}
	select {
	case <-p.done:
		return p.status, p.err
	case <-ctx.Done():
	}
	kctx, cancel := context.WithTimeout(context.Background(), killWait)
	defer cancel()
	p.Kill(kctx)
	select {
	case <-p.done:
		return p.status, fmt.Errorf("agent exec: %w", context.Cause(ctx))
	case <-kctx.Done():
		p.o.abort()
		return ExitStatus{Code: -1}, fmt.Errorf("agent exec: %w (and the command did not end within %s of SIGKILL)", context.Cause(ctx), killWait)
	}
}

// KillAll stops every process in the sandbox but the agent (see
// KillScope) with SIGKILL, and returns how many it signalled. Commands
// started by Run or Spawn end with signal: killed.
func (c *Client) KillAll(ctx context.Context) (int, error) {
	resp, err := c.call(ctx, request{Op: "killall"})
	return resp.Killed, err
}

// SetDeadline sets the agent's dead man's switch: if d passes without
// another SetDeadline, the agent kills every command and starts none until
// the next one. 0 lifts it. A service sets it to how long it is sure to
// own the sandbox.
func (c *Client) SetDeadline(ctx context.Context, d time.Duration) error {
	ms := d.Milliseconds()
	if d > 0 && ms == 0 {
		ms = 1
	}
	_, err := c.call(ctx, request{Op: "deadline", DeadlineMS: ms})
	return err
}

// Pause stops every command (SIGSTOP) until Continue, or until d passes,
// when the agent continues them itself; it returns how many it stopped.
func (c *Client) Pause(ctx context.Context, d time.Duration) (int, error) {
	ms := max(d.Milliseconds(), 1)
	resp, err := c.call(ctx, request{Op: "pause", PauseMS: ms})
	return resp.Killed, err
}

// Continue continues the commands Pause stopped.
func (c *Client) Continue(ctx context.Context) error {
	_, err := c.call(ctx, request{Op: "pause"})
	return err
}

// ---- files ----

// FileInfo describes a file in the sandbox. It implements fs.FileInfo.
type FileInfo struct {
	name    string
	size    int64
	mode    fs.FileMode
	modTime time.Time
}

func (f FileInfo) Name() string       { return f.name }
func (f FileInfo) Size() int64        { return f.size }
func (f FileInfo) Mode() fs.FileMode  { return f.mode }
func (f FileInfo) ModTime() time.Time { return f.modTime }
func (f FileInfo) IsDir() bool        { return f.mode.IsDir() }
func (f FileInfo) Sys() any           { return nil }

var _ fs.FileInfo = FileInfo{}

func fileInfo(w *wireStat) FileInfo {
	if w == nil {
		return FileInfo{}
	}
	return FileInfo{name: w.Name, size: w.Size, mode: fs.FileMode(w.Mode), modTime: time.Unix(0, w.ModTime)}
}

// Stat describes the file at path (absolute), following symlinks. A
// missing file matches fs.ErrNotExist.
func (c *Client) Stat(ctx context.Context, path string) (FileInfo, error) {
	resp, err := c.call(ctx, request{Op: "stat", Path: path})
	return fileInfo(resp.Stat), err
}

// Mkdir makes a directory and any missing parents (mkdir -p); zero perm
// means 0755.
func (c *Client) Mkdir(ctx context.Context, path string, perm fs.FileMode) error {
	_, err := c.call(ctx, request{Op: "mkdir", Path: path, Mode: uint32(perm.Perm())})
	return err
}

// Remove removes a file or an empty directory; with recursive, a tree
// (and a missing path is then not an error, as with rm -rf).
func (c *Client) Remove(ctx context.Context, path string, recursive bool) error {
	_, err := c.call(ctx, request{Op: "remove", Path: path, Recursive: recursive})
	return err
}

// ReadFile opens the regular file at path (absolute) for streaming. A
// missing file matches fs.ErrNotExist. The reader returns io.EOF only when
// the whole file arrived, and must be closed; ctx ending cuts it.
func (c *Client) ReadFile(ctx context.Context, path string) (io.ReadCloser, FileInfo, error) {
	o, resp, err := c.open(ctx, request{Op: "read", Path: path})
	if err != nil {
		return nil, FileInfo{}, err
	}
	return &fileReader{c: c, ctx: ctx, o: o, dr: dataReader{r: o.st}}, fileInfo(resp.Stat), nil
}

type fileReader struct {
	c    *Client
	ctx  context.Context
	o    *opStream
	dr   dataReader
	once sync.Once
}

func (r *fileReader) Read(p []byte) (int, error) {
	// Cut by its context at once: the stream's deadline, which the
	// context also sets, takes effect a moment later, and what is already
	// buffered would still be read.
	if err := r.ctx.Err(); err != nil {
		return 0, r.c.fail(r.ctx, "read", err)
	}
	n, err := r.dr.Read(p)
	if err != nil && err != io.EOF {
		err = r.c.fail(r.ctx, "read", err)
	}
	return n, err
}

func (r *fileReader) Close() error {
	r.once.Do(func() {
		if r.dr.err == io.EOF {
			r.o.close()
		} else {
			r.o.abort()
		}
	})
	return nil
}

// WriteOptions configures WriteFile. The zero value writes mode 0644 with
// a cap of DefaultMaxWriteBytes.
type WriteOptions struct {
	Perm     fs.FileMode // permission bits; zero means 0644
	MaxBytes int64       // refuse more than this many bytes; zero means DefaultMaxWriteBytes
}

// WriteFile writes r to path (absolute), creating missing parent
// directories. The content is streamed to a temporary file beside path and
// renamed into place only when complete, so a failed, cancelled or capped
// write (ErrTooLarge) leaves what was there. It returns the bytes written.
func (c *Client) WriteFile(ctx context.Context, path string, r io.Reader, opts WriteOptions) (int64, error) {
	o, _, err := c.open(ctx, request{Op: "write", Path: path, Mode: uint32(opts.Perm.Perm()), MaxBytes: opts.MaxBytes})
	if err != nil {
		return 0, err
	}
	resp, err := c.upload(ctx, "write", o, r)
	return resp.Written, err
}

// TarOptions configures TarIn.
type TarOptions struct {
	// MaxBytes caps the uncompressed tar stream; zero means
	// DefaultMaxTarBytes.
	MaxBytes int64
}

// TarIn applies a tar stream (bare, gzip or zstd, detected) to dir inside
// the sandbox, creating it if missing, with the snapshot package's safe
// extraction: absolute names, "..", writes through symlinks, hardlink
// escapes, devices and setuid bits are refused (matching ErrRefused and
// snapshot.ErrRefused), and a refused or incomplete stream changes nothing.
func (c *Client) TarIn(ctx context.Context, dir string, r io.Reader, opts TarOptions) error {
	o, _, err := c.open(ctx, request{Op: "tarin", Path: dir, MaxBytes: opts.MaxBytes})
	if err != nil {
		return err
	}
	_, err = c.upload(ctx, "tarin", o, r)
	return err
}

// upload streams r as data frames, then End, and returns the agent's final
// response. An early answer (a refusal, a cap) stops the upload. If r
// fails, End is not sent, so the agent discards what it received.
func (c *Client) upload(ctx context.Context, op string, o *opStream, r io.Reader) (response, error) {
	type result struct {
		resp response
		err  error
	}
	res := make(chan result, 1)
	go func() {
		var resp response
		var buf []byte
		err := readMsg(o.st, &buf, &resp)
		if err != nil || resp.Error != nil {
			o.st.SetWriteDeadline(timeZero1) // stop the upload at once
		}
		res <- result{resp, err}
	}()
	src := &sourceReader{r: r}
	_, cerr := io.CopyBuffer(dataWriter{o.f, kindData}, src, make([]byte, dataChunk))
	switch {
	case src.err != nil:
		o.st.Close() // EOF without End: the agent discards the upload
	case cerr == nil:
		cerr = o.f.msg(response{End: true})
	}
	got := <-res
	o.close()
	switch {
	case src.err != nil:
		return got.resp, fmt.Errorf("agent %s: reading the source: %w (nothing was applied)", op, src.err)
	case got.err != nil:
		return got.resp, c.fail(ctx, op, got.err)
	case got.resp.Error != nil:
		return got.resp, got.resp.Error.toError(op)
	case cerr != nil:
		return got.resp, c.fail(ctx, op, cerr)
	}
	return got.resp, nil
}

// sourceReader tells a failing source from a failing stream.
type sourceReader struct {
	r   io.Reader
	err error
}

func (s *sourceReader) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		s.err = err
	}
	return n, err
}

// TarOut writes the directory dir of the sandbox to w as a bare PAX tar
// stream (packed by the snapshot package; sockets are skipped, devices
// refused). It returns nil only when the whole tree was written.
func (c *Client) TarOut(ctx context.Context, dir string, w io.Writer) error {
	o, _, err := c.open(ctx, request{Op: "tarout", Path: dir})
	if err != nil {
		return err
	}
	dr := &dataReader{r: o.st}
	_, err = io.CopyBuffer(w, dr, make([]byte, dataChunk))
	if err != nil {
		o.abort()
		if dr.err != nil && dr.err != io.EOF {
			return c.fail(ctx, "tarout", dr.err)
		}
		return fmt.Errorf("agent tarout: writing the tar stream: %w", err)
	}
	o.close()
	return nil
}

// ---- ports ----

// DialPort connects to 127.0.0.1:port inside the sandbox. The conn has
// TCP's half-close (CloseWrite); ctx bounds the dial only. Nothing
// listening matches ErrUnreachable. When the agent passes sockets
// (Info.FDPass), the conn is the socket the agent connected, passed over
// the link: its bytes never cross the agent or yamux.
func (c *Client) DialPort(ctx context.Context, port int) (net.Conn, error) {
	o, resp, err := c.open(ctx, request{Op: "dial", Port: port, PassFD: c.info.FDPass})
	if err != nil {
		return nil, err
	}
	if resp.FD != 0 {
		o.close()
		conn, err := c.claimEgress(resp.FD)
		if err != nil {
			return nil, fmt.Errorf("agent dial: the socket the agent passed for 127.0.0.1:%d: %w", port, err)
		}
		// As on the stream path, the link going down cuts the connection.
		return &linkBoundConn{Conn: conn, stop: context.AfterFunc(c.linkCtx, func() { conn.Close() })}, nil
	}
	o.stop()
	return &streamConn{Stream: o.st, local: Addr{"service"}, remote: Addr{net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}}, nil
}
