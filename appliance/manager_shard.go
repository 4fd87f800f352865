package appliance

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance/cluster"
)

// ErrElsewhere: the sandbox runs on another shard sharing the store
// (errors.As to *cluster.HeldError names it). The HTTP layer forwards a
// request for it there; a call that reaches the manager anyway (the
// owner changed meanwhile) gets this.
var ErrElsewhere = cluster.ErrHeld

// ErrFenced: this service could not renew its heartbeat in the store in
// time: another shard may have taken its sandboxes, so it acts on none
// until it rejoins (seconds, once the store answers again).
var ErrFenced = cluster.ErrFenced

// ShardConfig is this service's membership of the shards sharing its store
// (package cluster). The zero value is a shard named after the host.
type ShardConfig struct {
	// ID names the shard ([a-z0-9][a-z0-9-]{0,62}); "" is DefaultShardID.
	// URL is where the other shards reach it: required for a request to
	// be forwarded to it.
	ID, URL string
	// LeaseTime and Renew: cluster.DefaultLeaseTime and DefaultRenew when
	// zero.
	LeaseTime, Renew time.Duration
	// Lock names the exclusive lock the process holds for the shard
	// (cluster.Config.Lock): serve's state directory lock.
	Lock string
}

// DefaultShardID is the host's name made a shard id: lower case, every
// other byte than a-z, 0-9 and - made -, at most 63 bytes.
func DefaultShardID() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "local"
	}
	b := []byte(strings.ToLower(h))
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			b[i] = '-'
		}
	}
	id := strings.Trim(string(b), "-")
	if len(id) > 63 {
		id = id[:63]
	}
	if id == "" {
		id = "local"
	}
	return id
}

// joinShards opens the manager's membership of the shards sharing its
// store.
func (m *Manager) joinShards(ctx context.Context) error {
	sc := m.cfg.Shard
	if sc.ID == "" {
		sc.ID = DefaultShardID()
	}
	c, err := cluster.Open(ctx, cluster.Config{
		Store: m.st, ID: sc.ID, URL: sc.URL, LeaseTime: sc.LeaseTime, Renew: sc.Renew, Lock: sc.Lock, Logger: m.log,
		Renewed: m.renewed, Fenced: m.fenced, Rejoined: m.rejoined, Load: m.load,
	})
	if err != nil {
		return fmt.Errorf("%w: joining the shards sharing the store: %v", ErrBadInput, err)
	}
	m.c = c
	return nil
}

// Shard is this service's shard: its id and URL.
func (m *Manager) Shard() (id, url string) { return m.c.ID(), m.c.URL() }

// load is what this shard's heartbeat says of it.
func (m *Manager) load() (running, max int, ids []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, b := range m.boxes {
		if b.getState() != "" {
			ids = append(ids, id)
		}
	}
	return m.nrunning, m.cfg.MaxRunning, ids
}

// liveBoxes are the boxes with a sandbox running.
func (m *Manager) liveBoxes() []*box {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*box
	for _, b := range m.boxes {
		if b.live.Load() != nil {
			out = append(out, b)
		}
	}
	return out
}

// deadlines is how many agents are told a new deadline at once.
const deadlines = 16

// renewed tells every sandbox's agent how long this shard is sure to own
// it: past that without a renewal, the agent kills its commands (this
// shard may be paused or cut off, and unable to). A sandbox whose lease
// is of an earlier epoch (not yet revalidated after a fence) is told
// nothing: its commands stay stopped.
func (m *Manager) renewed(valid time.Duration) {
	until := time.Now().Add(valid)
	epoch := m.c.Epoch()
	var wg sync.WaitGroup
	sem := make(chan struct{}, deadlines)
	for _, b := range m.liveBoxes() {
		sb := b.live.Load()
		if sb == nil || b.leaseEpoch() != epoch {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			sb.setDeadline(until)
		})
	}
	wg.Wait()
}

// fenced stops every sandbox's commands: this shard's leases may have
// expired, and another shard may resume its sandboxes from their last
// saved state at any moment.
func (m *Manager) fenced(err error) {
	m.log.Error("fenced: killing every sandbox's commands until this shard rejoins; sandboxes another shard takes meanwhile are dropped here unsaved", "err", err)
	var wg sync.WaitGroup
	for _, b := range m.liveBoxes() {
		if sb := b.live.Load(); sb != nil {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				sb.fence(ctx)
			})
		}
	}
	wg.Wait()
}

