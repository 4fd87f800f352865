package appliance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/snapshot/store"
)

// mrig is a Manager over real sandboxes, a real proxy and a store (a
// directory, or Cloud Storage through its emulator).
type mrig struct {
	t *testing.T
	*egress
	st  store.Store
	m   *Manager
	cfg ManagerConfig
	log *syncbuf.Buffer
}

// testShard is the rigs' shard, with the default leases: a renewal may
// stall for seconds (fsync behind the layers being saved on a loaded
// machine) without fencing it. shortShard's leases expire in seconds, for
// the tests that wait for one to: they keep their I/O small.
var (
	testShard  = ShardConfig{ID: "test-shard"}
	shortShard = ShardConfig{ID: "test-shard", LeaseTime: 6 * time.Second, Renew: time.Second}
)

// storeKinds are the stores every lifecycle test runs against.
var storeKinds = []string{"dir", "gcs"}

func newStore(t *testing.T, kind string) store.Store {
	t.Helper()
	switch kind {
	case "dir":
		st, err := store.NewDir(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return st
	case "gcs":
		_, client := gcstest.Start(t, "bucket")
		return store.NewGCS(client, "bucket", "svc")
	}
	t.Fatalf("no store %q", kind)
	return nil
}

func newManagerRig(t *testing.T, st store.Store, tweak func(*ManagerConfig)) *mrig {
	t.Helper()
	return newManagerRigOn(t, ourCLI, st, tweak)
}

// newManagerRigOn is newManagerRig with the launcher driving the CLI of
// mode.
func newManagerRigOn(t *testing.T, mode cliMode, st store.Store, tweak func(*ManagerConfig)) *mrig {
	t.Helper()
	r := &mrig{t: t, egress: newEgressOn(t, mode), st: st, log: &syncbuf.Buffer{}}
	r.cfg = ManagerConfig{
		Launcher: r.l, Proxy: r.proxy, Store: st, Version: "test", ImageID: "test-image",
		WorkDir: t.TempDir(), IdleSuspend: -1,
		Logger: slog.New(slog.NewJSONHandler(r.log, nil)),
		Shard:  testShard,
	}
	if tweak != nil {
		tweak(&r.cfg)
	}
	r.m = r.open()
	return r
}

// open makes a manager over the rig's launcher and store, closed (all
// saved) when the test ends.
func (r *mrig) open() *Manager {
	r.t.Helper()
	m, err := NewManager(r.ctx(), r.cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		m.Close(ctx)
		infos, _ := m.List(ctx)
		for _, in := range infos {
			m.Destroy(ctx, in.ID)
		}
		// Templates `sandgate sandbox` holds are mounted images: removed,
		// or the state directory could not be.
		names, _ := r.l.ListTemplates(ctx)
		for _, n := range names {
			r.l.RemoveTemplate(ctx, n)
		}
		if strings.Contains(r.log.String(), r.canary) {
			r.t.Errorf("the canary secret is in the manager's log")
		}
	})
	return m
}

func (r *mrig) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	r.t.Cleanup(cancel)
	return ctx
}

func (r *mrig) create(id string, opts CreateOptions) *Sandbox {
	r.t.Helper()
	if opts.Network.Policy == nil && opts.Network.AllowedHosts == nil {
		opts.Network.Policy = ptr(r.pol)
	}
	if opts.Network.BaseURLs == nil {
		opts.Network.BaseURLs = map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}
	}
	sb, err := r.m.Create(r.ctx(), id, opts)
	if err != nil {
		r.t.Fatalf("create %s: %v", id, err)
	}
	return sb
}

// sh runs a script in running sandbox id.
func (r *mrig) sh(id, script string) (int, string) {
	r.t.Helper()
	sb, err := r.m.Sandbox(id)
	if err != nil {
		r.t.Fatalf("sandbox %s: %v", id, err)
	}
	var out bytes.Buffer
	st, err := sb.Run(r.ctx(), agent.Cmd{Args: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &out})
	if err != nil {
		r.t.Fatalf("run %q in %s: %v", script, id, err)
	}
	return st.Code, out.String()
}

