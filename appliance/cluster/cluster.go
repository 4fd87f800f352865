// Package cluster lets several sandgate services share one store, with the
// store's own conditional writes as the only arbiter: no consensus of our
// own, no other coordinator.
//
// The store holds, beside the sandboxes' records:
//
//	shards/<shard>.json    a shard's heartbeat: its URL, its epoch (one per
//	                       incarnation), until when it is alive, its load
//	                       and the sandboxes it runs; written only by it
//	leases/<sandbox>.json  who runs the sandbox: a shard and its epoch
//
// A lease is valid while the heartbeat of the shard it names is alive and
// of the same epoch. A shard renews one object, its heartbeat, whatever the
// number of sandboxes it runs: leases are written only when a sandbox
// changes hands. A lease is taken from a dead shard (heartbeat expired, or
// of another epoch) by a compare-and-swap of the lease object, so of two
// shards taking it one wins. A shard that could not renew in time is
// fenced: it stops every sandbox's commands before its heartbeat can
// expire (the caller does, from Fenced; the agents enforce the deadline
// too), and rejoins under a new epoch, keeping only the sandboxes whose
// leases it can swap to that epoch: those nobody took meanwhile.
package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/snapshot/store"
)

// Defaults of Config.
const (
	DefaultLeaseTime = 30 * time.Second
	DefaultRenew     = 10 * time.Second
)

// maxObject bounds what is read of a heartbeat or a lease.
const maxObject = 1 << 20

var shardID = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

var (
	// ErrHeld: the sandbox's lease is held by another live shard
	// (errors.As to *HeldError names it).
	ErrHeld = errors.New("held by another shard")
	// ErrLost: a lease this shard held was taken by another shard while
	// it could not renew.
	ErrLost = errors.New("lease lost to another shard")
	// ErrFenced: this shard could not renew its heartbeat in time; until it
	// rejoins, it may not act on any sandbox.
	ErrFenced = errors.New("this shard could not renew its heartbeat in time")
	// ErrClosed: the cluster was closed.
	ErrClosed = errors.New("cluster membership closed")
)

// HeldError says which shard holds a sandbox.
type HeldError struct {
	Sandbox string
	Shard   Shard
}

func (e *HeldError) Error() string {
	return fmt.Sprintf("sandbox %s runs on shard %s (%s)", e.Sandbox, e.Shard.ID, e.Shard.URL)
}

func (e *HeldError) Unwrap() error { return ErrHeld }

// Config is a shard's membership.
type Config struct {
	Store store.Store
	// ID names the shard: [a-z0-9][a-z0-9-]{0,62}. URL is where the other
	// shards reach it ("" when it runs alone).
	ID, URL string
	// LeaseTime is how long a heartbeat keeps the shard's leases valid
	// (DefaultLeaseTime); Renew how often it is renewed (DefaultRenew),
	// at most a third of LeaseTime.
	LeaseTime, Renew time.Duration
	Logger           *slog.Logger
	// Renewed is called after each renewal with how long, from now, this
	// shard's leases are sure to be valid: sandboxes' commands must stop
	// by then unless the next renewal extends it.
	Renewed func(valid time.Duration)
	// Fenced is called once when that time passed without a renewal: the
	// caller stops every sandbox's commands at once and acts on none
	// until Rejoined.
	Fenced func(err error)
	// Rejoined is called when a fenced shard is a member again, under a
	// new epoch: the caller keeps each sandbox whose lease Revalidate
	// swaps to it, and drops (unsaved) the others.
	Rejoined func()
	// Load, when set, is called at each renewal for what the heartbeat
	// says of the shard: sandboxes running, the most it may run, and
	// their ids.
	Load func() (running, max int, sandboxes []string)
	// Lock, when set, names an exclusive lock this process holds for its
	// life, which no two processes can hold at once (serve's state
	// directory lock: the kernel's boot and the lock file's identity). A
	// live heartbeat of this shard naming the same Lock was written by a
	// process that held it and is gone (a crash): joining takes over at
	// once instead of waiting for that heartbeat to expire.
	Lock string
}

// Shard is a member as its heartbeat describes it.
type Shard struct {
	ID      string    `json:"shard"`
	URL     string    `json:"url,omitempty"`
	Epoch   string    `json:"epoch"`
	Expires time.Time `json:"expires"`
	Renewed time.Time `json:"renewed"`
	Running int       `json:"running"`
	Max     int       `json:"max"`
	// Sandboxes are the sandboxes it ran at its last renewal.
	Sandboxes []string `json:"sandboxes,omitempty"`
	// Lock is the lock its process held (Config.Lock).
	Lock string `json:"lock,omitempty"`
}

