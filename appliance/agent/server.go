package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"
)

// ServerOptions configures the agent side. The zero value serves with no
// logging and without reaping orphans.
type ServerOptions struct {
	// Logger receives operational messages (never a command's output or a
	// file's content). Nil discards.
	Logger *slog.Logger
	// Subreaper makes the agent a child subreaper: processes its commands
	// orphan are re-parented to it instead of the sandbox's PID 1, so they
	// are reaped (no zombies, whatever PID 1 does) and stay descendants
	// for KillDescendants. `sandgate agent` sets it. It changes the whole
	// process, so in-process tests leave it off.
	Subreaper bool
}

// Limits of the agent.
const (
	// requestTimeout bounds how long a stream may take to send its first
	// message.
	requestTimeout = 30 * time.Second
	// maxEgressConns caps the relay listener's connections in flight; the
	// relay's own per-sandbox cap (256 by default) answers with 429 below
	// it, this one only keeps a runaway sandbox from exhausting the agent.
	maxEgressConns = 1024
	// shutdownWait bounds how long Serve waits, after the link ended, for
	// the processes it killed and its handlers to finish.
	shutdownWait = 10 * time.Second
)

// Serve serves the agent's side of a link on conn (in production, the
// agent's stdin and stdout) until the link closes or ctx ends. When it
// returns, every process the agent started has been killed (its whole
// process group) and the relay listener is closed: commands belong to the
// link that started them, and a restarted agent starts clean.
//
// A link closed by the service is the normal end and returns nil; an ended
// ctx returns its cause.
//
// When the link is a unix stream socket (conn is a *net.UnixConn, as
// StdioLink returns for a socketpair on stdio) and the service asks for it,
// egress connections are passed to the service as sockets instead of
// copied over the link (README.md, "Descriptor passing").
func Serve(ctx context.Context, conn io.ReadWriteCloser, opts ServerOptions) error {
	return newServer(opts).serve(ctx, conn)
}

type server struct {
	log       *slog.Logger
	subreaper bool
	version   int // ProtocolVersion; tests change it to play an old agent

	ctx    context.Context // ends when the link ends
	cancel context.CancelCauseFunc
	sess   *yamux.Session
	procs  *procTable
	wg     sync.WaitGroup // stream handlers and egress connections

	mu        sync.Mutex
	cfg       *resolved // nil until hello
	relayAddr string    // bound address of the relay listener
	ln        net.Listener
	stopped   bool // the link ended: no listener may start any more

	egressActive atomic.Int64

	// dns is the DNS responder (nil without Config.DNS); capLn the
	// capture listener (nil until op capture).
	dns   *dnsResponder
	capLn net.Listener
	// deadline is the service's dead man's switch (op deadline): when it
	// fires, every command is killed and none starts until a new one.
	dmu      sync.Mutex
	deadline *time.Timer
	expired  bool
	// paused continues the commands a pause stopped, when it passes.
	paused *time.Timer

	// fd attaches descriptors to the link: nil unless the link is a unix
	// stream socket. fdPass is set once the service asked for sockets
	// (op fdpass): only a service reading with recvmsg may get them.
	fd     *fdSender
	fdPass atomic.Bool
}

// sender returns the link's descriptor sender (nil unless the link is a
// unix stream socket) and session, for code that runs beside serve rather
// than in the goroutines it starts.
func (s *server) sender() *fdSender {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fd
}

func (s *server) session() *yamux.Session {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sess
}

func newServer(opts ServerOptions) *server {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &server{log: log, subreaper: opts.Subreaper, version: ProtocolVersion, procs: newProcTable()}
}

