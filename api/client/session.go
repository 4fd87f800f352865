package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api"
)

// CreateOptions says what sandbox Create makes. The zero value makes one
// with a fresh name, the service's network and nothing else.
type CreateOptions struct {
	// ID names the sandbox; empty: "ai-sdk-<8 hex>". A name that exists,
	// running or suspended, is ErrSandboxExists: Create never resumes.
	ID string
	// AllowedHosts are hosts the sandbox may reach over HTTPS, on top of
	// the service's own ("*" is every host, "*.example.com" its
	// subdomains). Give AllowedHosts or NetworkPolicy, not both.
	AllowedHosts []string
	// NetworkPolicy is the whole harness policy, CIDR rules included; it
	// replaces the service's own hosts (as SetNetworkPolicy does).
	NetworkPolicy *NetworkPolicy
	// BaseURLs are base URL variables (ANTHROPIC_BASE_URL=https://...)
	// every command gets, routed through the egress proxy, overlaying the
	// service's.
	BaseURLs map[string]string
	// Ports the session exposes (PortEndpoint); known to the client only.
	Ports []int
	// Template, when set, is made sure of (EnsureTemplate, with Setup
	// added to its own setup commands) and the sandbox starts from it;
	// then Setup does not run again in the sandbox.
	Template *Template
	// TemplateID starts the sandbox from a template that exists, by id
	// (Templates lists them): ErrTemplateNotFound if it does not. Give
	// Template or TemplateID, not both; with TemplateID, Setup runs.
	TemplateID string
	// Setup commands run in order in a new sandbox not made from Template;
	// one that exits non-zero destroys the sandbox and fails Create.
	Setup []string
	// Limits bound what it may take (CPU, memory, processes, disk, how
	// long it lives); a zero field means the service's default. Kept with
	// it for its whole life (across suspend and resume). A value out of
	// range is refused by the service (a *ServiceError, 400, naming the
	// field) and nothing is made.
	Limits Limits
}

// ResumeOptions is the network a resumed sandbox gets (it replaces what
// it had) and the ports of the session. Without a network (no
// AllowedHosts, not even an empty list, no NetworkPolicy, no BaseURLs) the
// sandbox keeps its last one: Session.KeptNetwork says which.
type ResumeOptions struct {
	AllowedHosts  []string
	NetworkPolicy *NetworkPolicy
	BaseURLs      map[string]string
	Ports         []int
}

// Session is one sandbox: its files and commands (as Restricted), its
// ports, its network and credentials, and its lifecycle. It is modelled
// on the AI SDK harness's HarnessV1NetworkSandboxSession. Safe for
// concurrent use.
type Session struct {
	r *Restricted

	mu    sync.Mutex
	ports []int
	kept  *KeptNetwork // what a Resume without a network kept
}

// KeptNetwork is the network the sandbox kept when this session came from
// a Resume given none; nil otherwise.
func (s *Session) KeptNetwork() *KeptNetwork {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.kept
}

func checkPorts(ports []int) error {
	for _, p := range ports {
		if p < 1 || p > 65535 {
			return fmt.Errorf("port %d: want 1 to 65535", p)
		}
	}
	return nil
}

func (c *Client) newSession(d api.Description, ports []int) *Session {
	sb := &sandbox{c: c, id: d.Name, home: d.Home, workDir: d.WorkingDirectory, procs: map[string]*Process{}}
	return &Session{r: &Restricted{sb: sb}, ports: slices.Clone(ports)}
}

// networkBody is the body of create and resume: protocol 1's allowed
// hosts, or sandgate's whole policy.
func networkBody(hosts []string, policy *NetworkPolicy, baseURLs map[string]string) (map[string]any, error) {
	body := map[string]any{}
	if policy != nil {
		if len(hosts) > 0 {
			return nil, errors.New("give AllowedHosts or NetworkPolicy, not both")
		}
		if err := policy.check(); err != nil {
			return nil, err
		}
		body["policy"] = policy
	} else if hosts != nil {
		body["allowedHosts"] = hosts
	}
	if len(baseURLs) > 0 {
		body["baseUrls"] = baseURLs
	}
	return body, nil
}

