package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Regression tests for the snapshot review findings (F1..F5).

// TestDeferredLinkChmodEscape (F1): a hardlink deferred to the merge (its
// target is only in the existing tree) must not replace a directory the
// layer also declares, and directory metadata must never be applied through
// a symlink: here the link would make x a symlink to a file outside the
// target, which finishDirs then chmodded 0777.
func TestDeferredLinkChmodEscape(t *testing.T) {
	base := t.TempDir()
	victim := filepath.Join(mkdir(t, filepath.Join(base, "outside")), "victim")
	if err := os.WriteFile(victim, []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(base, "target")
	l1 := tarOf(t,
		&tar.Header{Typeflag: tar.TypeReg, Name: "keep", Size: 4},
		&tar.Header{Typeflag: tar.TypeSymlink, Name: "evil", Linkname: victim, Mode: 0o777},
	)
	if _, err := Unpack(context.Background(), bytes.NewReader(l1), target, ApplyOptions{}); err != nil {
		t.Fatal(err)
	}
	before := snapshotTree(t, target)
	for _, l2 := range [][]*tar.Header{
		{ // the review's recipe
			{Typeflag: tar.TypeLink, Name: "x", Linkname: "evil"},
			{Typeflag: tar.TypeDir, Name: "x/", Mode: 0o777},
		},
		{ // an entry written below the deferred link
			{Typeflag: tar.TypeLink, Name: "x", Linkname: "evil"},
			{Typeflag: tar.TypeDir, Name: "x/y/", Mode: 0o777},
		},
	} {
		_, err := Unpack(context.Background(), bytes.NewReader(tarOf(t, l2...)), target, ApplyOptions{})
		if !errors.Is(err, ErrRefused) {
			t.Errorf("got %v, want ErrRefused", err)
		}
		if st, _ := os.Stat(victim); st.Mode().Perm() != 0o600 {
			t.Fatalf("ESCAPE: %s outside the target is now %v", victim, st.Mode().Perm())
		}
		if after := snapshotTree(t, target); !reflect.DeepEqual(before, after) {
			t.Errorf("refused layer changed the target: %v -> %v", before, after)
		}
	}
	// An entry that comes before the link is replaced by it, as in tar.
	l3 := tarOf(t,
		&tar.Header{Typeflag: tar.TypeDir, Name: "x/", Mode: 0o777},
		&tar.Header{Typeflag: tar.TypeReg, Name: "x/f", Size: 4},
		&tar.Header{Typeflag: tar.TypeLink, Name: "x", Linkname: "keep"},
	)
	if _, err := Unpack(context.Background(), bytes.NewReader(l3), target, ApplyOptions{}); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Lstat(filepath.Join(target, "x")); err != nil || !st.Mode().IsRegular() {
		t.Errorf("x: %v %v, want a hardlink to keep", st, err)
	}
	if st, _ := os.Stat(victim); st.Mode().Perm() != 0o600 {
		t.Fatalf("ESCAPE: %s outside the target is now %v", victim, st.Mode().Perm())
	}
}

// TestFinishDirsDoesNotFollowSymlinks (F1): directory metadata is applied
// through an fd opened without following symlinks, so a directory that was
// replaced by a symlink (here to a file outside) fails instead of changing
// what the link points to.
func TestFinishDirsDoesNotFollowSymlinks(t *testing.T) {
	base := t.TempDir()
	victim := filepath.Join(base, "victim")
	os.WriteFile(victim, []byte("secret"), 0o600)
	outDir := mkdir(t, filepath.Join(base, "outdir"))
	os.Chmod(outDir, 0o700)
	tree := mkdir(t, filepath.Join(base, "tree"))
	os.Symlink(victim, filepath.Join(tree, "x"))
	os.Symlink(outDir, filepath.Join(tree, "y"))
	root, err := os.OpenRoot(tree)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	for _, name := range []string{"x", "y", "y/z"} {
		a := &applier{dirs: []*dirMeta{{name: name, mode: 0o777}}}
		if err := a.finishDirs(root); err == nil {
			t.Errorf("%s: finishDirs through a symlink succeeded", name)
		}
	}
	if st, _ := os.Stat(victim); st.Mode().Perm() != 0o600 {
		t.Errorf("victim chmodded to %v", st.Mode().Perm())
	}
	if st, _ := os.Stat(outDir); st.Mode().Perm() != 0o700 {
		t.Errorf("outside dir chmodded to %v", st.Mode().Perm())
	}
}

// TestMergeRefusalLeavesTargetUnchanged (F2): a layer the merge refuses
// (a deferred hardlink that will not find its target) is refused before
// the merge deletes or moves anything.
func TestMergeRefusalLeavesTargetUnchanged(t *testing.T) {
	cases := map[string][]*tar.Header{
		"missing target": {
			{Typeflag: tar.TypeReg, Name: ".wh.keep"},
			{Typeflag: tar.TypeReg, Name: "new", Size: 3},
			{Typeflag: tar.TypeLink, Name: "l", Linkname: "nonexistent"},
		},
		"target whited out": {
			{Typeflag: tar.TypeReg, Name: ".wh.keep"},
			{Typeflag: tar.TypeReg, Name: "new", Size: 3},
			{Typeflag: tar.TypeLink, Name: "l", Linkname: "keep"},
		},
		"target below a whited-out dir": {
			{Typeflag: tar.TypeReg, Name: ".wh.d"},
			{Typeflag: tar.TypeLink, Name: "l", Linkname: "d/f"},
		},
		"target below an opaque dir": {
			{Typeflag: tar.TypeDir, Name: "d/"},
			{Typeflag: tar.TypeReg, Name: "d/.wh..wh..opq"},
			{Typeflag: tar.TypeLink, Name: "l", Linkname: "d/f"},
		},
		"target is the link itself": {
			{Typeflag: tar.TypeReg, Name: "new", Size: 3},
			{Typeflag: tar.TypeLink, Name: "keep", Linkname: "keep"},
		},
		"target below the link": {
			{Typeflag: tar.TypeReg, Name: "new", Size: 3},
			{Typeflag: tar.TypeLink, Name: "d", Linkname: "d/f"},
		},
		"target a directory": {
			{Typeflag: tar.TypeReg, Name: "new", Size: 3},
			{Typeflag: tar.TypeLink, Name: "l", Linkname: "d"},
		},
		"target through a symlink of the tree": {
			{Typeflag: tar.TypeReg, Name: "new", Size: 3},
			{Typeflag: tar.TypeLink, Name: "l", Linkname: "sd/f"},
		},
		"target's dir replaced by a staged file": {
			{Typeflag: tar.TypeReg, Name: "d", Size: 3},
			{Typeflag: tar.TypeLink, Name: "l", Linkname: "d/f"},
		},
	}
	for name, hdrs := range cases {
		t.Run(name, func(t *testing.T) {
			target := mkdir(t, filepath.Join(t.TempDir(), "target"))
			os.WriteFile(filepath.Join(target, "keep"), []byte("precious"), 0o644)
			mkdir(t, filepath.Join(target, "d"))
			os.WriteFile(filepath.Join(target, "d", "f"), []byte("f"), 0o644)
			os.Symlink("d", filepath.Join(target, "sd"))
			before := snapshotTree(t, target)
			_, err := Unpack(context.Background(), bytes.NewReader(tarOf(t, hdrs...)), target, ApplyOptions{})
			if !errors.Is(err, ErrRefused) {
				t.Fatalf("got %v, want ErrRefused", err)
			}
			if after := snapshotTree(t, target); !reflect.DeepEqual(before, after) {
				t.Errorf("PARTIAL: refused layer changed the target:\n%v\n->\n%v", before, after)
			}
			if ents, _ := os.ReadDir(filepath.Dir(target)); len(ents) != 1 {
				t.Errorf("staging left behind: %d entries", len(ents))
			}
		})
	}
	// Links the merge can make still apply: to a file of the tree, to a
	// file a staged directory merges over, and to an earlier deferred link.
	target := mkdir(t, filepath.Join(t.TempDir(), "target"))
	os.WriteFile(filepath.Join(target, "keep"), []byte("precious"), 0o644)
	mkdir(t, filepath.Join(target, "d"))
	os.WriteFile(filepath.Join(target, "d", "f"), []byte("f"), 0o644)
	layer := tarOf(t,
		&tar.Header{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755},
		&tar.Header{Typeflag: tar.TypeReg, Name: "d/g", Size: 3},
		&tar.Header{Typeflag: tar.TypeLink, Name: "l1", Linkname: "keep"},
		&tar.Header{Typeflag: tar.TypeLink, Name: "d/l2", Linkname: "d/f"},
		&tar.Header{Typeflag: tar.TypeLink, Name: "l3", Linkname: "l1"},
	)
	if _, err := Unpack(context.Background(), bytes.NewReader(layer), target, ApplyOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"l1", "l3"} {
		if b, _ := os.ReadFile(filepath.Join(target, p)); string(b) != "precious" {
			t.Errorf("%s holds %q", p, b)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(target, "d", "l2")); string(b) != "f" {
		t.Errorf("d/l2 holds %q", b)
	}
}

// ustarBlock is a ustar header block.
func ustarBlock(name string, typ byte, size int64) []byte {
	return ustarHeader(name, typ, 0o644, 0, 0, size, time.Unix(1700000000, 0))
}

// sparseTar is n PAX (GNU sparse 1.0) entries, each of realsize bytes of
// which only the last is stored.
func sparseTar(n int, realsize int64) []byte {
	var buf bytes.Buffer
	for i := range n {
		e := sparseTarWith("f"+strconv.Itoa(i), realsize, fmt.Sprintf("1\n%d\n1\n", realsize-1), []byte("x"))
		buf.Write(e[:len(e)-1024])
	}
	buf.Write(make([]byte, 1024))
	return buf.Bytes()
}

// TestSparseEntryBypassesMaxBytes (F3): sparse entries expanded to zeros
// the decompressed-stream cap never saw. Their holes are now never made
// (applied with seeks, they stay holes, in Unpack, MergeLayers and
// PackDelta alike), so the cap sees all they cost: their data, which
// counts against MaxBytes (TestSparseEntriesRefused); 600 MiB of holes
// under a 64 MiB cap take no disk and no time.
func TestSparseEntryBypassesMaxBytes(t *testing.T) {
	raw := sparseTar(10, 60<<20)
	if tr := tar.NewReader(bytes.NewReader(raw)); true {
		h, err := tr.Next()
		if err != nil || h.Size != 60<<20 {
			t.Fatalf("generator: %v %+v", err, h)
		}
	}
	layer := zstdOf(t, raw)
	target := filepath.Join(t.TempDir(), "target")
	if _, err := Unpack(context.Background(), bytes.NewReader(layer), target, ApplyOptions{MaxBytes: 64 << 20}); err != nil {
		t.Fatalf("Unpack: %v", err)
	}
	for i := range 10 {
		p := filepath.Join(target, "f"+strconv.Itoa(i))
		if fi, err := os.Stat(p); err != nil || fi.Size() != 60<<20 {
			t.Fatalf("f%d: %v %v", i, fi, err)
		}
		if a := allocatedBytes(t, p); a > 2*sparseBlock {
			t.Errorf("f%d takes %d bytes of disk: its holes were written", i, a)
		}
	}

	src := mkdir(t, filepath.Join(t.TempDir(), "src"))
	os.WriteFile(filepath.Join(src, "a"), []byte("a"), 0o644)
	good, m := packDir(t, src, PackOptions{Index: true})
	delta, _ := packDir(t, src, PackOptions{Base: m})
	for name, run := range map[string]func(w io.Writer) error{
		"MergeLayers base": func(w io.Writer) error {
			_, err := MergeLayers(context.Background(), bytes.NewReader(layer), bytes.NewReader(delta), w, MergeOptions{MaxBytes: 64 << 20})
			return err
		},
		"MergeLayers delta": func(w io.Writer) error {
			_, err := MergeLayers(context.Background(), bytes.NewReader(good), bytes.NewReader(layer), w, MergeOptions{MaxBytes: 64 << 20})
			return err
		},
		"PackDelta": func(w io.Writer) error {
			_, err := PackDelta(context.Background(), m, bytes.NewReader(layer), w, PackOptions{})
			return err
		},
	} {
		out := &countWriter{w: io.Discard}
		if err := run(out); err != nil || out.n > 64<<10 {
			t.Errorf("%s: %v, wrote %d bytes: holes became data", name, err, out.n)
		}
	}

	// The running sum of entry sizes (not only each entry) is capped.
	var total int64
	for i, size := range []int64{40, 40} {
		err := checkSizes(&tar.Header{Name: "f", Size: size}, nil, &total, 64)
		if (i == 1) != (err != nil) {
			t.Errorf("entry %d: checkSizes = %v", i, err)
		}
	}
}

// TestDirHeaderMemoryRetained (F4): directory entries are kept until the
// end of the stream as a compact record, not as whole headers with their
// PAX records; what is kept is bounded.
func TestDirHeaderMemoryRetained(t *testing.T) {
	// Kept whole, the n headers would hold 40 MB more than the ~16 MiB the
	// decoder itself holds: over the bound below.
	const n = 80
	pad := strings.Repeat("a", 500000)
	var hdrs []*tar.Header
	for i := range n {
		hdrs = append(hdrs, &tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("d%03d/", i), Mode: 0o755,
			PAXRecords: map[string]string{"SANDGATE.test-pad": pad}})
	}
	layer := zstdOf(t, tarOf(t, hdrs...))
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before, peak := ms.HeapAlloc, ms.HeapAlloc
	count := 0
	_, err := Unpack(context.Background(), bytes.NewReader(layer), filepath.Join(t.TempDir(), "target"), ApplyOptions{Progress: func(int64) {
		if count++; count%50 == 0 {
			runtime.GC()
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapAlloc)
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	if grew := int64(peak) - int64(before); grew > 32<<20 {
		t.Errorf("live heap grew by %d MiB for %d directories", grew>>20, n)
	}

	// Attributes retained for directories are budgeted: directories with
	// ~1 MB of user.* attributes each, more than the budget (lowered here
	// to 8 MiB) in all, are refused, not held.
	old := maxDirMeta
	maxDirMeta = 8 << 20
	defer func() { maxDirMeta = old }()
	hdrs = hdrs[:0]
	val := strings.Repeat("v", 60<<10)
	for i := range 10 {
		x := map[string]string{}
		for j := range 16 {
			x[fmt.Sprintf("%suser.a%02d", paxXattr, j)] = val
		}
		hdrs = append(hdrs, &tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("d%03d/", i), Mode: 0o755, PAXRecords: x})
	}
	base := t.TempDir()
	_, err = Unpack(context.Background(), bytes.NewReader(zstdOf(t, tarOf(t, hdrs...))), filepath.Join(base, "target"), ApplyOptions{})
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "directory metadata") {
		t.Errorf("got %v, want the directory metadata budget refused", err)
	}
	if ents, _ := os.ReadDir(base); len(ents) != 0 {
		t.Errorf("left %q", ents[0].Name())
	}
}

// errAtEOF is a verifying reader over a corrupted object: every byte, then
// a mismatch error instead of io.EOF.
type errAtEOF struct{ r io.Reader }

func (e errAtEOF) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err == io.EOF {
		return n, ErrDigestMismatch
	}
	return n, err
}

// TestMergeAndPackDeltaDrainInput (F5): MergeLayers and PackDelta read each
// input to EOF, so a verifying reader's digest check is not skipped.
func TestMergeAndPackDeltaDrainInput(t *testing.T) {
	src := filepath.Join(t.TempDir(), "src")
	genTree(t, mkdir(t, src), 7, genOptions{MaxFiles: 30, MaxSize: 20000})
	for _, c := range []Compression{Zstd, Gzip, None} {
		layer, m := packDir(t, src, PackOptions{Compression: c, Index: true})
		delta, _ := packDir(t, src, PackOptions{Compression: c, Base: m})
		ctx := context.Background()
		for name, run := range map[string]func(bad bool) error{
			"MergeLayers base": func(bad bool) error {
				var r io.Reader = bytes.NewReader(layer)
				if bad {
					r = errAtEOF{r}
				}
				_, err := MergeLayers(ctx, r, bytes.NewReader(delta), io.Discard, MergeOptions{})
				return err
			},
			"MergeLayers delta": func(bad bool) error {
				var r io.Reader = bytes.NewReader(delta)
				if bad {
					r = errAtEOF{r}
				}
				_, err := MergeLayers(ctx, bytes.NewReader(layer), r, io.Discard, MergeOptions{})
				return err
			},
			"PackDelta": func(bad bool) error {
				var r io.Reader = bytes.NewReader(layer)
				if bad {
					r = errAtEOF{r}
				}
				_, err := PackDelta(ctx, m, r, io.Discard, PackOptions{})
				return err
			},
		} {
			if err := run(false); err != nil {
				t.Errorf("%s %s: %v", c, name, err)
			}
			if err := run(true); !errors.Is(err, ErrDigestMismatch) {
				t.Errorf("%s %s over a mismatching source: got %v, want ErrDigestMismatch", c, name, err)
			}
		}
		// Garbage after the layer is refused, like Unpack does.
		junk := append(append([]byte{}, layer...), make([]byte, maxTrailing+10)...)
		if c != None {
			if _, err := PackDelta(ctx, m, bytes.NewReader(junk), io.Discard, PackOptions{}); err == nil {
				t.Errorf("%s PackDelta with 1 MiB of trailing junk: no error", c)
			}
		}
	}
}

// TestPackRefusesOpaqueValueOtherThanY (review F6): trusted.overlay.opaque
// with a value other than "y" (such as Linux 6.7's "x", a directory with
// xattr whiteouts) is refused by name, not silently packed as not opaque.
func TestPackRefusesOpaqueValueOtherThanY(t *testing.T) {
	skipUnlessRoot(t)
	for _, v := range []string{"x", "n", ""} {
		dir := t.TempDir()
		d := mkdir(t, filepath.Join(dir, "d"))
		if err := unix.Setxattr(d, xattrOpaque, []byte(v), 0); err != nil {
			t.Skipf("set %s: %v", xattrOpaque, err)
		}
		_, err := Pack(context.Background(), dir, io.Discard, PackOptions{})
		if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), xattrOpaque) || !strings.Contains(err.Error(), `"d"`) {
			t.Errorf("opaque=%q: got %v, want ErrUnsupported naming d and the attribute", v, err)
		}
	}
	dir := t.TempDir()
	d := mkdir(t, filepath.Join(dir, "d"))
	unix.Setxattr(d, xattrOpaque, []byte("y"), 0)
	if _, err := Pack(context.Background(), dir, io.Discard, PackOptions{}); err != nil {
		t.Errorf("opaque=y: %v", err)
	}
}