func (s *server) serve(ctx context.Context, conn io.ReadWriteCloser) error {
	conn, fd := agentLink(conn)
	sess, err := yamux.Server(conn, yamuxConfig(s.log))
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	s.mu.Lock()
	s.fd, s.sess = fd, sess
	s.mu.Unlock()
	s.ctx, s.cancel = context.WithCancelCause(ctx)
	defer s.cancel(errors.New("agent stopped"))
	stop := context.AfterFunc(s.ctx, func() { sess.Close() })
	defer stop()

	if s.subreaper {
		stopReaper, err := s.procs.startReaper(s.log)
		if err != nil {
			sess.Close()
			return fmt.Errorf("agent: become a child subreaper: %w", err)
		}
		defer stopReaper()
	}

	for {
		st, err := sess.AcceptStream()
		if err != nil {
			break
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.handle(st)
		}()
	}
	cause := context.Cause(s.ctx)
	linkEnded := ctx.Err() == nil
	s.cancel(ErrLinkDown)
	sess.Close()
	s.mu.Lock()
	s.stopped = true
	if s.ln != nil {
		s.ln.Close()
	}
	if s.capLn != nil {
		s.capLn.Close()
	}
	dnsr := s.dns
	s.mu.Unlock()
	if dnsr != nil {
		dnsr.close()
	}
	s.procs.killAllStarted()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(shutdownWait):
		s.log.Warn("agent: handlers still running after the link ended", "wait", shutdownWait.String())
	}
	if linkEnded {
		return nil
	}
	return cause
}