// Create makes a new sandbox and returns its session. It never resumes
// one: a name that exists is ErrSandboxExists.
func (c *Client) Create(ctx context.Context, opts CreateOptions) (*Session, error) {
	id := opts.ID
	if id == "" {
		id = NewSandboxID()
	}
	if err := checkName("sandbox", id); err != nil {
		return nil, err
	}
	if err := checkPorts(opts.Ports); err != nil {
		return nil, err
	}
	body, err := networkBody(opts.AllowedHosts, opts.NetworkPolicy, opts.BaseURLs)
	if err != nil {
		return nil, err
	}
	if opts.Limits != (Limits{}) {
		body["limits"] = opts.Limits
	}
	if opts.TemplateID != "" {
		if opts.Template != nil {
			return nil, errors.New("give Template or TemplateID, not both")
		}
		if err := checkName("template", opts.TemplateID); err != nil {
			return nil, err
		}
		body["template"] = opts.TemplateID
	}
	var tmpl Template
	if opts.Template != nil {
		tmpl = *opts.Template
		tmpl.Setup = append(slices.Clone(tmpl.Setup), opts.Setup...)
		if tmpl.AllowedHosts == nil && tmpl.NetworkPolicy == nil && tmpl.BaseURLs == nil {
			tmpl.AllowedHosts, tmpl.NetworkPolicy, tmpl.BaseURLs = opts.AllowedHosts, opts.NetworkPolicy, opts.BaseURLs
		}
	}
	for attempt := 0; ; attempt++ {
		if opts.Template != nil {
			tid, err := c.EnsureTemplate(ctx, tmpl)
			if err != nil {
				return nil, err
			}
			body["template"] = tid
		}
		s, err := c.create(ctx, id, body, opts.Ports)
		if errors.Is(err, ErrTemplateNotFound) && opts.Template != nil && attempt == 0 {
			// Deleted since this process made sure of it: build it again.
			c.forgetTemplate(body["template"].(string))
			continue
		}
		if err != nil {
			return nil, err
		}
		if opts.Template == nil {
			if err := runSetup(ctx, s.r, opts.Setup); err != nil {
				dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
				defer cancel()
				s.Destroy(dctx)
				return nil, err
			}
		}
		return s, nil
	}
}

// create is POST /v1/sandboxes.
func (c *Client) create(ctx context.Context, id string, body map[string]any, ports []int) (*Session, error) {
	body["name"] = id
	var d api.Description
	_, err := c.doJSON(ctx, call{route: routeCreate, body: jsonBody(body)}, &d)
	switch st := statusOf(err); {
	case st == http.StatusConflict:
		return nil, categorize(ErrSandboxExists, err, "sandbox %q exists (running or suspended): create never resumes; resume it, or pick another name", id)
	case st == http.StatusNotFound && body["template"] != nil:
		return nil, categorize(ErrTemplateNotFound, err, "template %s is not in the service's namespace", body["template"])
	case err != nil:
		return nil, err
	}
	return c.newSession(d, ports), nil
}

// runSetup runs setup commands in order, stopping at the first failure.
func runSetup(ctx context.Context, r *Restricted, setup []string) error {
	for _, cmd := range setup {
		res, err := r.Run(ctx, Command{Command: cmd})
		if err != nil {
			return fmt.Errorf("setup command %q: %w", cmd, err)
		}
		if res.ExitCode != 0 {
			return fmt.Errorf("setup command %q exited with %d%s", cmd, res.ExitCode, said(res.Stderr))
		}
	}
	return nil
}

// said is ": " and what a failed command wrote to stderr, trimmed, or ""
// when it wrote nothing (a message never ends in a colon).
func said(stderr []byte) string {
	if s := bytes.TrimSpace(stderr); len(s) > 0 {
		return ": " + string(s)
	}
	return ""
}

