package snapshot

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// PackOptions configures Pack. The zero value packs a full zstd layer at
// level 1 with no file index.
type PackOptions struct {
	Compression Compression // "" means Zstd
	Level       int         // compressor level; 0 means the fastest
	// Index records a FileInfo per entry, with the sha256 of each regular
	// file, in Manifest.Files. Pack templates with it so that sandboxes made
	// from them can save deltas.
	Index bool
	// Base, when set, makes Pack write a delta: only entries that differ
	// from Base.Files, plus whiteouts for base paths that are gone. Base
	// must have been packed with Index.
	Base *Manifest
	// Parent, ImageID and SandboxID are copied into the manifest.
	Parent, ImageID, SandboxID string
	// Progress, if set, is called after each entry with the tar bytes
	// written so far (Pack), or the bytes of the source stream read so
	// far (PackStream, whose entries a delta may skip).
	Progress func(tarBytes int64)
}

// Pack writes the directory dir as a compressed layer to w and returns its
// manifest. Digests and sizes are computed while the bytes stream; w sees
// every byte exactly once. Pack does not close w.
func Pack(ctx context.Context, dir string, w io.Writer, opts PackOptions) (*Manifest, error) {
	var base map[string]FileInfo
	if opts.Base != nil {
		if len(opts.Base.Files) == 0 {
			return nil, fmt.Errorf("delta: base manifest %s has no file index; pack the base with Index (--index)", opts.Base.Digest)
		}
		base = make(map[string]FileInfo, len(opts.Base.Files))
		for _, f := range opts.Base.Files {
			base[f.Path] = f
		}
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return nil, fmt.Errorf("pack: %w", err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("pack: %s is not a directory", dir)
	}

	lw, err := newLayerWriter(w, opts.Compression, opts.Level)
	if err != nil {
		return nil, err
	}
	p := &packer{
		ctx:    ctx,
		root:   dir,
		tw:     lw.tw,
		tarN:   lw.tarN,
		opts:   opts,
		base:   base,
		seen:   map[string]string{},
		inodes: map[inodeKey]*inodeRec{},
		buf:    make([]byte, 1<<20),
	}
	if opts.Index {
		p.hasher = sha256.New()
	}
	err = p.walkDir(".", st, false)
	if err == nil && base != nil {
		err = p.writeRemovals()
	}
	m, err := lw.close(err, p.entries)
	if err != nil {
		return nil, fmt.Errorf("pack %s: %w", dir, err)
	}
	m.Parent, m.ImageID, m.SandboxID = opts.Parent, opts.ImageID, opts.SandboxID
	if opts.Base != nil {
		m.Base = opts.Base.Digest
	}
	if opts.Index {
		m.Files = p.index
	}
	return m, nil
}

type inodeKey struct{ dev, ino uint64 }

type inodeRec struct {
	path    string
	emitted bool // written in full in this layer
}

// packer walks one source tree into one tar writer.
type packer struct {
	ctx     context.Context
	root    string
	tw      *tar.Writer
	tarN    *countWriter // tar bytes written so far
	opts    PackOptions
	base    map[string]FileInfo // delta base index, nil for a full layer
	seen    map[string]string   // delta only: paths present now, with their type
	inodes  map[inodeKey]*inodeRec
	index   []FileInfo
	entries int64
	buf     []byte
	hasher  hash.Hash
}

// walkDir writes a directory's header, its opaque marker if any, then its
// children in byte order. forceAll writes everything below even if a delta
// base has it unchanged (the directory became opaque).
func (p *packer) walkDir(rel string, st os.FileInfo, forceAll bool) error {
	full := filepath.Join(p.root, rel)
	xattrs, opaque, err := readXattrs(full, rel)
	if err != nil {
		return err
	}
	hdr := p.baseHeader(rel, st)
	hdr.Typeflag = tar.TypeDir
	hdr.Name = rel + "/"
	if rel == "." {
		hdr.Name = "./"
	}
	setPAXXattrs(hdr, xattrs)
	markLiteral(hdr, rel)
	fi := infoOf(rel, "dir", hdr, xattrs)
	if err := p.emit(hdr, fi, nil, forceAll); err != nil {
		return err
	}
	if opaque || p.base != nil {
		marker := path.Join(rel, opaqueMarker)
		ofi := FileInfo{Path: marker, Type: "opaque"}
		_, wasOpaque := p.base[marker]
		switch {
		case opaque && p.base != nil && !wasOpaque:
			// Newly opaque: the marker hides the whole base directory, so
			// everything below it must be written again.
			forceAll = true
		case !opaque && wasOpaque && !forceAll:
			return unsupported(rel, "directory was opaque in the base and no longer is; pack a full layer")
		}
		if opaque {
			oh := &tar.Header{Typeflag: tar.TypeReg, Name: marker, Mode: 0, ModTime: hdr.ModTime, Format: tar.FormatPAX}
			if err := p.emit(oh, ofi, nil, forceAll); err != nil {
				return err
			}
		}
	}
	ents, err := os.ReadDir(full)
	if err != nil {
		return err
	}
	names := make([]string, len(ents))
	for i, e := range ents {
		names[i] = e.Name()
	}
	slices.Sort(names)
	for _, n := range names {
		if err := p.ctx.Err(); err != nil {
			return context.Cause(p.ctx)
		}
		if err := p.walkEntry(path.Join(rel, n), forceAll); err != nil {
			return err
		}
	}
	return nil
}

// walkEntry writes one non-root path, translating overlay whiteouts and
// deduplicating hardlinks by (device, inode).
func (p *packer) walkEntry(rel string, forceAll bool) error {
	full := filepath.Join(p.root, rel)
	st, err := os.Lstat(full)
	if err != nil {
		return err
	}
	sys := st.Sys().(*syscall.Stat_t)
	mode := st.Mode()
	switch {
	case mode.IsDir():
		return p.walkDir(rel, st, forceAll)
	case mode&os.ModeSocket != 0:
		return nil // sockets cannot live in a tar; they die with the sandbox
	case mode&os.ModeCharDevice != 0 && sys.Rdev == 0:
		return p.writeWhiteout(rel, st, forceAll)
	case mode&os.ModeDevice != 0:
		return unsupported(rel, "device node %d:%d cannot be saved in a layer", unixMajor(sys.Rdev), unixMinor(sys.Rdev))
	}
	xattrs, _, err := readXattrs(full, rel)
	if err != nil {
		return err
	}
	hdr := p.baseHeader(rel, st)
	hdr.Name = rel
	setPAXXattrs(hdr, xattrs)
	markLiteral(hdr, rel)
	switch {
	case mode&os.ModeSymlink != 0:
		target, err := os.Readlink(full)
		if err != nil {
			return err
		}
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, target
		return p.emit(hdr, infoOf(rel, "symlink", hdr, xattrs), nil, forceAll)
	case mode&os.ModeNamedPipe != 0:
		hdr.Typeflag = tar.TypeFifo
		return p.emit(hdr, infoOf(rel, "fifo", hdr, xattrs), nil, forceAll)
	case !mode.IsRegular():
		return unsupported(rel, "file type %v cannot be saved in a layer", mode.Type())
	}
	key := inodeKey{uint64(sys.Dev), uint64(sys.Ino)}
	if sys.Nlink > 1 {
		if rec, ok := p.inodes[key]; ok {
			hdr.Typeflag, hdr.Linkname = tar.TypeLink, rec.path
			fi := infoOf(rel, "hardlink", hdr, xattrs)
			fi.Size = 0
			if p.base != nil && !rec.emitted && p.unchanged(fi) {
				p.seen[rel] = fi.Type
				p.addIndex(fi)
				return nil
			}
			// A new link to an unchanged first path names a base path:
			// applying onto the base, or MergeLayers, resolves it.
			hdr.Size = 0
			return p.emit(hdr, fi, nil, forceAll || rec.emitted)
		}
		rec := &inodeRec{path: rel}
		p.inodes[key] = rec
		return p.writeFile(full, rel, hdr, xattrs, forceAll, rec)
	}
	return p.writeFile(full, rel, hdr, xattrs, forceAll, nil)
}

func (p *packer) writeFile(full, rel string, hdr *tar.Header, xattrs map[string]string, force bool, rec *inodeRec) error {
	hdr.Typeflag, hdr.Linkname = tar.TypeReg, ""
	fi := infoOf(rel, "file", hdr, xattrs)
	if p.base != nil && !force && p.unchanged(fi) {
		fi.SHA256 = p.base[rel].SHA256
		p.seen[rel] = fi.Type
		p.addIndex(fi)
		return nil
	}
	if rec != nil {
		rec.emitted = true
	}
	f, err := os.Open(full)
	if err != nil {
		return err
	}
	defer f.Close()
	if spans, sparse, err := holesOf(f, hdr.Size); err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	} else if sparse {
		return p.emitSparse(hdr, fi, f, spans)
	}
	return p.emit(hdr, fi, f, true)
}

