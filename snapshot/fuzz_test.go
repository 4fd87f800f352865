package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// FuzzUnpack feeds arbitrary bytes to the reader and applier. Whatever the
// input, Unpack must not panic, must not write beside the target, and must
// leave either a complete target or nothing at all. With onto, the target
// already holds a small tree (with a symlink to a file outside it): a
// refused layer must leave that tree exactly as it was, and nothing may
// change the file outside.
func FuzzUnpack(f *testing.F) {
	ents, _ := os.ReadDir(filepath.Join("testdata", "hostile"))
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("testdata", "hostile", e.Name()))
		if err == nil && len(b) < 4096 { // big bombs make coverage-instrumented runs crawl
			f.Add(b, false, false)
			f.Add(b, false, true)
		}
	}
	src := filepath.Join(f.TempDir(), "src")
	genTree(f, mkdir(f, src), 42, genOptions{MaxFiles: 12, MaxSize: 600})
	good, _ := packDir(f, src, PackOptions{})
	f.Add(good, false, false)
	f.Add(good, true, false)
	f.Add(good, false, true)
	gz, _ := packDir(f, src, PackOptions{Compression: Gzip})
	f.Add(gz, false, false)
	raw, _ := packDir(f, src, PackOptions{Compression: None})
	f.Add(raw, true, false)
	f.Add(raw, false, true)
	// Layers that use the tree under the target (see seedTarget).
	for _, hdrs := range [][]*tar.Header{
		{{Typeflag: tar.TypeLink, Name: "x", Linkname: "evil"}, {Typeflag: tar.TypeDir, Name: "x/", Mode: 0o777}},
		{{Typeflag: tar.TypeReg, Name: ".wh.keep"}, reg("new"), {Typeflag: tar.TypeLink, Name: "l", Linkname: "nonexistent"}},
		{{Typeflag: tar.TypeDir, Name: "d/"}, {Typeflag: tar.TypeReg, Name: "d/.wh..wh..opq"}, {Typeflag: tar.TypeLink, Name: "l", Linkname: "keep"}},
	} {
		f.Add(tarOf(f, hdrs...), false, true)
	}

	f.Fuzz(func(t *testing.T, data []byte, upper, onto bool) {
		mode := ModeTree
		if upper && isRoot() {
			mode = ModeUpper
		}
		base := t.TempDir()
		target := filepath.Join(base, "target")
		var before map[string]nodeInfo
		victim := filepath.Join(t.TempDir(), "victim")
		if onto {
			seedTarget(t, target, victim)
			before = snapshotTree(t, target)
		}
		_, err := Unpack(context.Background(), bytes.NewReader(data), target,
			ApplyOptions{Mode: mode, MaxBytes: 256 << 10, MaxEntries: 256})
		ents, rerr := os.ReadDir(base)
		if rerr != nil {
			t.Fatal(rerr)
		}
		switch {
		case err != nil && onto && (len(ents) != 1 || ents[0].Name() != "target"):
			t.Fatalf("refused (%v) but the parent holds %d entries", err, len(ents))
		case err != nil && !onto && len(ents) != 0:
			t.Fatalf("refused (%v) but left %q", err, ents[0].Name())
		case err == nil && (len(ents) != 1 || ents[0].Name() != "target"):
			t.Fatalf("applied but the parent holds %d entries", len(ents))
		}
		if err != nil && onto {
			if after := snapshotTree(t, target); !reflect.DeepEqual(before, after) {
				t.Fatalf("refused (%v) but changed the target:\n%v\n->\n%v", err, before, after)
			}
		}
		if onto {
			if st, err := os.Lstat(victim); err != nil || st.Mode() != 0o600 || st.Size() != 6 {
				t.Fatalf("file outside the target changed: %v %v", st, err)
			}
		}
	})
}

// seedTarget makes a small existing tree at target for FuzzUnpack, with a
// symlink evil to victim, a file outside it.
func seedTarget(t *testing.T, target, victim string) {
	t.Helper()
	if err := os.WriteFile(victim, []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	mkdir(t, filepath.Join(target, "d", "e"))
	for _, p := range []string{"keep", "d/f", "d/e/g"} {
		if err := os.WriteFile(filepath.Join(target, p), []byte(p), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for link, to := range map[string]string{"evil": victim, "sd": "d", "up": ".."} {
		if err := os.Symlink(to, filepath.Join(target, link)); err != nil {
			t.Fatal(err)
		}
	}
}
