package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net"
	"path"
	"slices"
	"strings"
	"sync"
	"testing/fstest"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
)

// fakeBackend is an in-memory Backend for route tests that need no root:
// sandboxes are records, files a map, a command's output is what its run
// function says (by default: the command line echoed), and a port is a
// dial to 127.0.0.1:<port> on the host, where a test listens.
type fakeBackend struct {
	mu        sync.Mutex
	boxes     map[string]*fakeBox
	templates map[string]time.Time
	events    map[string][]byte // per sandbox: audit lines
	// run is what a command does: its output and exit code.
	run func(box *fakeBox, req appliance.ExecRequest, p *appliance.Process) int
}

type fakeBox struct {
	state appliance.State
	// suspendedBy is who suspended it (a suspended box).
	suspendedBy appliance.SuspendReason
	created     time.Time
	spec        appliance.NetworkSpec
	rules       []transforms.Rule
	modules     []appliance.ModuleSource
	files       map[string][]byte
	procs       map[string]*appliance.Process
	execs       []appliance.ExecRequest
	limits      appliance.Limits
}

func newFakeBackend() *fakeBackend {
	return &fakeBackend{boxes: map[string]*fakeBox{}, templates: map[string]time.Time{}, events: map[string][]byte{}}
}

func (f *fakeBackend) box(id string, running bool) (*fakeBox, error) {
	b := f.boxes[id]
	if b == nil {
		return nil, fmt.Errorf("%w: sandbox %q is neither running nor suspended", appliance.ErrNotFound, id)
	}
	if running && b.state != appliance.Running {
		return nil, fmt.Errorf("%w: sandbox %q is not running", appliance.ErrNotRunning, id)
	}
	return b, nil
}

func (f *fakeBackend) Create(ctx context.Context, id string, opts appliance.CreateOptions) (*appliance.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.boxes[id]; ok {
		return nil, fmt.Errorf("%w: sandbox %q", appliance.ErrExists, id)
	}
	if opts.Template != "" {
		if _, ok := f.templates[opts.Template]; !ok {
			return nil, appliance.ErrNoTemplate
		}
	}
	f.boxes[id] = &fakeBox{state: appliance.Running, created: time.Now(), spec: opts.Network, rules: opts.Rules,
		modules: opts.Modules, files: map[string][]byte{}, procs: map[string]*appliance.Process{}, limits: opts.Limits}
	return nil, nil
}

func (f *fakeBackend) Resume(ctx context.Context, id string, opts appliance.ResumeOptions) (*appliance.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(id, false)
	if err != nil {
		return nil, err
	}
	if b.state != appliance.Running {
		b.state, b.rules, b.procs = appliance.Running, opts.Rules, map[string]*appliance.Process{}
	}
	if !opts.KeepNetwork {
		b.spec = opts.Network
	}
	return nil, nil
}

func (f *fakeBackend) Wake(ctx context.Context, id string, opts appliance.ResumeOptions) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(id, false)
	switch {
	case err != nil:
		return false, err
	case b.state == appliance.Running:
		return false, nil
	case !b.suspendedBy.Wakes():
		return false, fmt.Errorf("%w: sandbox %q is suspended (resume it)", appliance.ErrNotRunning, id)
	}
	b.state, b.rules, b.procs = appliance.Running, nil, map[string]*appliance.Process{}
	return true, nil
}

func (f *fakeBackend) Suspend(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if b := f.boxes[id]; b != nil {
		b.state, b.rules, b.procs, b.suspendedBy = appliance.Suspended, nil, nil, appliance.SuspendedByCaller
	}
	return nil
}

func (f *fakeBackend) Destroy(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.boxes, id)
	delete(f.events, id)
	return nil
}

func (f *fakeBackend) Fork(ctx context.Context, src, dst string, opts appliance.ForkOptions) (appliance.State, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(src, false)
	if err != nil {
		return "", err
	}
	if _, ok := f.boxes[dst]; ok {
		return "", fmt.Errorf("%w: sandbox %q", appliance.ErrExists, dst)
	}
	f.boxes[dst] = &fakeBox{state: b.state, created: time.Now(), spec: b.spec, modules: b.modules,
		files: maps.Clone(b.files), procs: map[string]*appliance.Process{}}
	return b.state, nil
}

