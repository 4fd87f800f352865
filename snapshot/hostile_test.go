package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
)

var update = flag.Bool("update", false, "rewrite testdata/hostile from the generators in hostile_test.go")

// hostileCase is one archive in testdata/hostile and the reason it must be
// refused.
type hostileCase struct {
	file string
	want string // substring of the error
	make func(t testing.TB) []byte
}

func tarOf(t testing.TB, hdrs ...*tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range hdrs {
		if h.Format == tar.FormatUnknown {
			h.Format = tar.FormatPAX
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg && h.Size > 0 {
			if _, err := tw.Write(bytes.Repeat([]byte("x"), int(h.Size))); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func zstdOf(t testing.TB, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, _ := zstd.NewWriter(&buf)
	w.Write(b)
	w.Close()
	return buf.Bytes()
}

func reg(name string) *tar.Header { return &tar.Header{Typeflag: tar.TypeReg, Name: name, Size: 4} }

// validLayer is a small good layer used by truncated and wrong-digest.
func validLayer(t testing.TB) []byte {
	return zstdOf(t, tarOf(t,
		&tar.Header{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755},
		&tar.Header{Typeflag: tar.TypeReg, Name: "d/f", Size: 3000},
		&tar.Header{Typeflag: tar.TypeReg, Name: "g", Size: 3000},
	))
}

// wrongDigest is the digest testdata/hostile/wrong-digest.tar.zst is
// claimed to have.
const wrongDigest = "sha256:0000000000000000000000000000000000000000000000000000000000000000"

var hostileCases = []hostileCase{
	{"traversal.tar", "'..'", func(t testing.TB) []byte { return tarOf(t, reg("../evil")) }},
	{"traversal-deep.tar", "'..'", func(t testing.TB) []byte { return tarOf(t, reg("a/b/../../../evil")) }},
	{"absolute.tar", "absolute", func(t testing.TB) []byte { return tarOf(t, reg("/tmp/sandgate-evil")) }},
	{"symlink-then-write.tar", "through a symlink", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeSymlink, Name: "link", Linkname: "/tmp"}, reg("link/sandgate-evil"))
	}},
	{"symlink-inside-then-write.tar", "through a symlink", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeDir, Name: "d/"}, &tar.Header{Typeflag: tar.TypeSymlink, Name: "l", Linkname: "d"}, reg("l/x"))
	}},
	{"symlink-parent-escape.tar", "through a symlink", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeSymlink, Name: "up", Linkname: "../.."}, &tar.Header{Typeflag: tar.TypeDir, Name: "up/etc/"})
	}},
	{"hardlink-escape.tar", "leaves", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "../../../etc/passwd"})
	}},
	{"hardlink-absolute.tar", "leaves", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "/etc/passwd"})
	}},
	{"hardlink-via-symlink.tar", "leaves the layer", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeSymlink, Name: "s", Linkname: "/etc"}, &tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "s/passwd"})
	}},
	{"hardlink-missing.tar", "not in the layer", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "nowhere"})
	}},
	{"hardlink-dir.tar", "hardlink to directory", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeDir, Name: "d/"}, &tar.Header{Typeflag: tar.TypeLink, Name: "h", Linkname: "d"})
	}},
	{"device-char.tar", "character device", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeChar, Name: "null", Devmajor: 1, Devminor: 3})
	}},
	{"device-block.tar", "block device", func(t testing.TB) []byte {
		return tarOf(t, &tar.Header{Typeflag: tar.TypeBlock, Name: "sda", Devmajor: 8, Devminor: 0})
	}},
	{"setuid.tar", "setuid", func(t testing.TB) []byte {
		h := reg("su")
		h.Mode = 0o4755
		return tarOf(t, h)
	}},
	{"capability.tar", "capabilities", func(t testing.TB) []byte {
		h := reg("cap")
		h.PAXRecords = map[string]string{paxXattr + xattrCapable: "\x01\x00\x00\x02"}
		return tarOf(t, h)
	}},
	{"xattr-overlay-redirect.tar", "not allowed", func(t testing.TB) []byte {
		h := &tar.Header{Typeflag: tar.TypeDir, Name: "d/", PAXRecords: map[string]string{paxXattr + "trusted.overlay.redirect": "/etc"}}
		return tarOf(t, h)
	}},
	{"whiteout-dotdot.tar", "whiteout", func(t testing.TB) []byte { return tarOf(t, reg("a/.wh..")) }},
	{"long-component.tar", "component longer", func(t testing.TB) []byte { return tarOf(t, reg(strings.Repeat("n", 300))) }},
	{"size-bomb.tar", "cap", func(t testing.TB) []byte {
		// A header claiming more bytes than the cap, refused before reading.
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "big", Size: 1 << 40, Mode: 0o644, Format: tar.FormatPAX})
		tw.Flush()
		return buf.Bytes()
	}},
	{"decompression-bomb.tar.zst", "exceeds", func(t testing.TB) []byte {
		// 48 entries of 1 MiB of zeros: a few KiB compressed, 48 MiB
		// decompressed, each entry under the per-file cap.
		var tb bytes.Buffer
		tw := tar.NewWriter(&tb)
		zero := make([]byte, 1<<20)
		for i := range 48 {
			tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "z" + string(rune('a'+i%26)) + string(rune('a'+i/26)), Size: 1 << 20, Mode: 0o644})
			tw.Write(zero)
		}
		tw.Close()
		return zstdOf(t, tb.Bytes())
	}},
	{"sparse-overlap.tar", "sparse map", func(t testing.TB) []byte {
		return sparseTarWith("f", 1<<20, "2\n0\n3\n2\n2\n", []byte("abcxy"))
	}},
	{"sparse-beyond.tar", "sparse map", func(t testing.TB) []byte {
		return sparseTarWith("f", 100, "1\n99\n2\n", []byte("ab"))
	}},
	{"sparse-data-bomb.tar.zst", "exceeds", func(t testing.TB) []byte {
		// 10 sparse entries of 2 MiB of data each (zeros: a few KiB
		// compressed): each under the cap, 20 MiB of data in all.
		var b bytes.Buffer
		for i := range 10 {
			e := sparseTarWith("f"+strconv.Itoa(i), 1<<40, "1\n0\n2097152\n", make([]byte, 2<<20))
			b.Write(e[:len(e)-1024])
		}
		b.Write(make([]byte, 1024))
		return zstdOf(t, b.Bytes())
	}},
	{"truncated.tar.zst", "", func(t testing.TB) []byte {
		b := validLayer(t)
		return b[:len(b)/2]
	}},
	{"wrong-digest.tar.zst", "digest mismatch", validLayer},
	{"not-a-layer.bin", "", func(t testing.TB) []byte { return []byte("this is not a tar stream at all, just text that goes on") }},
}