// holesOf says whether f, size bytes long, has holes (it takes fewer
// blocks than its size) and if so lists its data, in at most
// maxSparseSpans spans.
func holesOf(f *os.File, size int64) (spans []Span, sparse bool, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, false, err
	}
	if size == 0 || st.Blocks*512 >= size {
		return nil, false, nil
	}
	// Data not yet written back is not always found by SEEK_DATA (ext4
	// beneath a sandbox's overlay reports a hole over its delayed
	// allocations): this file's is written back first. A file with holes
	// is mostly holes, so this is quick.
	if err := unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WAIT_BEFORE|unix.SYNC_FILE_RANGE_WRITE|unix.SYNC_FILE_RANGE_WAIT_AFTER); err != nil {
		return nil, false, fmt.Errorf("write back before finding holes: %w", err)
	}
	if spans, err = DataSpans(f, size); err != nil {
		return nil, false, err
	}
	if dataBytes(spans) == size {
		return nil, false, nil // fewer blocks than bytes, but no hole: compressed, or inline
	}
	return coalesceSpans(spans, maxSparseSpans), true, nil
}

// emitSparse writes a file with holes as a sparse entry: its data spans
// only (sparse.go).
func (p *packer) emitSparse(hdr *tar.Header, fi FileInfo, f *os.File, spans []Span) error {
	if p.base != nil {
		p.seen[fi.Path] = fi.Type
	}
	var data io.Reader = &spanReader{f: f, spans: slices.Clone(spans)}
	var feeder *holeFeeder
	if p.hasher != nil {
		p.hasher.Reset()
		feeder = newHoleFeeder(p.hasher, spans, hdr.Size)
		data = io.TeeReader(data, feeder)
	}
	if err := writeSparseEntry(p.tw, p.tarN, hdr, spans, data, p.buf); err != nil {
		return fmt.Errorf("%s: %w", fi.Path, err)
	}
	p.entries++
	if feeder != nil {
		feeder.close()
		fi.SHA256 = hex.EncodeToString(p.hasher.Sum(nil))
	}
	p.addIndex(fi)
	if p.opts.Progress != nil {
		p.opts.Progress(p.tarN.n)
	}
	return nil
}

