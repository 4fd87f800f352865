package appliance

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/sandgate/sandgate/snapshot/store"
)

// A sandbox's time is bounded by its limits (Limits.Lifetime,
// Limits.KeepSuspended, over the service's defaults). A running sandbox
// past its lifetime is destroyed by the shard running it (the idle loop
// looks every tick); a suspended one past either by whichever shard
// sweeps the store first (every ManagerConfig.ExpirySweep). Either way
// its audit stays, for the audit's own retention, and the store keeps a
// note of the expiry:
//
//	expired/<id>.json   when sandbox <id> expired and why; what a call for
//	                    a sandbox of that id that is not there is told
//	                    (ErrExpired, a 404), until one of that id is
//	                    destroyed or the audit's retention ends
//
// "Suspended since" is its record's Saved: the save that suspended it. A
// record still marked spent whose shard died without saving it counts
// from its last save, or from when this shard first found it orphaned,
// whichever is later (its shard may have run it long after its last
// save): kept at least KeepSuspended from then, never less.

// ErrExpired: the sandbox was destroyed when its lifetime or its time
// suspended ran out (an *ExpiredError says when and why). It matches
// ErrNotFound and ErrNotRunning too.
var ErrExpired = errors.New("sandbox expired")

// ExpiredError says when and why a sandbox expired.
type ExpiredError struct {
	ID  string    `json:"-"`
	At  time.Time `json:"at"`
	Why string    `json:"why"`
}

func (e *ExpiredError) Error() string {
	return fmt.Sprintf("sandbox %q expired at %s: %s; it was destroyed (its audit is kept for the audit's retention)", e.ID, e.At.UTC().Format(time.RFC3339), e.Why)
}

// Is makes an expired sandbox one that is not found, and not running.
func (e *ExpiredError) Is(target error) bool {
	return target == ErrExpired || errors.Is(ErrNotFound, target) || target == ErrNotRunning
}

// DefaultExpirySweep is how often a shard sweeps the store for suspended
// sandboxes past their time (ManagerConfig.ExpirySweep): each sweep reads
// every snapshot record, so not too often; an expiry is late by at most
// this.
const DefaultExpirySweep = 5 * time.Minute

func expiredKey(id string) string { return "expired/" + id + ".json" }

// now is the manager's clock: the time, moved on by clockSkew in tests.
func (m *Manager) now() time.Time { return time.Now().Add(time.Duration(m.clockSkew.Load())) }

// expiryDeadline is when a sandbox created at created with limits lim
// (its own, over the service's) reaches its lifetime; zero for never.
func expiryDeadline(created time.Time, lim Limits) time.Time {
	if lim.Lifetime <= 0 || created.IsZero() {
		return time.Time{}
	}
	return created.Add(lim.Lifetime)
}

// expiredWhy says which limit of a suspended sandbox has run out at now,
// or "" if none.
func expiredWhy(lim Limits, created, since, now time.Time) string {
	if d := expiryDeadline(created, lim); !d.IsZero() && !now.Before(d) {
		return fmt.Sprintf("its lifetime of %s from its creation at %s ran out (limits.lifetime)", lim.Lifetime, created.UTC().Format(time.RFC3339))
	}
	if lim.KeepSuspended > 0 && !since.IsZero() && !now.Before(since.Add(lim.KeepSuspended)) {
		return fmt.Sprintf("it was suspended at %s and is kept suspended for %s (limits.keepSuspended)", since.UTC().Format(time.RFC3339), lim.KeepSuspended)
	}
	return ""
}

// expireRunning destroys the running sandboxes of this shard past their
// lifetime (the idle loop calls it every tick).
func (m *Manager) expireRunning(ctx context.Context) {
	now := m.now().UnixNano()
	var due []string
	m.mu.Lock()
	for id, b := range m.boxes {
		if e := b.expires.Load(); e != 0 && now >= e && b.live.Load() != nil {
			due = append(due, id)
		}
	}
	m.mu.Unlock()
	for _, id := range due {
		m.expireOne(ctx, id, 0, "")
	}
}

// expiryCandidate is a suspended sandbox a sweep found past its time, at
// the generation of its record it read.
type expiryCandidate struct {
	id  string
	gen int64
	why string
}

