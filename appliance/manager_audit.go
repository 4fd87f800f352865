package appliance

import (
	"context"
	"errors"

	"github.com/sandgate/sandgate/relay/audit"
)

// ErrNoAudit: the service keeps no audit events (ManagerConfig.Audit is
// nil).
var ErrNoAudit = errors.New("this service keeps no audit events")

// AuditEvents returns the egress decisions kept of sandbox id, running or
// suspended (ErrNotFound for neither), oldest first.
func (m *Manager) AuditEvents(ctx context.Context, id string) ([]audit.Event, error) {
	if m.cfg.Audit == nil {
		return nil, ErrNoAudit
	}
	if _, err := m.Get(ctx, id); err != nil {
		return nil, err
	}
	ev := m.cfg.Audit.Events(id)
	if ev == nil {
		ev = []audit.Event{}
	}
	return ev, nil
}

// FollowAudit returns the events kept of running sandbox id and a
// follower of those to come, which ends (stop, or done closing) when the
// sandbox stops running.
func (m *Manager) FollowAudit(id string) (kept []audit.Event, f *audit.Follower, done <-chan struct{}, stop func(), err error) {
	if m.cfg.Audit == nil {
		return nil, nil, nil, nil, ErrNoAudit
	}
	sb, err := m.Sandbox(id)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	f, stop = m.cfg.Audit.Follow(id)
	return m.cfg.Audit.Events(id), f, sb.Context().Done(), stop, nil
}

// forgetAudit drops what is kept of a destroyed sandbox's egress.
func (m *Manager) forgetAudit(id string) {
	if m.cfg.Audit != nil {
		m.cfg.Audit.Forget(id)
	}
}
