package appliance

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/snapshot/store"
)

// cutoff is a store a shard reaches only while it is not cut off: a
// network partition, or a process paused past its lease.
type cutoff struct {
	store.Store
	cut atomic.Bool
}

var errCutOff = errors.New("cut off from the store")

func (c *cutoff) Put(ctx context.Context, name string, r io.Reader, o store.PutOptions) (store.Info, error) {
	if c.cut.Load() {
		return store.Info{}, errCutOff
	}
	return c.Store.Put(ctx, name, r, o)
}

func (c *cutoff) Read(ctx context.Context, name string, max int64) ([]byte, store.Info, error) {
	if c.cut.Load() {
		return nil, store.Info{}, errCutOff
	}
	return c.Store.Read(ctx, name, max)
}

func (c *cutoff) DeleteIf(ctx context.Context, name string, gen int64) error {
	if c.cut.Load() {
		return errCutOff
	}
	return c.Store.DeleteIf(ctx, name, gen)
}

func shardRig(t *testing.T, st store.Store, id string) *mrig {
	return newManagerRig(t, st, func(c *ManagerConfig) {
		c.Shard = shortShard
		c.Shard.ID, c.Shard.URL = id, "http://"+id+".test"
	})
}

// Two shards over one store: a sandbox runs on one at a time, the other
// sees where; suspended, it is anyone's; a shard cut off from the store is
// fenced (its sandboxes' commands stop), the other takes its sandboxes
// from their last saved state once its heartbeat expires, and back, it
// drops its stale copies unsaved.
func TestShardsShareAStore(t *testing.T) {
	for _, kind := range storeKinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			testShardsShareAStore(t, newStore(t, kind))
		})
	}
}

func testShardsShareAStore(t *testing.T, st store.Store) {
	ctx := context.Background()
	cut := &cutoff{Store: st}
	a, b := shardRig(t, st, "a"), shardRig(t, cut, "b")

	a.create("x", CreateOptions{})
	a.sh("x", "echo one > /root/f")
	if in, err := b.m.Get(ctx, "x"); err != nil || in.State != Running || in.Shard != "a" {
		t.Fatalf("b describes x, which a runs: %+v %v", in, err)
	}
	var held *cluster.HeldError
	if _, err := b.m.Resume(ctx, "x", ResumeOptions{}); !errors.As(err, &held) || held.Shard.URL != "http://a.test" || !errors.Is(err, ErrElsewhere) {
		t.Fatalf("b resumes x, which a runs: %v, want ErrElsewhere naming a", err)
	}
	if _, err := b.m.Create(ctx, "x", CreateOptions{}); !errors.Is(err, ErrExists) {
		t.Fatalf("b creates x, which a runs: %v, want ErrExists", err)
	}
	if err := b.m.Destroy(ctx, "x"); !errors.Is(err, ErrElsewhere) {
		t.Fatalf("b destroys x, which a runs: %v, want ErrElsewhere", err)
	}
	if sh, local, err := b.m.Owner(ctx, "x"); err != nil || local || sh.ID != "a" {
		t.Fatalf("b: who runs x? %+v %v %v", sh, local, err)
	}
	eventually(t, "b lists x on a", func() error {
		infos, err := b.m.List(ctx)
		if err != nil {
			return err
		}
		for _, in := range infos {
			if in.ID == "x" && in.State == Running && in.Shard == "a" {
				return nil
			}
		}
		return errors.New("not listed")
	})

	// Suspended, it is anyone's: b resumes it, with its files (and a
	// network of b's own, kept with its record).
	if err := a.m.Suspend(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	bpol := b.pol
	given, err := netpolicy.ParseHostRule("given-on-b.example.com")
	if err != nil {
		t.Fatal(err)
	}
	bpol.AllowedHosts = append(slices.Clone(bpol.AllowedHosts), given)
	if _, err := b.m.Resume(ctx, "x", ResumeOptions{Network: NetworkSpec{Policy: &bpol}}); err != nil {
		t.Fatal(err)
	}
	if _, out := b.sh("x", "cat /root/f; echo two > /root/g"); out != "one\n" {
		t.Fatalf("x resumed on b: %q", out)
	}
	if in, err := a.m.Get(ctx, "x"); err != nil || in.Shard != "b" {
		t.Fatalf("a describes x, which b runs now: %+v %v", in, err)
	}

	// A checkpoint saves x as it runs: its commands pause for the copy,
	// and go on.
	sleeper, err := b.m.Exec(ctx, "x", ExecRequest{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.m.Checkpoint(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	if _, out := b.sh("x", "pgrep -x sleep >/dev/null && echo sleeping; echo three > /root/h"); out != "sleeping\n" {
		t.Fatalf("after a checkpoint: %q, want the command still there", out)
	}
	// b is cut off from the store: fenced, its commands stop.
	cut.cut.Store(true)
	waitCtx, cancel := context.WithTimeout(ctx, 20*shortShard.LeaseTime)
	defer cancel()
	if code, ok := sleeper.Wait(waitCtx); !ok || code != 137 {
		t.Fatalf("a command on the fenced shard: %d (ended: %v), want killed (137)", code, ok)
	}
	// Refused by the manager (fenced), or, in the moment before it knows,
	// by the agent (its deadline passed).
	if _, err := b.m.Exec(ctx, "x", ExecRequest{Args: []string{"true"}}); !errors.Is(err, ErrFenced) && !errors.Is(err, agent.ErrExpired) {
		t.Errorf("a command on the fenced shard: %v, want ErrFenced", err)
	}
	// a takes x once b's heartbeat expired, woken by the next call for
	// it: from its last saved state, the checkpoint (what b wrote after it
	// is gone with b's copy), with the network it had on b.
	eventually(t, "a wakes x from the cut-off b", func() error {
		_, err := a.m.Wake(ctx, "x", ResumeOptions{})
		return err
	})
	if _, out := a.sh("x", "cat /root/f /root/g; test -e /root/h || echo no-h"); out != "one\ntwo\nno-h\n" {
		t.Errorf("x taken over by a: %q, want its last checkpoint", out)
	}
	if in, err := a.m.Get(ctx, "x"); err != nil || in.Policy == nil || !slices.ContainsFunc(in.Policy.AllowedHosts, func(r netpolicy.HostRule) bool { return r.String() == "given-on-b.example.com" }) {
		t.Errorf("x taken over by a has policy %+v (%v), want the one b gave it", in.Policy, err)
	}
	// Back, b rejoins and drops its stale copy, unsaved.
	cut.cut.Store(false)
	eventually(t, "b drops its stale x", func() error {
		if _, err := b.m.Sandbox("x"); err == nil {
			return errors.New("b still runs x")
		}
		if sh, local, err := b.m.Owner(ctx, "x"); err != nil || local || sh.ID != "a" {
			return fmt.Errorf("b says x runs on %+v (here: %v, %v)", sh, local, err)
		}
		if ids, _ := b.l.List(ctx); len(ids) != 0 {
			return errors.New("b's sandbox CLI still has x")
		}
		return nil
	})
	if _, out := a.sh("x", "cat /root/f"); out != "one\n" {
		t.Errorf("x on a after b came back: %q", out)
	}
	if err := a.m.Destroy(ctx, "x"); err != nil {
		t.Fatal(err)
	}
}

// eventually retries f, a few times a second, for at most a minute.
func eventually(t *testing.T, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within a minute: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
