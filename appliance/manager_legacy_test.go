package appliance

import (
	"bytes"
	"compress/gzip"
	"errors"
	"os"
	"path/filepath"
	"testing"

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
