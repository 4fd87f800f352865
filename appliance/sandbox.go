package appliance

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/internal/netcapture"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/transforms"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// Options are what a sandbox is created with.
type Options struct {
	// Policy is the sandbox's network policy; the zero value denies all.
	Policy netpolicy.Policy
	// Transforms are its transformation rules (placeholder → secret on
	// base-URL routes); nil means none. They stay in the service.
	Transforms *transforms.RuleSet
	// Modules are its own WebAssembly transform modules, run after the
	// proxy's service-wide ones; nil means none. The caller owns them.
	Modules *wasm.Chain
	// ImportTar starts the writable layer from a layer tar (a snapshot
	// or a template).
	ImportTar string
	// Template names a template of `sandgate sandbox` (see
	// Launcher.ImportTemplate) mounted beneath the sandbox's own layer;
	// Google's CLI has none (import the template's layer instead).
	Template string
	// Agent configures the agent (relay address, PATH, HOME, base-URL
	// variables); the zero value means its defaults.
	Agent agent.Config
	// Limits are what it may take of the host (LaunchOptions.Limits).
	Limits Limits
}

// Sandbox is the service's handle on one running sandbox: its identity in
// the egress proxy and the link to its agent. The link is restarted when
// it drops; an operation under way when it drops fails with an error
// matching agent.ErrLinkDown, and the next waits for the new link.
type Sandbox struct {
	id    string
	l     *Launcher
	proxy *relay.Proxy
	relay *relay.Tenant
	opts  Options
	log   *slog.Logger

	ctx     context.Context // the sandbox's lifetime: ends at Destroy
	cancel  context.CancelCauseFunc
	started time.Time // when it started running (here: created, resumed, forked)

	mu       sync.Mutex
	cur      *agent.Client
	curLink  *link
	ready    chan struct{} // closed when cur is set; replaced when it drops
	restarts int
	wg       sync.WaitGroup

	// Activity, for idle suspend (see Idle).
	active atomic.Int64 // unix nanoseconds of the last call
	busy   atomic.Int32 // calls in progress (Use)
	ports  atomic.Int32 // port connections open (DialPort)

	// pmu guards the commands the manager started (Exec) and the port
	// connections open, by port: what the sandbox runs, which goes with it.
	pmu       sync.Mutex
	procs     map[string]*Process
	portsOpen map[int]int
	terms     map[string]*term // its terminals, by key (terminal.go)

	baseURLs atomic.Pointer[map[string]string]

	// hook steers the sandbox's captured connections to its agent's
	// current capture listener (nil: no capture); lookups limits the
	// lookups the agent reports for the audit.
	hook    *netcapture.Hook
	lookups rateLimit

	// deadline (unix nanoseconds; 0 none) is until when the service is
	// sure to own the sandbox: its agent kills every command past it
	// unless told a later one (setDeadline), and is told again whenever
	// it restarts.
	deadline atomic.Int64
}

// maxAgentStarts bounds how often the agent is restarted in a row without
// a link that stayed up for agentStableAfter; past it the sandbox is left
// without an agent and operations say why.
const (
	maxAgentStarts   = 5
	agentStableAfter = 10 * time.Second
	agentHelloWait   = 30 * time.Second
)

// Create starts sandbox id under the launcher, wires it into proxy as its
// own identity (its egress is served under opts.Policy and
// opts.Transforms) and starts its agent. On failure nothing of the sandbox
// is left behind.
func Create(ctx context.Context, l *Launcher, proxy *relay.Proxy, id string, opts Options) (*Sandbox, error) {
	return start(ctx, l, proxy, id, opts, func() error {
		return l.Create(ctx, id, LaunchOptions{ImportTar: opts.ImportTar, Template: opts.Template, Limits: opts.Limits})
	})
}

// Attach is Create for a sandbox the launcher has already started (a
// fork): it wires it into the proxy and starts its agent. On failure the
// sandbox is removed.
func Attach(ctx context.Context, l *Launcher, proxy *relay.Proxy, id string, opts Options) (*Sandbox, error) {
	return start(ctx, l, proxy, id, opts, func() error { return nil })
}