// TestFilesNamedLikeWhiteouts (sandbox review): a file or directory a
// sandbox names ".wh.<x>" or ".wh..wh..opq" is packed as itself and applied
// back as itself, in both modes, never read as a whiteout that would hide
// the image's copy of <x> (or all of a directory).
func TestFilesNamedLikeWhiteouts(t *testing.T) {
	src := t.TempDir()
	mkdir(t, filepath.Join(src, "usr"))
	mkdir(t, filepath.Join(src, ".wh.dir"))
	for name, body := range map[string]string{
		"usr/.wh..wh..opq":  "opaque?",
		".wh.opt":           "whiteout?",
		".wh.dir/.wh.inner": "both",
	} {
		if err := os.WriteFile(filepath.Join(src, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	layer, _ := packDir(t, src, PackOptions{Compression: None})
	for _, mode := range []Mode{ModeUpper, ModeTree} {
		target := filepath.Join(t.TempDir(), "t")
		if _, err := Unpack(context.Background(), bytes.NewReader(layer), target, ApplyOptions{Mode: mode}); err != nil {
			t.Fatalf("mode %v: %v", mode, err)
		}
		for name, body := range map[string]string{"usr/.wh..wh..opq": "opaque?", ".wh.opt": "whiteout?", ".wh.dir/.wh.inner": "both"} {
			if b, err := os.ReadFile(filepath.Join(target, name)); err != nil || string(b) != body {
				t.Errorf("mode %v: %s = %q, %v; want the file back", mode, name, b, err)
			}
		}
		if _, err := os.Lstat(filepath.Join(target, "opt")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("mode %v: a whiteout for opt was made: %v", mode, err)
		}
		var opq [1]byte
		if n, _ := unix.Lgetxattr(filepath.Join(target, "usr"), "trusted.overlay.opaque", opq[:]); n > 0 {
			t.Errorf("mode %v: usr was made opaque", mode)
		}
	}
}

// sparseTarWith is a tar of one sparse entry (format 1.0) name of
// realsize bytes whose stored bytes are sparseMap, padded, then data.
func sparseTarWith(name string, realsize int64, sparseMap string, data []byte) []byte {
	var buf bytes.Buffer
	recs := paxRecord("GNU.sparse.major", "1") + paxRecord("GNU.sparse.minor", "0") +
		paxRecord("GNU.sparse.name", name) + paxRecord("GNU.sparse.realsize", strconv.FormatInt(realsize, 10))
	body := append(padBlock([]byte(sparseMap)), data...)
	buf.Write(ustarBlock("PaxHeaders/"+name, tar.TypeXHeader, int64(len(recs))))
	buf.Write(padBlock([]byte(recs)))
	buf.Write(ustarBlock("GNUSparseFile.0/"+name, tar.TypeReg, int64(len(body))))
	buf.Write(padBlock(body))
	buf.Write(make([]byte, 1024))
	return buf.Bytes()
}
