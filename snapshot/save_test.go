package snapshot

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/snapshot/store"
)

// stores runs fn against a directory store and a Cloud Storage store (the
// emulator on loopback, its real JSON API).
func stores(t *testing.T, fn func(t *testing.T, st store.Store)) {
	t.Run("dir", func(t *testing.T) {
		st, err := store.NewDir(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		fn(t, st)
	})
	t.Run("gcs", func(t *testing.T) {
		_, client := gcstest.Start(t, "layers")
		st := store.NewGCS(client, "layers", "pfx")
		t.Cleanup(func() { st.Close() })
		fn(t, st)
	})
}

// loadInto applies the layer saved under key onto dir.
func loadInto(t *testing.T, st store.Store, key, dir string) *Manifest {
	t.Helper()
	l, err := Load(context.Background(), st, key)
	if err != nil {
		t.Fatalf("load %s: %v", key, err)
	}
	defer l.Close()
	res, err := l.Apply(context.Background(), dir, ApplyOptions{})
	if err != nil {
		t.Fatalf("apply %s: %v", key, err)
	}
	if res.Digest != l.Manifest.Digest || res.TarDigest != l.Manifest.TarDigest || res.Entries != l.Manifest.Entries {
		t.Fatalf("applied %+v, manifest %+v", res, l.Manifest)
	}
	return l.Manifest
}

// TestSaveLoad saves a directory (a template), a sandbox's tar stream in
// full and as a delta against the template, and loads each back, verified,
// in both stores.
func TestSaveLoad(t *testing.T) {
	stores(t, func(t *testing.T, st store.Store) {
		ctx := context.Background()
		base := mkdir(t, filepath.Join(t.TempDir(), "base"))
		genTree(t, base, 7, genOptions{MaxFiles: 80})
		const tmplKey = "templates/ns1/t1.tar.zst"
		tm, err := Save(ctx, DirSource(base), st, tmplKey, SaveOptions{PackOptions: PackOptions{Index: true, ImageID: "img-1"}})
		if err != nil {
			t.Fatal(err)
		}
		if tm.Compression != Zstd || tm.ImageID != "img-1" || len(tm.Files) == 0 || tm.Base != "" {
			t.Fatalf("template manifest %+v", tm)
		}
		info, err := st.Stat(ctx, tmplKey)
		if err != nil || info.Size != tm.Size || info.Digest != tm.Digest {
			t.Fatalf("stored %+v, %v; manifest %s %d", info, err, tm.Digest, tm.Size)
		}
		got := filepath.Join(t.TempDir(), "got")
		loadInto(t, st, tmplKey, got)
		compareTrees(t, base, got)

		// A sandbox made from the template changes it; its CLI's `tar`
		// writes the whole upper as a bare tar stream.
		changed := filepath.Join(t.TempDir(), "changed")
		loadInto(t, st, tmplKey, changed)
		mutate(t, changed, false)
		var bare bytes.Buffer
		if _, err := Pack(ctx, changed, &bare, PackOptions{Compression: None}); err != nil {
			t.Fatal(err)
		}

		// Full: the stream re-encoded as a zstd layer.
		fm, err := Save(ctx, StreamSource(bytes.NewReader(bare.Bytes())), st, "snapshots/s1.tar.zst",
			SaveOptions{PackOptions: PackOptions{Parent: tm.Digest, ImageID: "img-1", SandboxID: "s1"}})
		if err != nil {
			t.Fatal(err)
		}
		if fm.Compression != Zstd || fm.Base != "" || fm.Parent != tm.Digest || fm.SandboxID != "s1" || fm.Size >= int64(bare.Len()) {
			t.Fatalf("full manifest %+v (bare tar %d bytes)", fm, bare.Len())
		}
		full := filepath.Join(t.TempDir(), "full")
		loadInto(t, st, "snapshots/s1.tar.zst", full)
		compareTrees(t, changed, full)

		// Delta against the template's manifest as stored.
		baseM, err := ReadStoredManifest(ctx, st, ManifestName(tmplKey))
		if err != nil {
			t.Fatal(err)
		}
		dm, err := Save(ctx, StreamSource(bytes.NewReader(bare.Bytes())), st, "snapshots/s2.tar.zst",
			SaveOptions{PackOptions: PackOptions{Base: baseM, Parent: tm.Digest, SandboxID: "s2"}})
		if err != nil {
			t.Fatal(err)
		}
		if dm.Base != tm.Digest || dm.Compression != Zstd || dm.Entries >= fm.Entries {
			t.Fatalf("delta manifest %+v, full had %d entries", dm, fm.Entries)
		}
		onto := filepath.Join(t.TempDir(), "onto")
		loadInto(t, st, tmplKey, onto)
		loadInto(t, st, "snapshots/s2.tar.zst", onto)
		compareTrees(t, changed, onto)

		// Folded into one layer, as Google's CLI needs (it imports one tar).
		bl, err := Load(ctx, st, tmplKey)
		if err != nil {
			t.Fatal(err)
		}
		defer bl.Close()
		dl, err := Load(ctx, st, "snapshots/s2.tar.zst")
		if err != nil {
			t.Fatal(err)
		}
		defer dl.Close()
		var merged bytes.Buffer
		if _, err := MergeLayers(ctx, bl, dl, &merged, MergeOptions{}); err != nil {
			t.Fatal(err)
		}
		folded := filepath.Join(t.TempDir(), "folded")
		if _, err := Unpack(ctx, &merged, folded, ApplyOptions{}); err != nil {
			t.Fatal(err)
		}
		compareTrees(t, changed, folded)

		// NoClobber refuses an existing key and changes nothing.
		if _, err := Save(ctx, DirSource(changed), st, tmplKey, SaveOptions{NoClobber: true}); !errors.Is(err, store.ErrPreconditionFailed) {
			t.Fatalf("NoClobber over an existing key: %v", err)
		}
		again := filepath.Join(t.TempDir(), "again")
		if m := loadInto(t, st, tmplKey, again); m.Digest != tm.Digest {
			t.Fatalf("template changed under NoClobber: %s, was %s", m.Digest, tm.Digest)
		}
	})
}

// failingReader yields n bytes of r, then fails: a source cut short.
type failingReader struct {
	r io.Reader
	n int
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("source cut short")
	}
	if len(p) > f.n {
		p = p[:f.n]
	}
	n, err := f.r.Read(p)
	f.n -= n
	return n, err
}

