package store_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fsouza/fake-gcs-server/fakestorage"
	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/snapshot/store"
)

// harness is one store under test plus a way to damage an object behind
// its back.
type harness struct {
	s       store.Store
	corrupt func(t *testing.T, name string, data []byte) // replace content, keep recorded digest
	scan    func(t *testing.T) []string                  // every raw name in the backing storage
}

func dirHarness(t *testing.T) harness {
	dir := t.TempDir()
	s, err := store.NewDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return harness{
		s: s,
		corrupt: func(t *testing.T, name string, data []byte) {
			// Overwrite in place: the digest xattr stays.
			f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_TRUNC, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.Write(data)
			f.Close()
		},
		scan: func(t *testing.T) []string {
			var out []string
			filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
				if err == nil && !info.IsDir() {
					rel, _ := filepath.Rel(dir, p)
					out = append(out, rel)
				}
				return nil
			})
			return out
		},
	}
}

func gcsHarness(t *testing.T) harness {
	srv, client := gcstest.Start(t, "layers")
	s := store.NewGCS(client, "layers", "pfx")
	return harness{
		s: s,
		corrupt: func(t *testing.T, name string, data []byte) {
			obj, err := srv.GetObject("layers", "pfx/"+name)
			if err != nil {
				t.Fatal(err)
			}
			srv.CreateObject(fakestorage.Object{
				ObjectAttrs: fakestorage.ObjectAttrs{BucketName: "layers", Name: "pfx/" + name, Metadata: obj.Metadata},
				Content:     data,
			})
		},
		scan: func(t *testing.T) []string {
			objs, _, err := srv.ListObjectsWithOptions("layers", fakestorage.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			for _, o := range objs {
				out = append(out, o.Name)
			}
			return out
		},
	}
}

func TestDir(t *testing.T) { runContract(t, dirHarness) }
func TestGCS(t *testing.T) { runContract(t, gcsHarness) }

// failingReader yields n bytes then fails, like a pack that died midway.
type failingReader struct{ n int }

var errBoom = errors.New("source died")

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errBoom
	}
	k := min(len(p), f.n)
	for i := range p[:k] {
		p[i] = 'z'
	}
	f.n -= k
	return k, nil
}

