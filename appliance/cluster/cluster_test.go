package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/snapshot/store"
)

// testLease expires in seconds, for the test that waits for one to, yet a
// renewal may stall for six (fsync on a loaded machine) without fencing a
// shard; every wait below is bounded by a multiple of it. The tests that
// wait for no expiry take the defaults.
const (
	testLease = 10 * time.Second
	testRenew = 2 * time.Second
)

func stores(t *testing.T) map[string]func(t *testing.T) store.Store {
	return map[string]func(t *testing.T) store.Store{
		"dir": func(t *testing.T) store.Store {
			st, err := store.NewDir(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			return st
		},
		"gcs": func(t *testing.T) store.Store {
			_, client := gcstest.Start(t, "bucket")
			return store.NewGCS(client, "bucket", "svc")
		},
	}
}

// partition is a store one shard reaches only while it is not cut off.
type partition struct {
	store.Store
	cut atomic.Bool
}

var errCut = errors.New("partitioned from the store")

func (p *partition) Put(ctx context.Context, name string, r io.Reader, o store.PutOptions) (store.Info, error) {
	if p.cut.Load() {
		return store.Info{}, errCut
	}
	return p.Store.Put(ctx, name, r, o)
}

func (p *partition) Read(ctx context.Context, name string, max int64) ([]byte, store.Info, error) {
	if p.cut.Load() {
		return nil, store.Info{}, errCut
	}
	return p.Store.Read(ctx, name, max)
}

// member is a shard under test with what its callbacks saw.
type member struct {
	*Cluster
	part     *partition
	fenced   chan error
	rejoined chan struct{}
}

func join(t *testing.T, st store.Store, id string) *member {
	t.Helper()
	return joinFor(t, st, id, testLease, testRenew)
}

// joinFor is join with leases of lease, renewed every renew.
func joinFor(t *testing.T, st store.Store, id string, lease, renew time.Duration) *member {
	t.Helper()
	m := &member{part: &partition{Store: st}, fenced: make(chan error, 10), rejoined: make(chan struct{}, 10)}
	c, err := Open(context.Background(), Config{
		Store: m.part, ID: id, URL: "http://" + id + ".test", LeaseTime: lease, Renew: renew,
		Fenced:   func(err error) { m.fenced <- err },
		Rejoined: func() { m.rejoined <- struct{}{} },
		Load:     func() (int, int, []string) { return 1, 2, []string{"x"} },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	m.Cluster = c
	return m
}

// eventually retries f until it returns nil, for at most d.
func eventually(t *testing.T, d time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s: %v", what, d, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestLeases(t *testing.T) {
	for kind, mk := range stores(t) {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testLeases(t, mk(t))
		})
	}
}

func testLeases(t *testing.T, st store.Store) {
	ctx := context.Background()
	a, b := join(t, st, "a"), join(t, st, "b")

	la, err := a.Acquire(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	var held *HeldError
	if _, err := b.Acquire(ctx, "x"); !errors.As(err, &held) || held.Shard.ID != "a" || held.Shard.URL != "http://a.test" {
		t.Fatalf("b takes a's lease: %v, want HeldError naming a", err)
	}
	if again, err := a.Acquire(ctx, "x"); err != nil || again.gen != la.gen {
		t.Fatalf("a takes its own lease again: %+v %v", again, err)
	}
	if s, ok, err := b.Holder(ctx, "x"); err != nil || !ok || s.ID != "a" {
		t.Fatalf("b asks who holds x: %+v %v %v", s, ok, err)
	}
	shards, err := b.Shards(ctx)
	if err != nil || len(shards) != 2 || shards[0].ID != "a" || shards[0].Max != 2 || shards[0].Sandboxes[0] != "x" {
		t.Fatalf("shards: %+v %v", shards, err)
	}

	// Released, it is anyone's.
	if err := a.Release(ctx, la); err != nil {
		t.Fatal(err)
	}
	lb, err := b.Acquire(ctx, "x")
	if err != nil {
		t.Fatalf("b after a released: %v", err)
	}
	if err := a.Release(ctx, la); !errors.Is(err, ErrLost) {
		t.Errorf("a releases the lease b took since: %v, want ErrLost", err)
	}

	// A shard cut off from the store is fenced before its heartbeat
	// expires; the others take its sandboxes once it has.
	ly, err := b.Acquire(ctx, "y")
	if err != nil {
		t.Fatal(err)
	}
	lz, err := b.Acquire(ctx, "z")
	if err != nil {
		t.Fatal(err)
	}
	b.part.cut.Store(true)
	cutAt := time.Now()
	select {
	case err := <-b.fenced:
		if !errors.Is(err, ErrFenced) {
			t.Errorf("fenced with %v", err)
		}
	case <-time.After(10 * testLease):
		t.Fatal("a shard cut off from the store was never fenced")
	}
	if took := time.Since(cutAt); took > testLease {
		// Not a timing assertion of the machine: of the protocol. Fenced
		// after its leases expired would be too late, however slow.
		t.Logf("fenced %s after the cut (lease %s)", took, testLease)
	}
	if err := b.Valid(); !errors.Is(err, ErrFenced) {
		t.Errorf("a fenced shard says %v", err)
	}
	if _, err := b.Acquire(ctx, "w"); !errors.Is(err, ErrFenced) {
		t.Errorf("a fenced shard takes a lease: %v", err)
	}
	eventually(t, 10*testLease, "a takes y from the cut-off b", func() error {
		_, err := a.Acquire(ctx, "y")
		return err
	})
	if a.Safe().Before(time.Now()) {
		t.Errorf("a's own leases are not safe")
	}

	// Back, b rejoins under a new epoch: it keeps z, which nobody took,
	// and has lost y.
	b.part.cut.Store(false)
	select {
	case <-b.rejoined:
	case <-time.After(10 * testLease):
		t.Fatal("b did not rejoin")
	}
	if err := b.Revalidate(ctx, ly); !errors.Is(err, ErrLost) {
		t.Errorf("b revalidates y, which a took: %v, want ErrLost", err)
	}
	if err := b.Revalidate(ctx, lz); err != nil {
		t.Errorf("b revalidates z, which nobody took: %v", err)
	}
	if _, err := a.Acquire(ctx, "z"); !errors.As(err, &held) || held.Shard.ID != "b" {
		t.Errorf("a takes z, revalidated by b: %v", err)
	}
	if err := b.Release(ctx, lb); err != nil {
		t.Errorf("b releases x: %v", err)
	}
}

// Of shards racing for free leases, exactly one wins each.
func TestLeaseRaceHasOneWinner(t *testing.T) {
	for kind, mk := range stores(t) {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			st := mk(t)
			long := func(id string) *member { return joinFor(t, st, id, DefaultLeaseTime, DefaultRenew) }
			ms := []*member{long("a"), long("b"), long("c")}
			for i := range 10 {
				id := fmt.Sprint("s", i)
				var wg sync.WaitGroup
				var won atomic.Int32
				errs := make(chan error, len(ms))
				for _, m := range ms {
					wg.Go(func() {
						_, err := m.Acquire(context.Background(), id)
						var held *HeldError
						switch {
						case err == nil:
							won.Add(1)
						case !errors.As(err, &held):
							errs <- err
						}
					})
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					t.Fatal(err)
				}
				if won.Load() != 1 {
					t.Fatalf("%s: %d shards won its lease", id, won.Load())
				}
			}
		})
	}
}

