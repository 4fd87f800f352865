package appliance

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
)

// idleLoop suspends sandboxes idle for cfg.IdleSuspend, destroys those
// past their lifetime, and forgets commands that exited ProcessRetention
// ago, until ctx ends.
func (m *Manager) idleLoop(ctx context.Context) {
	defer close(m.loopDone)
	every := min(m.cfg.ProcessRetention/4, time.Minute)
	if m.cfg.IdleSuspend > 0 {
		every = min(every, max(m.cfg.IdleSuspend/4, 50*time.Millisecond), 30*time.Second)
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := time.Now()
		m.mu.Lock()
		var idle []string
		for id, b := range m.boxes {
			sb := b.live.Load()
			if sb == nil {
				continue
			}
			sb.forgetProcesses(m.cfg.ProcessRetention)
			if m.cfg.IdleSuspend > 0 && sb.Idle(now) >= m.cfg.IdleSuspend {
				idle = append(idle, id)
			}
		}
		m.mu.Unlock()
		m.expireRunning(ctx)
		for _, id := range idle {
			m.suspendIdle(ctx, id)
		}
	}
}

// suspendIdle suspends id if it is still idle once its lock is free; an
// operation in progress on it means it is not.
func (m *Manager) suspendIdle(ctx context.Context, id string) {
	m.mu.Lock()
	b := m.boxes[id]
	if b == nil {
		m.mu.Unlock()
		return
	}
	select {
	case b.sem <- struct{}{}:
		b.refs++
	default:
		m.mu.Unlock()
		return // busy: not idle
	}
	m.mu.Unlock()
	release := func() {
		<-b.sem
		m.mu.Lock()
		if b.refs--; b.refs == 0 && b.getState() == "" {
			delete(m.boxes, id)
		}
		m.mu.Unlock()
	}
	defer release()
	sb := b.live.Load()
	if sb == nil || sb.Idle(time.Now()) < m.cfg.IdleSuspend {
		return
	}
	start := time.Now()
	sctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	rec, err := m.suspendLocked(sctx, b, SuspendedIdle)
	m.done("suspend", id, start, err, func() []any {
		attrs := []any{"reason", "idle", "idle_for", m.cfg.IdleSuspend.String()}
		if rec != nil {
			attrs = append(attrs, "bytes", rec.Size)
		}
		return attrs
	})
}

// SaveAllResult says which sandboxes SaveAll saved and which it could not,
// and why.
type SaveAllResult struct {
	Saved  []string
	Failed map[string]error
}

// SaveAll suspends every running sandbox in parallel, bounded by ctx (on
// SIGTERM Cloud Run gives 10 s). A save cut short by ctx leaves nothing a
// resume would trust, and a sandbox it could not save keeps its previous
// snapshot, if it had one, and keeps running. A sandbox it saved wakes on
// its next call, on any shard (SuspendedShutdown).
func (m *Manager) SaveAll(ctx context.Context) SaveAllResult {
	m.mu.Lock()
	var ids []string
	for id, b := range m.boxes {
		if b.getState() != "" {
			ids = append(ids, id)
		}
	}
	m.mu.Unlock()
	res := SaveAllResult{Failed: map[string]error{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() {
			err := m.suspend(ctx, id, SuspendedShutdown)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				res.Failed[id] = err
			} else {
				res.Saved = append(res.Saved, id)
			}
		})
	}
	wg.Wait()
	slices.Sort(res.Saved)
	return res
}