// handle serves one stream the service opened.
func (s *server) handle(st *yamux.Stream) {
	defer st.Close()
	// A link that ends cuts every stream at once.
	stop := context.AfterFunc(s.ctx, func() { st.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	f := newFramer(st)
	var buf []byte
	st.SetReadDeadline(time.Now().Add(requestTimeout))
	kind, p, err := readFrame(st, &buf)
	if err != nil {
		return
	}
	st.SetReadDeadline(time.Time{})
	if kind != kindMsg {
		f.msg(response{Error: toWire(fmt.Errorf("%w: a stream must begin with a request message", errProtocol))})
		return
	}
	req, err := decodeRequest(p)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	if req.Op == "hello" {
		s.hello(f, req)
		return
	}
	s.mu.Lock()
	cfg, relay := s.cfg, s.relayAddr
	s.mu.Unlock()
	if cfg == nil {
		f.msg(response{Error: toWire(invalid("%s before hello: the first exchange on a link must be hello", req.Op))})
		return
	}
	switch req.Op {
	case "ping":
		f.msg(response{})
	case "exec":
		s.exec(st, f, req, cfg, relay)
	case "signal":
		s.signal(f, req)
	case "killall":
		s.killAll(f, req, cfg)
	case "read":
		s.readFile(st, f, req)
	case "write":
		s.writeFile(st, f, req)
	case "stat":
		s.stat(f, req)
	case "mkdir":
		s.mkdir(f, req)
	case "remove":
		s.remove(f, req)
	case "tarin":
		s.tarIn(st, f, req)
	case "tarout":
		s.tarOut(st, f, req)
	case "dial":
		s.dial(st, f, req)
	case "deadline":
		s.setDeadline(f, req, cfg)
	case "pause":
		s.pause(f, req, cfg)
	case "fdpass":
		// Sockets only go to a service that asked: one whose link is
		// not a unix socket (Cloud Run's CLI relays bytes) never asks.
		if s.fd != nil {
			s.fdPass.Store(true)
		}
		f.msg(response{FDPass: s.fd != nil})
	case "capture":
		s.capture(f)
	case "dnsmode":
		s.dnsMode(f, req)
	default:
		f.msg(response{Error: toWire(invalid("op %q is not served by the agent", req.Op))})
	}
}

// setDeadline arms (or lifts, at 0) the dead man's switch: a service that
// cannot tell whether it still owns this sandbox (its lease in the store
// may have expired, another service may run the sandbox from its last
// snapshot) sets it to how long it is sure to own it, renewing it before
// it passes. A paused or partitioned service cannot renew it, and cannot
// stop the commands itself; the agent does, in time.
func (s *server) setDeadline(f *framer, req request, cfg *resolved) {
	if req.DeadlineMS < 0 {
		f.msg(response{Error: toWire(invalid("deadline: %d ms is negative", req.DeadlineMS))})
		return
	}
	s.dmu.Lock()
	if s.deadline != nil {
		s.deadline.Stop()
		s.deadline = nil
	}
	s.expired = false
	if req.DeadlineMS > 0 {
		var t *time.Timer
		t = time.AfterFunc(time.Duration(req.DeadlineMS)*time.Millisecond, func() {
			s.dmu.Lock()
			if s.deadline != t { // replaced meanwhile
				s.dmu.Unlock()
				return
			}
			s.expired = true
			s.dmu.Unlock()
			n, err := killScope(s.ctx, cfg.killScope)
			s.log.Warn("agent: the service's deadline passed without renewal: every command killed, none starts until it renews", "killed", n, "err", err)
		})
		s.deadline = t
	}
	s.dmu.Unlock()
	f.msg(response{})
}

// pause stops every command (SIGSTOP) while the service copies the
// sandbox's layer for a checkpoint, and continues them (SIGCONT) when
// told, or by itself when PauseMS passes: a service that dies mid-copy
// leaves nothing stopped.
func (s *server) pause(f *framer, req request, cfg *resolved) {
	if req.PauseMS < 0 || req.PauseMS > int64(maxPause/time.Millisecond) {
		f.msg(response{Error: toWire(invalid("pause: %d ms: want 0 (continue) to %d", req.PauseMS, maxPause.Milliseconds()))})
		return
	}
	s.dmu.Lock()
	if s.paused != nil {
		s.paused.Stop()
		s.paused = nil
	}
	if req.PauseMS == 0 {
		s.dmu.Unlock()
		n, err := signalScope(cfg.killScope, syscall.SIGCONT)
		f.msg(response{Killed: n, Error: toWire0(err)})
		return
	}
	s.paused = time.AfterFunc(time.Duration(req.PauseMS)*time.Millisecond, func() {
		n, _ := signalScope(cfg.killScope, syscall.SIGCONT)
		s.log.Warn("agent: a pause passed its time without the service continuing the commands: continued", "commands", n)
	})
	s.dmu.Unlock()
	n, err := signalScope(cfg.killScope, syscall.SIGSTOP)
	f.msg(response{Killed: n, Error: toWire0(err)})
}

// maxPause bounds a pause.
const maxPause = 10 * time.Minute

// toWire0 is toWire of a possibly nil error.
func toWire0(err error) *wireError {
	if err == nil {
		return nil
	}
	return toWire(err)
}

// deadlinePassed says whether the service's deadline passed unrenewed.
func (s *server) deadlinePassed() bool {
	s.dmu.Lock()
	defer s.dmu.Unlock()
	return s.expired
}

// hello checks the version, applies the configuration and starts the relay
// listener. It may succeed once per link.
func (s *server) hello(f *framer, req request) {
	fail := func(err error) { f.msg(response{Error: toWire(err), Version: s.version}) }
	if req.Version != s.version {
		fail(&Error{Code: codeVersion, Message: fmt.Sprintf(
			"the service speaks agent protocol %d and this agent speaks %d: run the sandgate agent of the service's own release in the sandbox (the sandbox image's sandgate binary is older or newer)",
			req.Version, s.version)})
		return
	}
	var c Config
	if req.Config != nil {
		c = *req.Config
	}
	cfg, err := c.resolve()
	if err != nil {
		fail(err)
		return
	}
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		fail(ErrLinkDown)
		return
	}
	if s.cfg != nil {
		s.mu.Unlock()
		fail(invalid("hello was already accepted on this link; open a new link to change the configuration"))
		return
	}
	ln, err := net.Listen("tcp", cfg.relayAddr.String())
	if err != nil {
		s.mu.Unlock()
		fail(fmt.Errorf("relay listener on %s: %w (is another agent still running in this sandbox?)", cfg.relayAddr, err))
		return
	}
	s.cfg, s.ln, s.relayAddr = cfg, ln, ln.Addr().String()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.acceptEgress(ln)
	}()
	relay := s.relayAddr
	var dnsErr string
	if cfg.dns != "" {
		d := newDNSResponder(s.log, s.reportLookup)
		if err := d.listen(cfg.dns); err != nil {
			dnsErr = fmt.Sprintf("DNS responder on %s: %v", cfg.dns, err)
			s.log.Warn("agent: no DNS responder; lookups in the sandbox fail as before, unaudited", "err", err)
		} else {
			s.dns = d
		}
	}
	s.mu.Unlock()
	f.msg(response{Version: s.version, RelayAddr: relay, PID: os.Getpid(), DNSError: dnsErr})
}