// A second process of a shard id waits for the first to go, and a shard
// that closes leaves its leases free at once.
func TestSameShardTwice(t *testing.T) {
	st := stores(t)["dir"](t)
	first := join(t, st, "a")
	l, err := first.Acquire(context.Background(), "x")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testRenew)
	defer cancel()
	if _, err := Open(ctx, Config{Store: st, ID: "a", LeaseTime: testLease, Renew: testRenew}); err == nil {
		t.Fatal("a second process of shard a joined while the first is alive")
	}
	joined := make(chan *Cluster, 1)
	go func() {
		c, err := Open(context.Background(), Config{Store: st, ID: "a", LeaseTime: testLease, Renew: testRenew})
		if err != nil {
			t.Error(err)
		}
		joined <- c
	}()
	first.Release(context.Background(), l)
	first.Close(context.Background())
	select {
	case c := <-joined:
		if c != nil {
			defer c.Close(context.Background())
			if _, err := c.Acquire(context.Background(), "x"); err != nil {
				t.Errorf("the second process takes x: %v", err)
			}
		}
	case <-time.After(10 * testLease):
		t.Fatal("the second process never joined after the first closed")
	}
}

// A process of a shard that holds the lock the last one held (it crashed,
// and serve's state directory lock is free again) joins at once, though
// the dead one's heartbeat is still alive; a process with another lock
// (or none) still waits for it.
func TestSameShardAfterACrash(t *testing.T) {
	st := stores(t)["dir"](t)
	lease := 10 * time.Minute // far past the test: only the lock lets the next join
	first, err := Open(context.Background(), Config{Store: st, ID: "a", LeaseTime: lease, Renew: lease / 3, Lock: "boot 1, file 2:3"})
	if err != nil {
		t.Fatal(err)
	}
	// The crash: nothing of first runs on (its renewals stop), its
	// heartbeat stays.
	first.Close(context.Background())
	if _, err := st.Put(context.Background(), shardKey("a"), strings.NewReader(`{"shard":"a","epoch":"dead","expires":"2999-01-01T00:00:00Z","lock":"boot 1, file 2:3"}`), store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := Open(ctx, Config{Store: st, ID: "a", LeaseTime: lease, Renew: lease / 3, Lock: "boot 1, file 2:4"}); err == nil {
		t.Fatal("a process holding another lock joined while the heartbeat of shard a is alive")
	}
	ctx, cancel = context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	second, err := Open(ctx, Config{Store: st, ID: "a", LeaseTime: lease, Renew: lease / 3, Lock: "boot 1, file 2:3"})
	if err != nil {
		t.Fatalf("the process holding the dead one's lock: %v, want it joined at once", err)
	}
	defer second.Close(context.Background())
	if second.Epoch() == "dead" {
		t.Error("it joined under the dead process's epoch")
	}
}