// Resume starts a suspended sandbox again from its snapshot (or, if it
// runs, takes it over), with the network given: it replaces the one it
// had; given none, the sandbox keeps its last (Session.KeptNetwork says
// which). It never creates one: a name with no sandbox is
// ErrSandboxNotFound. A resumed sandbox has lost its request
// transformations.
func (c *Client) Resume(ctx context.Context, id string, opts ResumeOptions) (*Session, error) {
	if err := checkName("sandbox", id); err != nil {
		return nil, err
	}
	if err := checkPorts(opts.Ports); err != nil {
		return nil, err
	}
	body, err := networkBody(opts.AllowedHosts, opts.NetworkPolicy, opts.BaseURLs)
	if err != nil {
		return nil, err
	}
	if len(body) == 0 {
		body["keepNetwork"] = true // sandgate's: protocol 1's {} would give the service's network alone
	}
	var d api.Description
	if _, err := c.doLong(ctx, call{route: routeResume, args: []string{id}, body: jsonBody(body)}, &d); err != nil {
		if statusOf(err) == http.StatusNotFound {
			return nil, categorize(ErrSandboxNotFound, err, "no sandbox %q, running or suspended", id)
		}
		return nil, err
	}
	s := c.newSession(d, opts.Ports)
	if d.Network != nil {
		s.kept = &KeptNetwork{Kept: d.Network.Kept, Policy: wirePolicy(d.Network.Policy), BaseURLs: d.Network.BaseURLs}
	}
	return s, nil
}

// Attach returns a session of a running sandbox as it is, changing
// nothing of it (Resume replaces its network), or of one the service
// suspended on its own (idle, say: SandboxInfo.Wakes), which its next
// call wakes as it was. One its caller suspended is ErrSandboxNotRunning
// (resume it), a missing one ErrSandboxNotFound.
func (c *Client) Attach(ctx context.Context, id string, ports ...int) (*Session, error) {
	if err := checkPorts(ports); err != nil {
		return nil, err
	}
	in, err := c.Info(ctx, id)
	if err != nil {
		return nil, err
	}
	if in.State != "running" && !in.Wakes() {
		return nil, fmt.Errorf("%w: sandbox %q is %s (resume it)", ErrSandboxNotRunning, id, in.State)
	}
	return c.newSession(api.Description{Name: in.Name, Home: in.Home, WorkingDirectory: in.WorkingDirectory}, ports), nil
}

// Info describes a sandbox, running or suspended.
func (c *Client) Info(ctx context.Context, id string) (SandboxInfo, error) {
	if err := checkName("sandbox", id); err != nil {
		return SandboxInfo{}, err
	}
	return c.info(ctx, id)
}

func (c *Client) info(ctx context.Context, id string) (SandboxInfo, error) {
	var in api.Sandbox
	if _, err := c.doJSON(ctx, call{route: routeGet, args: []string{id}, idempotent: true}, &in); err != nil {
		if statusOf(err) == http.StatusNotFound {
			return SandboxInfo{}, categorize(ErrSandboxNotFound, err, "no sandbox %q, running or suspended", id)
		}
		return SandboxInfo{}, err
	}
	return sandboxInfo(in), nil
}

func sandboxInfo(in api.Sandbox) SandboxInfo {
	out := SandboxInfo{Name: in.Name, State: in.State, Created: in.Created, LayerBytes: in.LayerBytes, Template: in.Template,
		OpenPorts: in.Ports, BaseURLs: in.BaseURLs, Home: in.Home, WorkingDirectory: in.WorkDir, Shard: in.Shard, SuspendedBy: in.SuspendedBy}
	if in.LastActive != nil {
		out.LastActive = *in.LastActive
	}
	for _, m := range in.Modules {
		out.Modules = append(out.Modules, ModuleInfo{Name: m.Name, Digest: m.Digest, Bytes: m.Bytes})
	}
	out.Policy = wirePolicy(in.Policy)
	if in.Limits != nil {
		if b, err := json.Marshal(in.Limits); err == nil {
			var l Limits
			if json.Unmarshal(b, &l) == nil {
				out.Limits = &l
			}
		}
	}
	out.Usage = in.Usage
	return out
}

// wirePolicy is a policy as the service wrote it (nil for none, or one
// this client cannot read).
func wirePolicy(v any) *NetworkPolicy {
	if v == nil {
		return nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil
	}
	var p NetworkPolicy
	if json.Unmarshal(b, &p) != nil {
		return nil
	}
	return &p
}

// List describes every sandbox of the service, running or suspended.
func (c *Client) List(ctx context.Context) ([]SandboxInfo, error) {
	var l api.SandboxList
	if _, err := c.doJSON(ctx, call{route: routeList, idempotent: true}, &l); err != nil {
		return nil, err
	}
	out := make([]SandboxInfo, 0, len(l.Sandboxes))
	for _, in := range l.Sandboxes {
		out = append(out, sandboxInfo(in))
	}
	return out, nil
}

