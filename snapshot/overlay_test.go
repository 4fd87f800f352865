package snapshot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// mountOverlay mounts lower+upper at a new merged directory and unmounts it
// when the test ends.
func mountOverlay(t *testing.T, lower, upper string) string {
	t.Helper()
	base := t.TempDir()
	work, merged := mkdir(t, filepath.Join(base, "work")), mkdir(t, filepath.Join(base, "merged"))
	opts := "lowerdir=" + lower + ",upperdir=" + upper + ",workdir=" + work + ",redirect_dir=off,metacopy=off,index=off"
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		t.Skipf("overlayfs not available here: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(merged, 0) })
	return merged
}

// TestOverlayUpperRoundTrip uses the kernel's overlayfs: changes made
// through a mount (deleting lower files, replacing a lower directory, adding
// files) leave whiteouts and opaque directories in the upper; packing that
// upper and unpacking it as a new upper over the same lower shows the same
// merged tree, and applying it as a plain tree onto a copy of the lower
// gives that tree too.
func TestOverlayUpperRoundTrip(t *testing.T) {
	skipUnlessRoot(t)
	ctx := context.Background()
	lower := filepath.Join(t.TempDir(), "lower")
	genTree(t, mkdir(t, lower), 11, genOptions{MaxFiles: 80})
	upper := mkdir(t, filepath.Join(t.TempDir(), "upper"))
	merged := mountOverlay(t, lower, upper)

	ents, err := os.ReadDir(merged)
	if err != nil {
		t.Fatal(err)
	}
	var dirDone, fileDone bool
	for _, e := range ents {
		p := filepath.Join(merged, e.Name())
		switch {
		case e.IsDir() && !dirDone:
			// Replace a lower directory: the upper gets an opaque dir.
			must(t, os.RemoveAll(p))
			must(t, os.Mkdir(p, 0o750))
			must(t, os.WriteFile(filepath.Join(p, "fresh"), []byte("new"), 0o644))
			dirDone = true
		case e.Type().IsRegular() && !fileDone:
			must(t, os.Remove(p)) // a whiteout
			fileDone = true
		}
	}
	must(t, os.WriteFile(filepath.Join(merged, "added-日本"), []byte("added"), 0o600))
	if !dirDone || !fileDone {
		t.Fatal("generated lower has no top-level file or directory to change")
	}
	want := snapshotTree(t, merged)
	must(t, unix.Unmount(merged, 0))

	layer, m := packDir(t, upper, PackOptions{})
	var whiteouts, opaques int
	res, err := Inspect(ctx, bytes.NewReader(layer), nil)
	if err != nil || res.Digest != m.Digest {
		t.Fatalf("inspect: %v", err)
	}
	for _, f := range snapshotTreeNames(t, upper) {
		st, _ := os.Lstat(filepath.Join(upper, f))
		if st.Mode()&os.ModeCharDevice != 0 {
			whiteouts++
		}
		if v, err := getXattr(filepath.Join(upper, f), xattrOpaque); err == nil && v == "y" {
			opaques++
		}
	}
	if whiteouts == 0 || opaques == 0 {
		t.Fatalf("the kernel left %d whiteouts and %d opaque dirs in the upper; want both", whiteouts, opaques)
	}

	upper2 := filepath.Join(t.TempDir(), "upper2")
	if _, err := Unpack(ctx, bytes.NewReader(layer), upper2, ApplyOptions{Mode: ModeUpper}); err != nil {
		t.Fatal(err)
	}
	merged2 := mountOverlay(t, lower, upper2)
	compareSnapshots(t, want, snapshotTree(t, merged2))

	// As a plain tree onto a copy of the lower.
	tree := filepath.Join(t.TempDir(), "tree")
	lowerLayer, _ := packDir(t, lower, PackOptions{})
	if _, err := Unpack(ctx, bytes.NewReader(lowerLayer), tree, ApplyOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Unpack(ctx, bytes.NewReader(layer), tree, ApplyOptions{}); err != nil {
		t.Fatal(err)
	}
	compareSnapshots(t, want, snapshotTree(t, tree))
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func snapshotTreeNames(t *testing.T, dir string) []string {
	var out []string
	for k := range snapshotTree(t, dir) {
		out = append(out, k)
	}
	return out
}

// compareSnapshots compares two snapshotTree results like compareTrees.
func compareSnapshots(t *testing.T, want, got map[string]nodeInfo) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("%q missing", k)
			continue
		}
		w.Group, g.Group = 0, 0
		if w != g {
			t.Errorf("%q:\n got %+v\nwant %+v", k, g, w)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%q unexpected", k)
		}
	}
}