// capture makes the capture listener and passes it to the service, which
// steers the sandbox's connections to the capture prefix to it
// (internal/netcapture); its connections are then passed on as egress
// connections naming where they were going. Only over a link that passes
// sockets, once per link.
func (s *server) capture(f *framer) {
	if !s.fdPass.Load() {
		f.msg(response{Error: toWire(refused("capture needs a link that passes sockets (a unix socket link, after fdpass)"))})
		return
	}
	s.mu.Lock()
	if s.capLn != nil || s.stopped {
		s.mu.Unlock()
		f.msg(response{Error: toWire(invalid("capture was already set up on this link"))})
		return
	}
	var lc net.ListenConfig
	lc.SetMultipathTCP(false) // an MPTCP socket cannot be steered to
	ln, err := lc.Listen(s.ctx, "tcp4", "127.0.0.1:0")
	if err != nil {
		s.mu.Unlock()
		f.msg(response{Error: toWire(fmt.Errorf("capture listener: %w", err))})
		return
	}
	s.capLn = ln
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.acceptCaptured(ln)
	}()
	s.mu.Unlock()
	fd, err := dupListener(ln.(*net.TCPListener))
	if err != nil {
		f.msg(response{Error: toWire(fmt.Errorf("capture listener: %w", err))})
		return
	}
	if seq, ok := s.sender().attach(fd); ok {
		f.msg(response{FD: seq})
	}
}

// dnsMode switches the DNS responder to capture mode: the service has
// steered the prefix to the capture listener.
func (s *server) dnsMode(f *framer, req request) {
	p, err := netip.ParsePrefix(req.Prefix)
	if err != nil || !p.Addr().Is4() || p != p.Masked() {
		f.msg(response{Error: toWire(invalid("dnsmode prefix %q: want an IPv4 prefix such as 198.18.0.0/15", req.Prefix))})
		return
	}
	s.mu.Lock()
	d := s.dns
	s.mu.Unlock()
	if d == nil {
		f.msg(response{Error: toWire(refused("the agent runs no DNS responder (config dns)"))})
		return
	}
	d.setCapture(p)
	f.msg(response{})
}

// acceptCaptured passes each connection the capture listener accepts to
// the service, naming where the process was going.
func (s *server) acceptCaptured(ln net.Listener) { s.accept(ln, "capture", s.capturedTo) }

// capturedTo says where a captured connection was going: the name its
// address was given and the port, or the address itself if it has no name
// (the service judges that as it judges CONNECT to an address).
func (s *server) capturedTo(c *net.TCPConn) string {
	la := c.LocalAddr().(*net.TCPAddr).AddrPort()
	s.mu.Lock()
	d := s.dns
	s.mu.Unlock()
	if d != nil {
		if name, ok := d.nameOf(la.Addr().Unmap()); ok {
			return net.JoinHostPort(name, strconv.Itoa(int(la.Port())))
		}
	}
	return la.String()
}

// reportLookup tells the service of a lookup the responder refused, on a
// stream of its own.
func (s *server) reportLookup(name, qtype string) {
	sess := s.session()
	if sess == nil {
		return
	}
	st, err := sess.OpenStream()
	if err != nil {
		return
	}
	newFramer(st).msg(request{Op: "lookup", Name: name, QType: qtype})
	st.Close()
}