func (f *fakeBackend) info(id string, b *fakeBox) appliance.Info {
	in := appliance.Info{ID: id, State: b.state, Created: b.created, Limits: b.limits}
	if b.state == appliance.Suspended {
		in.SuspendedBy = b.suspendedBy
	}
	if b.state == appliance.Running {
		in.BaseURLs = b.spec.BaseURLs
	}
	for _, m := range b.modules {
		in.Modules = append(in.Modules, appliance.ModuleInfo{Name: m.Name, Digest: "sha256:fake", Bytes: len(m.Wasm)})
	}
	return in
}

func (f *fakeBackend) Get(ctx context.Context, id string) (appliance.Info, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(id, false)
	if err != nil {
		return appliance.Info{}, err
	}
	return f.info(id, b), nil
}

func (f *fakeBackend) List(ctx context.Context) ([]appliance.Info, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []appliance.Info
	for _, id := range slices.Sorted(maps.Keys(f.boxes)) {
		out = append(out, f.info(id, f.boxes[id]))
	}
	return out, nil
}

// OpenTerminal: the fake runs no terminal (a Terminal needs an agent); the
// PTY route's tests run against the real service (api/service).
func (f *fakeBackend) OpenTerminal(ctx context.Context, id string, req appliance.TerminalRequest) (*appliance.Terminal, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.box(id, true); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("%w: the fake backend runs no terminal", errors.ErrUnsupported)
}

// AttachTerminal: no terminal is ever there.
func (f *fakeBackend) AttachTerminal(ctx context.Context, id, key string, from int64, alive func(context.Context) error) (*appliance.Terminal, error) {
	return nil, fmt.Errorf("%w: no terminal %q in sandbox %q", appliance.ErrNotFound, key, id)
}

func (f *fakeBackend) Exec(ctx context.Context, id string, req appliance.ExecRequest) (*appliance.Process, error) {
	f.mu.Lock()
	b, err := f.box(id, true)
	if err != nil {
		f.mu.Unlock()
		return nil, err
	}
	g := transforms.NewRuleSet(b.rules...).Guard()
	f.mu.Unlock()
	if err := g.Check("the command", req.Args...); err != nil {
		return nil, err
	}
	if err := g.Check("the command's environment", req.Env...); err != nil {
		return nil, err
	}
	if req.Check != nil {
		if err := req.Check(); err != nil {
			return nil, err
		}
	}
	p := appliance.NewProcess(1 << 20)
	f.mu.Lock()
	b.execs = append(b.execs, req)
	b.procs[p.ID()] = p
	run := f.run
	f.mu.Unlock()
	if req.Stdin == nil {
		req.Stdin = bytes.NewReader(nil)
	}
	req.Stdin = io.MultiReader(bytes.NewReader(req.StdinHead), req.Stdin)
	go func() {
		if run == nil {
			io.WriteString(p.Output(appliance.Stdout), strings.Join(req.Args, " ")+"\n")
			p.Finish(0)
			return
		}
		p.Finish(run(b, req, p))
	}()
	return p, nil
}

func (f *fakeBackend) Process(id, pid string) (*appliance.Process, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(id, true)
	if err != nil {
		return nil, err
	}
	if p := b.procs[pid]; p != nil {
		return p, nil
	}
	return nil, appliance.ErrNoProcess
}

func (f *fakeBackend) KillAll(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, err := f.box(id, true)
	return err
}

func (f *fakeBackend) files(id string) (fstest.MapFS, error) {
	b, err := f.box(id, true)
	if err != nil {
		return nil, err
	}
	m := fstest.MapFS{}
	for p, data := range b.files {
		m[strings.TrimPrefix(p, "/")] = &fstest.MapFile{Data: data, Mode: 0o644}
	}
	return m, nil
}

func (f *fakeBackend) ReadFile(ctx context.Context, id, p string) (io.ReadCloser, fs.FileInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, err := f.files(id)
	if err != nil {
		return nil, nil, err
	}
	fi, err := fs.Stat(m, strings.TrimPrefix(p, "/"))
	if err != nil {
		return nil, nil, err
	}
	return io.NopCloser(bytes.NewReader(f.boxes[id].files[p])), fi, nil
}

func (f *fakeBackend) Stat(ctx context.Context, id, p string) (fs.FileInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, err := f.files(id)
	if err != nil {
		return nil, err
	}
	return fs.Stat(m, strings.TrimPrefix(path.Clean(p), "/"))
}

