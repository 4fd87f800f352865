package snapshot

import (
	"archive/tar"
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path"
)

// MergeOptions configures MergeLayers.
type MergeOptions struct {
	Compression Compression // of the output; "" means Zstd
	Level       int
	MaxBytes    int64 // cap on each input's tar stream; 0 means DefaultMaxBytes
	// TempDir is where the delta is spooled while the base streams: a
	// place no sandbox sees (it holds a sandbox's files). "" means
	// os.TempDir.
	TempDir string
}

// deltaSet is what a delta layer changes, keyed by clean path.
type deltaSet struct {
	replaced map[string]bool // paths the delta writes an entry for
	hidden   []string        // whiteouts: the path and everything below go
	opaque   []string        // directories whose base contents go
	nondirs  map[string]bool // paths the delta makes non-directories
}

func (d *deltaSet) drops(p string) bool {
	if d.replaced[p] {
		return true
	}
	for _, h := range d.hidden {
		if hasPrefixPath(p, h) {
			return true
		}
	}
	for _, o := range d.opaque {
		if p != o && hasPrefixPath(p, o) {
			return true
		}
	}
	for q := path.Dir(p); q != "."; q = path.Dir(q) {
		if d.nondirs[q] {
			return true
		}
	}
	return false
}

// MergeLayers folds a delta (from Pack with PackOptions.Base) onto the base
// layer it was made against and writes the equivalent full layer to w. The
// delta's tar stream is spooled to a temporary file (it is the small one)
// while its changes are collected; the base then streams through once,
// minus what the delta replaces or removes, followed by the delta's
// entries. Whiteouts the delta marks as removals are dropped; other
// whiteouts are kept, as they may hide files of the image below.
func MergeLayers(ctx context.Context, base, delta io.Reader, w io.Writer, opts MergeOptions) (*Manifest, error) {
	if opts.MaxBytes <= 0 {
		opts.MaxBytes = DefaultMaxBytes
	}
	spool, err := os.CreateTemp(opts.TempDir, "sandgate-delta-*.tar")
	if err != nil {
		return nil, fmt.Errorf("merge: %w", err)
	}
	defer os.Remove(spool.Name())
	defer spool.Close()
	ds := &deltaSet{replaced: map[string]bool{}, nondirs: map[string]bool{}}
	dr, err := openTar(delta, opts.MaxBytes)
	if err != nil {
		return nil, fmt.Errorf("merge: delta: %w", err)
	}
	sw := bufio.NewWriterSize(spool, 1<<20)
	tw := tar.NewWriter(sw)
	buf := make([]byte, 1<<20)
	err = eachEntry(ctx, dr.tr, opts.MaxBytes, func(h *tar.Header, sp *sparseFile, r io.Reader) error {
		name, err := cleanEntryName(h.Name)
		if err != nil {
			return err
		}
		if target, opaque, ok, err := splitWhiteout(name, h); err != nil {
			return err
		} else if ok && opaque {
			ds.opaque = append(ds.opaque, target)
			ds.replaced[name] = true
		} else if ok {
			ds.hidden = append(ds.hidden, target)
			ds.replaced[name] = true
		} else {
			ds.replaced[name] = true
			if h.Typeflag != tar.TypeDir {
				ds.nondirs[name] = true
			}
		}
		return copyEntry(tw, sw, h, sp, r, buf)
	})
	if err == nil {
		err = dr.finish()
	}
	dr.close()
	if err == nil {
		err = tw.Close()
	}
	if err == nil {
		err = sw.Flush()
	}
	if err != nil {
		return nil, fmt.Errorf("merge: delta: %w", err)
	}

	lw, err := newLayerWriter(w, opts.Compression, opts.Level)
	if err != nil {
		return nil, err
	}
	var entries int64
	br, err := openTar(base, opts.MaxBytes)
	if err != nil {
		_, _ = lw.close(err, entries) // stops the compressor's goroutines
		return nil, fmt.Errorf("merge: base: %w", err)
	}
	err = eachEntry(ctx, br.tr, opts.MaxBytes, func(h *tar.Header, sp *sparseFile, r io.Reader) error {
		name, err := cleanEntryName(h.Name)
		if err != nil {
			return err
		}
		key := name
		if target, opaque, ok, _ := splitWhiteout(name, h); ok && !opaque {
			key = target // a base whiteout goes if the delta writes that path
			if ds.replaced[target] {
				return nil
			}
		}
		if ds.drops(key) || ds.drops(name) {
			return nil
		}
		if h.Typeflag == tar.TypeLink {
			if t, err := cleanEntryName(h.Linkname); err == nil && ds.drops(t) {
				return refuse(h.Name, "hardlink to %q, which the delta replaces without rewriting this link", h.Linkname)
			}
		}
		entries++
		return copyEntry(lw.tw, lw.tarN, h, sp, r, buf)
	})
	if err == nil {
		err = br.finish()
	}
	br.close()
	if err != nil {
		_, _ = lw.close(err, entries)
		return nil, fmt.Errorf("merge: base: %w", err)
	}
	if _, err := spool.Seek(0, io.SeekStart); err != nil {
		_, _ = lw.close(err, entries)
		return nil, err
	}
	err = eachEntry(ctx, tar.NewReader(newSparseFilter(bufio.NewReaderSize(spool, 1<<20))), opts.MaxBytes, func(h *tar.Header, sp *sparseFile, r io.Reader) error {
		if h.PAXRecords[paxRemovedKey] == "1" {
			return nil
		}
		entries++
		return copyEntry(lw.tw, lw.tarN, h, sp, r, buf)
	})
	m, err := lw.close(err, entries)
	if err != nil {
		return nil, fmt.Errorf("merge: %w", err)
	}
	return m, nil
}