func readAll(t *testing.T, s store.Store, name string) ([]byte, error) {
	t.Helper()
	rc, err := s.Get(context.Background(), name)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

func runContract(t *testing.T, mk func(t *testing.T) harness) {
	ctx := context.Background()
	payload := bytes.Repeat([]byte("layer bytes "), 300_000) // ~3.6 MB

	t.Run("PutGetStatListDelete", func(t *testing.T) {
		h := mk(t)
		info, err := h.s.Put(ctx, "snapshots/a.tar.zst", bytes.NewReader(payload), store.PutOptions{IfNotExist: true})
		if err != nil {
			t.Fatal(err)
		}
		if info.Size != int64(len(payload)) || !strings.HasPrefix(info.Digest, "sha256:") {
			t.Fatalf("info %+v", info)
		}
		got, err := readAll(t, h.s, "snapshots/a.tar.zst")
		if err != nil || !bytes.Equal(got, payload) {
			t.Fatalf("get: %v (%d bytes)", err, len(got))
		}
		h.s.Put(ctx, "templates/img/d1.tar.zst", strings.NewReader("t"), store.PutOptions{})
		list, err := h.s.List(ctx, "snapshots/")
		if err != nil || len(list) != 1 || list[0].Name != "snapshots/a.tar.zst" {
			t.Fatalf("list snapshots/: %v %+v", err, list)
		}
		all, _ := h.s.List(ctx, "")
		if len(all) != 2 {
			t.Fatalf("list all: %+v", all)
		}
		if err := h.s.Delete(ctx, "snapshots/a.tar.zst"); err != nil {
			t.Fatal(err)
		}
		if _, err := h.s.Stat(ctx, "snapshots/a.tar.zst"); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("stat after delete: %v, want ErrNotFound", err)
		}
		if err := h.s.Delete(ctx, "snapshots/a.tar.zst"); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("second delete: %v, want ErrNotFound", err)
		}
		if _, err := h.s.Get(ctx, "nope"); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("get missing: %v, want ErrNotFound", err)
		}
	})

	t.Run("ConflictingPutIsTyped", func(t *testing.T) {
		h := mk(t)
		if _, err := h.s.Put(ctx, "x", strings.NewReader("first"), store.PutOptions{IfNotExist: true}); err != nil {
			t.Fatal(err)
		}
		_, err := h.s.Put(ctx, "x", strings.NewReader("second"), store.PutOptions{IfNotExist: true})
		if !errors.Is(err, store.ErrPreconditionFailed) {
			t.Fatalf("got %v, want ErrPreconditionFailed", err)
		}
		if got, _ := readAll(t, h.s, "x"); string(got) != "first" {
			t.Fatalf("object is %q after refused put", got)
		}
		if _, err := h.s.Put(ctx, "x", strings.NewReader("replaced"), store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		if got, err := readAll(t, h.s, "x"); err != nil || string(got) != "replaced" {
			t.Fatalf("after replace: %q %v", got, err)
		}
	})

	t.Run("GenerationsAndConditionalChanges", func(t *testing.T) {
		h := mk(t)
		first, err := h.s.Put(ctx, "leases/a.json", strings.NewReader("one"), store.PutOptions{IfNotExist: true})
		if err != nil || first.Generation == 0 {
			t.Fatalf("put: %+v %v, want a generation", first, err)
		}
		b, in, err := h.s.Read(ctx, "leases/a.json", 1<<10)
		if err != nil || string(b) != "one" || in.Generation != first.Generation {
			t.Fatalf("read: %q %+v %v, want generation %d", b, in, err, first.Generation)
		}
		if _, _, err := h.s.Read(ctx, "leases/a.json", 2); err == nil {
			t.Errorf("read of 3 bytes with max 2: no error")
		}
		second, err := h.s.Put(ctx, "leases/a.json", strings.NewReader("two"), store.PutOptions{IfGenerationMatch: first.Generation})
		if err != nil || second.Generation == first.Generation || second.Generation == 0 {
			t.Fatalf("compare-and-swap: %+v %v", second, err)
		}
		// The generation it replaced is gone: a second writer that read it
		// is refused, and changes nothing.
		if _, err := h.s.Put(ctx, "leases/a.json", strings.NewReader("stale"), store.PutOptions{IfGenerationMatch: first.Generation}); !errors.Is(err, store.ErrPreconditionFailed) {
			t.Fatalf("stale compare-and-swap: %v, want ErrPreconditionFailed", err)
		}
		if err := h.s.DeleteIf(ctx, "leases/a.json", first.Generation); !errors.Is(err, store.ErrPreconditionFailed) {
			t.Fatalf("stale conditional delete: %v, want ErrPreconditionFailed", err)
		}
		if b, _, _ := h.s.Read(ctx, "leases/a.json", 1<<10); string(b) != "two" {
			t.Fatalf("after refused changes: %q", b)
		}
		if _, err := h.s.Put(ctx, "leases/none.json", strings.NewReader("x"), store.PutOptions{IfGenerationMatch: 1}); !errors.Is(err, store.ErrPreconditionFailed) {
			t.Fatalf("compare-and-swap of a missing object: %v, want ErrPreconditionFailed", err)
		}
		if err := h.s.DeleteIf(ctx, "leases/a.json", second.Generation); err != nil {
			t.Fatal(err)
		}
		if err := h.s.DeleteIf(ctx, "leases/a.json", second.Generation); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("conditional delete of a missing object: %v, want ErrNotFound", err)
		}
	})

	t.Run("CompareAndSwapLosesNoUpdate", func(t *testing.T) {
		// Writers incrementing one counter by read → compare-and-swap:
		// every increment lands exactly once.
		h := mk(t)
		if _, err := h.s.Put(ctx, "counter", strings.NewReader("0"), store.PutOptions{IfNotExist: true}); err != nil {
			t.Fatal(err)
		}
		const writers, each = 4, 10
		errs := make(chan error, writers)
		for range writers {
			go func() {
				for range each {
					ok := false
					for try := 0; try < 1000 && !ok; try++ {
						b, in, err := h.s.Read(ctx, "counter", 64)
						if err != nil {
							errs <- err
							return
						}
						n, _ := strconv.Atoi(string(b))
						_, err = h.s.Put(ctx, "counter", strings.NewReader(strconv.Itoa(n+1)), store.PutOptions{IfGenerationMatch: in.Generation})
						switch {
						case err == nil:
							ok = true
						case !errors.Is(err, store.ErrPreconditionFailed):
							errs <- err
							return
						}
					}
					if !ok {
						errs <- errors.New("an increment lost 1000 races in a row")
						return
					}
				}
				errs <- nil
			}()
		}
		for range writers {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		if b, _, err := h.s.Read(ctx, "counter", 64); err != nil || string(b) != strconv.Itoa(writers*each) {
			t.Fatalf("counter %q (%v), want %d", b, err, writers*each)
		}
	})

	t.Run("RacingIfNotExistPutsOneWins", func(t *testing.T) {
		// The first put is past any early check when the second lands;
		// only the atomic create (link / DoesNotExist) can refuse it.
		h := mk(t)
		gate, started := make(chan struct{}), make(chan struct{})
		done := make(chan error, 1)
		go func() {
			first := true
			r := readerFunc(func(p []byte) (int, error) {
				if first {
					first = false
					close(started)
					return copy(p, "slow "), nil
				}
				<-gate
				return 0, io.EOF
			})
			_, err := h.s.Put(ctx, "race", r, store.PutOptions{IfNotExist: true})
			done <- err
		}()
		<-started
		if _, err := h.s.Put(ctx, "race", strings.NewReader("fast"), store.PutOptions{IfNotExist: true}); err != nil {
			t.Fatal(err)
		}
		close(gate)
		if err := <-done; !errors.Is(err, store.ErrPreconditionFailed) {
			t.Fatalf("losing put: %v, want ErrPreconditionFailed", err)
		}
		if got, _ := readAll(t, h.s, "race"); string(got) != "fast" {
			t.Fatalf("object is %q, want the winner's", got)
		}
	})

	t.Run("InterruptedPutLeavesNothingVisible", func(t *testing.T) {
		h := mk(t)
		_, err := h.s.Put(ctx, "snapshots/new.tar.zst", &failingReader{n: 3 << 20}, store.PutOptions{IfNotExist: true})
		if !errors.Is(err, errBoom) {
			t.Fatalf("got %v, want the source's error", err)
		}
		if _, err := h.s.Stat(ctx, "snapshots/new.tar.zst"); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("stat: %v, want ErrNotFound", err)
		}
		if list, _ := h.s.List(ctx, ""); len(list) != 0 {
			t.Fatalf("list shows %+v", list)
		}
		if raw := h.scan(t); len(raw) != 0 {
			t.Fatalf("backing storage holds %v", raw)
		}
	})

	t.Run("InterruptedReplaceKeepsOld", func(t *testing.T) {
		h := mk(t)
		h.s.Put(ctx, "o", strings.NewReader("old"), store.PutOptions{})
		cctx, cancel := context.WithCancel(ctx)
		r := io.MultiReader(strings.NewReader("new new new"), readerFunc(func([]byte) (int, error) {
			cancel()
			return 0, context.Canceled
		}))
		if _, err := h.s.Put(cctx, "o", r, store.PutOptions{}); err == nil {
			t.Fatal("put succeeded")
		}
		if got, err := readAll(t, h.s, "o"); err != nil || string(got) != "old" {
			t.Fatalf("got %q %v, want the old object", got, err)
		}
	})

	t.Run("CorruptedObjectFailsDigest", func(t *testing.T) {
		h := mk(t)
		if _, err := h.s.Put(ctx, "c", bytes.NewReader(payload), store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		bad := bytes.Clone(payload)
		bad[len(bad)/2] ^= 0xff
		h.corrupt(t, "c", bad)
		_, err := readAll(t, h.s, "c")
		if !errors.Is(err, store.ErrDigestMismatch) {
			t.Fatalf("read corrupted object: %v, want ErrDigestMismatch", err)
		}
		h.corrupt(t, "c", payload[:100])
		if _, err := readAll(t, h.s, "c"); !errors.Is(err, store.ErrDigestMismatch) {
			t.Fatalf("read truncated object: %v, want ErrDigestMismatch", err)
		}
	})

	t.Run("CallerDigestIsRecordedAndChecked", func(t *testing.T) {
		h := mk(t)
		good := "sha256:a40e4c6ee0b2bdfff6350d42ec04e8a1fb8b1c9b2c2a6b08e4ac6ef5e4f30bc2"
		info, err := h.s.Put(ctx, "d", strings.NewReader("payload"), store.PutOptions{Digest: func() string { return good }})
		if err != nil || info.Digest != good {
			t.Fatalf("put: %+v %v", info, err)
		}
		// The digest above is not that of "payload": Get must say so.
		if _, err := readAll(t, h.s, "d"); !errors.Is(err, store.ErrDigestMismatch) {
			t.Fatalf("read with a wrong caller digest: %v, want ErrDigestMismatch", err)
		}
	})

	t.Run("BadNames", func(t *testing.T) {
		h := mk(t)
		for _, n := range []string{"", "/abs", "a/../b", "a//b", ".hidden", "a/.tmp-x", "dir/"} {
			if _, err := h.s.Put(ctx, n, strings.NewReader("x"), store.PutOptions{}); !errors.Is(err, store.ErrBadName) {
				t.Errorf("put %q: %v, want ErrBadName", n, err)
			}
		}
	})
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }

