package bridge

import (
	"context"
	"io"
	"io/fs"
	"net"

	"github.com/sandgate/sandgate/appliance"
)

// Backend is what the bridge needs of the sandboxes: the lifecycle
// manager (*appliance.Manager) satisfies it. It owns every piece of a
// sandbox's state, sessions included; the bridge keeps none. Errors carry
// their meaning (appliance.ErrNotFound, ErrNotRunning, ErrExists,
// ErrBadInput, ErrCapacity, transforms.ErrCredential, ...); the bridge
// turns them into the contract's statuses and codes in one place
// (errors.go).
type Backend interface {
	Create(ctx context.Context, id string, opts appliance.CreateOptions) (*appliance.Sandbox, error)
	Resume(ctx context.Context, id string, opts appliance.ResumeOptions) (*appliance.Sandbox, error)
	Destroy(ctx context.Context, id string) error
	Get(ctx context.Context, id string) (appliance.Info, error)
	Capacity(ctx context.Context) (appliance.Capacity, error)

	Exec(ctx context.Context, id string, req appliance.ExecRequest) (*appliance.Process, error)
	Process(id, pid string) (*appliance.Process, error)
	OpenTerminal(ctx context.Context, id string, req appliance.TerminalRequest) (*appliance.Terminal, error)
	AttachTerminal(ctx context.Context, id, key string, from int64, alive func(context.Context) error) (*appliance.Terminal, error)

	CreateSession(ctx context.Context, id, name string, s appliance.Session) error
	Session(ctx context.Context, id, name string) (appliance.Session, error)
	DeleteSession(ctx context.Context, id, name string) error

	ReadFile(ctx context.Context, id, path string) (io.ReadCloser, fs.FileInfo, error)
	Stat(ctx context.Context, id, path string) (fs.FileInfo, error)
	WriteFile(ctx context.Context, id, path string, r io.Reader) (int64, error)
	TarIn(ctx context.Context, id, dir string, r io.Reader) error
	TarOut(ctx context.Context, id, dir string, w io.Writer) error
	DialPort(ctx context.Context, id string, port int) (net.Conn, error)
	PortGuard(id string) (appliance.PortGuard, error)
}

var _ Backend = (*appliance.Manager)(nil)