func start(ctx context.Context, l *Launcher, proxy *relay.Proxy, id string, opts Options, launch func() error) (*Sandbox, error) {
	if err := sandboxcli.CheckID(id); err != nil { // the id rule both CLIs share
		return nil, err
	}
	s := &Sandbox{id: id, l: l, proxy: proxy, opts: opts, log: l.log.With("sandbox", id), ready: make(chan struct{}),
		procs: map[string]*Process{}, portsOpen: map[int]int{}, started: time.Now()}
	s.touch()
	s.relay = relay.NewTenant(id, opts.Policy, opts.Transforms)
	if opts.Modules != nil {
		s.relay.SetModules(opts.Modules)
	}
	s.ctx, s.cancel = context.WithCancelCause(context.Background())
	// However the sandbox stops running (destroyed, suspended, its agent
	// gone for good), its credentials and modules go at once.
	context.AfterFunc(s.ctx, s.dropSecrets)
	if err := launch(); err != nil {
		s.cancel(err)
		return nil, err
	}
	c, k, err := s.connect(ctx)
	if err != nil && l.google {
		c, k, err = s.connectWhenReady(ctx, err)
	}
	if err != nil {
		s.cancel(err)
		cleanup, stop := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer stop()
		if derr := l.Delete(cleanup, id); derr != nil {
			err = fmt.Errorf("%w (and removing the half-made sandbox failed: %v)", err, derr)
		}
		return nil, err
	}
	s.set(c, k)
	s.wg.Add(1)
	go s.supervise()
	return s, nil
}

// ID returns the sandbox id.
func (s *Sandbox) ID() string { return s.id }

// connect starts an agent and performs the hello exchange.
func (s *Sandbox) connect(ctx context.Context) (*agent.Client, *link, error) {
	k, err := s.l.startAgent(s.id)
	if err != nil {
		return nil, nil, err
	}
	hctx, stop := context.WithTimeout(ctx, agentHelloWait)
	defer stop()
	c, err := agent.NewClient(hctx, k.transport(), agent.ClientOptions{
		Config:   s.l.AgentConfig(s.opts.Agent),
		Egress:   s.egress,
		Captured: s.captured,
		Lookup:   s.lookup,
		Logger:   s.log,
	})
	if err != nil {
		k.Close() // waits for the CLI process: its exit status is known after
		if kind := s.l.kind(k.err); kind != nil {
			// The CLI said why it could not run the agent (the sandbox
			// is gone, or stopped): a fact, not a hiccup of the link.
			return nil, nil, fmt.Errorf("sandbox %s: starting its agent: %w (%w; %s)", s.id, kind, err, k.exitReason())
		}
		return nil, nil, fmt.Errorf("sandbox %s: starting its agent: %w (%s)", s.id, err, k.exitReason())
	}
	if why := c.Info().DNSError; why != "" {
		s.log.Warn("the sandbox's DNS responder did not start: its lookups fail as they did before, unaudited", "err", why)
	}
	if s.l.Capture() && c.Info().FDPass {
		s.startCapture(hctx, c)
	}
	return c, k, nil
}

// startCapture steers the connections the sandbox makes to the capture
// prefix, on any port, to its agent's capture listener, then tells its
// DNS responder to give names addresses there. What fails leaves the
// sandbox without capture: its lookups then fail at once, audited.
func (s *Sandbox) startCapture(ctx context.Context, c *agent.Client) {
	fd, err := c.CaptureListener(ctx)
	if err != nil {
		s.log.Warn("no connection capture in the sandbox: the agent gave no listener", "err", err)
		return
	}
	hook, err := netcapture.Attach(fd, netcapture.DefaultPrefix)
	unix.Close(fd) // the hook holds the socket; the agent has its own
	if err != nil {
		s.log.Warn("no connection capture in the sandbox: processes that ignore the proxy variables reach nothing (their lookups are audited)", "err", err)
		return
	}
	s.mu.Lock()
	old := s.hook
	s.hook = hook
	s.mu.Unlock()
	if old != nil {
		old.Close()
	}
	if err := c.SetDNSCapture(ctx, netcapture.DefaultPrefix); err != nil {
		s.log.Warn("no connection capture in the sandbox: its DNS responder refused capture mode", "err", err)
	}
}