// TestDirCrashLeftovers simulates a crash after the temporary file was
// written but before the rename: the leftover is invisible.
func TestDirCrashLeftovers(t *testing.T) {
	dir := t.TempDir()
	s, err := store.NewDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	os.MkdirAll(filepath.Join(dir, "snapshots"), 0o755)
	os.WriteFile(filepath.Join(dir, "snapshots", ".tmp-a.tar.zst-0123"), []byte("half"), 0o644)
	if list, _ := s.List(context.Background(), ""); len(list) != 0 {
		t.Fatalf("list shows %+v", list)
	}
	if _, err := s.Stat(context.Background(), "snapshots/a.tar.zst"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("stat: %v", err)
	}
}

// A crashed put's temporary file is removed once it is old enough; a
// recent one (a put that may still be running) and every object stay.
func TestDirRemoveStale(t *testing.T) {
	dir := t.TempDir()
	s, err := store.NewDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if _, err := s.Put(ctx, "snapshots/kept.tar.zst", strings.NewReader("object"), store.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	old := filepath.Join(dir, "snapshots", ".tmp-a.tar.zst-0123")
	fresh := filepath.Join(dir, "snapshots", ".tmp-b.tar.zst-4567")
	os.WriteFile(old, []byte("half a layer"), 0o644)
	os.WriteFile(fresh, []byte("being written"), 0o644)
	hourAgo := time.Now().Add(-2 * time.Hour)
	if err := os.Chtimes(old, hourAgo, hourAgo); err != nil {
		t.Fatal(err)
	}
	files, size, err := s.RemoveStale(ctx, time.Hour)
	if err != nil || files != 1 || size != int64(len("half a layer")) {
		t.Fatalf("RemoveStale = %d files, %d bytes, %v; want 1 file of %d bytes", files, size, err, len("half a layer"))
	}
	if _, err := os.Stat(old); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the stale temporary file is still there: %v", err)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Errorf("the recent temporary file was removed: %v", err)
	}
	if _, err := s.Stat(ctx, "snapshots/kept.tar.zst"); err != nil {
		t.Errorf("the object: %v", err)
	}
}

