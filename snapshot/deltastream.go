package snapshot

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"path"
)

// PackStream is Pack for a layer that arrives as a stream rather than a
// directory: the full layer read from src (any compression, or none; for
// example what a sandbox CLI's `tar` verb wrote) is re-encoded, in one
// pass, as a layer with opts.Compression, its digests and a manifest. Its
// entries are checked as they pass (names, types: what Pack could not have
// written is refused with ErrUnsupported or ErrRefused).
//
// With opts.Base it writes a delta: entries are compared with Base.Files
// by the same quick check as Pack (type, mode, owner, size, mtime, link,
// xattrs), unchanged ones are skipped as they stream by, and removal
// whiteouts for base paths that are gone end the layer. A stream whose
// tool drops sub-second mtimes yields a larger delta, never a wrong one.
// opts.Index records the index of the whole tree (so deltas chain).
func PackStream(ctx context.Context, src io.Reader, w io.Writer, opts PackOptions) (*Manifest, error) {
	base := opts.Base
	if base != nil && len(base.Files) == 0 {
		return nil, fmt.Errorf("delta: base manifest %s has no file index; pack the base with Index (--index)", base.Digest)
	}
	if base == nil {
		base = &Manifest{} // a full layer: every entry differs from nothing
	}
	idx := make(map[string]FileInfo, len(base.Files))
	for _, f := range base.Files {
		idx[f.Path] = f
	}
	var read *countReader // the stream's bytes, for Progress
	if opts.Progress != nil {
		read = &countReader{r: src}
		src = read
	}
	in, err := openTar(src, DefaultMaxBytes)
	if err != nil {
		return nil, fmt.Errorf("pack stream: %w", err)
	}
	defer in.close()
	lw, err := newLayerWriter(w, opts.Compression, opts.Level)
	if err != nil {
		return nil, err
	}
	p := &packer{ctx: ctx, tw: lw.tw, tarN: lw.tarN, opts: opts, base: idx, seen: map[string]string{}, buf: make([]byte, 1<<20)}
	forced := map[string]bool{}  // directories newly opaque: everything below is written
	written := map[string]bool{} // paths written in full, for hardlinks to them
	err = eachEntry(ctx, in.tr, DefaultMaxBytes, func(h *tar.Header, sp *sparseFile, r io.Reader) error {
		if read != nil {
			defer func() { opts.Progress(read.n.Load()) }()
		}
		fi, dir, err := streamInfo(h)
		if err != nil {
			return err
		}
		force := false
		for q := fi.Path; ; q = path.Dir(q) {
			if forced[q] {
				force = true
				break
			}
			if q == "." {
				break
			}
		}
		if fi.Type == "opaque" {
			if _, ok := idx[fi.Path]; !ok {
				forced[dir], force = true, true
			}
		}
		if fi.Type == "hardlink" && written[fi.Link] {
			force = true
		}
		p.seen[fi.Path] = fi.Type
		if !force && p.unchanged(fi) {
			if fi.Type == "file" {
				fi.SHA256 = idx[fi.Path].SHA256
			}
			p.addIndex(fi)
			return nil
		}
		p.entries++
		written[fi.Path] = true
		if !opts.Index || h.Typeflag != tar.TypeReg || h.Size == 0 {
			if err := copyEntry(p.tw, lw.tarN, h, sp, r, p.buf); err != nil {
				return err
			}
			p.addIndex(fi)
			return nil
		}
		// The index has the sha256 of the file's content: its data, and
		// the zeros of its holes.
		sum := sha256.New()
		var fed io.Writer = sum
		var feeder *holeFeeder
		if sp != nil {
			feeder = newHoleFeeder(sum, sp.spans, h.Size)
			fed = feeder
		}
		if err := copyEntry(p.tw, lw.tarN, h, sp, io.TeeReader(r, fed), p.buf); err != nil {
			return err
		}
		if feeder != nil {
			feeder.close()
		}
		fi.SHA256 = hex.EncodeToString(sum.Sum(nil))
		p.addIndex(fi)
		return nil
	})
	if err == nil {
		err = in.finish()
	}
	if err == nil {
		err = p.writeRemovals()
	}
	m, err := lw.close(err, p.entries)
	if err != nil {
		return nil, fmt.Errorf("pack stream: %w", err)
	}
	m.Parent, m.ImageID, m.SandboxID, m.Base = opts.Parent, opts.ImageID, opts.SandboxID, base.Digest
	if opts.Index {
		m.Files = p.index
	}
	return m, nil
}

// streamInfo is the index entry of a tar entry, keyed like Pack's: a
// whiteout by the path it hides, an opaque marker by its own name (dir is
// then the directory it marks).
func streamInfo(h *tar.Header) (fi FileInfo, dir string, err error) {
	name, err := cleanEntryName(h.Name)
	if err != nil {
		return FileInfo{}, "", err
	}
	x := paxXattrs(h.PAXRecords)
	if target, opaque, ok, err := splitWhiteout(name, h); err != nil {
		return FileInfo{}, "", err
	} else if ok && opaque {
		return FileInfo{Path: name, Type: "opaque"}, target, nil
	} else if ok {
		return infoOf(target, "whiteout", h, nil), "", nil
	}
	switch h.Typeflag {
	case tar.TypeReg:
		return infoOf(name, "file", h, x), "", nil
	case tar.TypeDir:
		return infoOf(name, "dir", h, x), "", nil
	case tar.TypeSymlink:
		return infoOf(name, "symlink", h, x), "", nil
	case tar.TypeFifo:
		return infoOf(name, "fifo", h, x), "", nil
	case tar.TypeLink:
		link, err := cleanEntryName(h.Linkname)
		if err != nil {
			return FileInfo{}, "", err
		}
		fi := infoOf(name, "hardlink", h, x)
		fi.Link, fi.Size = link, 0
		return fi, "", nil
	case tar.TypeChar:
		if h.Devmajor == 0 && h.Devminor == 0 {
			return infoOf(name, "whiteout", h, nil), "", nil
		}
	}
	return FileInfo{}, "", unsupported(h.Name, "entry type %q cannot be in a layer", h.Typeflag)
}

// PackDelta is PackStream with opts.Base = base: the delta of the full
// layer read from full against base (nil base: a full layer).
func PackDelta(ctx context.Context, base *Manifest, full io.Reader, w io.Writer, opts PackOptions) (*Manifest, error) {
	opts.Base = base
	return PackStream(ctx, full, w, opts)
}