// alive says whether a heartbeat still holds at now, with margin for the
// clocks of the shard that wrote it and of the one reading it.
func (s Shard) alive(now time.Time, skew time.Duration) bool {
	return now.Before(s.Expires.Add(skew))
}

// Room says whether the shard has room for another running sandbox.
func (s Shard) Room() bool { return s.Max <= 0 || s.Running < s.Max }

// Lease is a sandbox's lease as this shard holds it.
type Lease struct {
	Sandbox string
	epoch   string
	gen     int64
}

// Epoch is the epoch of this shard the lease was taken (or revalidated)
// under.
func (l *Lease) Epoch() string { return l.epoch }

// leaseRecord is a lease object.
type leaseRecord struct {
	Sandbox string    `json:"sandbox"`
	Shard   string    `json:"shard"`
	URL     string    `json:"url,omitempty"`
	Epoch   string    `json:"epoch"`
	Taken   time.Time `json:"taken"`
}

// Cluster is this shard's membership: its heartbeat, renewed in the
// background, and the leases it takes.
type Cluster struct {
	cfg  Config
	st   store.Store
	log  *slog.Logger
	skew time.Duration

	mu      sync.Mutex
	epoch   string
	gen     int64     // the heartbeat's generation
	safe    time.Time // until when this shard's leases are sure to hold
	fenced  bool
	closed  bool
	peers   map[string]Shard // the last heartbeats read, by id
	peersAt time.Time

	stop chan struct{}
	done chan struct{}
}

func shardKey(id string) string   { return "shards/" + id + ".json" }
func leaseKey(id string) string   { return "leases/" + id + ".json" }
func newEpoch() string            { var b [8]byte; rand.Read(b[:]); return hex.EncodeToString(b[:]) }
func (c *Cluster) now() time.Time { return time.Now() }

