package appliance

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
)

// TestLegacySnapshotAdopted suspends a sandbox the way the reference
// service of protocol 1 does (the CLI's tar of its layer, gzipped, at
// snapshots/<name>.tar.gz) and finds it adopted: suspended, taken for
// create, resumed with its files, saved in sandgate's format at the next
// suspend (the old object removed only then), and removed by destroy.
func TestLegacySnapshotAdopted(t *testing.T) {
	for _, mode := range cliModes {
		t.Run(string(mode), func(t *testing.T) {
			r := newManagerRigOn(t, mode, newStore(t, "dir"), nil)
			putLegacy := func(id, content string) {
				t.Helper()
				if err := r.l.Create(r.ctx(), id, LaunchOptions{}); err != nil {
					t.Fatal(err)
				}
				if _, err := r.l.run(r.ctx(), nil, "exec", id, "--", "/bin/sh", "-c", "mkdir -p /workspace && echo "+content+" > /workspace/f"); err != nil {
					t.Fatal(err)
				}
				file := filepath.Join(t.TempDir(), "layer.tar")
				if err := r.l.Tar(r.ctx(), id, file); err != nil {
					t.Fatal(err)
				}
				if err := r.l.Delete(r.ctx(), id); err != nil {
					t.Fatal(err)
				}
				raw, err := os.ReadFile(file)
				if err != nil {
					t.Fatal(err)
				}
				var gz bytes.Buffer
				zw := gzip.NewWriter(&gz)
				zw.Write(raw)
				zw.Close()
				if _, err := r.st.Put(r.ctx(), legacyKey(id), &gz, store.PutOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			objectExists := func(key string) bool {
				_, err := r.st.Stat(r.ctx(), key)
				return err == nil
			}
			putLegacy("ref", "from-the-reference")
			if st := r.state("ref"); st != Suspended {
				t.Fatalf("a reference service's suspended sandbox: %q, want suspended", st)
			}
			infos, err := r.m.List(r.ctx())
			if err != nil || len(infos) != 1 || infos[0].ID != "ref" || infos[0].State != Suspended {
				t.Errorf("List: %+v, %v", infos, err)
			}
			if _, err := r.m.Create(r.ctx(), "ref", CreateOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); !errors.Is(err, ErrExists) {
				t.Errorf("create while the reference's object exists: %v, want ErrExists (409)", err)
			}
			if _, err := r.m.Resume(r.ctx(), "ref", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
				t.Fatalf("resume: %v", err)
			}
			if _, out := r.sh("ref", "cat /workspace/f"); out != "from-the-reference\n" {
				t.Errorf("after resume: %q", out)
			}
			if !objectExists(legacyKey("ref")) {
				t.Error("the reference's object is gone before sandgate saved the sandbox")
			}
			r.sh("ref", "echo changed >> /workspace/f")
			if err := r.m.Suspend(r.ctx(), "ref"); err != nil {
				t.Fatal(err)
			}
			if objectExists(legacyKey("ref")) {
				t.Error("the reference's object outlived the sandbox's first save in sandgate's format")
			}
			if !objectExists(snapshotRecordKey("ref")) {
				t.Error("no record of sandgate's after the save")
			}
			if _, err := r.m.Resume(r.ctx(), "ref", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
				t.Fatal(err)
			}
			if _, out := r.sh("ref", "cat /workspace/f"); out != "from-the-reference\nchanged\n" {
				t.Errorf("after the second resume: %q", out)
			}
			// Destroy removes a sandbox known only by the reference's object.
			putLegacy("old", "x")
			if st, err := r.m.Fork(r.ctx(), "old", "old-copy", ForkOptions{}); err != nil || st != Suspended {
				t.Errorf("fork of the reference's sandbox: %q, %v", st, err)
			}
			for _, id := range []string{"old", "old-copy"} {
				if err := r.m.Destroy(r.ctx(), id); err != nil {
					t.Fatal(err)
				}
				if objectExists(legacyKey(id)) || r.state(id) != "" {
					t.Errorf("%s: destroy left the reference's object", id)
				}
			}
		})
	}
}

// legacyStore is a store and a way to write an object into it as the
// reference service's deployment did: with the store's own tools, not
// sandgate's Put (no digest, no sandgate metadata).
type legacyStore struct {
	st    store.Store
	write func(t *testing.T, key string, data []byte)
}

func newLegacyStore(t *testing.T, kind string) legacyStore {
	t.Helper()
	switch kind {
	case "dir":
		dir := t.TempDir()
		st, err := store.NewDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		return legacyStore{st: st, write: func(t *testing.T, key string, data []byte) {
			p := filepath.Join(dir, filepath.FromSlash(key))
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, data, 0o644); err != nil {
				t.Fatal(err)
			}
		}}
	case "gcs":
		_, client := gcstest.Start(t, "bucket")
		return legacyStore{st: store.NewGCS(client, "bucket", "svc"), write: func(t *testing.T, key string, data []byte) {
			w := client.Bucket("bucket").Object("svc/" + key).NewWriter(context.Background())
			w.Write(data)
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
		}}
	}
	t.Fatalf("no store %q", kind)
	return legacyStore{}
}

// tarCzf is what `tar czf` makes of a tree holding workspace/f.
func tarCzf(t *testing.T, content string) []byte {
	t.Helper()
	tree := t.TempDir()
	if err := os.MkdirAll(filepath.Join(tree, "workspace"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tree, "workspace", "f"), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "layer.tar.gz")
	if b, err := exec.Command("tar", "czf", out, "-C", tree, ".").CombinedOutput(); err != nil {
		t.Fatalf("tar czf: %v: %s", err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A sandbox the reference service suspended, its snapshot written by
// `tar czf` straight into the store (no digest, no sandgate metadata), is
// adopted in both stores: resumed with its files, forked. A damaged one (a
// truncated gzip, a tar that is not one) is a clear error that changes
// nothing: the sandbox stays suspended on the same bytes, and no record or
// copy is written.
func TestLegacySnapshotWrittenByTar(t *testing.T) {
	for _, mode := range cliModes {
		for _, kind := range []string{"dir", "gcs"} {
			t.Run(string(mode)+"/"+kind, func(t *testing.T) {
				ls := newLegacyStore(t, kind)
				r := newManagerRigOn(t, mode, ls.st, nil)
				good := tarCzf(t, "from-tar")
				ls.write(t, legacyKey("ref"), good)
				if st := r.state("ref"); st != Suspended {
					t.Fatalf("a snapshot written by tar: %q, want suspended", st)
				}
				if _, err := r.m.Resume(r.ctx(), "ref", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
					t.Fatalf("resume: %v", err)
				}
				if _, out := r.sh("ref", "cat /workspace/f"); out != "from-tar" {
					t.Errorf("after resume: %q", out)
				}
				// A fork copies the object once verified (its copy, written
				// by sandgate, resumes as any: TestLegacySnapshotAdopted).
				ls.write(t, legacyKey("src"), good)
				if st, err := r.m.Fork(r.ctx(), "src", "src-copy", ForkOptions{}); err != nil || st != Suspended {
					t.Errorf("fork: %q, %v", st, err)
				}
				if st := r.state("src-copy"); st != Suspended {
					t.Errorf("the fork: %q, want suspended", st)
				}

				// Damaged: refused, nothing changed.
				var badTar bytes.Buffer
				zw := gzip.NewWriter(&badTar)
				zw.Write(bytes.Repeat([]byte("not a tar header "), 64))
				zw.Close()
				for id, data := range map[string][]byte{"truncated": good[:len(good)-12], "badtar": badTar.Bytes()} {
					ls.write(t, legacyKey(id), data)
					for range 2 {
						_, err := r.m.Resume(r.ctx(), id, ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}})
						if !errors.Is(err, snapshot.ErrDigestMismatch) || !strings.Contains(err.Error(), "damaged") || !strings.Contains(err.Error(), "nothing was changed") {
							t.Errorf("resume of a %s snapshot: %v, want the damage named", id, err)
						}
						if st := r.state(id); st != Suspended {
							t.Errorf("after a failed resume, %s is %q, want suspended", id, st)
						}
					}
					if _, err := r.m.Fork(r.ctx(), id, id+"-copy", ForkOptions{}); !errors.Is(err, snapshot.ErrDigestMismatch) {
						t.Errorf("fork of a %s snapshot: %v, want the damage named", id, err)
					}
					rc, err := ls.st.Get(r.ctx(), legacyKey(id))
					if err != nil {
						t.Fatal(err)
					}
					got, _ := io.ReadAll(store.AcceptUnrecorded(rc))
					rc.Close()
					if !bytes.Equal(got, data) {
						t.Errorf("%s: the object changed", id)
					}
					for _, key := range []string{snapshotRecordKey(id), legacyKey(id + "-copy"), snapshotRecordKey(id + "-copy")} {
						if _, err := ls.st.Stat(r.ctx(), key); !errors.Is(err, store.ErrNotFound) {
							t.Errorf("%s: %s was written (%v)", id, key, err)
						}
					}
				}
			})
		}
	}
}
