package snapshot

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
)

func packDir(t testing.TB, dir string, opts PackOptions) ([]byte, *Manifest) {
	t.Helper()
	var buf bytes.Buffer
	m, err := Pack(context.Background(), dir, &buf, opts)
	if err != nil {
		t.Fatalf("Pack: %v", err)
	}
	return buf.Bytes(), m
}

// TestRoundTripProperty packs generated trees and unpacks them, checking
// the result equals the source byte for byte and attribute for attribute,
// and that the manifest matches what the reader measured.
func TestRoundTripProperty(t *testing.T) {
	cases := []struct {
		name string
		mode Mode
		gen  genOptions
		comp Compression
		root bool
	}{
		{"tree-zstd", ModeTree, genOptions{}, Zstd, false},
		{"tree-gzip", ModeTree, genOptions{}, Gzip, false},
		{"upper-zstd-whiteouts-owners", ModeUpper, genOptions{Whiteouts: true, Owners: true}, Zstd, true},
		{"upper-gzip-whiteouts", ModeUpper, genOptions{Whiteouts: true}, Gzip, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.root {
				skipUnlessRoot(t)
			}
			for seed := uint64(1); seed <= 8; seed++ {
				src := filepath.Join(t.TempDir(), "src")
				genTree(t, mkdir(t, src), seed, tc.gen)
				data, m := packDir(t, src, PackOptions{Compression: tc.comp})
				dst := filepath.Join(t.TempDir(), "dst")
				res, err := Unpack(context.Background(), bytes.NewReader(data), dst, ApplyOptions{Mode: tc.mode, Digest: m.Digest, TarDigest: m.TarDigest})
				if err != nil {
					t.Fatalf("seed %d: Unpack: %v", seed, err)
				}
				if res.Digest != m.Digest || res.TarDigest != m.TarDigest || res.Entries != m.Entries || res.Size != m.Size || res.TarSize != m.TarSize || res.Compression != tc.comp {
					t.Fatalf("seed %d: read %+v, manifest %+v", seed, res, m)
				}
				compareTrees(t, src, dst)
				if t.Failed() {
					t.Fatalf("seed %d differs", seed)
				}
			}
		})
	}
}
