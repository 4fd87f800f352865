package appliance

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/snapshot/store"
)

// skew moves the manager's clock on by d (its loops and sweeps see it).
func (r *mrig) skew(d time.Duration) { r.m.clockSkew.Add(int64(d)) }

// putAuditSegment stores an audit segment of sandbox id, as a journal's
// flush would, and returns its key.
func (r *mrig) putAuditSegment(id string) string {
	r.t.Helper()
	name := time.Now().UTC().Format("20060102T150405.000000000Z") + "-0badcafe"
	if err := r.m.audits.WriteSegment(r.ctx(), id, name, []byte("not read here")); err != nil {
		r.t.Fatal(err)
	}
	return auditDir(id) + name + segmentExt
}

func (r *mrig) exists(key string) bool {
	r.t.Helper()
	_, err := r.st.Stat(r.ctx(), key)
	if errors.Is(err, store.ErrNotFound) {
		return false
	}
	if err != nil {
		r.t.Fatal(err)
	}
	return true
}

// A suspended sandbox's layers stayed in the store for ever: past its
// keepSuspended any shard's sweep destroys it, layers and record, and keeps
// its audit; a call for it is told it expired, and when.
func TestSuspendedSandboxPastKeepSuspendedRemovedAuditKept(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("kept-short", CreateOptions{Limits: Limits{KeepSuspended: time.Minute}})
	r.create("kept-ever", CreateOptions{})
	for _, id := range []string{"kept-short", "kept-ever"} {
		if err := r.m.Suspend(r.ctx(), id); err != nil {
			t.Fatal(err)
		}
	}
	rec, err := r.m.readRecord(r.ctx(), snapshotRecordKey("kept-short"))
	if err != nil {
		t.Fatal(err)
	}
	seg := r.putAuditSegment("kept-short")
	if n, err := r.m.sweepExpired(r.ctx()); err != nil || n != 0 {
		t.Fatalf("a sweep before its time destroyed %d sandboxes (%v)", n, err)
	}
	r.skew(2 * time.Minute)
	if n, err := r.m.sweepExpired(r.ctx()); err != nil || n != 1 {
		t.Fatalf("the sweep past its time destroyed %d sandboxes (%v), want 1", n, err)
	}
	for _, key := range []string{snapshotRecordKey("kept-short"), rec.Layer, rec.Layer + ".manifest.json"} {
		if r.exists(key) {
			t.Errorf("%s is still in the store", key)
		}
	}
	if !r.exists(seg) {
		t.Errorf("its audit segment %s went with it; it is kept for the audit's retention", seg)
	}
	_, err = r.m.Get(r.ctx(), "kept-short")
	if !errors.Is(err, ErrExpired) || !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get of the expired sandbox: %v, want ErrExpired (a not found)", err)
	}
	for _, want := range []string{"expired at", "limits.keepSuspended", "audit"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	if got := r.state("kept-ever"); got != Suspended {
		t.Errorf("a sandbox without a limit is %q after the sweep, want suspended", got)
	}
	if !strings.Contains(r.log.String(), "kept-short expired") {
		t.Errorf("no log line of the expiry:\n%s", r.log.String())
	}
	// The id is free again, and a new sandbox of it is no expired one.
	r.create("kept-short", CreateOptions{})
	if _, err := r.m.Get(r.ctx(), "kept-short"); err != nil {
		t.Errorf("the id created again: %v", err)
	}
}

// A running sandbox could run for ever: past its lifetime the shard
// running it destroys it, its commands killed; the next call is a not
// found saying it expired.
func TestRunningSandboxPastLifetimeDestroyed(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("short-life", CreateOptions{Limits: Limits{Lifetime: time.Minute}})
	r.create("long-life", CreateOptions{Limits: Limits{Lifetime: time.Hour}})
	p, err := r.m.Exec(r.ctx(), "short-life", ExecRequest{Args: []string{"/bin/sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	r.m.expireRunning(r.ctx())
	if _, err := r.m.Sandbox("short-life"); err != nil {
		t.Fatalf("expired before its lifetime: %v", err)
	}
	r.skew(2 * time.Minute)
	r.m.expireRunning(r.ctx())
	_, err = r.m.Sandbox("short-life")
	if !errors.Is(err, ErrExpired) || !strings.Contains(err.Error(), "limits.lifetime") || !strings.Contains(err.Error(), "commands were killed") {
		t.Fatalf("a call after its lifetime: %v, want ErrExpired naming limits.lifetime", err)
	}
	if _, err := r.m.Get(r.ctx(), "short-life"); !errors.Is(err, ErrExpired) {
		t.Errorf("Get after its lifetime: %v", err)
	}
	ctx, cancel := context.WithTimeout(r.ctx(), time.Minute)
	defer cancel()
	if _, ok := p.Wait(ctx); !ok {
		t.Errorf("its command still runs")
	}
	left, err := r.l.List(r.ctx())
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range left {
		if in.ID == "short-life" {
			t.Errorf("the sandbox CLI still has it")
		}
	}
	if _, err := r.m.Sandbox("long-life"); err != nil {
		t.Errorf("a sandbox within its lifetime: %v", err)
	}
}

// The sweep judges a suspended sandbox at its record's generation: a
// resume (and a suspend) between the judgment and the delete wins, and
// the sandbox stays.
func TestResumeRacingExpirySweepKeepsSandbox(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("racer", CreateOptions{Limits: Limits{KeepSuspended: time.Minute}})
	if err := r.m.Suspend(r.ctx(), "racer"); err != nil {
		t.Fatal(err)
	}
	r.skew(2 * time.Minute)
	due, err := r.m.expiredSuspended(r.ctx())
	if err != nil || len(due) != 1 || due[0].id != "racer" {
		t.Fatalf("the sweep found %v (%v), want racer", due, err)
	}
	if _, err := r.m.Resume(r.ctx(), "racer", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
		t.Fatal(err)
	}
	if r.m.expireOne(r.ctx(), due[0].id, due[0].gen, due[0].why) {
		t.Fatal("the sweep destroyed a sandbox resumed after it judged it")
	}
	if got := r.state("racer"); got != Running {
		t.Fatalf("racer is %q, want running", got)
	}
	if err := r.m.Suspend(r.ctx(), "racer"); err != nil {
		t.Fatal(err)
	}
	if r.m.expireOne(r.ctx(), due[0].id, due[0].gen, due[0].why) {
		t.Fatal("the sweep destroyed a sandbox suspended again after it judged it")
	}
	if got := r.state("racer"); got != Suspended {
		t.Errorf("racer is %q, want suspended", got)
	}
}

func TestExpiredWhy(t *testing.T) {
	created := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	since := created.Add(time.Hour)
	for _, c := range []struct {
		lim  Limits
		now  time.Time
		want string
	}{
		{Limits{}, created.Add(1000 * time.Hour), ""},
		{Limits{Lifetime: 2 * time.Hour}, created.Add(119 * time.Minute), ""},
		{Limits{Lifetime: 2 * time.Hour}, created.Add(2 * time.Hour), "limits.lifetime"},
		{Limits{KeepSuspended: time.Hour}, since.Add(59 * time.Minute), ""},
		{Limits{KeepSuspended: time.Hour}, since.Add(time.Hour), "limits.keepSuspended"},
		{Limits{Lifetime: 10 * time.Hour, KeepSuspended: time.Hour}, since.Add(3 * time.Hour), "limits.keepSuspended"},
	} {
		got := expiredWhy(c.lim, created, since, c.now)
		if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%+v at %v: %q, want %q", c.lim, c.now.Sub(created), got, c.want)
		}
	}
}