// Suspend saves a running sandbox's files and frees it (Session.Stop for
// a sandbox by name). One that is not running is no error.
func (c *Client) Suspend(ctx context.Context, id string) error {
	if err := checkName("sandbox", id); err != nil {
		return err
	}
	_, err := c.doLong(ctx, call{route: routeSuspend, args: []string{id}, idempotent: true}, nil)
	return err
}

// Destroy removes a sandbox, running or suspended, and its snapshot
// (Session.Destroy for a sandbox by name). One that does not exist is no
// error.
func (c *Client) Destroy(ctx context.Context, id string) error {
	if err := checkName("sandbox", id); err != nil {
		return err
	}
	_, err := c.doJSON(ctx, call{route: routeDestroy, args: []string{id}, idempotent: true}, nil)
	return err
}

// ID is the sandbox's name: what Resume takes in another process.
func (s *Session) ID() string { return s.r.sb.id }

// DefaultWorkingDirectory is where commands run and relative paths
// resolve.
func (s *Session) DefaultWorkingDirectory() string { return s.r.sb.workDir }

// Home is the sandbox's home directory.
func (s *Session) Home() string { return s.r.sb.home }

// Description is the text a harness gives an agent about the sandbox.
func (s *Session) Description() string { return s.r.Description() }

// Restricted is the files-and-commands view of the sandbox, for tools:
// no lifecycle, ports, network or credentials.
func (s *Session) Restricted() *Restricted { return s.r }

// Ports are the ports the session exposes (PortEndpoint).
func (s *Session) Ports() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.ports)
}

// SetPorts replaces the ports the session exposes. Ports are the
// client's own: the service lets any port be reached by whoever may call
// it.
func (s *Session) SetPorts(ports []int) error {
	if err := checkPorts(ports); err != nil {
		return err
	}
	s.mu.Lock()
	s.ports = slices.Clone(ports)
	s.mu.Unlock()
	return nil
}

// Run runs a command to its end (Restricted.Run).
func (s *Session) Run(ctx context.Context, cmd Command) (Result, error) { return s.r.Run(ctx, cmd) }

// Spawn starts a command (Restricted.Spawn).
func (s *Session) Spawn(ctx context.Context, cmd Command) (*Process, error) {
	return s.r.Spawn(ctx, cmd)
}

// ReadFile streams a file (Restricted.ReadFile).
func (s *Session) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	return s.r.ReadFile(ctx, name)
}

// ReadTextFile reads a file as text (Restricted.ReadTextFile).
func (s *Session) ReadTextFile(ctx context.Context, name string) (string, error) {
	return s.r.ReadTextFile(ctx, name)
}

// ReadTextLines reads lines of a file (Restricted.ReadTextLines).
func (s *Session) ReadTextLines(ctx context.Context, name string, start, end int) (string, error) {
	return s.r.ReadTextLines(ctx, name, start, end)
}

// WriteFile streams content into a file (Restricted.WriteFile).
func (s *Session) WriteFile(ctx context.Context, name string, content io.Reader) error {
	return s.r.WriteFile(ctx, name, content)
}

// WriteTextFile writes text to a file (Restricted.WriteTextFile).
func (s *Session) WriteTextFile(ctx context.Context, name, text string) error {
	return s.r.WriteTextFile(ctx, name, text)
}

// ExportWorkspace writes the working directory as a tar, checked
// (Restricted.ExportWorkspace).
func (s *Session) ExportWorkspace(ctx context.Context, w io.Writer) (string, error) {
	return s.r.ExportWorkspace(ctx, w)
}

// ImportWorkspace unpacks a tar into the working directory
// (Restricted.ImportWorkspace).
func (s *Session) ImportWorkspace(ctx context.Context, tar io.Reader) error {
	return s.r.ImportWorkspace(ctx, tar)
}

// Info describes the sandbox as the service sees it now.
func (s *Session) Info(ctx context.Context) (SandboxInfo, error) { return s.r.sb.c.info(ctx, s.ID()) }

// notRunning names a 404 of a route of a running sandbox.
func (s *Session) notRunning(err error) error {
	if statusOf(err) == http.StatusNotFound {
		return categorize(ErrSandboxNotFound, err, "sandbox %q is not running", s.ID())
	}
	return err
}

