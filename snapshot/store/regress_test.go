package store

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestDirMissingDigestXattrIsMismatch (review F6): on a file system that
// keeps user attributes, an object whose digest attribute is missing (copied
// without -X, restored from a backup, stripped) is not served as good on a
// size check alone; where attributes cannot be kept, the size check stays.
func TestDirMissingDigestXattrIsMismatch(t *testing.T) {
	dir := t.TempDir()
	d, err := NewDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if !d.xattrs {
		t.Skip("the test directory's file system keeps no user xattrs")
	}
	ctx := context.Background()
	const name = "snapshots/a.tar.zst"
	if _, err := d.Put(ctx, name, bytes.NewReader([]byte("hello world")), PutOptions{}); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := unix.Removexattr(p, digestXattr); err != nil {
		t.Fatal(err)
	}
	read := func() ([]byte, error) {
		rc, err := d.Get(ctx, name)
		if err != nil {
			return nil, err
		}
		defer rc.Close()
		return io.ReadAll(rc)
	}
	// Get succeeds; reading fails at EOF, as for any damaged object.
	for _, content := range []string{"hello world", "HELLO WORLD"} { // intact, then same-size corruption
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if b, err := read(); !errors.Is(err, ErrDigestMismatch) || !errors.Is(err, ErrNoDigest) {
			t.Errorf("%q without a digest attribute: served %q, err %v; want ErrDigestMismatch, ErrNoDigest", content, b, err)
		}
	}
	// A caller that checks the bytes itself reads them whole.
	rc, err := d.Get(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(AcceptUnrecorded(rc)); err != nil || string(b) != "HELLO WORLD" {
		t.Errorf("AcceptUnrecorded: %q, %v", b, err)
	}
	rc.Close()
	// No probe leftovers (the lock file aside), nothing hidden listed.
	if ents, _ := os.ReadDir(dir); len(ents) != 2 || ents[0].Name() != ".lock" {
		t.Errorf("store root holds %v, want .lock and the object", ents)
	}

	// Where attributes cannot be kept, such an object is served (checked
	// only against its size, as documented).
	d.xattrs = false
	if b, err := read(); err != nil || string(b) != "HELLO WORLD" {
		t.Errorf("without xattr support: %q, %v", b, err)
	}
}