// expiredSuspended lists the suspended sandboxes past their time.
func (m *Manager) expiredSuspended(ctx context.Context) ([]expiryCandidate, error) {
	recs, err := m.snapshotRecords(ctx)
	if err != nil {
		return nil, err
	}
	now := m.now()
	var out []expiryCandidate
	orphans := map[string]time.Time{}
	for id, rec := range recs {
		lim := m.effectiveLimits(rec.Limits)
		if (lim.Lifetime <= 0 && lim.KeepSuspended <= 0) || m.Runs(id) {
			continue
		}
		since := rec.Saved
		if rec.Spent {
			// Running on a live shard (which enforces its lifetime), or
			// orphaned: its shard died without saving it.
			if _, held, err := m.c.Holder(ctx, id); err != nil || held {
				continue
			}
			m.mu.Lock()
			seen, ok := m.orphans[id]
			m.mu.Unlock()
			if !ok {
				seen = now
			}
			orphans[id] = seen
			since = later(since, seen)
		}
		if why := expiredWhy(lim, rec.Created, since, now); why != "" {
			out = append(out, expiryCandidate{id: id, gen: rec.gen, why: why})
		}
	}
	m.mu.Lock()
	m.orphans = orphans // those no longer orphaned are forgotten
	m.mu.Unlock()
	return out, nil
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// sweepExpired destroys the suspended sandboxes past their time, and
// removes expiry notes past the audit's retention. It returns how many it
// destroyed.
func (m *Manager) sweepExpired(ctx context.Context) (int, error) {
	due, err := m.expiredSuspended(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, c := range due {
		if m.expireOne(ctx, c.id, c.gen, c.why) {
			n++
		}
	}
	m.pruneExpiryNotes(ctx)
	return n, nil
}

// expireOne destroys sandbox id, keeping its audit: running here past its
// lifetime (gen 0), or suspended at record generation gen for why. A
// sandbox that changed since it was judged (resumed, saved, destroyed,
// taken by another shard) is left as it is. It reports whether it
// destroyed it.
func (m *Manager) expireOne(ctx context.Context, id string, gen int64, why string) bool {
	start := time.Now()
	actx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	b, release, err := m.acquire(actx, id)
	if err != nil {
		return false
	}
	defer release()
	state := Suspended
	if gen == 0 {
		sb := b.live.Load()
		e := b.expires.Load()
		if sb == nil || e == 0 || m.now().UnixNano() < e {
			return false // suspended or destroyed meanwhile
		}
		state = Running
		lim := m.effectiveLimits(b.limits)
		why = fmt.Sprintf("its lifetime of %s from its creation at %s ran out (limits.lifetime); its commands were killed", lim.Lifetime, b.created.UTC().Format(time.RFC3339))
	}
	ok, err := m.destroyLocked(actx, b, destroyOptions{keepAudit: true, ifGen: gen})
	if err != nil || !ok {
		if err != nil && !errors.Is(err, ErrRecordChanged) && !errors.Is(err, ErrElsewhere) {
			m.log.Warn(fmt.Sprintf("sandbox %s is past its time, but destroying it failed; the next sweep tries again", id), "sandbox", id, "err", err)
		}
		return false
	}
	e := &ExpiredError{ID: id, At: m.now().UTC(), Why: why}
	m.noteExpiry(actx, e)
	m.met.expired.WithLabelValues(string(state)).Inc()
	m.log.Info(fmt.Sprintf("%s expired: %s", id, why), "sandbox", id, "op", "expire", "state", string(state), "ms", time.Since(start).Milliseconds())
	return true
}

// noteExpiry keeps what a call for an expired sandbox is told: here, and
// in the store for every shard.
func (m *Manager) noteExpiry(ctx context.Context, e *ExpiredError) {
	m.mu.Lock()
	m.expired[e.ID] = e
	m.mu.Unlock()
	data, _ := json.Marshal(e)
	if _, err := m.st.Put(ctx, expiredKey(e.ID), bytes.NewReader(data), store.PutOptions{}); err != nil {
		m.log.Warn("noting a sandbox's expiry in the store failed; other shards answer a plain 404 for it", "sandbox", e.ID, "err", err)
	}
}

// forgetExpiry drops the note of id's expiry: a sandbox of that id is
// destroyed.
func (m *Manager) forgetExpiry(ctx context.Context, id string) {
	m.mu.Lock()
	delete(m.expired, id)
	m.mu.Unlock()
	if err := m.st.Delete(ctx, expiredKey(id)); err != nil && !errors.Is(err, store.ErrNotFound) {
		m.log.Warn("removing a sandbox's expiry note failed", "sandbox", id, "err", err)
	}
}

// expiry is the note of id's expiry, or nil: this shard's, else the
// store's.
func (m *Manager) expiry(ctx context.Context, id string) *ExpiredError {
	m.mu.Lock()
	e := m.expired[id]
	m.mu.Unlock()
	if e != nil {
		return e
	}
	data, _, err := m.st.Read(ctx, expiredKey(id), 1<<16)
	if err != nil {
		return nil
	}
	var n ExpiredError
	if json.Unmarshal(data, &n) != nil || n.At.IsZero() {
		return nil
	}
	n.ID = id
	return &n
}

// localExpiry is this shard's note of id's expiry, or nil (no store read:
// for the calls that look up a running sandbox).
func (m *Manager) localExpiry(id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e := m.expired[id]; e != nil {
		return e
	}
	return nil
}

// pruneExpiryNotes removes the notes of expiries older than the audit's
// retention (the audit they point to is gone by then).
func (m *Manager) pruneExpiryNotes(ctx context.Context) {
	keep := m.cfg.AuditRetention
	if keep < 0 {
		return // the audit is kept forever, and so are the notes
	}
	cutoff := m.now().Add(-keep)
	infos, err := m.st.List(ctx, "expired/")
	if err != nil {
		return
	}
	for _, in := range infos {
		if in.Modified.Before(cutoff) {
			m.st.Delete(ctx, in.Name)
		}
	}
	m.mu.Lock()
	for id, e := range m.expired {
		if e.At.Before(cutoff) {
			delete(m.expired, id)
		}
	}
	m.mu.Unlock()
}

// expiryLoop sweeps the store for suspended sandboxes past their time
// every ExpirySweep, until ctx ends.
func (m *Manager) expiryLoop(ctx context.Context) {
	tick := time.NewTicker(m.cfg.ExpirySweep)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		sctx, cancel := context.WithTimeout(ctx, 30*time.Minute)
		if _, err := m.sweepExpired(sctx); err != nil && ctx.Err() == nil {
			m.log.Warn("sweeping the store for sandboxes past their time failed; the next sweep tries again", "err", err)
		}
		cancel()
	}
}