// crashBeforeManifest is a store whose process "dies" between a layer and
// its manifest: every manifest put fails, having written nothing.
type crashBeforeManifest struct{ store.Store }

func (c crashBeforeManifest) Put(ctx context.Context, name string, r io.Reader, opts store.PutOptions) (store.Info, error) {
	if strings.HasSuffix(name, ".manifest.json") {
		return store.Info{}, errors.New("crashed before writing the manifest")
	}
	return c.Store.Put(ctx, name, r, opts)
}

// TestInterruptedSaveLeavesNothingTrusted: whenever a save is cut short —
// its source fails, or it stops between the layer and its manifest — no
// Load trusts what it left: it finds the previous layer intact, or refuses.
func TestInterruptedSaveLeavesNothingTrusted(t *testing.T) {
	stores(t, func(t *testing.T, st store.Store) {
		ctx := context.Background()
		a := mkdir(t, filepath.Join(t.TempDir(), "a"))
		genTree(t, a, 3, genOptions{MaxFiles: 40})
		b := mkdir(t, filepath.Join(t.TempDir(), "b"))
		genTree(t, b, 4, genOptions{MaxFiles: 40})
		var bareB bytes.Buffer
		if _, err := Pack(ctx, b, &bareB, PackOptions{Compression: None}); err != nil {
			t.Fatal(err)
		}
		cut := func() Source {
			return StreamSource(&failingReader{r: bytes.NewReader(bareB.Bytes()), n: bareB.Len() / 2})
		}
		mustNotLoad := func(key string, want error) {
			t.Helper()
			l, err := Load(ctx, st, key)
			if err == nil {
				_, err = l.Apply(ctx, filepath.Join(t.TempDir(), "x"), ApplyOptions{})
				l.Close()
			}
			if !errors.Is(err, want) {
				t.Fatalf("load %s: %v, want %v", key, err, want)
			}
		}

		// A fresh key: nothing is left at all.
		if _, err := Save(ctx, cut(), st, "snapshots/fresh.tar.zst", SaveOptions{}); err == nil {
			t.Fatal("a save whose source failed succeeded")
		}
		if list, err := st.List(ctx, "snapshots/fresh"); err != nil || len(list) != 0 {
			t.Fatalf("a failed save left %+v (%v)", list, err)
		}
		mustNotLoad("snapshots/fresh.tar.zst", store.ErrNotFound)

		// Over a saved layer: the previous layer and manifest stay, whole.
		const key = "snapshots/s.tar.zst"
		am, err := Save(ctx, DirSource(a), st, key, SaveOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Save(ctx, cut(), st, key, SaveOptions{}); err == nil {
			t.Fatal("a save whose source failed succeeded")
		}
		got := filepath.Join(t.TempDir(), "got")
		if m := loadInto(t, st, key, got); m.Digest != am.Digest {
			t.Fatalf("after a failed save the key holds %s, want %s", m.Digest, am.Digest)
		}
		compareTrees(t, a, got)

		// Stopped between the layer and its manifest: the new layer beside
		// the previous manifest is refused before a byte is applied.
		if _, err := Save(ctx, DirSource(b), crashBeforeManifest{st}, key, SaveOptions{}); err == nil {
			t.Fatal("the save reported success without its manifest")
		}
		mustNotLoad(key, ErrDigestMismatch)
		// ... and on a fresh key the layer has no manifest: not a layer.
		if _, err := Save(ctx, DirSource(b), crashBeforeManifest{st}, "snapshots/new.tar.zst", SaveOptions{}); err == nil {
			t.Fatal("the save reported success without its manifest")
		}
		mustNotLoad("snapshots/new.tar.zst", store.ErrNotFound)

		// The other way round: a manifest beside a layer it does not
		// describe (another save's, written over it).
		bm, err := Save(ctx, DirSource(b), st, "snapshots/b.tar.zst", SaveOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Save(ctx, DirSource(a), st, key, SaveOptions{}); err != nil {
			t.Fatal(err)
		}
		var mb bytes.Buffer
		bm.WriteTo(&mb)
		if _, err := st.Put(ctx, ManifestName(key), &mb, store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		mustNotLoad(key, ErrDigestMismatch)
	})
}

// TestLoadRefusesDamage: a layer damaged behind the store's back — cut
// short, or the same size with other bytes — is refused, and nothing of it
// is applied.
func TestLoadRefusesDamage(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, err := store.NewDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	src := mkdir(t, filepath.Join(t.TempDir(), "src"))
	genTree(t, src, 9, genOptions{MaxFiles: 30})
	for i, damage := range []func(b []byte) []byte{
		func(b []byte) []byte { return b[:len(b)-100] },
		func(b []byte) []byte { b[len(b)/2] ^= 0xff; return b },
	} {
		key := fmt.Sprintf("snapshots/d%d.tar.zst", i)
		if _, err := Save(ctx, DirSource(src), st, key, SaveOptions{}); err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, key)
		b, _ := os.ReadFile(p)
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_TRUNC, 0) // in place: the recorded digest stays
		if err != nil {
			t.Fatal(err)
		}
		f.Write(damage(b))
		f.Close()
		into := filepath.Join(t.TempDir(), "into")
		l, err := Load(ctx, st, key)
		if err == nil {
			_, err = l.Apply(ctx, into, ApplyOptions{})
			l.Close()
		}
		if !errors.Is(err, ErrDigestMismatch) {
			t.Fatalf("damage %d: %v, want a digest mismatch", i, err)
		}
		if _, err := os.Stat(into); err == nil {
			t.Fatalf("damage %d: a refused layer left its target", i)
		}
	}
}

// TestSaveRefusesBadInput: bad keys and sources change nothing.
func TestSaveRefusesBadInput(t *testing.T) {
	ctx := context.Background()
	st, err := store.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, tc := range []struct {
		src Source
		key string
	}{
		{Source{}, "snapshots/a.tar.zst"},
		{DirSource(filepath.Join(t.TempDir(), "missing")), "snapshots/a.tar.zst"},
		{DirSource(t.TempDir()), "../a.tar.zst"},
		{DirSource(t.TempDir()), ""},
	} {
		if _, err := Save(ctx, tc.src, st, tc.key, SaveOptions{}); err == nil {
			t.Errorf("Save(%v, %q) succeeded", tc.src, tc.key)
		}
	}
	if list, _ := st.List(ctx, ""); len(list) != 0 {
		t.Fatalf("refused saves left %+v", list)
	}
	for _, bad := range []string{"", "md5:abc", "sha256:xyz", strings.Repeat("a", 63)} {
		if _, err := ParseDigest(bad); err == nil {
			t.Errorf("ParseDigest(%q) succeeded", bad)
		}
	}
	d := strings.Repeat("Ab", 32)
	if got, err := ParseDigest(d); err != nil || got != "sha256:"+strings.ToLower(d) {
		t.Errorf("ParseDigest(%q) = %q, %v", d, got, err)
	}
}
