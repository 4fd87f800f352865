package appliance

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"
)

// DefaultCheckpointInterval is how often a running sandbox that changed is
// saved while it runs (ManagerConfig.CheckpointInterval).
const DefaultCheckpointInterval = 5 * time.Minute

// checkpointPauseLimit bounds how long a checkpoint keeps a sandbox's
// commands stopped: past it the agent continues them by itself, and the
// checkpoint is given up.
const checkpointPauseLimit = 2 * time.Minute

// checkpointLoop saves, every CheckpointInterval, each running sandbox
// that had activity since its last save: what a crash of the service (or
// of its host) loses is at most that much. Saving stops its commands
// only while its layer is copied to the work directory; the copy is then
// compressed and stored while they run.
func (m *Manager) checkpointLoop(ctx context.Context) {
	every := m.cfg.CheckpointInterval
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for _, b := range m.liveBoxes() {
			if ctx.Err() != nil {
				return
			}
			if err := m.checkpoint(ctx, b.id); err != nil && ctx.Err() == nil {
				m.log.Warn("checkpointing a running sandbox failed; its last save stands, and the next checkpoint tries again", "sandbox", b.id, "err", err)
			}
		}
	}
}

// Checkpoint saves running sandbox id as it is now, without stopping it
// (its commands pause while its layer is copied): its record then names
// this state as its last good one, which the sandbox resumes from if this
// service dies without saving it. A sandbox with no activity since its
// last save is left as it is. An operation in progress on it means it is
// not checkpointed now (nil).
func (m *Manager) Checkpoint(ctx context.Context, id string) error {
	return m.checkpoint(ctx, id)
}

func (m *Manager) checkpoint(ctx context.Context, id string) error {
	m.mu.Lock()
	b := m.boxes[id]
	if b == nil {
		m.mu.Unlock()
		return nil
	}
	select {
	case b.sem <- struct{}{}:
		b.refs++
	default:
		m.mu.Unlock()
		return nil // busy: the next tick
	}
	m.mu.Unlock()
	defer func() {
		<-b.sem
		m.mu.Lock()
		if b.refs--; b.refs == 0 && b.getState() == "" {
			delete(m.boxes, id)
		}
		m.mu.Unlock()
	}()
	sb := b.live.Load()
	if sb == nil || m.c.Valid() != nil {
		return nil
	}
	start := time.Now()
	if !b.saved.IsZero() && sb.Idle(start) >= start.Sub(b.saved) {
		return nil // nothing happened since the last save
	}
	refs, err := m.saveModules(ctx, b.modules)
	if err != nil {
		return err
	}
	file, cleanup, err := m.tempFile("checkpoint-*.tar")
	if err != nil {
		return err
	}
	defer cleanup()
	c, err := sb.quietClient()
	if err != nil {
		return err
	}
	if _, err := c.Pause(ctx, checkpointPauseLimit); err != nil {
		return fmt.Errorf("sandbox %s: pausing its commands: %w", id, err)
	}
	layer, err := m.exportLayer(ctx, id)
	if err == nil {
		err = copyToFile(file, layer)
		if cerr := layer.Close(); err == nil {
			err = cerr
		}
	}
	paused := time.Since(start)
	if cerr := c.Continue(context.WithoutCancel(ctx)); cerr != nil {
		m.log.Warn("continuing a sandbox's commands after a checkpoint's copy failed; the agent continues them itself", "sandbox", id, "err", cerr)
	}
	if err != nil {
		return fmt.Errorf("sandbox %s: copying its layer: %w", id, err)
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	key := "snapshots/" + id + "/" + generation() + ".tar.zst"
	man, err := m.saveLayer(ctx, f, key, id, b.base, false)
	if err != nil {
		return err
	}
	rec := &record{Layer: key, Digest: man.Digest, Size: man.Size, Template: b.template, Created: b.created, Saved: start.UTC(), Modules: refs, Limits: b.limits, Held: b.held, Spent: true,
		Network: saveNetwork(b.spec)}
	if b.base != nil {
		rec.Base, rec.BaseDigest = b.base.Layer, b.base.Digest
	}
	old, _ := m.readRecord(ctx, snapshotRecordKey(id))
	if err := m.writeRecordIf(ctx, snapshotRecordKey(id), rec, b.recGen); err != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		if errors.Is(err, ErrRecordChanged) {
			m.log.Error("a checkpoint found the sandbox's record changed under this shard: another shard runs it now", "sandbox", id)
		}
		return err
	}
	if old != nil && old.Layer != key && old.gen == b.recGen {
		m.deleteLayer(ctx, old.Layer)
	}
	if err := m.dropLegacy(ctx, id); err != nil {
		m.log.Warn("checkpointed in sandgate's format, but the reference service's old object could not be removed", "sandbox", id, "err", err)
	}
	b.recGen, b.saved = rec.gen, start
	m.log.Info(fmt.Sprintf("%s checkpointed in %d ms (commands paused %d ms)", id, time.Since(start).Milliseconds(), paused.Milliseconds()),
		"sandbox", id, "bytes", rec.Size, "paused_ms", paused.Milliseconds())
	return nil
}
