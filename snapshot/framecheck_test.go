package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/binary"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
)

// zstdFramesOf encodes each part as its own frame, with or without a
// content checksum, and concatenates them.
func zstdFramesOf(t testing.TB, crc []bool, parts ...[]byte) []byte {
	t.Helper()
	var out []byte
	for i, p := range parts {
		enc, err := zstd.NewWriter(nil, zstd.WithEncoderCRC(crc[i]), zstd.WithSingleSegment(i%2 == 0))
		if err != nil {
			t.Fatal(err)
		}
		out = enc.EncodeAll(p, out)
		enc.Close()
	}
	return out
}

// mixedData has raw (incompressible), RLE (one repeated byte) and
// compressed blocks, over more than one 128 KiB block.
func mixedData(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		switch (i / 50_000) % 3 {
		case 0:
			b[i] = byte(r.Uint32())
		case 1:
			b[i] = 7
		default:
			b[i] = "abcabd"[r.IntN(6)]
		}
	}
	return b
}

func walk(b []byte, chunk int) *zstdFrames {
	z := &zstdFrames{}
	for len(b) > 0 {
		k := min(chunk, len(b))
		z.Write(b[:k])
		b = b[k:]
	}
	return z
}

func TestZstdFramesSeesEveryChecksum(t *testing.T) {
	parts := [][]byte{mixedData(1, 300_000), []byte("x"), []byte("small"), mixedData(2, 70_000)}
	two := zstdFramesOf(t, []bool{true, true}, parts[0], parts[3])
	first := zstdFramesOf(t, []bool{true}, parts[0])
	skippable := binary.LittleEndian.AppendUint32(nil, 0x184D2A53)
	skippable = binary.LittleEndian.AppendUint32(skippable, 5)
	skippable = append(skippable, "hello"...)
	for _, tc := range []struct {
		name   string
		stream []byte
		frames int
		all    bool
	}{
		{"all", zstdFramesOf(t, []bool{true, true, true, true}, parts...), 4, true},
		{"none", zstdFramesOf(t, []bool{false, false, false, false}, parts...), 4, false},
		{"mixed", zstdFramesOf(t, []bool{true, false, true, true}, parts...), 4, false},
		{"skippable first", append(skippable, zstdFramesOf(t, []bool{true}, parts[0])...), 1, true},
		{"cut short", two[:len(first)+(len(two)-len(first))/2], 1, false},
		{"an empty frame (klauspost writes it without a checksum)", zstdFramesOf(t, []bool{true, true}, parts[2], nil), 2, false},
		{"not zstd", []byte("plain tar bytes, not a frame"), 0, false},
	} {
		for _, chunk := range []int{1, 3, 4096, 1 << 20} {
			z := walk(tc.stream, chunk)
			if z.frames != tc.frames || z.all() != tc.all {
				t.Errorf("%s, chunks of %d: %d frames, all=%v; want %d, %v", tc.name, chunk, z.frames, z.all(), tc.frames, tc.all)
			}
		}
	}
}

// TestStreamChecksumReported: what Inspect and Unpack say of the checks a
// stream carried, and that a damaged checksummed frame is refused.
func TestStreamChecksumReported(t *testing.T) {
	ctx := context.Background()
	bare := tarOf(t,
		&tar.Header{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755},
		&tar.Header{Typeflag: tar.TypeReg, Name: "d/f", Size: 3000},
	)
	var gz bytes.Buffer
	w := gzip.NewWriter(&gz)
	w.Write(bare)
	w.Close()
	src := t.TempDir()
	packed, _ := packDir(t, src, PackOptions{})
	withCRC := zstdFramesOf(t, []bool{true, true}, bare[:1024], bare[1024:])
	for name, tc := range map[string]struct {
		stream []byte
		want   string
	}{
		"bare":             {bare, ""},
		"gzip":             {gz.Bytes(), "crc32"},
		"sandgate zstd":    {packed, ""},
		"zstd with checks": {withCRC, "xxhash64"},
	} {
		res, err := Inspect(ctx, bytes.NewReader(tc.stream), nil)
		if err != nil || res.StreamChecksum != tc.want {
			t.Errorf("%s: Inspect: %q, %v; want %q", name, res.StreamChecksum, err, tc.want)
		}
		ures, err := Unpack(ctx, bytes.NewReader(tc.stream), filepath.Join(t.TempDir(), "x"), ApplyOptions{})
		if err != nil || ures.StreamChecksum != tc.want {
			t.Errorf("%s: Unpack: %+v, %v; want %q", name, ures, err, tc.want)
		}
	}
	bad := bytes.Clone(withCRC)
	bad[len(bad)-1] ^= 0xff // the last frame's checksum
	if _, err := Inspect(ctx, bytes.NewReader(bad), nil); err == nil {
		t.Error("a frame whose checksum does not match was read as good")
	}
}

func FuzzZstdFrames(f *testing.F) {
	f.Add(zstdFramesOf(f, []bool{true, false}, []byte("seed one"), mixedData(3, 10_000)), 7)
	f.Add([]byte{0x28, 0xb5, 0x2f, 0xfd, 0xff}, 1)
	f.Fuzz(func(t *testing.T, b []byte, chunk int) {
		if chunk <= 0 || chunk > 1<<16 {
			chunk = 1 + len(b)
		}
		a, c := walk(b, len(b)+1), walk(b, chunk)
		if a.frames != c.frames || a.checksummed != c.checksummed || a.all() != c.all() {
			t.Fatalf("chunking changed the walk: %+v vs %+v", a, c)
		}
	})
}
