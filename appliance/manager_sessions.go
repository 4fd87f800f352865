package appliance

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"sync"

	"github.com/sandgate/sandgate/snapshot/store"
)

// Session is a named shell of a sandbox (the Cloudflare bridge's
// sessions): its commands (ExecRequest.Session) run one after another in
// its shell state, so that `cd`, `export`, functions and aliases carry
// from one to the next (manager_shell.go). Its directory and exported
// variables are kept in the store beside the sandbox's record, so they
// outlive a suspend, a resume, a move to another shard and a restart of
// the service; destroying the sandbox removes them.
type Session struct {
	// Dir is the working directory of the session's shell; "" means
	// where its first command starts.
	Dir string `json:"cwd,omitempty"`
	// Env are its variables, name → value, on top of what every command
	// gets (those its commands exported, or changed).
	Env map[string]string `json:"env,omitempty"`
	// Unset are the variables every command gets that its commands
	// unset.
	Unset []string `json:"unset,omitempty"`
}

// MaxSessions caps the sessions of one sandbox: their record is read
// whole.
const MaxSessions = 256

// sessionName is what a session may be called: the bridge's rule for its
// Session-Id header.
var sessionName = regexp.MustCompile(`^[a-zA-Z0-9._-]{1,128}$`)

// envName is a variable name sessions may set.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

func sessionsKey(id string) string { return "sessions/" + id + ".json" }

// sessionFile is what the store keeps of a sandbox's sessions.
type sessionFile struct {
	Sessions map[string]Session `json:"sessions"`
}

// sessionTable is a running sandbox's sessions, read from the store once
// (the manager is their one writer while the sandbox runs here). gen is
// the generation of their object as last read or written (0: none): a
// write is made only on it, so that a shard that lost the sandbox to
// another never overwrites the new owner's sessions.
type sessionTable struct {
	mu     sync.Mutex
	loaded bool
	m      map[string]Session
	gen    int64
	// turns are the sessions with a command running, and the commands
	// waiting for it; seeded the sessions whose kept state the running
	// sandbox has been given (manager_shell.go).
	turns  map[string]*sessionTurn
	seeded map[string]bool
	// bash is the running sandbox's bash ("" none), once bashLooked.
	bash       string
	bashLooked bool
}

// CreateSession records session name of running sandbox id. Its
// directory and variables pass the credential guard (they are bound for
// the sandbox); a name that exists is ErrExists, a bad name or variable
// name ErrBadInput.
func (m *Manager) CreateSession(ctx context.Context, id, name string, s Session) error {
	if !sessionName.MatchString(name) || name == "." || name == ".." {
		return fmt.Errorf("%w: session name %q: want 1 to 128 letters, digits, '.', '_' or '-'", ErrBadInput, name)
	}
	for k := range s.Env {
		if !envName.MatchString(k) {
			return fmt.Errorf("%w: variable name %q: names are letters, digits and _, not starting with a digit", ErrBadInput, k)
		}
	}
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	sb := b.live.Load()
	if sb == nil {
		return fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
	}
	g := sb.relay.Transforms().Guard()
	if err := g.Check(whereDir, s.Dir); err != nil {
		return err
	}
	env := make([]string, 0, len(s.Env))
	for _, k := range slices.Sorted(maps.Keys(s.Env)) {
		env = append(env, k+"="+s.Env[k])
	}
	if err := g.Check(whereEnv, env...); err != nil {
		return err
	}
	t := &b.sessions
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := m.loadSessions(ctx, id, t); err != nil {
		return err
	}
	if _, ok := t.m[name]; ok {
		return fmt.Errorf("%w: session %q of sandbox %q exists", ErrExists, name, id)
	}
	if len(t.m) >= MaxSessions {
		return fmt.Errorf("%w: sandbox %q has %d sessions already; delete one", ErrBadInput, id, MaxSessions)
	}
	next := maps.Clone(t.m)
	next[name] = Session{Dir: s.Dir, Env: maps.Clone(s.Env)}
	if err := m.writeSessions(ctx, id, t, next); err != nil {
		return err
	}
	t.m = next
	delete(t.seeded, name) // a shell of that name before is not this one
	return nil
}

