package appliance

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sandgate/sandgate/relay/audit"
)

// ErrNoAudit: the service keeps no audit events (ManagerConfig.Audit is
// nil).
var ErrNoAudit = errors.New("this service keeps no audit events")

// DefaultAuditRetention is how long a sandbox's audit segments are kept
// when ManagerConfig.AuditRetention is zero.
const DefaultAuditRetention = 30 * 24 * time.Hour

// Bounds of the audit's own waits.
const (
	// auditDrain bounds the wait, at a suspend or destroy, for the
	// sandbox's egress connections to end (and record their events)
	// before its audit is written: they are cut with its link, so this
	// is only ever waited for a moment.
	auditDrain = 5 * time.Second
	// auditKeepalive is how often a follow stream with nothing to say says
	// so (an empty line), and looks again whether a suspended sandbox was
	// destroyed.
	auditKeepalive = 30 * time.Second
	// auditElsewherePoll is how often a follow stream of a sandbox another
	// shard runs lists what that shard wrote to the store since.
	auditElsewherePoll = 5 * time.Second
	// auditSweepEvery is how often segments past their retention are
	// removed.
	auditSweepEvery = time.Hour
)

// openAudit starts keeping sandbox id's events (it runs now).
func (m *Manager) openAudit(id string) {
	if m.cfg.Audit != nil {
		m.cfg.Audit.Open(id)
	}
}

// sealAudit stops keeping sandbox sb's events once its egress connections
// have ended (its commands were killed: a suspend), and writes what is
// held to the store, so that the suspended sandbox's audit is whole there
// before its lease goes (another shard may resume it at once). The suspend
// runs it beside the save of the layer, which takes longer. A store that
// fails keeps the events held, tried again every flush and written by a
// shutdown (Service.Shutdown); the suspend goes on.
func (m *Manager) sealAudit(ctx context.Context, sb *Sandbox) {
	if m.cfg.Audit == nil {
		return
	}
	dctx, cancel := context.WithTimeout(ctx, auditDrain)
	sb.relay.Drain(dctx)
	cancel()
	if err := m.cfg.Audit.Seal(ctx, sb.id); err != nil {
		m.log.Warn("writing a suspended sandbox's audit to the store failed; it is held and tried again", "sandbox", sb.id, "err", err)
	}
}

// removeAudit drops sandbox id's audit, held and stored: a destroy. The
// sandbox's egress (sb, when it was running) has ended first, so nothing
// of it is written after.
func (m *Manager) removeAudit(ctx context.Context, id string, sb *Sandbox) error {
	if m.cfg.Audit != nil {
		if sb != nil {
			dctx, cancel := context.WithTimeout(ctx, auditDrain)
			sb.relay.Drain(dctx)
			cancel()
		}
		m.cfg.Audit.Forget(id)
	}
	// Also what a run of the service that kept an audit left.
	return m.audits.remove(ctx, id)
}

// AuditEvents lists sandbox id's egress events that q selects, a page at a
// time, oldest first: those the store holds (a suspended sandbox's, or
// one's that ran on another instance or before a restart) and those
// held in memory since its last write. A sandbox neither running nor
// suspended is ErrNotFound; a bad q is ErrBadInput.
func (m *Manager) AuditEvents(ctx context.Context, id string, q audit.Query) (audit.Page, error) {
	if m.cfg.Audit == nil {
		return audit.Page{}, ErrNoAudit
	}
	if err := q.Check(); err != nil {
		return audit.Page{}, fmt.Errorf("%w: %v", ErrBadInput, err)
	}
	if _, err := m.Get(ctx, id); err != nil && !errors.Is(err, ErrExpired) {
		return audit.Page{}, err // an expired sandbox's audit is kept
	}
	return m.auditPage(ctx, id, q)
}

func (m *Manager) auditPage(ctx context.Context, id string, q audit.Query) (audit.Page, error) {
	// Held ones first: a segment written and dropped from memory between
	// the two looks is in the store's listing, made after.
	segs := m.cfg.Audit.Held(id)
	stored, err := m.audits.segments(ctx, id)
	if err != nil {
		return audit.Page{}, err
	}
	return audit.Select(ctx, append(segs, stored...), q)
}

