package appliance

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/transforms"
)

// startOptions are what every way of starting a sandbox takes.
type startOptions struct {
	Rules []transforms.Rule
	Agent *agent.Config
	Dirs  []string
	// Held are the credentials the sandbox's rules held before, sealed for
	// it (its record's, or its fork source's): scrubbed, as its rules'.
	Held []transforms.SealedSecret
}

// agentConfig is the agent configuration a sandbox starts with: the
// caller's, else the service's, with the sandbox's base URLs.
func (m *Manager) agentConfig(b *box, so startOptions) agent.Config {
	cfg := m.cfg.Agent
	if so.Agent != nil {
		cfg = *so.Agent
	}
	if len(b.network.BaseURLs) > 0 {
		urls := maps.Clone(cfg.BaseURLs)
		if urls == nil {
			urls = map[string]string{}
		}
		maps.Copy(urls, b.network.BaseURLs)
		cfg.BaseURLs = urls
	}
	return cfg
}

// start starts b's sandbox: from rec (a snapshot) when given, else from
// b.base (a template) or the image. The layers it needs are fetched into
// the work directory and checked against their digests first; on failure
// nothing of the sandbox is left, and the store is untouched.
func (m *Manager) start(ctx context.Context, b *box, rec *record, so startOptions) (*Sandbox, error) {
	b.state.Store(Starting)
	m.met.states.WithLabelValues(string(Starting)).Inc()
	defer m.met.states.WithLabelValues(string(Starting)).Dec()
	mods, err := m.loadModules(ctx, b.modules)
	if err != nil {
		b.state.Store(State(""))
		return nil, err
	}
	var cleanups []func()
	defer func() {
		for _, c := range cleanups {
			c()
		}
	}()
	fail := func(err error) (*Sandbox, error) {
		b.state.Store(State(""))
		if mods != nil {
			mods.Close(context.WithoutCancel(ctx))
		}
		return nil, err
	}
	rs := transforms.NewRuleSet(so.Rules...)
	if b.held, err = m.unsealHeld(b.id, rs, so.Held); err != nil {
		return fail(err)
	}
	opts := Options{Policy: b.network.Policy, Transforms: rs, Modules: mods, Agent: m.agentConfig(b, so), Limits: m.effectiveLimits(b.limits)}
	switch {
	case rec != nil && rec.legacy:
		file, cleanup, err := m.fetchLegacy(ctx, rec.Layer, m.l.BareImports())
		if err != nil {
			return fail(err)
		}
		cleanups = append(cleanups, cleanup)
		opts.ImportTar = file
	case rec != nil && rec.Base != "" && !m.l.Templates():
		file, cleanup, err := m.mergeToFile(ctx, b.base, rec.Layer, rec.Digest)
		if err != nil {
			return fail(err)
		}
		cleanups = append(cleanups, cleanup)
		opts.ImportTar = file
	case rec != nil:
		file, cleanup, err := m.fetchLayer(ctx, rec.Layer, rec.Digest)
		if err != nil {
			return fail(err)
		}
		cleanups = append(cleanups, cleanup)
		opts.ImportTar = file
		if rec.Base != "" {
			if opts.Template, err = m.ensureTemplate(ctx, b.base); err != nil {
				return fail(err)
			}
		}
	case b.base != nil && m.l.Templates():
		name, err := m.ensureTemplate(ctx, b.base)
		if err != nil {
			return fail(err)
		}
		opts.Template = name
	case b.base != nil:
		file, cleanup, err := m.fetchLayer(ctx, b.base.Layer, b.base.Digest)
		if err != nil {
			return fail(err)
		}
		cleanups = append(cleanups, cleanup)
		opts.ImportTar = file
	}
	sb, err := Create(ctx, m.l, m.proxy, b.id, opts)
	if err != nil {
		return fail(err)
	}
	return m.publish(ctx, b, sb, so)
}