// captured serves one connection captured in the sandbox, to where the
// process was going, under this sandbox's identity, naming the process
// that made it (when the agent could tell) in its events.
func (s *Sandbox) captured(c net.Conn, to string, p agent.Peer) {
	host, port, err := netpolicy.SplitHostPort(to)
	if err != nil || port == 0 {
		c.Close()
		return
	}
	s.proxy.ServeCaptured(s.ctx, c, s.relay, strings.Trim(host, "[]"), port, relay.Peer{PID: p.PID, Args: p.Args})
}

// lookup audits a lookup the sandbox's DNS responder refused; a sandbox
// that reports too many in a burst has the rest dropped.
func (s *Sandbox) lookup(name, qtype string) {
	if s.lookups.allow(time.Now()) {
		s.proxy.RecordLookup(s.relay, name, qtype)
	}
}

// rateLimit is a token bucket: lookupRate a second, lookupBurst at once.
type rateLimit struct {
	mu     sync.Mutex
	tokens float64
	last   time.Time
}

const (
	lookupRate  = 20
	lookupBurst = 40
)

func (r *rateLimit) allow(now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.last.IsZero() {
		r.tokens = lookupBurst
	} else {
		r.tokens = min(lookupBurst, r.tokens+now.Sub(r.last).Seconds()*lookupRate)
	}
	r.last = now
	if r.tokens < 1 {
		return false
	}
	r.tokens--
	return true
}

// googleReadyWait bounds how long the first agent start in a sandbox
// Google's CLI just started is tried again.
const googleReadyWait = 15 * time.Second

// connectWhenReady tries the first agent start again, for a while: Google's
// CLI may return from `run --detach` (or `fork --detach`) before the
// sandbox accepts `exec` (a third-party probe of it found so; its reference
// does not say), and its status does not tell that from any other failure.
func (s *Sandbox) connectWhenReady(ctx context.Context, err error) (*agent.Client, *link, error) {
	deadline := time.Now().Add(googleReadyWait)
	for wait := 50 * time.Millisecond; time.Now().Before(deadline); wait = min(2*wait, time.Second) {
		select {
		case <-ctx.Done():
			return nil, nil, err
		case <-time.After(wait):
		}
		c, k, cerr := s.connect(ctx)
		if cerr == nil {
			return c, k, nil
		}
		err = cerr
	}
	return nil, nil, err
}

// egress serves one connection a sandbox process made to its relay
// listener, under this sandbox's identity: the identity is the link it
// came on, never anything it says. What the agent says of the process
// that made it only names it in the audit.
func (s *Sandbox) egress(c net.Conn, p agent.Peer) {
	s.proxy.ServePeer(s.ctx, c, s.relay, relay.Peer{PID: p.PID, Args: p.Args})
}

func (s *Sandbox) set(c *agent.Client, k *link) {
	s.mu.Lock()
	s.cur, s.curLink = c, k
	close(s.ready)
	s.mu.Unlock()
	s.pushDeadline()
}

// setDeadline tells the agent until when the service is sure to own the
// sandbox (see Sandbox.deadline). It is no call: it does not keep the
// sandbox from being idle.
func (s *Sandbox) setDeadline(until time.Time) {
	s.deadline.Store(until.UnixNano())
	s.pushDeadline()
}