// hostileOptions are the caps the corpus is checked against.
func hostileOptions(file string) ApplyOptions {
	o := ApplyOptions{MaxBytes: 16 << 20, MaxEntries: 1000}
	if file == "wrong-digest.tar.zst" {
		o.Digest = wrongDigest
	}
	return o
}

// TestHostileCorpus applies every archive in testdata/hostile and checks
// it is refused for its reason, leaving nothing where the caller looks and
// no staging directory behind.
func TestHostileCorpus(t *testing.T) {
	dir := filepath.Join("testdata", "hostile")
	if *update {
		os.MkdirAll(dir, 0o755)
		for _, c := range hostileCases {
			if err := os.WriteFile(filepath.Join(dir, c.file), c.make(t), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, c := range hostileCases {
		for _, mode := range []Mode{ModeTree, ModeUpper} {
			t.Run(c.file+"/"+string(mode), func(t *testing.T) {
				if mode == ModeUpper {
					skipUnlessRoot(t)
				}
				data, err := os.ReadFile(filepath.Join(dir, c.file))
				if err != nil {
					t.Fatalf("%v (run with -update to regenerate the corpus)", err)
				}
				base := t.TempDir()
				target := filepath.Join(base, "target")
				opts := hostileOptions(c.file)
				opts.Mode = mode
				_, err = Unpack(context.Background(), bytes.NewReader(data), target, opts)
				if err == nil {
					t.Fatal("applied; want refused")
				}
				if c.want != "" && !strings.Contains(err.Error(), c.want) {
					t.Errorf("error %q, want it to mention %q", err, c.want)
				}
				if c.want == "digest mismatch" && !errors.Is(err, ErrDigestMismatch) {
					t.Errorf("error %v is not ErrDigestMismatch", err)
				}
				if ents, _ := os.ReadDir(base); len(ents) != 0 {
					t.Errorf("left %d entries in the parent (first %q)", len(ents), ents[0].Name())
				}
				if _, err := os.Lstat("/tmp/sandgate-evil"); err == nil {
					t.Error("/tmp/sandgate-evil was written")
				}
			})
		}
	}
}

// TestRefusedArchiveKeepsExistingTarget checks that a refused layer applied
// onto an existing tree changes nothing in it.
func TestRefusedArchiveKeepsExistingTarget(t *testing.T) {
	target := mkdir(t, filepath.Join(t.TempDir(), "target"))
	os.WriteFile(filepath.Join(target, "keep"), []byte("old"), 0o644)
	before := snapshotTree(t, target)
	layer := tarOf(t, reg("keep"), &tar.Header{Typeflag: tar.TypeReg, Name: ".wh.other"}, reg("../evil"))
	if _, err := Unpack(context.Background(), bytes.NewReader(layer), target, ApplyOptions{}); !errors.Is(err, ErrRefused) {
		t.Fatalf("got %v, want ErrRefused", err)
	}
	after := snapshotTree(t, target)
	if len(before) != len(after) || before["keep"] != after["keep"] {
		t.Fatalf("target changed: %v -> %v", before, after)
	}
	if ents, _ := os.ReadDir(filepath.Dir(target)); len(ents) != 1 {
		t.Fatalf("staging left behind: %d entries", len(ents))
	}
}