func (r *mrig) state(id string) State {
	r.t.Helper()
	in, err := r.m.Get(r.ctx(), id)
	if errors.Is(err, ErrNotFound) {
		return ""
	}
	if err != nil {
		r.t.Fatal(err)
	}
	return in.State
}

// storeHolds reports whether any object of the store, decompressed when it
// is zstd, contains s.
func (r *mrig) storeHolds(s string) bool {
	r.t.Helper()
	infos, err := r.st.List(r.ctx(), "")
	if err != nil {
		r.t.Fatal(err)
	}
	for _, in := range infos {
		rc, err := r.st.Get(r.ctx(), in.Name)
		if err != nil {
			r.t.Fatal(err)
		}
		b, _ := io.ReadAll(rc)
		rc.Close()
		if d, err := zstd.NewReader(bytes.NewReader(b)); err == nil {
			if plain, err := io.ReadAll(d); err == nil {
				b = plain
			}
			d.Close()
		}
		if bytes.Contains(b, []byte(s)) {
			return true
		}
	}
	return false
}

// The whole life of a sandbox on both stores and both CLIs (ours, and
// Google's as documented: see internal/testkit/googlecli): create, files, suspend
// (its credentials never saved), resume with its files, create refusing a
// suspended id, idempotent suspend and destroy.
func TestLifecycle(t *testing.T) {
	for _, mode := range cliModes {
		for _, kind := range storeKinds {
			t.Run(string(mode)+"/"+kind, func(t *testing.T) { testLifecycle(t, mode, kind) })
		}
	}
}