// pushDeadline tells the current agent the deadline, if there is one.
func (s *Sandbox) pushDeadline() {
	until := s.deadline.Load()
	s.mu.Lock()
	c := s.cur
	s.mu.Unlock()
	if until == 0 || c == nil || c.Err() != nil {
		return
	}
	d := max(time.Until(time.Unix(0, until)), time.Millisecond)
	ctx, cancel := context.WithTimeout(s.ctx, 10*time.Second)
	defer cancel()
	if err := c.SetDeadline(ctx, d); err != nil && s.ctx.Err() == nil {
		s.log.Warn("telling the agent its deadline failed; it keeps the previous one", "err", err)
	}
}

// fence stops every command at once, and has the agent start none until
// a new deadline: the service may no longer own the sandbox.
func (s *Sandbox) fence(ctx context.Context) {
	s.deadline.Store(1)
	s.mu.Lock()
	c := s.cur
	s.mu.Unlock()
	if c == nil || c.Err() != nil {
		return
	}
	if err := c.SetDeadline(ctx, time.Millisecond); err != nil {
		s.log.Warn("fencing: the agent did not take its deadline; killing its commands", "err", err)
	}
	if _, err := c.KillAll(ctx); err != nil {
		s.log.Warn("fencing: killing the sandbox's commands failed", "err", err)
	}
}

// supervise restarts the agent whenever its link drops, until Destroy.
func (s *Sandbox) supervise() {
	defer s.wg.Done()
	for {
		s.mu.Lock()
		c, k := s.cur, s.curLink
		s.mu.Unlock()
		up := time.Now()
		select {
		case <-s.ctx.Done():
			return
		case <-c.Done():
		}
		if s.ctx.Err() != nil {
			return
		}
		s.log.Warn("agent link dropped; restarting the agent", "reason", k.exitReason())
		k.Close()
		s.mu.Lock()
		s.ready = make(chan struct{})
		s.cur = nil
		if time.Since(up) > agentStableAfter {
			s.restarts = 0
		}
		s.mu.Unlock()
		lookedAgain := false
		for {
			s.mu.Lock()
			s.restarts++
			n := s.restarts
			s.mu.Unlock()
			if n > maxAgentStarts {
				err := fmt.Errorf("sandbox %s: its agent failed %d times in a row; destroy and recreate the sandbox", s.id, maxAgentStarts)
				s.log.Error("giving up on the agent", "err", err)
				s.cancel(err)
				return
			}
			c, k, err := s.connect(s.ctx)
			if err == nil {
				s.set(c, k)
				s.log.Info("agent restarted", "attempt", n)
				break
			}
			if !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrNotRunning) && s.l.Gone(s.ctx, s.id) {
				// Google's CLI says nothing by its status; that it cannot
				// run anything in the sandbox either does. (Only here: a
				// sandbox being created is not gone, it failed.)
				err = fmt.Errorf("%w: the sandbox CLI runs nothing in sandbox %s (%w)", ErrNotFound, s.id, err)
			}
			if errors.Is(err, ErrNotRunning) && !errors.Is(err, ErrNotFound) && !lookedAgain {
				// A delete under way elsewhere looks like this for a
				// moment (its init killed, its state not yet marked):
				// look once more, so that a deleted sandbox is reported
				// as gone, not as stopped for good. Not counted.
				lookedAgain = true
				s.mu.Lock()
				s.restarts--
				s.mu.Unlock()
				s.log.Warn("the sandbox's init is not running; looking once more", "err", err)
				select {
				case <-s.ctx.Done():
					return
				case <-time.After(500 * time.Millisecond):
				}
				continue
			}
			if errors.Is(err, ErrNotFound) || errors.Is(err, ErrNotRunning) {
				// Deleted or stopped behind our back: no restart can help.
				s.log.Error("the sandbox is gone; not restarting its agent", "err", err)
				s.cancel(err)
				return
			}
			if errors.Is(err, ErrBusy) {
				// Another process is deleting (or creating) it: the next
				// attempt learns which. Not a failure of the agent, so not
				// counted; Destroy still ends the loop.
				s.mu.Lock()
				s.restarts--
				s.mu.Unlock()
				n = 1
			}
			s.log.Warn("restarting the agent failed", "attempt", n, "err", err)
			select {
			case <-s.ctx.Done():
				return
			case <-time.After(time.Duration(n) * 200 * time.Millisecond):
			}
		}
	}
}