// attach takes over a sandbox the launcher already started (a fork).
func (m *Manager) attach(ctx context.Context, b *box, so startOptions) (*Sandbox, error) {
	b.state.Store(Starting)
	mods, err := m.loadModules(ctx, b.modules)
	if err != nil {
		b.state.Store(State(""))
		return nil, err
	}
	rs := transforms.NewRuleSet(so.Rules...)
	if b.held, err = m.unsealHeld(b.id, rs, so.Held); err != nil {
		b.state.Store(State(""))
		if mods != nil {
			mods.Close(context.WithoutCancel(ctx))
		}
		return nil, err
	}
	opts := Options{Policy: b.network.Policy, Transforms: rs, Modules: mods, Agent: m.agentConfig(b, so), Limits: m.effectiveLimits(b.limits)}
	sb, err := Attach(ctx, m.l, m.proxy, b.id, opts)
	if err != nil {
		b.state.Store(State(""))
		if mods != nil {
			mods.Close(context.WithoutCancel(ctx))
		}
		return nil, err
	}
	return m.publish(ctx, b, sb, so)
}

// publish finishes a start: the directories asked for, the journal entry,
// and the sandbox published as running.
func (m *Manager) publish(ctx context.Context, b *box, sb *Sandbox, so startOptions) (*Sandbox, error) {
	sb.setNetwork(b.network)
	for _, d := range so.Dirs {
		if err := sb.Mkdir(ctx, d, 0o755); err != nil {
			sb.Destroy(context.WithoutCancel(ctx))
			b.state.Store(State(""))
			return nil, fmt.Errorf("sandbox %s: making %s: %w", b.id, d, err)
		}
	}
	if err := m.journal(b); err != nil {
		m.log.Warn("recording the sandbox for restart recovery failed; if the service crashes it is saved without its template", "sandbox", b.id, "err", err)
	}
	m.openAudit(b.id)
	sb.setDeadline(m.c.Safe())
	// Its sessions are read again from the store: another shard may have
	// changed them since this one last ran it.
	b.sessions.mu.Lock()
	b.sessions.loaded, b.sessions.seeded, b.sessions.bashLooked = false, nil, false
	b.sessions.mu.Unlock()
	var expires int64
	if d := expiryDeadline(b.created, m.effectiveLimits(b.limits)); !d.IsZero() {
		expires = d.UnixNano()
	}
	b.expires.Store(expires)
	b.live.Store(sb)
	b.state.Store(Running)
	m.mu.Lock()
	close(m.started)
	m.started = make(chan struct{})
	m.mu.Unlock()
	return sb, nil
}

// The journal: one file per running sandbox in the work directory, with
// what a restarted service needs to save it as its snapshot (its creation
// time, the template layer its layer is a delta onto, its modules and
// its network as its caller gave it). Its credentials are not in it: they
// live in memory only.
type journalEntry struct {
	Created  time.Time                 `json:"created"`
	Template string                    `json:"template,omitempty"`
	Base     *record                   `json:"base,omitempty"`
	Modules  []moduleRef               `json:"modules,omitempty"` // their bytes are in the store
	Held     []transforms.SealedSecret `json:"held,omitempty"`    // sealed
	Limits   Limits                    `json:"limits,omitzero"`
	// Network is what its caller said of where it may go (no credential).
	Network *savedNetwork `json:"network,omitempty"`
}

func (m *Manager) journalDir() string { return filepath.Join(m.work, "running") }

func (m *Manager) journal(b *box) error {
	if err := os.MkdirAll(m.journalDir(), 0o700); err != nil {
		return err
	}
	refs, err := m.saveModules(context.Background(), b.modules)
	if err != nil {
		return err
	}
	data, err := json.Marshal(journalEntry{Created: b.created, Template: b.template, Base: b.base, Modules: refs, Held: b.held, Limits: b.limits, Network: saveNetwork(b.spec)})
	if err != nil {
		return err
	}
	tmp := filepath.Join(m.journalDir(), "."+b.id+".tmp")
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(m.journalDir(), b.id+".json"))
}

func (m *Manager) unjournal(id string) {
	if err := os.Remove(filepath.Join(m.journalDir(), id+".json")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		m.log.Warn("removing a journal entry failed", "sandbox", id, "err", err)
	}
}

func (m *Manager) readJournal(id string) (*journalEntry, error) {
	data, err := os.ReadFile(filepath.Join(m.journalDir(), id+".json"))
	if err != nil {
		return nil, err
	}
	var e journalEntry
	if err := json.Unmarshal(data, &e); err != nil {
		return nil, err
	}
	return &e, nil
}