// Close stops the service's sandboxes: new operations are refused
// (ErrClosed), idle suspend stops, and every running sandbox is saved as
// SaveAll does, within ctx. It returns what was saved and what was not.
func (m *Manager) Close(ctx context.Context) SaveAllResult {
	m.mu.Lock()
	if !m.closed {
		close(m.closing)
	}
	m.closed = true
	m.mu.Unlock()
	m.stop()
	<-m.loopDone
	if m.auditDone != nil {
		<-m.auditDone
	}
	m.loops.Wait()
	res := m.SaveAll(ctx)
	if len(res.Failed) > 0 {
		m.log.Error(fmt.Sprintf("could not save %d sandboxes: %s", len(res.Failed), strings.Join(slices.Sorted(maps.Keys(res.Failed)), ", ")), "saved", res.Saved)
	}
	// The saved ones' leases are released: another shard may resume them
	// at once. Without its heartbeat, what this shard still holds is free
	// to take too, from its last saved state.
	if err := m.c.Close(context.WithoutCancel(ctx)); err != nil {
		m.log.Warn("leaving the shards: "+err.Error(), "err", err)
	}
	return res
}

// RecoverResult is what Recover found.
type RecoverResult struct {
	// Saved are sandboxes a previous process left running (or stopped),
	// now saved as their snapshots and removed.
	Saved []string
	// Failed are sandboxes it could not save: left as they are, their
	// previous snapshots (if any) untouched.
	Failed map[string]error
	// Removed are store objects no record names (saves cut short).
	Removed []string
	// LastGood are sandboxes that were running, unsaved, when the
	// previous process ended and are not running any more: suspended at
	// the snapshot they were last resumed from.
	LastGood []string
}

// Recover finds what a previous process of the service left (NewManager
// calls it). A sandbox still known to the sandbox CLI (`sandgate sandbox`
// keeps them across a crash of the service) is saved as its snapshot —
// it is newer than any snapshot it has — and removed; one that cannot be
// saved is left, and its previous snapshot kept. Layers no record names
// (a save or a copy cut short) are removed, and so are template layers no
// template or snapshot names.
func (m *Manager) Recover(ctx context.Context) (RecoverResult, error) {
	res := RecoverResult{Failed: map[string]error{}}
	left, err := m.l.List(ctx)
	if err != nil {
		return res, fmt.Errorf("appliance: listing the sandboxes a previous run left: %w", err)
	}
	for _, in := range left {
		if err := m.recoverSandbox(ctx, in.ID, in.Created); err != nil {
			res.Failed[in.ID] = err
			m.log.Error("a sandbox left by a previous run could not be saved; it is left as it is", "sandbox", in.ID, "err", err)
			continue
		}
		res.Saved = append(res.Saved, in.ID)
		m.log.Info("a sandbox left by a previous run was saved as its snapshot", "sandbox", in.ID)
	}
	removed, err := m.collectGarbage(ctx)
	res.Removed = removed
	if err != nil {
		m.log.Warn("cleaning the store failed; the next start tries again", "err", err)
	}
	// Spent snapshots of sandboxes nothing runs any more (their shard
	// died unsaved): suspended at their last good state, which the next
	// resume, here or on any shard, starts from. One a live shard runs is
	// that shard's.
	recs, err := m.snapshotRecords(ctx)
	if err != nil {
		return res, err
	}
	suspended := 0
	for id, rec := range recs {
		if !rec.Spent {
			suspended++
			continue
		}
		if _, ok, err := m.c.Holder(ctx, id); err == nil && !ok {
			suspended++
			res.LastGood = append(res.LastGood, id)
			m.log.Warn(fmt.Sprintf("sandbox %s was running when its shard stopped without saving it: it is suspended at its last good state, saved %s", id, rec.Saved.Format(time.RFC3339)), "sandbox", id)
		}
	}
	m.met.suspended.Set(float64(suspended))
	if names, err := m.l.ListTemplates(ctx); err == nil {
		m.tmu.Lock()
		for _, n := range names {
			m.imported[n] = true
		}
		m.tmu.Unlock()
	}
	return res, nil
}