// setNetwork replaces the sandbox's egress policy (every new connection
// is judged by it at once) and the base URLs its commands are given.
func (s *Sandbox) setNetwork(n Network) {
	s.relay.SetPolicy(n.Policy)
	urls := maps.Clone(n.BaseURLs)
	s.baseURLs.Store(&urls)
}

// BaseURLs returns the base URLs the sandbox's commands are given
// (variable name → upstream URL).
func (s *Sandbox) BaseURLs() map[string]string {
	if p := s.baseURLs.Load(); p != nil {
		return maps.Clone(*p)
	}
	return nil
}

// touch records a call now.
func (s *Sandbox) touch() { s.active.Store(time.Now().UnixNano()) }

// Use marks a call in progress (an HTTP request, a streamed command) until
// done is called: a sandbox is never idle while one is.
func (s *Sandbox) Use() (done func()) {
	s.busy.Add(1)
	s.touch()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.touch()
			s.busy.Add(-1)
		})
	}
}

// Idle reports how long the sandbox has been idle: no call, no call in
// progress (Use), no port connection open and no egress; zero when it is
// not idle now.
func (s *Sandbox) Idle(now time.Time) time.Duration {
	if s.busy.Load() > 0 || s.ports.Load() > 0 {
		return 0
	}
	last := time.Unix(0, s.active.Load())
	open, egress := s.relay.Egress()
	if open > 0 {
		return 0
	}
	if egress.After(last) {
		last = egress
	}
	return max(now.Sub(last), 0)
}

// RelayAddr is the address of the sandbox's relay listener as its commands
// reach it ("127.0.0.1:3128"), or "" while its agent is down.
func (s *Sandbox) RelayAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil {
		return ""
	}
	return s.cur.Info().RelayAddr
}

// Context ends when the sandbox is destroyed, or when its agent could not
// be restarted (context.Cause says why).
func (s *Sandbox) Context() context.Context { return s.ctx }

// client returns the live agent link, waiting under ctx for a restart in
// progress. It counts as a call (see Idle).
func (s *Sandbox) client(ctx context.Context) (*agent.Client, error) {
	s.touch()
	for {
		s.mu.Lock()
		c, ready := s.cur, s.ready
		s.mu.Unlock()
		if c != nil && c.Err() == nil {
			return c, nil
		}
		if s.ctx.Err() != nil {
			return nil, fmt.Errorf("sandbox %s: %w", s.id, context.Cause(s.ctx))
		}
		select {
		case <-ready:
		case <-s.ctx.Done():
		case <-ctx.Done():
			return nil, fmt.Errorf("sandbox %s: waiting for its agent: %w", s.id, context.Cause(ctx))
		case <-time.After(50 * time.Millisecond): // a drop the supervisor has yet to see
		}
	}
}

// quietClient is the live agent link, without counting as a call (the
// service's own work: checkpoints, deadlines), or an error if there is
// none right now.
func (s *Sandbox) quietClient() (*agent.Client, error) {
	s.mu.Lock()
	c := s.cur
	s.mu.Unlock()
	if c == nil || c.Err() != nil {
		return nil, fmt.Errorf("sandbox %s: its agent is restarting", s.id)
	}
	return c, nil
}

// Run runs a command in the sandbox and waits for it; see agent.Client.Run.
// Without base URLs of its own it gets the sandbox's current ones.
func (s *Sandbox) Run(ctx context.Context, cmd agent.Cmd) (agent.ExitStatus, error) {
	c, err := s.client(ctx)
	if err != nil {
		return agent.ExitStatus{}, err
	}
	return c.Run(ctx, s.withBaseURLs(cmd))
}