// SetNetworkPolicy replaces what the sandbox may reach: the harness's
// policy, CIDR rules included. It replaces the service's own allowed
// hosts too: deny-all denies everything but the base URLs' and the
// request transformations' hosts. It takes effect for every new
// connection at once.
func (s *Session) SetNetworkPolicy(ctx context.Context, p NetworkPolicy) error {
	if err := p.check(); err != nil {
		return err
	}
	_, err := s.r.sb.c.doJSON(ctx, call{route: routeNetwork, args: []string{s.ID()}, body: jsonBody(map[string]any{"policy": p}), idempotent: true}, nil)
	return s.notRunning(err)
}

// SetRequestTransformations replaces the sandbox's request
// transformations (an empty list removes them). They live in the
// service's memory only: a suspended sandbox loses them.
func (s *Session) SetRequestTransformations(ctx context.Context, ts []RequestTransformation) error {
	return s.transformations(ctx, routeSetTransforms, ts, true)
}

// AddRequestTransformations appends to the sandbox's request
// transformations.
func (s *Session) AddRequestTransformations(ctx context.Context, ts []RequestTransformation) error {
	return s.transformations(ctx, routeAddTransforms, ts, false)
}

func (s *Session) transformations(ctx context.Context, route string, ts []RequestTransformation, idempotent bool) error {
	for i, t := range ts {
		if t.Match.Host == "" || t.Transform.Headers == nil {
			return fmt.Errorf("transformation %d: Match.Host and Transform.Headers are required", i)
		}
	}
	if ts == nil {
		ts = []RequestTransformation{}
	}
	b, err := json.Marshal(map[string]any{"transformations": ts})
	if err != nil {
		return err
	}
	_, err = s.r.sb.c.doJSON(ctx, call{route: route, args: []string{s.ID()}, body: b, idempotent: idempotent}, nil)
	return s.notRunning(err)
}

// SetModules replaces the sandbox's own WebAssembly transform modules,
// run on its routed requests after the service's and before the
// credential swap; none removes them. A service that runs no modules is
// ErrCapabilityUnsupported.
func (s *Session) SetModules(ctx context.Context, mods []Module) error {
	if mods == nil {
		mods = []Module{}
	}
	_, err := s.r.sb.c.doJSON(ctx, call{route: routeModules, args: []string{s.ID()}, body: jsonBody(map[string]any{"modules": mods}), idempotent: true}, nil)
	return s.notRunning(err)
}

// Audit returns a page of the sandbox's egress events that q selects;
// see Client.Audit.
func (s *Session) Audit(ctx context.Context, q AuditQuery) (AuditPage, error) {
	return s.r.sb.c.Audit(ctx, s.ID(), q)
}

// FollowAudit yields the sandbox's egress events that q selects, then each
// new one as it happens; see Client.FollowAudit.
func (s *Session) FollowAudit(ctx context.Context, q AuditQuery) iter.Seq2[AuditEvent, error] {
	return s.r.sb.c.FollowAudit(ctx, s.ID(), q)
}

// KillAllProcesses stops every process started in the sandbox since it
// last started, by anyone (a previous run of the program included).
func (s *Session) KillAllProcesses(ctx context.Context) error {
	_, err := s.r.sb.c.doJSON(ctx, call{route: routeKillAll, args: []string{s.ID()}, idempotent: true}, nil)
	if err != nil {
		return s.notRunning(err)
	}
	sb := s.r.sb
	sb.mu.Lock()
	for _, p := range sb.procs {
		p.kmu.Lock()
		p.killed = true
		p.kmu.Unlock()
	}
	sb.mu.Unlock()
	return nil
}

// Stop suspends the sandbox: the processes this session started are
// stopped, its files saved, and it is freed, with the credentials the
// service held for it. Nothing runs until Resume. Stopping a sandbox that
// is not running is no error.
func (s *Session) Stop(ctx context.Context) error {
	if err := s.r.sb.killOwn(ctx); err != nil && statusOf(err) != http.StatusNotFound {
		return err
	}
	return s.r.sb.c.Suspend(ctx, s.ID())
}

