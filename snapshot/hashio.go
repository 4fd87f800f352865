package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"io"
	"sync/atomic"
)

// hashCounter is a writer that hashes and counts what passes through it on
// its way to w, so digests come from the one streaming pass.
type hashCounter struct {
	w io.Writer
	h hash.Hash
	n int64
}

func newHashCounter(w io.Writer) *hashCounter {
	return &hashCounter{w: w, h: sha256.New()}
}

func (c *hashCounter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.h.Write(p[:n])
	c.n += int64(n)
	return n, err
}

func (c *hashCounter) digest() string { return "sha256:" + hex.EncodeToString(c.h.Sum(nil)) }

// hashingReader hashes and counts what is read through it. n may be
// loaded from another goroutine (progress reports) while it reads.
type hashingReader struct {
	r io.Reader
	h hash.Hash
	n atomic.Int64
}

func newHashingReader(r io.Reader) *hashingReader {
	return &hashingReader{r: r, h: sha256.New()}
}

func (c *hashingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.h.Write(p[:n])
	c.n.Add(int64(n))
	return n, err
}

func (c *hashingReader) digest() string { return "sha256:" + hex.EncodeToString(c.h.Sum(nil)) }

// countReader counts what is read through it; n may be loaded from
// another goroutine (progress reports).
type countReader struct {
	r io.Reader
	n atomic.Int64
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// cappedReader fails once more than max bytes have been read: the
// decompressed-size cap that defeats decompression bombs.
type cappedReader struct {
	r   io.Reader
	n   int64
	max int64
}

func (c *cappedReader) Read(p []byte) (int, error) {
	if c.n > c.max {
		return 0, refuse("(stream)", "decompressed stream exceeds %d bytes", c.max)
	}
	if rem := c.max - c.n + 1; int64(len(p)) > rem {
		p = p[:rem]
	}
	n, err := c.r.Read(p)
	c.n += int64(n)
	if c.n > c.max {
		return n, refuse("(stream)", "decompressed stream exceeds %d bytes", c.max)
	}
	return n, err
}

// onlyWriter hides any ReadFrom method so io.CopyBuffer uses our buffer.
type onlyWriter struct{ io.Writer }

// countWriter counts what passes through it on its way to w.
type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