// Spawn starts a command and returns its handle; see agent.Client.Spawn.
// Without base URLs of its own it gets the sandbox's current ones.
func (s *Sandbox) Spawn(ctx context.Context, cmd agent.Cmd) (*agent.Process, error) {
	c, err := s.client(ctx)
	if err != nil {
		return nil, err
	}
	return c.Spawn(ctx, s.withBaseURLs(cmd))
}

// withBaseURLs gives cmd the sandbox's base URLs, once its network was
// set (setNetwork): the agent routes them (agent.RouteBaseURL), the one
// place a command's environment is made.
func (s *Sandbox) withBaseURLs(cmd agent.Cmd) agent.Cmd {
	if cmd.BaseURLs == nil {
		if p := s.baseURLs.Load(); p != nil {
			cmd.BaseURLs = maps.Clone(*p)
			if cmd.BaseURLs == nil {
				cmd.BaseURLs = map[string]string{}
			}
		}
	}
	return cmd
}

// KillAll stops every process in the sandbox but its agent.
func (s *Sandbox) KillAll(ctx context.Context) (int, error) {
	c, err := s.client(ctx)
	if err != nil {
		return 0, err
	}
	return c.KillAll(ctx)
}

// ReadFile streams a file out of the sandbox; a missing file matches
// fs.ErrNotExist.
func (s *Sandbox) ReadFile(ctx context.Context, path string) (io.ReadCloser, fs.FileInfo, error) {
	c, err := s.client(ctx)
	if err != nil {
		return nil, nil, err
	}
	r, fi, err := c.ReadFile(ctx, path)
	if err != nil {
		return nil, nil, err
	}
	return r, fi, nil
}

// WriteFile streams r into a file in the sandbox, creating parents; the
// file is replaced only when the whole content arrived.
func (s *Sandbox) WriteFile(ctx context.Context, path string, r io.Reader, opts agent.WriteOptions) (int64, error) {
	c, err := s.client(ctx)
	if err != nil {
		return 0, err
	}
	return c.WriteFile(ctx, path, r, opts)
}

// Stat describes a file in the sandbox.
func (s *Sandbox) Stat(ctx context.Context, path string) (fs.FileInfo, error) {
	c, err := s.client(ctx)
	if err != nil {
		return nil, err
	}
	fi, err := c.Stat(ctx, path)
	if err != nil {
		return nil, err
	}
	return fi, nil
}

// Mkdir makes a directory and its parents in the sandbox.
func (s *Sandbox) Mkdir(ctx context.Context, path string, perm fs.FileMode) error {
	c, err := s.client(ctx)
	if err != nil {
		return err
	}
	return c.Mkdir(ctx, path, perm)
}

// Remove removes a file or directory (a tree with recursive).
func (s *Sandbox) Remove(ctx context.Context, path string, recursive bool) error {
	c, err := s.client(ctx)
	if err != nil {
		return err
	}
	return c.Remove(ctx, path, recursive)
}

// TarIn seeds dir in the sandbox from a tar stream (bare, gzip or zstd).
func (s *Sandbox) TarIn(ctx context.Context, dir string, r io.Reader, opts agent.TarOptions) error {
	c, err := s.client(ctx)
	if err != nil {
		return err
	}
	return c.TarIn(ctx, dir, r, opts)
}

// TarOut writes dir in the sandbox to w as a tar stream.
func (s *Sandbox) TarOut(ctx context.Context, dir string, w io.Writer) error {
	c, err := s.client(ctx)
	if err != nil {
		return err
	}
	return c.TarOut(ctx, dir, w)
}

// DialPort connects to 127.0.0.1:port inside the sandbox. The sandbox is
// not idle while the connection is open.
func (s *Sandbox) DialPort(ctx context.Context, port int) (net.Conn, error) {
	c, err := s.client(ctx)
	if err != nil {
		return nil, err
	}
	conn, err := c.DialPort(ctx, port)
	if err != nil {
		return nil, err
	}
	s.ports.Add(1)
	s.pmu.Lock()
	s.portsOpen[port]++
	s.pmu.Unlock()
	return &portConn{Conn: conn, s: s, port: port}, nil
}