func TestOpenLocations(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	for _, loc := range []string{"file://" + dir + "/st", "file://localhost" + dir + "/st2", dir + "/st3"} {
		s, err := store.Open(ctx, loc)
		if err != nil {
			t.Fatalf("Open(%q): %v", loc, err)
		}
		s.Close()
		if _, ok := s.(*store.Dir); !ok {
			t.Fatalf("Open(%q) opened %T", loc, s)
		}
	}
	for _, bad := range []string{"http://x/y", "gs:///nobucket", "file://host/path", "::", "relative/dir", ""} {
		if _, err := store.Open(ctx, bad); !errors.Is(err, store.ErrBadLocation) {
			t.Errorf("Open(%q): %v, want ErrBadLocation", bad, err)
		}
	}
	t.Chdir(dir)
	for loc, want := range map[string]string{"layer.tar.zst": "layer.tar.zst", "sub/l.tar.zst": "l.tar.zst", "file://" + dir + "/o/l.tar.gz": "l.tar.gz"} {
		s, name, err := store.OpenObject(ctx, loc)
		if err != nil || name != want {
			t.Fatalf("OpenObject(%q) = %q, %v; want %q", loc, name, err, want)
		}
		s.Close()
	}
	for _, bad := range []string{"", "/", "dir/.hidden", "gs://b", "gs://b/", "gs://b/a/../c", "ftp://h/x"} {
		if _, _, err := store.OpenObject(ctx, bad); !errors.Is(err, store.ErrBadLocation) && !errors.Is(err, store.ErrBadName) {
			t.Errorf("OpenObject(%q): %v, want a bad location or name", bad, err)
		}
	}
	t.Setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:1") // no credentials needed; nothing is dialed
	s, name, err := store.OpenObject(ctx, "gs://bucket/snapshots/a.tar.zst")
	if err != nil || name != "snapshots/a.tar.zst" {
		t.Fatalf("OpenObject(gs) = %q, %v", name, err)
	}
	s.Close()
	if _, ok := s.(*store.GCS); !ok {
		t.Fatalf("gs location opened %T", s)
	}
}

// Two Dir stores over one directory (two processes sharing it) still
// change an object atomically: the lock is the directory's, not the
// process's.
func TestDirCompareAndSwapAcrossOpens(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	var stores [2]*store.Dir
	for i := range stores {
		s, err := store.NewDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		stores[i] = s
	}
	in, err := stores[0].Put(ctx, "lease", strings.NewReader("a"), store.PutOptions{IfNotExist: true})
	if err != nil {
		t.Fatal(err)
	}
	// Both read the same generation; exactly one swap wins.
	results := make(chan error, 2)
	for i := range stores {
		go func() {
			_, err := stores[i].Put(ctx, "lease", strings.NewReader(strconv.Itoa(i)), store.PutOptions{IfGenerationMatch: in.Generation})
			results <- err
		}()
	}
	won := 0
	for range stores {
		switch err := <-results; {
		case err == nil:
			won++
		case !errors.Is(err, store.ErrPreconditionFailed):
			t.Fatal(err)
		}
	}
	if won != 1 {
		t.Fatalf("%d swaps of one generation won, want 1", won)
	}
	if list, _ := stores[1].List(ctx, ""); len(list) != 1 {
		t.Errorf("the lock file shows in List: %+v", list)
	}
}
