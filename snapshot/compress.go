package snapshot

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"runtime"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
)

// Compression names a layer's compression. The zero value means Zstd when
// packing; when reading, compression is detected from magic bytes.
type Compression string

// Supported compressions.
const (
	Zstd Compression = "zstd"
	Gzip Compression = "gzip"
	None Compression = "none" // a bare tar stream
)

// Ext is the file name extension for a layer with this compression.
func (c Compression) Ext() string {
	switch c {
	case Gzip:
		return ".tar.gz"
	case None:
		return ".tar"
	default:
		return ".tar.zst"
	}
}

// ParseCompression accepts "zstd", "gzip" (or "gz") and "none".
func ParseCompression(s string) (Compression, error) {
	switch s {
	case "", "zstd", "zst":
		return Zstd, nil
	case "gzip", "gz":
		return Gzip, nil
	case "none":
		return None, nil
	}
	return "", fmt.Errorf("compression %q: want zstd, gzip or none", s)
}

var (
	zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}
	gzipMagic = []byte{0x1f, 0x8b}
)

// newCompressor wraps w in the encoder for c. level is the zstd level
// (1 fastest .. 4 best, 0 = 1) or the gzip level (0 = 1 for speed).
func newCompressor(w io.Writer, c Compression, level int) (io.WriteCloser, error) {
	switch c {
	case Zstd, "":
		if level == 0 {
			level = 1
		}
		return newParallelZstd(w, level, runtime.GOMAXPROCS(0), nil)
	case Gzip:
		if level == 0 {
			level = gzip.BestSpeed
		}
		return gzip.NewWriterLevel(w, level)
	case None:
		return nopWriteCloser{w}, nil
	}
	return nil, fmt.Errorf("compression %q: want zstd, gzip or none", c)
}

type nopWriteCloser struct{ io.Writer }

func (nopWriteCloser) Close() error { return nil }

// maxZstdWindow bounds decoder memory for hostile streams.
const maxZstdWindow = 128 << 20

// newDecompressor detects the compression of br from its first bytes and
// returns a reader of the tar stream.
func newDecompressor(br *bufio.Reader) (io.ReadCloser, Compression, error) {
	head, err := br.Peek(4)
	if err != nil && len(head) == 0 {
		if err == io.EOF {
			return nil, "", refuse("(stream)", "empty stream")
		}
		return nil, "", fmt.Errorf("read layer: %w", err)
	}
	switch {
	case bytes.HasPrefix(head, zstdMagic):
		d, err := zstd.NewReader(br,
			zstd.WithDecoderConcurrency(1),
			zstd.WithDecoderMaxWindow(maxZstdWindow),
			zstd.WithDecoderMaxMemory(maxZstdWindow*2))
		if err != nil {
			return nil, "", fmt.Errorf("zstd: %w", err)
		}
		return zstdReadCloser{d}, Zstd, nil
	case bytes.HasPrefix(head, gzipMagic):
		g, err := gzip.NewReader(br)
		if err != nil {
			return nil, "", fmt.Errorf("gzip: %w", err)
		}
		g.Multistream(false)
		return g, Gzip, nil
	}
	return io.NopCloser(br), None, nil
}

// Decompress returns the bare tar stream of layer r, whatever its
// compression (zstd, gzip or none, detected from its first bytes as every
// reader of layers here does), with the decoder bounds kept for hostile
// streams. Close releases the decoder, not r.
func Decompress(r io.Reader) (io.ReadCloser, error) {
	dec, _, err := newDecompressor(bufio.NewReaderSize(r, 1<<20))
	return dec, err
}

type zstdReadCloser struct{ d *zstd.Decoder }

func (z zstdReadCloser) Read(p []byte) (int, error) { return z.d.Read(p) }
func (z zstdReadCloser) Close() error               { z.d.Close(); return nil }