// Open joins: it writes this shard's heartbeat (waiting, within ctx, for
// a live one of the same id — another process of this shard, say the
// previous revision on Cloud Run — to be released or to expire) and starts
// renewing it.
func Open(ctx context.Context, cfg Config) (*Cluster, error) {
	if cfg.Store == nil {
		return nil, errors.New("cluster: Config needs a Store")
	}
	if err := CheckID(cfg.ID); err != nil {
		return nil, err
	}
	if cfg.LeaseTime <= 0 {
		cfg.LeaseTime = DefaultLeaseTime
	}
	if cfg.Renew <= 0 {
		cfg.Renew = min(DefaultRenew, cfg.LeaseTime/3)
	}
	if cfg.Renew > cfg.LeaseTime/3 {
		return nil, fmt.Errorf("lease renewal every %s for leases of %s: renew at most every third of the lease time, so that two renewals may fail before it expires", cfg.Renew, cfg.LeaseTime)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c := &Cluster{cfg: cfg, st: cfg.Store, log: cfg.Logger, skew: cfg.LeaseTime / 6, peers: map[string]Shard{},
		stop: make(chan struct{}), done: make(chan struct{})}
	if err := c.join(ctx, true); err != nil {
		return nil, err
	}
	go c.loop()
	return c, nil
}

// CheckID checks a shard id: 1 to 63 of a-z, 0-9 and -, starting with a
// letter or digit.
func CheckID(id string) error {
	if !shardID.MatchString(id) {
		return fmt.Errorf("shard id %q: want 1 to 63 of a-z, 0-9 and -, starting with a letter or digit", id)
	}
	return nil
}

// ID is this shard's id; URL where the others reach it.
func (c *Cluster) ID() string  { return c.cfg.ID }
func (c *Cluster) URL() string { return c.cfg.URL }

// Config is the membership's configuration, defaults filled in.
func (c *Cluster) Config() Config { return c.cfg }

// heartbeat is this shard's heartbeat as of now.
func (c *Cluster) heartbeat(epoch string, now time.Time) Shard {
	hb := Shard{ID: c.cfg.ID, URL: c.cfg.URL, Epoch: epoch, Renewed: now.UTC(), Expires: now.Add(c.cfg.LeaseTime).UTC(), Lock: c.cfg.Lock}
	if c.cfg.Load != nil {
		hb.Running, hb.Max, hb.Sandboxes = c.cfg.Load()
		slices.Sort(hb.Sandboxes)
	}
	return hb
}

// join writes a heartbeat under a new epoch: a first one, or one over
// this shard's expired one. wait says whether to wait for a live one of
// another epoch (another process of this id) to go.
func (c *Cluster) join(ctx context.Context, wait bool) error {
	epoch := newEpoch()
	for {
		now := c.now()
		b, in, err := c.st.Read(ctx, shardKey(c.cfg.ID), maxObject)
		var put store.PutOptions
		switch {
		case errors.Is(err, store.ErrNotFound):
			put.IfNotExist = true
		case err != nil:
			return fmt.Errorf("shard %s: reading its heartbeat: %w", c.cfg.ID, err)
		default:
			var old Shard
			live := json.Unmarshal(b, &old) == nil && old.alive(now, c.skew) && old.Epoch != c.currentEpoch()
			if live && c.cfg.Lock != "" && old.Lock == c.cfg.Lock {
				// Its process held the lock this one holds now: it is gone.
				c.log.Info(fmt.Sprintf("the last process of shard %s held the lock this one holds: it is gone, and its heartbeat is taken over at once", c.cfg.ID), "shard", c.cfg.ID, "epoch", old.Epoch)
				live = false
			}
			if live {
				if !wait {
					return fmt.Errorf("shard %s: another process holds its heartbeat (epoch %s, until %s)", c.cfg.ID, old.Epoch, old.Expires.Format(time.RFC3339))
				}
				until := time.Until(old.Expires.Add(c.skew))
				c.log.Warn(fmt.Sprintf("another process of shard %s is alive (its heartbeat holds until %s): waiting for it to stop or expire", c.cfg.ID, old.Expires.Format(time.RFC3339)), "shard", c.cfg.ID, "epoch", old.Epoch)
				select {
				case <-ctx.Done():
					return fmt.Errorf("shard %s: another process of it is alive until %s: %w", c.cfg.ID, old.Expires.Format(time.RFC3339), context.Cause(ctx))
				case <-time.After(min(until, c.cfg.Renew) + 10*time.Millisecond):
				}
				continue
			}
			put.IfGenerationMatch = in.Generation
		}
		hb := c.heartbeat(epoch, now)
		data, _ := json.Marshal(hb)
		in, err = c.st.Put(ctx, shardKey(c.cfg.ID), strings.NewReader(string(data)), put)
		if errors.Is(err, store.ErrPreconditionFailed) {
			continue // another process wrote it meanwhile: look again
		}
		if err != nil {
			return fmt.Errorf("shard %s: writing its heartbeat: %w", c.cfg.ID, err)
		}
		c.mu.Lock()
		c.epoch, c.gen, c.safe, c.fenced = epoch, in.Generation, now.Add(c.cfg.LeaseTime-c.skew), false
		c.mu.Unlock()
		c.log.Info("joined the shards sharing the store", "shard", c.cfg.ID, "url", c.cfg.URL, "epoch", epoch)
		return nil
	}
}

// Epoch is this shard's current epoch: its incarnation since it last
// joined.
func (c *Cluster) Epoch() string { return c.currentEpoch() }

func (c *Cluster) currentEpoch() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.epoch
}

// loop renews the heartbeat every Renew until Close.
func (c *Cluster) loop() {
	defer close(c.done)
	t := time.NewTicker(c.cfg.Renew)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
		}
		c.renew()
	}
}

// renew renews the heartbeat, or, fenced, rejoins.
func (c *Cluster) renew() {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Renew)
	defer cancel()
	c.mu.Lock()
	fenced, epoch, gen, safe := c.fenced, c.epoch, c.gen, c.safe
	c.mu.Unlock()
	if fenced {
		if err := c.join(ctx, false); err != nil {
			c.log.Warn("a fenced shard could not rejoin yet", "shard", c.cfg.ID, "err", err)
			return
		}
		if c.cfg.Rejoined != nil {
			c.cfg.Rejoined()
		}
		return
	}
	start := c.now()
	if start.After(safe) {
		c.fence(fmt.Errorf("%w: last renewed until %s", ErrFenced, safe.Format(time.RFC3339Nano)))
		return
	}
	data, _ := json.Marshal(c.heartbeat(epoch, start))
	in, err := c.st.Put(ctx, shardKey(c.cfg.ID), strings.NewReader(string(data)), store.PutOptions{IfGenerationMatch: gen})
	switch {
	case errors.Is(err, store.ErrPreconditionFailed):
		// Another process of this shard took the heartbeat (this one
		// was thought dead): its leases are that one's to judge now.
		c.fence(fmt.Errorf("%w: another process of shard %s took its heartbeat", ErrFenced, c.cfg.ID))
		return
	case err != nil:
		c.log.Warn("renewing the heartbeat failed; retrying", "shard", c.cfg.ID, "err", err, "safe_until", safe.Format(time.RFC3339Nano))
		if c.now().After(safe) {
			c.fence(fmt.Errorf("%w: %v", ErrFenced, err))
		}
		return
	}
	c.mu.Lock()
	if c.epoch == epoch && !c.fenced {
		c.gen, c.safe = in.Generation, start.Add(c.cfg.LeaseTime-c.skew)
	}
	safe = c.safe
	c.mu.Unlock()
	if c.cfg.Renewed != nil {
		c.cfg.Renewed(time.Until(safe))
	}
}