// spanReader reads the data of spans of f, in order.
type spanReader struct {
	f     *os.File
	spans []Span
}

func (r *spanReader) Read(b []byte) (int, error) {
	for len(r.spans) > 0 && r.spans[0].Length == 0 {
		r.spans = r.spans[1:]
	}
	if len(r.spans) == 0 {
		return 0, io.EOF
	}
	s := &r.spans[0]
	n, err := r.f.ReadAt(b[:min(int64(len(b)), s.Length)], s.Offset)
	s.Offset, s.Length = s.Offset+int64(n), s.Length-int64(n)
	if err == io.EOF {
		if n > 0 {
			err = nil
		} else {
			err = fmt.Errorf("file shrank while packing: %w", io.ErrUnexpectedEOF)
		}
	}
	return n, err
}

// emit writes one header and its content, unless this is a delta and the
// entry is unchanged from the base (and not forced).
func (p *packer) emit(hdr *tar.Header, fi FileInfo, content io.Reader, force bool) error {
	if p.base != nil {
		p.seen[fi.Path] = fi.Type
		if !force && p.unchanged(fi) {
			if fi.Type == "file" {
				fi.SHA256 = p.base[fi.Path].SHA256
			}
			p.addIndex(fi)
			return nil
		}
	}
	if err := p.tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("%s: %w", fi.Path, err)
	}
	p.entries++
	if content != nil {
		var dst io.Writer = p.tw
		if p.hasher != nil {
			p.hasher.Reset()
			dst = io.MultiWriter(p.tw, p.hasher)
		}
		n, err := io.CopyBuffer(onlyWriter{dst}, io.LimitReader(content, hdr.Size), p.buf)
		if err != nil {
			return fmt.Errorf("%s: %w", fi.Path, err)
		}
		if n != hdr.Size {
			return fmt.Errorf("%s: file shrank while packing (%d of %d bytes)", fi.Path, n, hdr.Size)
		}
		if p.hasher != nil {
			fi.SHA256 = hex.EncodeToString(p.hasher.Sum(nil))
		}
	}
	p.addIndex(fi)
	if p.opts.Progress != nil {
		p.opts.Progress(p.tarN.n)
	}
	return nil
}