// acceptEgress turns each connection to the relay listener into a stream
// to the service.
func (s *server) acceptEgress(ln net.Listener) {
	s.accept(ln, "relay", func(*net.TCPConn) string { return "" })
}

// accept hands each connection ln accepts to the service (egressTo, where
// to says it was going), at most maxEgressConns at once, until ln closes.
func (s *server) accept(ln net.Listener, what string, to func(*net.TCPConn) string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			s.log.Warn("agent: "+what+" listener failed", "err", err)
			return
		}
		if s.egressActive.Add(1) > maxEgressConns {
			s.egressActive.Add(-1)
			c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.egressActive.Add(-1)
			tc := c.(*net.TCPConn)
			s.egressTo(tc, to(tc))
		}()
	}
}

// egressTo hands one connection to the service, with the process that
// made it when the agent can tell: to is "" for one made to the relay
// listener, where the process said it was going (a captured one).
func (s *server) egressTo(c *net.TCPConn, to string) {
	peer := findPeer(c)
	if s.fdPass.Load() {
		fd, err := dupConn(c)
		if err == nil {
			s.passFD(fd, c.RemoteAddr().String(), to, peer)
			c.Close() // the service holds the socket now
			return
		}
		s.log.Warn("agent: cannot duplicate an egress connection; it goes over the link", "err", err)
	}
	st, err := s.sess.OpenStream()
	if err != nil {
		c.Close()
		return
	}
	sc := &streamConn{Stream: st}
	if err := newFramer(st).msg(request{Op: "egress", From: c.RemoteAddr().String(), To: to, Peer: peer}); err != nil {
		sc.Close()
		c.Close()
		return
	}
	stop := context.AfterFunc(s.ctx, func() { sc.Close(); c.Close() })
	defer stop()
	splice(c, sc)
}

// passFD hands the socket fd (which it consumes) to the service: fd rides
// on the link's next write, then an egress stream names it by number.
// The stream carries nothing else and is closed at once.
func (s *server) passFD(fd int, from, to string, peer *Peer) {
	seq, ok := s.sender().attach(fd)
	if !ok {
		return
	}
	st, err := s.session().OpenStream()
	if err != nil {
		return // the link is down: closing it closes fd
	}
	newFramer(st).msg(request{Op: "egress", From: from, FD: seq, To: to, Peer: peer})
	st.Close()
}

// dial connects a stream to 127.0.0.1:<port> inside the sandbox.
func (s *server) dial(st *yamux.Stream, f *framer, req request) {
	if req.Port < 1 || req.Port > 65535 {
		f.msg(response{Error: toWire(invalid("port %d: want 1-65535", req.Port))})
		return
	}
	d := net.Dialer{Timeout: 10 * time.Second}
	c, err := d.DialContext(s.ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(req.Port)))
	if err != nil {
		f.msg(response{Error: &wireError{Code: codeUnreach, Message: fmt.Sprintf("nothing answers on 127.0.0.1:%d in the sandbox: %v", req.Port, err)}})
		return
	}
	if req.PassFD && s.fdPass.Load() {
		fd, err := dupConn(c.(*net.TCPConn))
		c.Close() // the service holds the socket now, or nobody does
		if err != nil {
			f.msg(response{Error: toWire(fmt.Errorf("passing the connection to 127.0.0.1:%d: %w", req.Port, err))})
			return
		}
		// The socket rides on the link's next write, at the latest the
		// one of this response, so it arrives before the response.
		if seq, ok := s.sender().attach(fd); ok {
			f.msg(response{FD: seq})
		}
		return
	}
	if err := f.msg(response{}); err != nil {
		c.Close()
		return
	}
	sc := &streamConn{Stream: st}
	stop := context.AfterFunc(s.ctx, func() { sc.Close(); c.Close() })
	defer stop()
	splice(c.(*net.TCPConn), sc)
}