// fence marks the shard fenced and tells the caller, once.
func (c *Cluster) fence(err error) {
	c.mu.Lock()
	already := c.fenced
	c.fenced = true
	c.mu.Unlock()
	if already {
		return
	}
	c.log.Error("fenced: this shard's leases may have expired; stopping every sandbox's commands until it rejoins", "shard", c.cfg.ID, "err", err)
	if c.cfg.Fenced != nil {
		c.cfg.Fenced(err)
	}
}

// Valid says whether this shard's leases are sure to hold now, and if not
// why.
func (c *Cluster) Valid() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return ErrClosed
	case c.fenced || c.now().After(c.safe):
		return ErrFenced
	}
	return nil
}

// Safe is until when this shard's leases are sure to hold.
func (c *Cluster) Safe() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.safe
}

// readLease reads sandbox id's lease object.
func (c *Cluster) readLease(ctx context.Context, id string) (leaseRecord, int64, error) {
	b, in, err := c.st.Read(ctx, leaseKey(id), maxObject)
	if err != nil {
		return leaseRecord{}, 0, err
	}
	var lr leaseRecord
	if err := json.Unmarshal(b, &lr); err != nil {
		return leaseRecord{}, 0, fmt.Errorf("lease of %s: not a lease: %w", id, err)
	}
	return lr, in.Generation, nil
}

// shard reads shard id's heartbeat; a missing one is store.ErrNotFound.
func (c *Cluster) shard(ctx context.Context, id string) (Shard, error) {
	b, _, err := c.st.Read(ctx, shardKey(id), maxObject)
	if err != nil {
		return Shard{}, err
	}
	var s Shard
	if err := json.Unmarshal(b, &s); err != nil {
		return Shard{}, fmt.Errorf("heartbeat of %s: %w", id, err)
	}
	return s, nil
}

// holder is the live shard a lease names, or ok false when the lease no
// longer holds (its shard's heartbeat expired, is gone, or is of another
// epoch).
func (c *Cluster) holder(ctx context.Context, lr leaseRecord) (Shard, bool, error) {
	if lr.Shard == c.cfg.ID {
		c.mu.Lock()
		mine := lr.Epoch == c.epoch && !c.fenced
		c.mu.Unlock()
		return Shard{ID: c.cfg.ID, URL: c.cfg.URL, Epoch: lr.Epoch}, mine, nil
	}
	s, err := c.shard(ctx, lr.Shard)
	if errors.Is(err, store.ErrNotFound) {
		return Shard{}, false, nil
	}
	if err != nil {
		return Shard{}, false, err
	}
	return s, s.Epoch == lr.Epoch && s.alive(c.now(), c.skew), nil
}

// Acquire takes sandbox id's lease for this shard: a new one, one this
// shard holds already, or one whose shard is dead. One a live shard holds
// is a *HeldError.
func (c *Cluster) Acquire(ctx context.Context, id string) (*Lease, error) {
	if err := c.Valid(); err != nil {
		return nil, err
	}
	epoch := c.currentEpoch()
	for try := 0; ; try++ {
		if try == 20 {
			return nil, fmt.Errorf("lease of %s: changed under 20 attempts in a row", id)
		}
		mine := leaseRecord{Sandbox: id, Shard: c.cfg.ID, URL: c.cfg.URL, Epoch: epoch, Taken: c.now().UTC()}
		data, _ := json.Marshal(mine)
		lr, gen, err := c.readLease(ctx, id)
		var put store.PutOptions
		switch {
		case errors.Is(err, store.ErrNotFound):
			put.IfNotExist = true
		case err != nil:
			return nil, err
		default:
			if lr.Shard == c.cfg.ID && lr.Epoch == epoch {
				return &Lease{Sandbox: id, epoch: epoch, gen: gen}, nil
			}
			s, alive, err := c.holder(ctx, lr)
			if err != nil {
				return nil, err
			}
			if alive && s.ID != c.cfg.ID {
				return nil, &HeldError{Sandbox: id, Shard: s}
			}
			put.IfGenerationMatch = gen
			if lr.Shard != c.cfg.ID {
				c.log.Info("taking over the lease of a sandbox whose shard is gone", "sandbox", id, "from", lr.Shard, "from_epoch", lr.Epoch)
			}
		}
		in, err := c.st.Put(ctx, leaseKey(id), strings.NewReader(string(data)), put)
		if errors.Is(err, store.ErrPreconditionFailed) {
			continue // changed meanwhile: judge again
		}
		if err != nil {
			return nil, fmt.Errorf("lease of %s: %w", id, err)
		}
		return &Lease{Sandbox: id, epoch: epoch, gen: in.Generation}, nil
	}
}