func (p *packer) addIndex(fi FileInfo) {
	if p.opts.Index {
		p.index = append(p.index, fi)
	}
}

// unchanged is the quick check: same type, mode, owner, size, mtime (ns),
// link and xattrs as the base. Content is not reread.
func (p *packer) unchanged(fi FileInfo) bool {
	b, ok := p.base[fi.Path]
	if !ok {
		return false
	}
	return b.Type == fi.Type && b.Mode == fi.Mode && b.UID == fi.UID && b.GID == fi.GID &&
		b.Size == fi.Size && b.Mtime == fi.Mtime && b.Link == fi.Link && b.Xattrs == fi.Xattrs
}

func (p *packer) writeWhiteout(rel string, st os.FileInfo, force bool) error {
	hdr := p.baseHeader(rel, st)
	dir, base := path.Split(rel)
	hdr.Name = dir + whiteoutPrefix + base
	hdr.Typeflag = tar.TypeReg
	fi := infoOf(rel, "whiteout", hdr, nil)
	return p.emit(hdr, fi, nil, force)
}

// writeRemovals ends a delta with a whiteout for each topmost base path
// that is gone, marked as a removal so MergeLayers drops it entirely.
func (p *packer) writeRemovals() error {
	paths := make([]string, 0, len(p.base))
	for k, fi := range p.base {
		if _, ok := p.seen[k]; ok {
			continue
		}
		if fi.Type == "opaque" {
			if d := path.Dir(k); p.seen[d] == "dir" {
				return unsupported(d, "directory was opaque in the base and no longer is; pack a full layer")
			}
			continue
		}
		paths = append(paths, k)
	}
	slices.Sort(paths)
	for _, rel := range paths {
		if parent := path.Dir(rel); parent != "." && p.seen[parent] != "dir" {
			continue // the parent is gone or no longer a directory: that covers this path
		}
		dir, base := path.Split(rel)
		hdr := &tar.Header{
			Typeflag:   tar.TypeReg,
			Name:       dir + whiteoutPrefix + base,
			ModTime:    time.Unix(0, 0),
			Format:     tar.FormatPAX,
			PAXRecords: map[string]string{paxRemovedKey: "1"},
		}
		if err := p.tw.WriteHeader(hdr); err != nil {
			return err
		}
		p.entries++
	}
	return nil
}

func (p *packer) baseHeader(rel string, st os.FileInfo) *tar.Header {
	sys := st.Sys().(*syscall.Stat_t)
	mode := int64(st.Mode().Perm())
	if st.Mode()&os.ModeSetuid != 0 {
		mode |= 0o4000
	}
	if st.Mode()&os.ModeSetgid != 0 {
		mode |= 0o2000
	}
	if st.Mode()&os.ModeSticky != 0 {
		mode |= 0o1000
	}
	h := &tar.Header{
		Name:    rel,
		Mode:    mode,
		Uid:     int(sys.Uid),
		Gid:     int(sys.Gid),
		ModTime: time.Unix(sys.Mtim.Sec, sys.Mtim.Nsec),
		Format:  tar.FormatPAX,
	}
	if st.Mode().IsRegular() {
		h.Size = st.Size()
	}
	return h
}

func setPAXXattrs(h *tar.Header, x map[string]string) {
	if len(x) == 0 {
		return
	}
	if h.PAXRecords == nil {
		h.PAXRecords = map[string]string{}
	}
	for k, v := range x {
		h.PAXRecords[paxXattr+k] = v
	}
}

func infoOf(rel, typ string, h *tar.Header, x map[string]string) FileInfo {
	return FileInfo{
		Path:   rel,
		Type:   typ,
		Mode:   uint32(h.Mode),
		UID:    h.Uid,
		GID:    h.Gid,
		Size:   h.Size,
		Mtime:  h.ModTime.UnixNano(),
		Link:   h.Linkname,
		Xattrs: xattrsDigest(x),
	}
}

func unixMajor(dev uint64) uint64 { return (dev >> 8) & 0xfff }
func unixMinor(dev uint64) uint64 { return (dev & 0xff) | ((dev >> 12) & 0xfff00) }