func testLifecycle(t *testing.T, mode cliMode, kind string) {
	r := newManagerRigOn(t, mode, newStore(t, kind), nil)
	r.create("life", CreateOptions{Rules: r.rules(t).Rules(), Dirs: []string{"/home/agent", "/workspace"}})
	if code, out := r.sh("life", "echo kept > /workspace/f; echo tmp > /tmp/t; test -d /home/agent && echo home"); code != 0 || out != "home\n" {
		t.Fatalf("first command: %d %q", code, out)
	}
	// The credential is swapped on the way out, never inside.
	if code, out := r.sh("life", "curl -sS -H 'X-Api-Key: sandgate-placeholder-key' $ANTHROPIC_BASE_URL/v1/x"); code != 0 || out != "upstream saw GET /v1/x" {
		t.Fatalf("route: %d %q", code, out)
	}
	if seen := strings.Join(r.seenByUpstream(), "\n"); !strings.Contains(seen, "key="+r.canary) {
		t.Errorf("the upstream never got the swapped credential: %q", seen)
	}
	// A command's status is the agent's, whatever the CLI would say (1 for
	// all of these on Google's).
	for _, code := range []int{1, 120, 137} {
		if got, _ := r.sh("life", fmt.Sprintf("exit %d", code)); got != code {
			t.Errorf("exit %d through the manager's sandbox: got %d", code, got)
		}
	}
	if r.state("life") != Running {
		t.Fatalf("state %q, want running", r.state("life"))
	}
	if err := r.m.Suspend(r.ctx(), "life"); err != nil {
		t.Fatal(err)
	}
	in, err := r.m.Get(r.ctx(), "life")
	if err != nil || in.State != Suspended || in.LayerBytes <= 0 || in.Created.IsZero() {
		t.Fatalf("after suspend: %+v, %v", in, err)
	}
	if _, err := r.m.Sandbox("life"); !errors.Is(err, ErrNotRunning) {
		t.Errorf("Sandbox of a suspended one: %v", err)
	}
	if err := r.m.Suspend(r.ctx(), "life"); err != nil {
		t.Errorf("suspend again: %v, want nil (idempotent)", err)
	}
	if _, err := r.m.Create(r.ctx(), "life", CreateOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); !errors.Is(err, ErrExists) {
		t.Errorf("create over a suspended sandbox: %v, want ErrExists", err)
	}
	if r.storeHolds(r.canary) {
		t.Errorf("the canary secret is in the store after suspend")
	}
	if _, err := r.m.Resume(r.ctx(), "life", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
		t.Fatal(err)
	}
	if code, out := r.sh("life", "cat /workspace/f; test -e /tmp/t || echo no-tmp"); code != 0 || out != "kept\nno-tmp\n" {
		t.Errorf("after resume: %d %q", code, out)
	}
	if in, _ := r.m.Get(r.ctx(), "life"); in.State != Running {
		t.Errorf("after resume: %q, want running", in.State)
	}
	// Spent, and kept as the last good state until the next save.
	if rec, err := r.m.readRecord(r.ctx(), snapshotRecordKey("life")); err != nil || !rec.Spent {
		t.Errorf("the snapshot after resume: %+v, %v; want it kept, spent", rec, err)
	}
	if err := r.m.Destroy(r.ctx(), "life"); err != nil {
		t.Fatal(err)
	}
	if err := r.m.Destroy(r.ctx(), "life"); err != nil {
		t.Errorf("destroy again: %v, want nil (idempotent)", err)
	}
	if _, err := r.m.Resume(r.ctx(), "life", ResumeOptions{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("resume after destroy: %v, want ErrNotFound", err)
	}
	// Nothing of it is left: no snapshot, no lease (the shard's own
	// heartbeat aside).
	infos, _ := r.st.List(r.ctx(), "")
	for _, in := range infos {
		if !strings.HasPrefix(in.Name, "shards/") {
			t.Errorf("the store holds %s after destroy", in.Name)
		}
	}
	if !strings.Contains(r.log.String(), "life suspended in ") {
		t.Errorf("no suspend event in the log:\n%s", r.log.String())
	}
}

// Of two concurrent creates of one id exactly one wins.
func TestConcurrentCreateOneWins(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := r.m.Create(r.ctx(), "twin", CreateOptions{Network: NetworkSpec{Policy: ptr(r.pol)}})
			errs <- err
		}()
	}
	e1, e2 := <-errs, <-errs
	if (e1 == nil) == (e2 == nil) || !(errors.Is(e1, ErrExists) || errors.Is(e2, ErrExists)) {
		t.Errorf("two creates: %v and %v; want one success and one ErrExists", e1, e2)
	}
}

