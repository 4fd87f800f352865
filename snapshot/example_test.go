package snapshot_test

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/sandgate/sandgate/snapshot"
)

// Pack a directory into a zstd layer, list it, and apply it elsewhere,
// checking the digests recorded in the manifest.
func Example() {
	ctx := context.Background()
	src, _ := os.MkdirTemp("", "example-src")
	defer os.RemoveAll(src)
	os.MkdirAll(filepath.Join(src, "etc"), 0o755)
	os.WriteFile(filepath.Join(src, "etc", "motd"), []byte("hello\n"), 0o644)
	os.Symlink("etc/motd", filepath.Join(src, "motd"))

	var layer bytes.Buffer
	m, err := snapshot.Pack(ctx, src, &layer, snapshot.PackOptions{SandboxID: "sb-1"})
	if err != nil {
		panic(err)
	}
	fmt.Println(m.Compression, m.Entries, strings.HasPrefix(m.Digest, "sha256:"))

	snapshot.Inspect(ctx, bytes.NewReader(layer.Bytes()), func(h *tar.Header) error {
		fmt.Println(strings.TrimSpace(h.Name + " " + h.Linkname))
		return nil
	})

	dst, _ := os.MkdirTemp("", "example-dst")
	defer os.RemoveAll(dst)
	_, err = snapshot.Unpack(ctx, &layer, filepath.Join(dst, "restored"),
		snapshot.ApplyOptions{Digest: m.Digest, TarDigest: m.TarDigest})
	b, _ := os.ReadFile(filepath.Join(dst, "restored", "motd"))
	fmt.Printf("%v %q\n", err, b)
	// Output:
	// zstd 4 true
	// ./
	// etc/
	// etc/motd
	// motd etc/motd
	// <nil> "hello\n"
}