// tarStream is a decompressing tar reader over a layer.
type tarStream struct {
	tr  *tar.Reader
	tar io.Reader     // the capped decompressed stream tr reads
	br  *bufio.Reader // the compressed stream dec reads
	dec io.Closer
}

func (t *tarStream) close() { t.dec.Close() }

// finish reads the rest of the stream after the tar end marker: the tar
// padding, the end of the compressed stream and at most maxTrailing bytes
// after it, so that a verifying source (see the store package) reaches EOF
// and reports a digest mismatch, as Unpack does.
func (t *tarStream) finish() error {
	if _, err := io.Copy(io.Discard, t.tar); err != nil {
		return fmt.Errorf("read tar trailer: %w", err)
	}
	if n, err := io.Copy(io.Discard, io.LimitReader(t.br, maxTrailing+1)); err != nil {
		return fmt.Errorf("read stream end: %w", err)
	} else if n > maxTrailing {
		return refuse("(stream)", "more than %d bytes after the end of the layer", maxTrailing)
	}
	return nil
}

func openTar(r io.Reader, max int64) (*tarStream, error) {
	br := bufio.NewReaderSize(r, 1<<20)
	dec, _, err := newDecompressor(br)
	if err != nil {
		return nil, err
	}
	capped := &cappedReader{r: dec, max: max}
	return &tarStream{tr: tar.NewReader(newSparseFilter(capped)), tar: capped, br: br, dec: dec}, nil
}

// eachEntry calls fn with each entry of tr, its sparse map read when it
// is a sparse file (sparseOf: r then yields the data of its spans),
// refusing entries whose data add up to more than max bytes (see
// checkSizes).
func eachEntry(ctx context.Context, tr *tar.Reader, max int64, fn func(h *tar.Header, sp *sparseFile, r io.Reader) error) error {
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if h.Typeflag == tar.TypeXGlobalHeader {
			continue
		}
		sp, err := sparseOf(h, tr)
		if err != nil {
			return err
		}
		if err := checkSizes(h, sp, &total, max); err != nil {
			return err
		}
		if err := fn(h, sp, tr); err != nil {
			return err
		}
	}
}

// copyEntry writes an entry read by eachEntry to tw (raw: the stream
// beneath it), a sparse file as one.
func copyEntry(tw *tar.Writer, raw io.Writer, h *tar.Header, sp *sparseFile, r io.Reader, buf []byte) error {
	if sp != nil {
		return writeSparseEntry(tw, raw, h, sp.spans, r, buf)
	}
	h.Format = tar.FormatPAX
	if err := tw.WriteHeader(h); err != nil {
		return fmt.Errorf("%s: %w", h.Name, err)
	}
	if h.Size > 0 {
		if _, err := io.CopyBuffer(onlyWriter{tw}, io.LimitReader(r, h.Size), buf); err != nil {
			return fmt.Errorf("%s: %w", h.Name, err)
		}
	}
	return nil
}