// recoverSandbox saves a sandbox left by a previous run and removes it;
// if another shard runs it since (this one died, its lease expired, and
// that one resumed it from its last saved state), the copy here is stale:
// removed unsaved.
func (m *Manager) recoverSandbox(ctx context.Context, id string, created time.Time) error {
	j, err := m.readJournal(id)
	if err != nil {
		// Not one of this service's (no journal entry): its layer may be a
		// delta onto a template this process cannot name. Leave it.
		return fmt.Errorf("no journal entry (%v): not saved; remove it with `sandgate sandbox delete --force %s` if it is not needed", err, id)
	}
	if j.Created.IsZero() {
		j.Created = created
	}
	lease, err := m.c.Acquire(ctx, id)
	var held *cluster.HeldError
	if errors.As(err, &held) {
		m.log.Warn(fmt.Sprintf("sandbox %s, left here by a previous run, runs on shard %s since: the copy here is stale and is removed unsaved", id, held.Shard.ID), "sandbox", id)
		if err := m.l.Delete(ctx, id); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		m.unjournal(id)
		return nil
	}
	if err != nil {
		return err
	}
	defer func() {
		if err := m.c.Release(context.WithoutCancel(ctx), lease); err != nil {
			m.log.Warn("releasing a recovered sandbox's lease failed", "sandbox", id, "err", err)
		}
	}()
	var gen int64
	if rec, err := m.readRecord(ctx, snapshotRecordKey(id)); err == nil {
		gen = rec.gen
	} else if !errors.Is(err, store.ErrNotFound) {
		return err
	}
	if _, err := m.saveSnapshotOf(ctx, id, j.Created, j.Template, j.Base, j.Modules, gen, recordMeta{Network: j.Network, Reason: SuspendedRecovery, Limits: j.Limits, Held: j.Held}); err != nil {
		return err
	}
	if err := m.l.Delete(ctx, id); err != nil && !errors.Is(err, ErrNotFound) {
		m.log.Warn("a recovered sandbox was saved but could not be removed", "sandbox", id, "err", err)
	}
	m.unjournal(id)
	return nil
}

// strayLayerAge is how old a layer no record names must be before it is
// removed: younger, it may be a save in progress (its record is written
// last), on this shard or another sharing the store.
const strayLayerAge = time.Hour

// collectGarbage removes layer objects no record names.
func (m *Manager) collectGarbage(ctx context.Context) ([]string, error) {
	recs, err := m.snapshotRecords(ctx)
	if err != nil {
		return nil, err
	}
	named := map[string]bool{} // layer keys a record names
	keep := map[string]bool{}  // templates of `sandgate sandbox` to keep
	for _, r := range recs {
		named[r.Layer] = true
		if r.Base != "" {
			named[r.Base] = true
			keep[localTemplateName(r.BaseDigest)] = true
		}
	}
	tinfos, err := m.st.List(ctx, "templates/"+m.ns+"/")
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrStore, err)
	}
	for _, in := range tinfos {
		if strings.HasSuffix(in.Name, ".json") && strings.Count(strings.TrimPrefix(in.Name, "templates/"+m.ns+"/"), "/") == 0 {
			if r, err := m.readRecord(ctx, in.Name); err == nil {
				named[r.Layer] = true
				keep[localTemplateName(r.Digest)] = true
			}
		}
	}
	sinfos, err := m.st.List(ctx, "snapshots/")
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrStore, err)
	}
	var removed []string
	for _, in := range append(sinfos, tinfos...) {
		layer := strings.TrimSuffix(in.Name, ".manifest.json")
		if !strings.HasSuffix(layer, snapshot.Zstd.Ext()) || strings.Count(layer, "/") < 2 || named[layer] {
			continue
		}
		if time.Since(in.Modified) < strayLayerAge {
			continue // a save in progress, here or on another shard
		}
		if err := m.st.Delete(ctx, in.Name); err != nil && !errors.Is(err, store.ErrNotFound) {
			return removed, fmt.Errorf("%w: removing %s: %v", ErrStore, in.Name, err)
		}
		removed = append(removed, in.Name)
	}
	// Templates `sandgate sandbox` holds for layers nothing names.
	if names, err := m.l.ListTemplates(ctx); err == nil {
		for _, n := range names {
			if strings.HasPrefix(n, "t-") && !keep[n] {
				_ = m.l.RemoveTemplate(ctx, n) // refused while a sandbox uses it
			}
		}
	}
	return removed, nil
}