// portConn counts an open port connection until it is closed.
type portConn struct {
	net.Conn
	s    *Sandbox
	port int
	once sync.Once
}

func (c *portConn) Close() error {
	c.once.Do(func() {
		c.s.touch()
		c.s.ports.Add(-1)
		c.s.pmu.Lock()
		if c.s.portsOpen[c.port]--; c.s.portsOpen[c.port] <= 0 {
			delete(c.s.portsOpen, c.port)
		}
		c.s.pmu.Unlock()
	})
	return c.Conn.Close()
}

// OpenPorts lists the ports with a connection open now (DialPort), in
// order.
func (s *Sandbox) OpenPorts() []int {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	out := make([]int, 0, len(s.portsOpen))
	for p := range s.portsOpen {
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}

// addProcess records a command the manager started.
func (s *Sandbox) addProcess(p *Process) {
	s.pmu.Lock()
	s.procs[p.id] = p
	s.pmu.Unlock()
}

// addTerminal records a terminal under its key, unless one is there.
func (s *Sandbox) addTerminal(t *term) bool {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	if s.terms == nil {
		s.terms = map[string]*term{}
	}
	if s.terms[t.key] != nil {
		return false
	}
	s.terms[t.key] = t
	return true
}

// removeTerminal forgets terminal t.
func (s *Sandbox) removeTerminal(t *term) {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	if s.terms[t.key] == t {
		delete(s.terms, t.key)
	}
}

// terminal is the live terminal of that key, or nil.
func (s *Sandbox) terminal(key string) *term {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	return s.terms[key]
}

// process returns the command of that id, or nil.
func (s *Sandbox) process(id string) *Process {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	return s.procs[id]
}

// forgetProcesses drops the commands that exited more than retention ago
// and that no stream follows.
func (s *Sandbox) forgetProcesses(retention time.Duration) {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	for id, p := range s.procs {
		if p.forgettable(retention) {
			delete(s.procs, id)
			p.release()
		}
	}
}

// releaseProcesses lets go of every command's output: the sandbox stopped
// running, and its commands with it.
func (s *Sandbox) releaseProcesses() {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	for _, p := range s.procs {
		p.release()
	}
}

// dropSecrets empties the sandbox's credential rules (and forgets the
// secrets they held before: its record keeps them sealed) and closes its
// modules: run once it stops running, by whatever path, so that no secret
// of a sandbox that does not run stays in the service.
func (s *Sandbox) dropSecrets() {
	s.relay.Transforms().Forget()
	if mods := s.relay.Modules(); mods != nil {
		s.relay.SetModules(nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		mods.Close(ctx)
	}
}

// ExportLayer writes the sandbox's writable layer to file as a layer tar
// (bare, as both CLIs write it); snapshot.Save(ctx,
// snapshot.StreamSource(f), ...) stores it compressed, in full or as a
// delta against its template. Stop its processes first (KillAll) for a
// consistent layer.
func (s *Sandbox) ExportLayer(ctx context.Context, file string) error {
	return s.l.Tar(ctx, s.id, file)
}

// Destroy stops the agent and every process of the sandbox, removes it,
// and drops its kept-alive upstream connections. Egress connections in
// progress are cut when the link goes. A sandbox already gone (the CLI
// says ErrNotFound) is destroyed: nil.
func (s *Sandbox) Destroy(ctx context.Context) error {
	s.cancel(errDestroyed)
	s.wg.Wait()
	s.mu.Lock()
	c, k := s.cur, s.curLink
	s.cur = nil
	s.mu.Unlock()
	if c != nil {
		c.Close()
	}
	if k != nil {
		k.Close()
	}
	err := s.l.Delete(ctx, s.id)
	s.relay.Close()
	s.releaseProcesses()
	s.mu.Lock()
	if s.hook != nil {
		s.hook.Close()
		s.hook = nil
	}
	s.mu.Unlock()
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("destroying sandbox %s: %w", s.id, err)
	}
	return err
}
