package appliance

import (
	"context"
	"fmt"
	"maps"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
)

// RuleInfo describes one credential rule of a sandbox without any value:
// the host it applies to and the names of the headers it sets.
type RuleInfo struct {
	Host    string   `json:"host"`
	Headers []string `json:"headers"`
}

// CredentialRules describes running sandbox id's credential rules, in
// order, never a value (for an operator's view). A sandbox not running
// here has none (they were dropped when it stopped): ErrNotRunning. It
// does not count as activity (idle suspend).
func (m *Manager) CredentialRules(id string) ([]RuleInfo, error) {
	if err := sandboxcli.CheckID(id); err != nil {
		return nil, err
	}
	m.mu.Lock()
	b := m.boxes[id]
	m.mu.Unlock()
	var sb *Sandbox
	if b != nil {
		sb = b.live.Load()
	}
	if sb == nil {
		return nil, fmt.Errorf("%w: sandbox %q is not running here", ErrNotRunning, id)
	}
	rules := sb.relay.Transforms().Rules()
	out := make([]RuleInfo, len(rules))
	for i, r := range rules {
		out[i] = RuleInfo{Host: r.Host(), Headers: r.HeaderNames()}
	}
	return out, nil
}

// Sessions returns sandbox id's sessions (see Session), running here or
// suspended (they are kept in the store beside its record); none is an
// empty map. It does not count as activity.
func (m *Manager) Sessions(ctx context.Context, id string) (map[string]Session, error) {
	if err := sandboxcli.CheckID(id); err != nil {
		return nil, err
	}
	m.mu.Lock()
	b := m.boxes[id]
	m.mu.Unlock()
	var t *sessionTable
	if b != nil && b.live.Load() != nil {
		t = &b.sessions // its one copy, which writes keep current
	} else {
		t = &sessionTable{} // read from the store, as it is there
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := m.loadSessions(ctx, id, t); err != nil {
		return nil, err
	}
	out := make(map[string]Session, len(t.m))
	for k, s := range t.m {
		out[k] = Session{Dir: s.Dir, Env: maps.Clone(s.Env)}
	}
	return out, nil
}