// FollowAudit streams sandbox id's events that q selects: every one so far
// (from q.Since or q.After on), then each new one as it is recorded,
// across the sandbox's suspends and resumes, until ctx ends, the sandbox
// is destroyed or send fails. send gets each event's line (without its
// newline); nil once at the start, before any line, and whenever nothing
// happened for a while (a keep-alive). An error before the first send is
// the sandbox's or q's: ErrNotFound, ErrBadInput. A reader too slow for
// the events misses none: what its buffer could not take is listed again.
func (m *Manager) FollowAudit(ctx context.Context, id string, q audit.Query, send func(line []byte) error) error {
	if m.cfg.Audit == nil {
		return ErrNoAudit
	}
	if err := q.Check(); err != nil {
		return fmt.Errorf("%w: %v", ErrBadInput, err)
	}
	if _, err := m.Get(ctx, id); err != nil && !errors.Is(err, ErrExpired) {
		return err // an expired sandbox's audit is kept
	}
	if err := send(nil); err != nil {
		return nil
	}
	q.Limit = 0
	for ctx.Err() == nil {
		f, stop, running, live := m.followLive(id)
		// Everything up to now, from where the stream is.
		for {
			p, err := m.auditPage(ctx, id, q)
			if err != nil {
				if stop != nil {
					stop()
				}
				return err
			}
			for _, l := range p.Lines {
				if err := send(l); err != nil {
					if stop != nil {
						stop()
					}
					return nil
				}
			}
			q.After = p.Next
			if !p.More {
				break
			}
		}
		if !q.Until.IsZero() && time.Now().After(q.Until) {
			if stop != nil {
				stop()
			}
			return nil // nothing later can be selected
		}
		if f == nil {
			if !m.waitRunning(ctx, id, send, live) {
				return nil
			}
			continue
		}
		last, err := m.followEvents(ctx, f, running, q, send)
		stop()
		if err != nil {
			return nil
		}
		q.After = last
	}
	return nil
}

// followLive registers a follower of running sandbox id's events; nil
// when it is not running (live false) or its events cannot be followed
// (live true: its journal is being sealed). done ends when it stops.
func (m *Manager) followLive(id string) (f *audit.Follower, stop func(), done <-chan struct{}, live bool) {
	sb, err := m.Sandbox(id)
	if err != nil {
		return nil, nil, nil, false
	}
	f, stop, ok := m.cfg.Audit.Follow(id)
	if !ok {
		return nil, nil, nil, true
	}
	return f, stop, sb.Context().Done(), true
}

// followEvents sends f's events that come after q.After and that q
// selects, until the sandbox stops (done), f dropped one, or ctx ends. It
// returns the position of the last event it looked at, from which the
// caller lists what came after (what f dropped, what came as the sandbox
// stopped). An error is send's.
func (m *Manager) followEvents(ctx context.Context, f *audit.Follower, done <-chan struct{}, q audit.Query, send func([]byte) error) (audit.Pos, error) {
	keepalive := time.NewTicker(auditKeepalive)
	defer keepalive.Stop()
	dropped := f.Dropped()
	last := q.After
	for {
		select {
		case <-ctx.Done():
			return last, nil
		case <-done:
			return last, nil
		case <-keepalive.C:
			if f.Dropped() != dropped {
				return last, nil
			}
			if err := send(nil); err != nil {
				return last, err
			}
		case l := <-f.C:
			if f.Dropped() != dropped {
				return last, nil // listed again from last: nothing is missed
			}
			if !last.Before(l.Pos) {
				continue // listed already
			}
			last = l.Pos
			if !q.Match(l.Data) {
				continue
			}
			if err := send(l.Data); err != nil {
				return last, err
			}
		}
	}
}

// waitRunning waits for suspended sandbox id to run again, keeping the
// stream alive meanwhile. It reports false when it never will (destroyed),
// the service is closing (its streams end as its sandboxes are saved), or
// ctx ended. A sandbox running whose events could not be followed (seen)
// is waited for until the next start or keep-alive.
func (m *Manager) waitRunning(ctx context.Context, id string, send func([]byte) error, seen bool) bool {
	keepalive := time.NewTicker(auditKeepalive)
	defer keepalive.Stop()
	for {
		m.mu.Lock()
		started := m.started
		m.mu.Unlock()
		if _, err := m.Sandbox(id); err == nil && !seen {
			return true
		}
		seen = false
		in, err := m.Get(ctx, id)
		if errors.Is(err, ErrNotFound) {
			return false
		}
		// Running on another shard: its events reach the store there, a
		// segment every flush; they are listed from it every
		// auditElsewherePoll.
		var elsewhere <-chan time.Time
		if err == nil && in.State != "" && in.State != Suspended {
			elsewhere = time.After(auditElsewherePoll)
		}
		select {
		case <-ctx.Done():
			return false
		case <-m.closing:
			return false
		case <-started:
		case <-elsewhere:
			return send(nil) == nil
		case <-keepalive.C:
			if send(nil) != nil {
				return false
			}
		}
	}
}

// auditLoop removes segments past their retention every auditSweepEvery,
// until ctx ends.
func (m *Manager) auditLoop(ctx context.Context) {
	defer close(m.auditDone)
	if m.cfg.AuditRetention < 0 {
		return
	}
	tick := time.NewTicker(auditSweepEvery)
	defer tick.Stop()
	for {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
		n, err := m.audits.sweep(sctx, time.Now().Add(-m.cfg.AuditRetention))
		cancel()
		if err != nil && ctx.Err() == nil {
			m.log.Warn("removing audit segments past their retention failed; the next sweep tries again", "err", err)
		} else if n > 0 {
			m.log.Info(fmt.Sprintf("removed %d audit segments older than %s", n, m.cfg.AuditRetention))
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