// Revalidate swaps a lease taken under an earlier epoch to the current
// one, if nobody took it meanwhile: ErrLost if somebody did.
func (c *Cluster) Revalidate(ctx context.Context, l *Lease) error {
	if err := c.Valid(); err != nil {
		return err
	}
	epoch := c.currentEpoch()
	if l.epoch == epoch {
		return nil
	}
	data, _ := json.Marshal(leaseRecord{Sandbox: l.Sandbox, Shard: c.cfg.ID, URL: c.cfg.URL, Epoch: epoch, Taken: c.now().UTC()})
	in, err := c.st.Put(ctx, leaseKey(l.Sandbox), strings.NewReader(string(data)), store.PutOptions{IfGenerationMatch: l.gen})
	if errors.Is(err, store.ErrPreconditionFailed) {
		return fmt.Errorf("sandbox %s: %w", l.Sandbox, ErrLost)
	}
	if err != nil {
		return fmt.Errorf("lease of %s: %w", l.Sandbox, err)
	}
	l.epoch, l.gen = epoch, in.Generation
	return nil
}

// Release gives a lease up. One taken meanwhile by another shard is left
// to it (ErrLost).
func (c *Cluster) Release(ctx context.Context, l *Lease) error {
	err := c.st.DeleteIf(ctx, leaseKey(l.Sandbox), l.gen)
	switch {
	case errors.Is(err, store.ErrPreconditionFailed):
		return fmt.Errorf("sandbox %s: %w", l.Sandbox, ErrLost)
	case errors.Is(err, store.ErrNotFound):
		return nil
	}
	return err
}

// Holder is who runs sandbox id: a live shard (this one or another), or
// none (ok false: it is free to take).
func (c *Cluster) Holder(ctx context.Context, id string) (Shard, bool, error) {
	lr, _, err := c.readLease(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		return Shard{}, false, nil
	}
	if err != nil {
		return Shard{}, false, err
	}
	return c.holder(ctx, lr)
}

// Shards are the live shards, this one included, as their heartbeats say
// (read at most once per Renew).
func (c *Cluster) Shards(ctx context.Context) ([]Shard, error) {
	c.mu.Lock()
	fresh := c.now().Sub(c.peersAt) < c.cfg.Renew
	c.mu.Unlock()
	if !fresh {
		infos, err := c.st.List(ctx, "shards/")
		if err != nil {
			return nil, err
		}
		peers := map[string]Shard{}
		for _, in := range infos {
			id, ok := strings.CutSuffix(strings.TrimPrefix(in.Name, "shards/"), ".json")
			if !ok || strings.Contains(id, "/") {
				continue
			}
			s, err := c.shard(ctx, id)
			if err != nil {
				continue // gone meanwhile, or not a heartbeat
			}
			peers[id] = s
		}
		c.mu.Lock()
		c.peers, c.peersAt = peers, c.now()
		c.mu.Unlock()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []Shard
	now := c.now()
	for _, s := range c.peers {
		if s.alive(now, c.skew) {
			out = append(out, s)
		}
	}
	slices.SortFunc(out, func(a, b Shard) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// Close stops renewing and removes the heartbeat: the caller released its
// leases first (a lease left names a dead shard, and is free to take).
func (c *Cluster) Close(ctx context.Context) error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	close(c.stop)
	<-c.done
	c.mu.Lock()
	gen, fenced := c.gen, c.fenced
	c.mu.Unlock()
	if fenced {
		return nil // the heartbeat may be another process's now
	}
	if err := c.st.DeleteIf(ctx, shardKey(c.cfg.ID), gen); err != nil && !errors.Is(err, store.ErrNotFound) && !errors.Is(err, store.ErrPreconditionFailed) {
		return fmt.Errorf("shard %s: removing its heartbeat: %w", c.cfg.ID, err)
	}
	return nil
}
