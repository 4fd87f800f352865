package snapshot

import (
	"bytes"
	"io"
	"testing"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
)

// Decompress gives the bare stream of a layer in each compression.
func TestDecompress(t *testing.T) {
	plain := bytes.Repeat([]byte("a bare tar stream "), 1000)
	var z, g bytes.Buffer
	zw, _ := zstd.NewWriter(&z)
	zw.Write(plain)
	zw.Close()
	gw := gzip.NewWriter(&g)
	gw.Write(plain)
	gw.Close()
	for name, in := range map[string][]byte{"zstd": z.Bytes(), "gzip": g.Bytes(), "none": plain} {
		r, err := Decompress(bytes.NewReader(in))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got, err := io.ReadAll(r)
		r.Close()
		if err != nil || !bytes.Equal(got, plain) {
			t.Errorf("%s: %d bytes, %v", name, len(got), err)
		}
	}
	if _, err := Decompress(bytes.NewReader(nil)); err == nil {
		t.Error("an empty stream decompressed")
	}
}
