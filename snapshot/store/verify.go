package store

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// verifyingReader checks size, sha256 and (when known) CRC32C of an object
// as it is read, and turns EOF into ErrDigestMismatch when they disagree.
type verifyingReader struct {
	rc      io.ReadCloser
	name    string
	sha     hash.Hash
	crc     uint32
	n       int64
	size    int64  // expected size, -1 unknown
	digest  string // expected "sha256:<hex>", "" unknown
	wantCRC *uint32
	missing string // why the object cannot be verified: a mismatch at EOF
	err     error
}

func newVerifyingReader(rc io.ReadCloser, name string, size int64, digest string, crc *uint32) *verifyingReader {
	return &verifyingReader{rc: rc, name: name, sha: sha256.New(), size: size, digest: digest, wantCRC: crc}
}

func (v *verifyingReader) Read(p []byte) (int, error) {
	if v.err != nil {
		return 0, v.err
	}
	n, err := v.rc.Read(p)
	v.sha.Write(p[:n])
	if v.wantCRC != nil {
		v.crc = crc32.Update(v.crc, castagnoli, p[:n])
	}
	v.n += int64(n)
	if v.size >= 0 && v.n > v.size {
		v.err = fmt.Errorf("%s: more than the %d bytes recorded: %w", v.name, v.size, ErrDigestMismatch)
		return n, v.err
	}
	if err == io.EOF {
		if v.err = v.check(); v.err != nil {
			return n, v.err
		}
	}
	return n, err
}

func (v *verifyingReader) check() error {
	if v.size >= 0 && v.n != v.size {
		return fmt.Errorf("%s: read %d bytes, %d recorded: %w", v.name, v.n, v.size, ErrDigestMismatch)
	}
	if v.wantCRC != nil && v.crc != *v.wantCRC {
		return fmt.Errorf("%s: crc32c %08x, %08x recorded: %w", v.name, v.crc, *v.wantCRC, ErrDigestMismatch)
	}
	if v.missing != "" {
		return fmt.Errorf("%s: %s: %w", v.name, v.missing, ErrNoDigest)
	}
	if v.digest != "" {
		if got := "sha256:" + hex.EncodeToString(v.sha.Sum(nil)); got != v.digest {
			return fmt.Errorf("%s: %s, %s recorded: %w", v.name, got, v.digest, ErrDigestMismatch)
		}
	}
	return nil
}

func (v *verifyingReader) Close() error { return v.rc.Close() }

// ctxReader stops a copy when its context ends.
type ctxReader struct {
	ctx interface{ Err() error }
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// readMax reads all of r, an object of at most max bytes.
func readMax(r io.Reader, name string, max int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, max+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("read %s: over %d bytes", name, max)
	}
	return b, nil
}
