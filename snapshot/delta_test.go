package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// mutate changes a copy of a generated tree the way a session would:
// edits, additions, deletions, a directory replaced by a file, a new
// hardlink to an unchanged file, a mode change and, for uppers, a new
// whiteout and a newly opaque directory.
func mutate(t *testing.T, dir string, upper bool) {
	t.Helper()
	var files, dirs []string
	filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil || p == dir {
			return nil
		}
		switch {
		case info.Mode().IsRegular():
			files = append(files, p)
		case info.IsDir():
			dirs = append(dirs, p)
		}
		return nil
	})
	slices.Sort(files)
	slices.Sort(dirs)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(files) < 12 || len(dirs) < 3 {
		t.Fatalf("generated tree too small: %d files %d dirs", len(files), len(dirs))
	}
	for i, f := range files {
		switch i % 9 {
		case 1:
			must(os.Chmod(f, 0o644)) // writable for non-root runs too
			fh, err := os.OpenFile(f, os.O_APPEND|os.O_WRONLY, 0)
			must(err)
			fh.WriteString("changed")
			fh.Close()
		case 4:
			os.Remove(f)
		case 7:
			must(os.Chmod(f, 0o600))
		}
	}
	must(os.RemoveAll(dirs[0]))
	victim := dirs[len(dirs)-1]
	if _, err := os.Lstat(victim); err == nil {
		must(os.RemoveAll(victim))
		must(os.WriteFile(victim, []byte("was a directory"), 0o644))
	}
	must(os.MkdirAll(filepath.Join(dir, "new", "deep", "日本"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "new", "deep", "日本", "f"), []byte("new file"), 0o644))
	for _, f := range files {
		if _, err := os.Lstat(f); err == nil && !strings.Contains(f, "L") {
			must(os.Link(f, filepath.Join(dir, "new", "link-to-unchanged")))
			break
		}
	}
	if upper {
		must(unix.Mknod(filepath.Join(dir, "new", "gone-from-image"), unix.S_IFCHR, 0))
		for _, d := range dirs[1:] {
			if _, err := os.Lstat(d); err == nil {
				must(unix.Setxattr(d, xattrOpaque, []byte("y"), 0))
				break
			}
		}
	}
}

// TestDeltaAndMerge checks that a delta against a base, applied onto the
// base tree, and the base merged with the delta into one layer, both give
// the changed tree exactly; and that the delta is smaller than a full pack.
func TestDeltaAndMerge(t *testing.T) {
	for _, upper := range []bool{false, true} {
		name, mode := "tree", ModeTree
		if upper {
			name, mode = "upper", ModeUpper
		}
		t.Run(name, func(t *testing.T) {
			if upper {
				skipUnlessRoot(t)
			}
			ctx := context.Background()
			for seed := uint64(1); seed <= 5; seed++ {
				base := filepath.Join(t.TempDir(), "base")
				genTree(t, mkdir(t, base), seed, genOptions{MaxFiles: 120, Whiteouts: upper})
				baseLayer, baseM := packDir(t, base, PackOptions{Index: true})
				if len(baseM.Files) == 0 {
					t.Fatal("no index in base manifest")
				}
				changed := filepath.Join(t.TempDir(), "changed")
				if _, err := Unpack(ctx, bytes.NewReader(baseLayer), changed, ApplyOptions{Mode: mode}); err != nil {
					t.Fatal(err)
				}
				mutate(t, changed, upper)
				full, fullM := packDir(t, changed, PackOptions{})
				delta, deltaM := packDir(t, changed, PackOptions{Base: baseM, Index: true})
				if deltaM.Base != baseM.Digest || deltaM.Entries >= fullM.Entries || len(delta) >= len(full) {
					t.Fatalf("seed %d: delta %d entries/%d bytes vs full %d/%d, base %q", seed, deltaM.Entries, len(delta), fullM.Entries, len(full), deltaM.Base)
				}

				// The same delta, computed from the full layer as a stream.
				var sdelta bytes.Buffer
				sdM, err := PackDelta(ctx, baseM, bytes.NewReader(full), &sdelta, PackOptions{})
				if err != nil {
					t.Fatalf("seed %d: PackDelta: %v", seed, err)
				}
				if sdM.TarDigest != deltaM.TarDigest {
					t.Errorf("seed %d: stream delta (%d entries) differs from directory delta (%d entries)", seed, sdM.Entries, deltaM.Entries)
				}

				// Base then delta, applied in place.
				got := filepath.Join(t.TempDir(), "got")
				if _, err := Unpack(ctx, bytes.NewReader(baseLayer), got, ApplyOptions{Mode: mode}); err != nil {
					t.Fatal(err)
				}
				if _, err := Unpack(ctx, bytes.NewReader(delta), got, ApplyOptions{Mode: mode}); err != nil {
					t.Fatalf("seed %d: apply delta: %v", seed, err)
				}
				compareTrees(t, changed, got)
				if t.Failed() {
					t.Fatalf("seed %d: base+delta differs from the changed tree", seed)
				}

				// Base merged with delta into one layer.
				var merged bytes.Buffer
				mm, err := MergeLayers(ctx, bytes.NewReader(baseLayer), bytes.NewReader(delta), &merged, MergeOptions{})
				if err != nil {
					t.Fatalf("seed %d: merge: %v", seed, err)
				}
				got2 := filepath.Join(t.TempDir(), "got2")
				res, err := Unpack(ctx, &merged, got2, ApplyOptions{Mode: mode})
				if err != nil {
					t.Fatalf("seed %d: apply merged: %v", seed, err)
				}
				if res.Digest != mm.Digest || res.Entries != mm.Entries {
					t.Fatalf("merged manifest %+v, read %+v", mm, res)
				}
				compareTrees(t, changed, got2)
				if t.Failed() {
					t.Fatalf("seed %d: merged layer differs from the changed tree", seed)
				}

				// A delta of an unchanged tree is nearly empty.
				_, same := packDir(t, changed, PackOptions{Base: deltaM})
				if same.Entries != 0 {
					t.Fatalf("seed %d: delta of an unchanged tree has %d entries", seed, same.Entries)
				}
			}
		})
	}
}

func TestDeltaNeedsIndex(t *testing.T) {
	dir := t.TempDir()
	_, m := packDir(t, dir, PackOptions{})
	if _, err := Pack(context.Background(), dir, &bytes.Buffer{}, PackOptions{Base: m}); err == nil || !strings.Contains(err.Error(), "index") {
		t.Fatalf("got %v, want an error naming the missing index", err)
	}
}

// PackStream reports its progress as Pack does: the source's bytes read,
// after each entry, growing to the whole stream (a suspend's progress bar
// stood still at nothing).
func TestPackStreamProgress(t *testing.T) {
	src := tarOf(t,
		&tar.Header{Name: "a", Typeflag: tar.TypeReg, Size: 100 << 10},
		&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755},
		&tar.Header{Name: "d/b", Typeflag: tar.TypeReg, Size: 300 << 10})
	var got []int64
	if _, err := PackStream(context.Background(), bytes.NewReader(src), io.Discard, PackOptions{Progress: func(n int64) { got = append(got, n) }}); err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("progress %v: want one report per entry", got)
	}
	for i := 1; i < len(got); i++ {
		if got[i] < got[i-1] {
			t.Errorf("progress went back: %v", got)
		}
	}
	if got[2] < 400<<10 || got[2] > int64(len(src)) {
		t.Errorf("progress %v, want the last near the stream's %d bytes", got, len(src))
	}
}