func (f *fakeBackend) WriteFile(ctx context.Context, id, p string, r io.Reader) (int64, error) {
	f.mu.Lock()
	b, err := f.box(id, true)
	var g *transforms.Guard
	if err == nil {
		g = transforms.NewRuleSet(b.rules...).Guard()
	}
	f.mu.Unlock()
	if err != nil {
		return 0, err
	}
	data, err := io.ReadAll(g.Reader(r, "the file's content"))
	if err != nil {
		return 0, err
	}
	f.mu.Lock()
	b.files[p] = data
	f.mu.Unlock()
	return int64(len(data)), nil
}

func (f *fakeBackend) TarIn(ctx context.Context, id, dir string, r io.Reader) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, err := f.box(id, true)
	return err
}

func (f *fakeBackend) TarOut(ctx context.Context, id, dir string, w io.Writer) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, err := f.box(id, true)
	return err
}

func (f *fakeBackend) DialPort(ctx context.Context, id string, port int) (net.Conn, error) {
	f.mu.Lock()
	_, err := f.box(id, true)
	f.mu.Unlock()
	if err != nil {
		return nil, err
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", port))
}

// PortGuard finds nothing: route tests hold no credential in a tunnel;
// the real guard is tested with the real manager (api/service).
func (f *fakeBackend) PortGuard(id string) (appliance.PortGuard, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, err := f.box(id, true)
	return appliance.PortGuard{}, err
}

func (f *fakeBackend) SetNetwork(ctx context.Context, id string, spec appliance.NetworkSpec) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(id, true)
	if err != nil {
		return err
	}
	if spec.BaseURLs == nil {
		spec.BaseURLs = b.spec.BaseURLs
	}
	b.spec = spec
	return nil
}

func (f *fakeBackend) SetRules(ctx context.Context, id string, rules []transforms.Rule, add bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(id, true)
	if err != nil {
		return err
	}
	if add {
		rules = append(slices.Clone(b.rules), rules...)
	}
	b.rules = rules
	return nil
}

func (f *fakeBackend) SetModules(ctx context.Context, id string, srcs []appliance.ModuleSource) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, err := f.box(id, true)
	if err != nil {
		return err
	}
	b.modules = nil
	for _, src := range srcs { // read now: an upload's files go when the request ends
		if src.Open != nil {
			rc, err := src.Open()
			if err != nil {
				return err
			}
			src.Wasm, err = io.ReadAll(rc)
			rc.Close()
			if err != nil {
				return err
			}
			src.Open = nil
		}
		b.modules = append(b.modules, src)
	}
	return nil
}

// record adds an audit event of sandbox id.
func (f *fakeBackend) record(id string, e audit.Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events[id] = audit.AppendJSON(f.events[id], &e)
}

// fakeSegment is the one segment the fake keeps a sandbox's events in.
const fakeSegment = "20250601T000000.000000000Z-00000000"

func (f *fakeBackend) AuditEvents(ctx context.Context, id string, q audit.Query) (audit.Page, error) {
	f.mu.Lock()
	if _, err := f.box(id, false); err != nil {
		f.mu.Unlock()
		return audit.Page{}, err
	}
	lines := f.events[id]
	f.mu.Unlock()
	return audit.Select(ctx, []audit.Segment{{Name: fakeSegment, Lines: func(context.Context) ([]byte, error) { return lines, nil }}}, q)
}

func (f *fakeBackend) FollowAudit(ctx context.Context, id string, q audit.Query, send func([]byte) error) error {
	p, err := f.AuditEvents(ctx, id, q)
	if err != nil {
		return err
	}
	if send(nil) != nil {
		return nil
	}
	for _, l := range p.Lines {
		if send(l) != nil {
			return nil
		}
	}
	<-ctx.Done()
	return nil
}

func (f *fakeBackend) SaveTemplate(ctx context.Context, id, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.box(id, true); err != nil {
		return err
	}
	f.templates[name] = time.Now()
	return nil
}

func (f *fakeBackend) TemplateExists(ctx context.Context, name string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.templates[name]
	return ok, nil
}

func (f *fakeBackend) DeleteTemplate(ctx context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.templates, name)
	return nil
}

func (f *fakeBackend) ListTemplates(ctx context.Context) ([]appliance.TemplateInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []appliance.TemplateInfo
	for _, n := range slices.Sorted(maps.Keys(f.templates)) {
		out = append(out, appliance.TemplateInfo{Name: n, Created: f.templates[n]})
	}
	return out, nil
}

func (f *fakeBackend) Namespace() string { return "fake" }

var _ Backend = (*fakeBackend)(nil)
