package snapshot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
)

// FuzzUnpack feeds arbitrary bytes to the reader and applier. Whatever the
// input, Unpack must not panic, must not write beside the target, and must
// leave either a complete target or nothing at all.
func FuzzUnpack(f *testing.F) {
	ents, _ := os.ReadDir(filepath.Join("testdata", "hostile"))
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("testdata", "hostile", e.Name()))
		if err == nil && len(b) < 4096 { // big bombs make coverage-instrumented runs crawl
			f.Add(b, false)
		}
	}
	src := filepath.Join(f.TempDir(), "src")
	genTree(f, mkdir(f, src), 42, genOptions{MaxFiles: 12, MaxSize: 600})
	good, _ := packDir(f, src, PackOptions{})
	f.Add(good, false)
	f.Add(good, true)
	gz, _ := packDir(f, src, PackOptions{Compression: Gzip})
	f.Add(gz, false)
	raw, _ := packDir(f, src, PackOptions{Compression: None})
	f.Add(raw, true)

	f.Fuzz(func(t *testing.T, data []byte, upper bool) {
		mode := ModeTree
		if upper && isRoot() {
			mode = ModeUpper
		}
		base := t.TempDir()
		target := filepath.Join(base, "target")
		_, err := Unpack(context.Background(), bytes.NewReader(data), target,
			ApplyOptions{Mode: mode, MaxBytes: 256 << 10, MaxEntries: 256})
		ents, rerr := os.ReadDir(base)
		if rerr != nil {
			t.Fatal(rerr)
		}
		switch {
		case err != nil && len(ents) != 0:
			t.Fatalf("refused (%v) but left %q", err, ents[0].Name())
		case err == nil && (len(ents) != 1 || ents[0].Name() != "target"):
			t.Fatalf("applied but the parent holds %d entries", len(ents))
		}
	})
}
