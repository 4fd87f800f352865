package server

import (
	"context"
	"io"
	"io/fs"
	"net"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/transforms"
)

// Backend is what the HTTP server needs of the sandboxes: it owns every
// piece of a sandbox's state (its network, credential rules, modules,
// processes, ports and audit), and the server keeps none. The lifecycle
// manager (*appliance.Manager) satisfies it; route tests use a double.
// Errors carry their meaning (appliance.ErrNotFound, ErrNotRunning,
// ErrExists, ErrBadInput, transforms.ErrCredential, ...); the server turns
// them into statuses in one place (status).
type Backend interface {
	lifecycleBackend
	execBackend
	fileBackend
	egressBackend
	templateBackend
}

// lifecycleBackend: sandboxes' lives.
type lifecycleBackend interface {
	Create(ctx context.Context, id string, opts appliance.CreateOptions) (*appliance.Sandbox, error)
	Resume(ctx context.Context, id string, opts appliance.ResumeOptions) (*appliance.Sandbox, error)
	Wake(ctx context.Context, id string, opts appliance.ResumeOptions) (bool, error)
	Suspend(ctx context.Context, id string) error
	Destroy(ctx context.Context, id string) error
	Fork(ctx context.Context, src, dst string, opts appliance.ForkOptions) (appliance.State, error)
	Get(ctx context.Context, id string) (appliance.Info, error)
	List(ctx context.Context) ([]appliance.Info, error)
}

// execBackend: commands and their output.
type execBackend interface {
	Exec(ctx context.Context, id string, req appliance.ExecRequest) (*appliance.Process, error)
	OpenTerminal(ctx context.Context, id string, req appliance.TerminalRequest) (*appliance.Terminal, error)
	AttachTerminal(ctx context.Context, id, key string, from int64, alive func(context.Context) error) (*appliance.Terminal, error)
	Process(id, pid string) (*appliance.Process, error)
	KillAll(ctx context.Context, id string) error
}

// fileBackend: files, workspace tars and ports inside a sandbox.
type fileBackend interface {
	ReadFile(ctx context.Context, id, path string) (io.ReadCloser, fs.FileInfo, error)
	Stat(ctx context.Context, id, path string) (fs.FileInfo, error)
	WriteFile(ctx context.Context, id, path string, r io.Reader) (int64, error)
	TarIn(ctx context.Context, id, dir string, r io.Reader) error
	TarOut(ctx context.Context, id, dir string, w io.Writer) error
	DialPort(ctx context.Context, id string, port int) (net.Conn, error)
	// PortGuard is the sandbox's credential guard for what the port
	// tunnel carries in.
	PortGuard(id string) (appliance.PortGuard, error)
}

// egressBackend: where a sandbox may go, with which credentials and
// modules, and what it did.
type egressBackend interface {
	SetNetwork(ctx context.Context, id string, spec appliance.NetworkSpec) error
	SetRules(ctx context.Context, id string, rules []transforms.Rule, add bool) error
	SetModules(ctx context.Context, id string, srcs []appliance.ModuleSource) error
	AuditEvents(ctx context.Context, id string, q audit.Query) (audit.Page, error)
	FollowAudit(ctx context.Context, id string, q audit.Query, send func(line []byte) error) error
}

// templateBackend: templates of this service's namespace.
type templateBackend interface {
	SaveTemplate(ctx context.Context, id, name string) error
	TemplateExists(ctx context.Context, name string) (bool, error)
	DeleteTemplate(ctx context.Context, name string) error
	ListTemplates(ctx context.Context) ([]appliance.TemplateInfo, error)
	Namespace() string
}

var _ Backend = (*appliance.Manager)(nil)
