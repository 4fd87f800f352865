package snapshot

import (
	"archive/tar"
	"bufio"
	"context"
	"fmt"
	"io"
)

// Inspect reads a layer without applying it, calling fn with each entry's
// header (fn may be nil), and returns what it measured: compression,
// digests, sizes and entry count. Entry content is read and discarded.
// Names are reported as stored; nothing is validated beyond the tar format.
func Inspect(ctx context.Context, r io.Reader, fn func(*tar.Header) error) (*ApplyResult, error) {
	hr := newHashingReader(r)
	frames := &zstdFrames{}
	br := bufio.NewReaderSize(io.TeeReader(hr, frames), 1<<20)
	dec, comp, err := newDecompressor(br)
	if err != nil {
		return nil, err
	}
	defer dec.Close()
	tarRead := newHashingReader(dec)
	tr := tar.NewReader(tarRead)
	var entries int64
	for {
		if err := ctx.Err(); err != nil {
			return nil, context.Cause(ctx)
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("inspect: entry %d: %w", entries+1, err)
		}
		entries++
		if fn != nil {
			if err := fn(hdr); err != nil {
				return nil, err
			}
		}
	}
	if _, err := io.Copy(io.Discard, tarRead); err != nil {
		return nil, fmt.Errorf("inspect: %w", err)
	}
	if _, err := io.Copy(io.Discard, br); err != nil {
		return nil, fmt.Errorf("inspect: %w", err)
	}
	return &ApplyResult{
		Compression: comp,
		Digest:      hr.digest(),
		Size:        hr.n.Load(),
		TarDigest:   tarRead.digest(),
		TarSize:     tarRead.n.Load(),
		Entries:     entries,

		StreamChecksum: streamChecksum(comp, frames),
	}, nil
}