// Destroy removes the sandbox, running or suspended, and its snapshot.
// Destroying one that is gone is no error.
func (s *Session) Destroy(ctx context.Context) error {
	s.r.sb.killOwn(ctx) // it goes anyway
	return s.r.sb.c.Destroy(ctx, s.ID())
}

// Fork copies the sandbox, as its files are now, to a new sandbox name
// (the service copies it; this one keeps running) and returns the copy's
// session, with this session's ports. The copy has this sandbox's network
// but none of its request transformations. A name that exists is
// ErrSandboxExists.
func (s *Session) Fork(ctx context.Context, name string) (*Session, error) {
	fr, err := s.r.sb.c.fork(ctx, s.ID(), name)
	if err != nil {
		return nil, err
	}
	return s.r.sb.c.newSession(api.Description{Name: fr.Name, Home: fr.Home, WorkingDirectory: fr.WorkingDirectory}, s.Ports()), nil
}

// Fork copies sandbox src to a new sandbox dst and returns the copy's
// state: "running" (a copy of a running sandbox's files, with its network
// but none of its request transformations) or "suspended" (a copy of a
// suspended sandbox's snapshot, to Resume). A dst that exists is
// ErrSandboxExists; a src that is neither running nor suspended
// ErrSandboxNotFound.
func (c *Client) Fork(ctx context.Context, src, dst string) (string, error) {
	if err := checkName("sandbox", src); err != nil {
		return "", err
	}
	fr, err := c.fork(ctx, src, dst)
	return fr.State, err
}

func (c *Client) fork(ctx context.Context, src, dst string) (api.ForkResult, error) {
	var fr api.ForkResult
	if err := checkName("sandbox", dst); err != nil {
		return fr, err
	}
	_, err := c.doJSON(ctx, call{route: routeFork, args: []string{src}, body: jsonBody(map[string]string{"name": dst})}, &fr)
	switch st := statusOf(err); {
	case st == http.StatusConflict:
		return fr, categorize(ErrSandboxExists, err, "sandbox %q exists", dst)
	case st == http.StatusNotFound:
		return fr, categorize(ErrSandboxNotFound, err, "no sandbox %q to fork, running or suspended", src)
	case err != nil:
		return fr, err
	}
	return fr, nil
}

// SaveTemplate saves the sandbox's files, as they are now, as template id
// of the service's namespace (replacing one of that id); the sandbox
// keeps running. Sandboxes made from it (CreateOptions.TemplateID) start
// with those files and save only what differs.
func (s *Session) SaveTemplate(ctx context.Context, id string) error {
	if err := checkName("template", id); err != nil {
		return err
	}
	_, err := s.r.sb.c.doLong(ctx, call{route: routeSaveTemplate, args: []string{s.ID()}, body: jsonBody(map[string]string{"id": id})}, nil)
	return s.notRunning(err)
}

// PortEndpoint is how to reach port of the sandbox from outside, through
// the service's port tunnel: the URL (ws:// or wss:// for protocol "ws",
// else http:// or https://, after the service's scheme) and the headers
// the connection must carry: the protocol, the service token, and an
// identity token read anew at each call. The tunnel carries requests that
// upgrade the connection (a WebSocket, as the harness bridges use). A port
// the session does not expose (Ports) is ErrCapabilityUnsupported.
func (s *Session) PortEndpoint(ctx context.Context, port int, protocol string) (Endpoint, error) {
	if !slices.Contains(s.Ports(), port) {
		return Endpoint{}, fmt.Errorf("%w: port %d is not exposed by sandbox %q (exposed: %v); add it with SetPorts", ErrCapabilityUnsupported, port, s.ID(), s.Ports())
	}
	c := s.r.sb.c
	sh := c.target(s.ID())
	u := *sh.base
	switch protocol {
	case "", "http", "https":
	case "ws":
		u.Scheme = map[string]string{"http": "ws", "https": "wss"}[u.Scheme]
	default:
		return Endpoint{}, fmt.Errorf("protocol %q: want http, https or ws", protocol)
	}
	_, p := call{route: routePorts, args: []string{s.ID(), strconv.Itoa(port)}}.path()
	h := http.Header{}
	if err := c.authorizeFor(ctx, sh, h); err != nil {
		return Endpoint{}, err
	}
	return Endpoint{URL: u.String() + p, Header: h}, nil
}