// Resuming a running sandbox keeps it (its processes too) and replaces its
// network.
func TestResumeRunningReplacesNetwork(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	sb := r.create("run", CreateOptions{})
	p, err := sb.Spawn(r.ctx(), agent.Cmd{Args: []string{"sleep", "300"}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill(context.Background())
	got, err := r.m.Resume(r.ctx(), "run", ResumeOptions{Network: NetworkSpec{Policy: ptr(allowAll(t))}})
	if err != nil || got != sb {
		t.Fatalf("resume of a running sandbox: %p %v, want the same sandbox", got, err)
	}
	if pol := sb.relay.Policy(); pol.Mode != "allow-all" {
		t.Errorf("policy after resume: %+v, want allow-all", pol)
	}
	if code, out := r.sh("run", "pgrep -x sleep >/dev/null && echo alive"); code != 0 || out != "alive\n" {
		t.Errorf("its process after resume: %d %q", code, out)
	}
}

// failingStore fails writes (or reads of layers) while failing is set.
type failingStore struct {
	store.Store
	failPut, failGet sync.Mutex
	puts, gets       bool
}

var errInjected = errors.New("injected store failure")

func (f *failingStore) Put(ctx context.Context, name string, r io.Reader, o store.PutOptions) (store.Info, error) {
	f.failPut.Lock()
	fail := f.puts
	f.failPut.Unlock()
	if fail {
		return store.Info{}, errInjected
	}
	return f.Store.Put(ctx, name, r, o)
}

func (f *failingStore) Get(ctx context.Context, name string) (io.ReadCloser, error) {
	f.failGet.Lock()
	fail := f.gets
	f.failGet.Unlock()
	if fail && strings.HasSuffix(name, ".tar.zst") {
		return nil, errInjected
	}
	return f.Store.Get(ctx, name)
}

func (f *failingStore) set(puts, gets bool) {
	f.failPut.Lock()
	f.puts = puts
	f.failPut.Unlock()
	f.failGet.Lock()
	f.gets = gets
	f.failGet.Unlock()
}

// A failed save leaves the sandbox running; a failed restore leaves the
// snapshot in place. Nothing is lost either way.
func TestStoreFailuresLoseNothing(t *testing.T) {
	fs := &failingStore{Store: newStore(t, "dir")}
	r := newManagerRig(t, fs, nil)
	r.create("safe", CreateOptions{})
	r.sh("safe", "echo precious > /root/f")
	fs.set(true, false)
	if err := r.m.Suspend(r.ctx(), "safe"); !errors.Is(err, ErrStore) {
		t.Fatalf("suspend with a failing store: %v, want ErrStore", err)
	}
	if code, out := r.sh("safe", "cat /root/f"); code != 0 || out != "precious\n" {
		t.Fatalf("after a failed save the sandbox should run on: %d %q", code, out)
	}
	fs.set(false, false)
	if err := r.m.Suspend(r.ctx(), "safe"); err != nil {
		t.Fatal(err)
	}
	fs.set(false, true)
	if _, err := r.m.Resume(r.ctx(), "safe", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err == nil {
		t.Fatal("resume with a failing store succeeded")
	}
	if r.state("safe") != Suspended {
		t.Fatalf("after a failed restore: state %q, want suspended (the snapshot kept)", r.state("safe"))
	}
	fs.set(false, false)
	if _, err := r.m.Resume(r.ctx(), "safe", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
		t.Fatal(err)
	}
	if _, out := r.sh("safe", "cat /root/f"); out != "precious\n" {
		t.Errorf("after resume: %q", out)
	}
}

// A template is made once and used by two sandboxes; a sandbox made from
// it saves only what it changed.
func TestTemplateSharedAndDeltaSmall(t *testing.T) {
	for _, mode := range cliModes {
		t.Run(string(mode), func(t *testing.T) { testTemplateSharedAndDeltaSmall(t, mode) })
	}
}

func testTemplateSharedAndDeltaSmall(t *testing.T, mode cliMode) {
	r := newManagerRigOn(t, mode, newStore(t, "dir"), nil)
	r.create("builder", CreateOptions{Rules: r.rules(t).Rules()})
	r.sh("builder", "curl -sS -H 'X-Api-Key: sandgate-placeholder-key' $ANTHROPIC_BASE_URL/v1/y > /root/answer 2>&1")
	// 8 MiB of incompressible bytes the sandboxes inherit.
	if code, out := r.sh("builder", "mkdir -p /opt/tool && head -c 8388608 /dev/urandom > /opt/tool/blob && echo v1 > /opt/tool/version"); code != 0 {
		t.Fatal(out)
	}
	if err := r.m.SaveTemplate(r.ctx(), "builder", "tool"); err != nil {
		t.Fatal(err)
	}
	if ok, err := r.m.TemplateExists(r.ctx(), "tool"); !ok || err != nil {
		t.Fatalf("TemplateExists: %v %v", ok, err)
	}
	if list, err := r.m.ListTemplates(r.ctx()); err != nil || len(list) != 1 || list[0].Name != "tool" || list[0].LayerBytes < 8<<20 || list[0].Created.IsZero() {
		t.Errorf("ListTemplates: %+v %v, want tool, of its 8 MiB and more", list, err)
	}
	if r.storeHolds(r.canary) {
		t.Error("the canary secret is in the store after SaveTemplate")
	}
	if seen := strings.Join(r.seenByUpstream(), "\n"); !strings.Contains(seen, "key="+r.canary) {
		t.Errorf("the upstream never got the swapped credential: %q", seen)
	}
	if err := r.m.Destroy(r.ctx(), "builder"); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"one", "two"} {
		r.create(id, CreateOptions{Template: "tool"})
		if code, out := r.sh(id, "cat /opt/tool/version; head -c 100000 /dev/urandom > /root/mine"); code != 0 || out != "v1\n" {
			t.Fatalf("%s from the template: %d %q", id, code, out)
		}
	}
	if err := r.m.Suspend(r.ctx(), "one"); err != nil {
		t.Fatal(err)
	}
	in, _ := r.m.Get(r.ctx(), "one")
	if in.LayerBytes <= 0 || in.LayerBytes > 1<<20 || in.Template != "tool" {
		t.Errorf("suspended from a template: %+v; want a layer of about the 100 kB changed, not the 8 MiB template", in)
	}
	// The template can go: the suspended sandbox keeps the layer it needs.
	if err := r.m.DeleteTemplate(r.ctx(), "tool"); err != nil {
		t.Fatal(err)
	}
	if ok, _ := r.m.TemplateExists(r.ctx(), "tool"); ok {
		t.Error("the template exists after DeleteTemplate")
	}
	if list, err := r.m.ListTemplates(r.ctx()); err != nil || len(list) != 0 {
		t.Errorf("ListTemplates after DeleteTemplate: %+v %v", list, err)
	}
	if _, err := r.m.Create(r.ctx(), "three", CreateOptions{Template: "tool"}); !errors.Is(err, ErrNoTemplate) || !errors.Is(err, ErrNotFound) {
		t.Errorf("create from a deleted template: %v, want ErrNoTemplate", err)
	}
	if _, err := r.m.Resume(r.ctx(), "one", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
		t.Fatal(err)
	}
	if code, out := r.sh("one", "cat /opt/tool/version; wc -c < /opt/tool/blob; wc -c < /root/mine"); code != 0 || out != "v1\n8388608\n100000\n" {
		t.Errorf("resumed from a delta onto a deleted template: %d %q", code, out)
	}
}

// Fork of a running sandbox runs a copy; fork of a suspended one copies
// its snapshot, which stays.
func TestFork(t *testing.T) {
	for _, mode := range cliModes {
		t.Run(string(mode), func(t *testing.T) { testFork(t, mode) })
	}
}

func testFork(t *testing.T, mode cliMode) {
	r := newManagerRigOn(t, mode, newStore(t, "dir"), nil)
	r.create("src", CreateOptions{})
	r.sh("src", "echo original > /root/f")
	if st, err := r.m.Fork(r.ctx(), "src", "copy", ForkOptions{}); err != nil || st != Running {
		t.Fatalf("fork of a running sandbox: %q %v", st, err)
	}
	r.sh("copy", "echo changed > /root/f")
	if _, out := r.sh("src", "cat /root/f"); out != "original\n" {
		t.Errorf("the source after its fork changed: %q", out)
	}
	if _, err := r.m.Fork(r.ctx(), "src", "copy", ForkOptions{}); !errors.Is(err, ErrExists) {
		t.Errorf("fork onto a taken id: %v", err)
	}
	if err := r.m.Suspend(r.ctx(), "src"); err != nil {
		t.Fatal(err)
	}
	if st, err := r.m.Fork(r.ctx(), "src", "later", ForkOptions{}); err != nil || st != Suspended {
		t.Fatalf("fork of a suspended sandbox: %q %v", st, err)
	}
	for _, id := range []string{"src", "later"} {
		if r.state(id) != Suspended {
			t.Errorf("%s: %q, want suspended", id, r.state(id))
		}
		if _, err := r.m.Resume(r.ctx(), id, ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
			t.Fatal(err)
		}
		if _, out := r.sh(id, "cat /root/f"); out != "original\n" {
			t.Errorf("%s: %q", id, out)
		}
	}
}

// A sandbox with nothing going on is suspended by the service itself.
func TestIdleSuspend(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.IdleSuspend = 200 * time.Millisecond })
	r.create("sleepy", CreateOptions{})
	deadline := time.Now().Add(60 * time.Second)
	for r.state("sleepy") != Suspended {
		if time.Now().After(deadline) {
			t.Fatalf("not suspended after 60s idle (state %q)", r.state("sleepy"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Logged once the suspend is done, a moment after the state shows it.
	for !strings.Contains(r.log.String(), `"reason":"idle"`) {
		if time.Now().After(deadline) {
			t.Fatalf("the idle suspend is not logged as such")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// What keeps a sandbox from being idle: a call in progress, an open port
// connection, egress.
func TestIdleCounts(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	sb := r.create("busy", CreateOptions{})
	later := time.Now().Add(time.Hour)
	if sb.Idle(later) < 59*time.Minute {
		t.Fatalf("a sandbox untouched for an hour: idle %v", sb.Idle(later))
	}
	done := sb.Use()
	if sb.Idle(later) != 0 {
		t.Error("idle while a call is in progress")
	}
	done()
	server := `import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.recv(1)`
	ready := newLineSignal()
	p, err := sb.Spawn(r.ctx(), agent.Cmd{Args: []string{"/usr/bin/python3", "-c", server}, Stdout: ready})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill(context.Background())
	select {
	case <-ready.ch:
	case <-time.After(30 * time.Second):
		t.Fatal("the server inside never became ready")
	}
	conn, err := sb.DialPort(r.ctx(), 7000)
	if err != nil {
		t.Fatal(err)
	}
	if sb.Idle(later) != 0 {
		t.Error("idle while a port connection is open")
	}
	conn.Close()
	if sb.Idle(later) == 0 {
		t.Error("not idle once the port connection closed")
	}
}

// SaveAll saves every running sandbox in parallel; cut short, it saves
// none, corrupts nothing, and the sandboxes run on.
func TestSaveAll(t *testing.T) {
	for _, mode := range cliModes {
		t.Run(string(mode), func(t *testing.T) { testSaveAll(t, mode) })
	}
}

func testSaveAll(t *testing.T, mode cliMode) {
	r := newManagerRigOn(t, mode, newStore(t, "dir"), nil)
	for i := range 3 {
		id := fmt.Sprintf("s%d", i)
		r.create(id, CreateOptions{})
		r.sh(id, "echo "+id+" > /root/who")
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	res := r.m.SaveAll(gone)
	if len(res.Saved) != 0 || len(res.Failed) != 3 {
		t.Fatalf("SaveAll with an ended context: %+v", res)
	}
	for i := range 3 {
		if r.state(fmt.Sprintf("s%d", i)) != Running {
			t.Errorf("s%d not running after a save cut short", i)
		}
	}
	ctx, cancel2 := context.WithTimeout(context.Background(), time.Minute)
	defer cancel2()
	res = r.m.Close(ctx)
	if len(res.Saved) != 3 || len(res.Failed) != 0 {
		t.Fatalf("Close: %+v", res)
	}
	if _, err := r.m.Create(r.ctx(), "late", CreateOptions{}); !errors.Is(err, ErrClosed) {
		t.Errorf("create after Close: %v, want ErrClosed", err)
	}
	m2 := r.open()
	for i := range 3 {
		id := fmt.Sprintf("s%d", i)
		if _, err := m2.Resume(r.ctx(), id, ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
			t.Fatal(err)
		}
	}
	r.m = m2
	if _, out := r.sh("s1", "cat /root/who"); out != "s1\n" {
		t.Errorf("s1 after SaveAll and a new manager: %q", out)
	}
}

// The cap on running sandboxes refuses a create beyond it, with the fix.
func TestCapacity(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.MaxRunning = 1 })
	r.create("only", CreateOptions{})
	if _, err := r.m.Create(r.ctx(), "more", CreateOptions{}); !errors.Is(err, ErrCapacity) || !strings.Contains(err.Error(), "suspend or destroy") {
		t.Errorf("create beyond the cap: %v", err)
	}
	c, err := r.m.Capacity(r.ctx())
	if err != nil || c.Running != 1 || c.MaxRunning != 1 {
		t.Errorf("Capacity = %+v, %v", c, err)
	}
	if err := r.m.Suspend(r.ctx(), "only"); err != nil {
		t.Fatal(err)
	}
	r.create("more", CreateOptions{})
}

func allowAll(t *testing.T) netpolicy.Policy {
	t.Helper()
	p, err := netpolicy.ParsePolicy([]byte(`{"mode":"allow-all"}`))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// A sandbox removed behind the manager's back (by another process, or gone
// with its main process) is reported gone, can be destroyed, and its id
// used again, on both CLIs. On Google's, whose failures all exit 1, the
// launcher learns that it is gone by failing to run anything in it, never
// from a status.
func TestSandboxVanishedBehindTheManager(t *testing.T) {
	for _, mode := range cliModes {
		t.Run(string(mode), func(t *testing.T) { testSandboxVanishedBehindTheManager(t, mode) })
	}
}

func testSandboxVanishedBehindTheManager(t *testing.T, mode cliMode) {
	r := newManagerRigOn(t, mode, newStore(t, "dir"), nil)
	sb := r.create("gone", CreateOptions{})
	if err := r.l.Delete(r.ctx(), "gone"); err != nil {
		t.Fatal(err)
	}
	var err error
	waitFor(t, "operations to report the sandbox gone", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = sb.Run(ctx, agent.Cmd{Args: []string{"true"}})
		// `sandgate sandbox` may catch it stopped on its way out.
		return errors.Is(err, ErrNotFound) || errors.Is(err, ErrNotRunning)
	})
	if err := r.m.Destroy(r.ctx(), "gone"); err != nil {
		t.Fatalf("destroy of a sandbox that vanished: %v", err)
	}
	r.create("gone", CreateOptions{})
	if code, out := r.sh("gone", "echo again"); code != 0 || out != "again\n" {
		t.Errorf("the id used again: %d %q", code, out)
	}
}

// Google's CLI may return from a detached run or fork before the sandbox
// accepts exec (its stand-in does so when asked): create, fork and resume
// wait for it instead of failing.
func TestGoogleCLISlowStart(t *testing.T) {
	r := newManagerRigOn(t, googleCLI, newStore(t, "dir"), nil)
	if err := os.WriteFile(r.egress.state+".slow-start", []byte("300ms"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The stand-in does refuse exec right after a detached run.
	if err := r.l.Create(r.ctx(), "probe", LaunchOptions{}); err != nil {
		t.Fatal(err)
	}
	if !r.l.Gone(r.ctx(), "probe") {
		t.Fatal("exec right after run --detach worked: the slow start is not emulated")
	}
	r.l.Delete(r.ctx(), "probe")
	r.create("slow", CreateOptions{})
	r.sh("slow", "echo kept > /root/f")
	if _, err := r.m.Fork(r.ctx(), "slow", "slow-copy", ForkOptions{}); err != nil {
		t.Fatalf("fork: %v", err)
	}
	if err := r.m.Suspend(r.ctx(), "slow"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.m.Resume(r.ctx(), "slow", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
		t.Fatalf("resume: %v", err)
	}
	for _, id := range []string{"slow", "slow-copy"} {
		if code, out := r.sh(id, "cat /root/f"); code != 0 || out != "kept\n" {
			t.Errorf("%s: %d %q", id, code, out)
		}
	}
}

// ptr returns a pointer to a copy of v.
func ptr[T any](v T) *T { return &v }
