package console

import (
	"context"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/relay/audit"
)

// Backend is what the console reads and asks of the sandboxes: the
// lifecycle manager (*appliance.Manager) satisfies it; route tests use a
// double. The console keeps nothing of a sandbox: every page is read from
// it. Errors carry their meaning (appliance.ErrNotFound, ErrNotRunning,
// ErrBadInput, ...); the console turns them into statuses in one place.
type Backend interface {
	List(ctx context.Context) ([]appliance.Info, error)
	Get(ctx context.Context, id string) (appliance.Info, error)
	Resume(ctx context.Context, id string, opts appliance.ResumeOptions) (*appliance.Sandbox, error)
	Suspend(ctx context.Context, id string) error
	Destroy(ctx context.Context, id string) error
	// CredentialRules and Sessions describe what a sandbox holds without a
	// credential's value.
	CredentialRules(id string) ([]appliance.RuleInfo, error)
	Sessions(ctx context.Context, id string) (map[string]appliance.Session, error)
	AuditEvents(ctx context.Context, id string, q audit.Query) (audit.Page, error)
	FollowAudit(ctx context.Context, id string, q audit.Query, send func(line []byte) error) error
	// Shard is this service's shard; Shards every live one (their URLs,
	// for a sandbox another shard runs).
	Shard() (id, url string)
	Shards(ctx context.Context) ([]cluster.Shard, error)
}

var _ Backend = (*appliance.Manager)(nil)