// Session returns session name of running sandbox id: ErrNotRunning, or
// ErrNotFound for a session it does not have.
func (m *Manager) Session(ctx context.Context, id, name string) (Session, error) {
	m.mu.Lock()
	b := m.boxes[id]
	m.mu.Unlock()
	if b == nil || b.live.Load() == nil {
		return Session{}, fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
	}
	t := &b.sessions
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := m.loadSessions(ctx, id, t); err != nil {
		return Session{}, err
	}
	s, ok := t.m[name]
	if !ok {
		return Session{}, fmt.Errorf("%w: sandbox %q has no session %q", ErrNotFound, id, name)
	}
	return Session{Dir: s.Dir, Env: maps.Clone(s.Env), Unset: slices.Clone(s.Unset)}, nil
}

// DeleteSession removes session name of running sandbox id; one it does
// not have is ErrNotFound.
func (m *Manager) DeleteSession(ctx context.Context, id, name string) error {
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	if b.live.Load() == nil {
		return fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
	}
	t := &b.sessions
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := m.loadSessions(ctx, id, t); err != nil {
		return err
	}
	if _, ok := t.m[name]; !ok {
		return fmt.Errorf("%w: sandbox %q has no session %q", ErrNotFound, id, name)
	}
	next := maps.Clone(t.m)
	delete(next, name)
	if err := m.writeSessions(ctx, id, t, next); err != nil {
		return err
	}
	t.m = next
	delete(t.seeded, name)
	return nil
}

// loadSessions reads sandbox id's sessions into t once (t.mu held).
func (m *Manager) loadSessions(ctx context.Context, id string, t *sessionTable) error {
	if t.loaded {
		return nil
	}
	t.m, t.gen = map[string]Session{}, 0
	data, in, err := m.st.Read(ctx, sessionsKey(id), MaxSessions*(maxSessionState+4<<10))
	if errors.Is(err, store.ErrNotFound) {
		t.loaded = true
		return nil
	}
	if err != nil {
		return fmt.Errorf("%w: reading %s: %v", ErrStore, sessionsKey(id), err)
	}
	var f sessionFile
	if err := json.Unmarshal(data, &f); err != nil {
		return fmt.Errorf("%w: %s is not a sessions record: %v", ErrStore, sessionsKey(id), err)
	}
	if f.Sessions != nil {
		t.m = f.Sessions
	}
	t.gen, t.loaded = in.Generation, true
	return nil
}

// writeSessions replaces sandbox id's sessions in the store with s (none:
// the object is removed), only if their object is still the one t last
// read or wrote (t.mu held): otherwise another shard runs the sandbox now
// and this one's sessions are stale (ErrRecordChanged, and t is read
// again next time).
func (m *Manager) writeSessions(ctx context.Context, id string, t *sessionTable, s map[string]Session) error {
	key := sessionsKey(id)
	var err error
	var in store.Info
	switch {
	case len(s) == 0 && t.gen == 0:
		return nil
	case len(s) == 0:
		err = m.st.DeleteIf(ctx, key, t.gen)
	default:
		var data []byte
		if data, err = json.Marshal(sessionFile{Sessions: s}); err != nil {
			return err
		}
		in, err = m.st.Put(ctx, key, bytes.NewReader(data), store.PutOptions{IfGenerationMatch: t.gen, IfNotExist: t.gen == 0})
	}
	switch {
	case errors.Is(err, store.ErrPreconditionFailed), len(s) == 0 && errors.Is(err, store.ErrNotFound):
		t.loaded = false
		return fmt.Errorf("%w: %w (%s)", ErrStore, ErrRecordChanged, key)
	case err != nil:
		return fmt.Errorf("%w: writing %s: %v", ErrStore, key, err)
	}
	t.gen = in.Generation // 0 once removed
	return nil
}

// dropSessions removes sandbox id's sessions (b's lock held): it is being
// destroyed.
func (m *Manager) dropSessions(ctx context.Context, b *box) error {
	b.sessions.mu.Lock()
	defer b.sessions.mu.Unlock()
	b.sessions.loaded, b.sessions.m, b.sessions.gen = false, nil, 0
	if err := m.st.Delete(ctx, sessionsKey(b.id)); err != nil && !errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("%w: removing %s: %v", ErrStore, sessionsKey(b.id), err)
	}
	return nil
}