// rejoined keeps each sandbox whose lease nobody took while this shard was
// fenced (swapped to the new epoch; its agent's deadline renewed), and
// drops, unsaved, those another shard took: that one runs them now, from
// their last saved state.
func (m *Manager) rejoined() {
	for _, b := range m.liveBoxes() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		m.revalidate(ctx, b)
		cancel()
	}
}

func (m *Manager) revalidate(ctx context.Context, b *box) {
	b.sem <- struct{}{}
	defer func() { <-b.sem }()
	sb := b.live.Load()
	if sb == nil || b.lease == nil {
		return
	}
	err := m.c.Revalidate(ctx, b.lease)
	if err == nil {
		sb.setDeadline(m.c.Safe())
		m.log.Info("kept after rejoining: nobody took it meanwhile", "sandbox", b.id)
		return
	}
	if !errors.Is(err, cluster.ErrLost) {
		m.log.Warn("could not revalidate a sandbox's lease after rejoining; its commands stay stopped", "sandbox", b.id, "err", err)
		return
	}
	m.log.Warn("another shard took this sandbox while this one was fenced: dropping the copy here, unsaved", "sandbox", b.id)
	b.live.Store(nil)
	if err := sb.Destroy(ctx); err != nil && !errors.Is(err, ErrNotFound) {
		m.log.Warn("dropping a lost sandbox failed", "sandbox", b.id, "err", err)
	}
	b.lease, b.recGen = nil, 0
	b.state.Store(State(""))
	m.setBase(b, nil)
	m.unjournal(b.id)
	m.unreserve()
}

// takeLease takes sandbox id's lease for this shard; b holds it from then
// on. One another live shard holds is a *cluster.HeldError.
func (m *Manager) takeLease(ctx context.Context, b *box) error {
	if b.lease != nil {
		return nil
	}
	l, err := m.c.Acquire(ctx, b.id)
	if errors.Is(err, cluster.ErrClosed) {
		return fmt.Errorf("%w: sandbox %s", ErrClosed, b.id)
	}
	if err != nil {
		return err
	}
	b.lease = l
	return nil
}

// releaseLease gives b's lease up, if it holds one.
func (m *Manager) releaseLease(ctx context.Context, b *box) {
	if b.lease == nil {
		return
	}
	if err := m.c.Release(context.WithoutCancel(ctx), b.lease); err != nil {
		m.log.Warn("releasing a sandbox's lease failed; it frees itself when this shard stops", "sandbox", b.id, "err", err)
	}
	b.lease, b.recGen = nil, 0
}

// leaseEpoch is the epoch of b's lease, "" if it holds none.
func (b *box) leaseEpoch() string {
	if b.lease == nil {
		return ""
	}
	return b.lease.Epoch()
}

// Owner says which shard runs sandbox id: this one (local true), or
// another live shard (its id and URL) that requests for it go to. A
// sandbox nobody runs (suspended, or unknown) is this shard's to serve.
func (m *Manager) Owner(ctx context.Context, id string) (shard cluster.Shard, local bool, err error) {
	me := cluster.Shard{ID: m.c.ID(), URL: m.c.URL()}
	if m.Runs(id) {
		return me, true, nil
	}
	s, ok, err := m.c.Holder(ctx, id)
	if err != nil {
		return me, true, fmt.Errorf("%w: who runs %s: %v", ErrStore, id, err)
	}
	if !ok || s.ID == me.ID {
		return me, true, nil
	}
	return s, false, nil
}

// Runs says whether sandbox id is this shard's now: starting, running or
// being saved here.
func (m *Manager) Runs(id string) bool {
	m.mu.Lock()
	b := m.boxes[id]
	m.mu.Unlock()
	return b != nil && b.getState() != ""
}

// Place says where a new sandbox should start: here while this shard has
// room (local true), else on one of others, the live shards whose last
// heartbeat said they had room, most room first (a heartbeat is seconds
// old: one may be full by now, and refuse).
func (m *Manager) Place(ctx context.Context) (others []cluster.Shard, local bool) {
	m.mu.Lock()
	room := m.nrunning < m.cfg.MaxRunning
	m.mu.Unlock()
	if room {
		return nil, true
	}
	shards, err := m.c.Shards(ctx)
	if err != nil {
		return nil, true
	}
	for _, s := range shards {
		if s.ID != m.c.ID() && s.URL != "" && s.Room() {
			others = append(others, s)
		}
	}
	slices.SortStableFunc(others, func(a, b cluster.Shard) int { return (b.Max - b.Running) - (a.Max - a.Running) })
	return others, false
}

// Shards are the live shards sharing the store, this one included.
func (m *Manager) Shards(ctx context.Context) ([]cluster.Shard, error) { return m.c.Shards(ctx) }
