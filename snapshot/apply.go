package snapshot

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Mode says how Unpack treats whiteouts.
type Mode string

const (
	// ModeTree applies the layer as a plain directory tree: a whiteout
	// deletes what it names and an opaque marker empties its directory.
	ModeTree Mode = "tree"
	// ModeUpper restores an overlayfs upper: whiteouts become 0/0
	// character devices and opaque markers the trusted.overlay.opaque
	// attribute. It needs root.
	ModeUpper Mode = "upper"
)

// ParseMode accepts "tree" and "upper".
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeTree:
		return ModeTree, nil
	case ModeUpper:
		return ModeUpper, nil
	}
	return "", fmt.Errorf("mode %q: want upper or tree", s)
}

// Default caps for Unpack.
const (
	DefaultMaxBytes   = 64 << 30 // decompressed tar bytes
	DefaultMaxEntries = 4 << 20
)

// ApplyOptions configures Unpack. The zero value applies a layer as a plain
// tree with the default caps, refuses setuid/setgid bits and file
// capabilities, and does not check digests.
type ApplyOptions struct {
	Mode Mode // "" means ModeTree
	// Trusted allows setuid/setgid bits and security.capability: set it
	// only for layers the caller made itself from a trusted tree.
	Trusted    bool
	MaxBytes   int64 // cap on the decompressed tar stream; 0 means DefaultMaxBytes
	MaxEntries int64 // cap on tar entries; 0 means DefaultMaxEntries
	// Digest and TarDigest, when set ("sha256:<hex>"), must match the
	// compressed stream and the tar stream, or nothing is applied.
	Digest, TarDigest string
	// NoChown keeps files owned by the caller. Ownership is only restored
	// when running as root.
	NoChown bool
	// Progress, if set, is called after each entry with the compressed
	// bytes read so far.
	Progress func(read int64)
}

// ApplyResult describes the layer Unpack applied, as measured while reading.
type ApplyResult struct {
	Compression Compression
	Digest      string
	Size        int64
	TarDigest   string
	TarSize     int64
	Entries     int64
	// StreamChecksum names the integrity check the compressed stream
	// carried itself, verified while reading: "crc32" for gzip (always
	// there), "xxhash64" when every zstd frame carried a content checksum,
	// "" when there was none (a bare tar, or zstd frames without
	// checksums, as Pack writes them: a manifest's sha256 covers those).
	StreamChecksum string
}

// maxTrailing bounds the bytes accepted after the end of a compressed stream.
const maxTrailing = 1 << 20

// maxDirMeta bounds the directory metadata (names and attributes) held
// until finishDirs applies it: a directory's mode and times can only be set
// once its contents stop changing, so it is kept for the whole stream. A
// variable so that a test can prove the bound without 64 MiB of fixture.
var maxDirMeta int64 = 64 << 20

// dirMetaOverhead is what one retained directory costs besides its name
// and attributes, for the maxDirMeta budget.
const dirMetaOverhead = 128

// Unpack applies the layer read from r to dir. Everything is extracted into
// a fresh sibling directory first; only when the whole stream has been read,
// checked and verified is it renamed to dir (if dir is missing or empty) or
// merged into dir. A refused or broken archive leaves dir untouched.
// r is read to EOF, so a verifying reader (see the store package) gets to
// check its digest before anything becomes visible.
func Unpack(ctx context.Context, r io.Reader, dir string, opts ApplyOptions) (*ApplyResult, error) {
	if opts.Mode == "" {
		opts.Mode = ModeTree
	}
	if opts.Mode != ModeTree && opts.Mode != ModeUpper {
		return nil, fmt.Errorf("unpack: mode %q: want upper or tree", opts.Mode)
	}
	if opts.MaxBytes <= 0 {
		opts.MaxBytes = DefaultMaxBytes
	}
	if opts.MaxEntries <= 0 {
		opts.MaxEntries = DefaultMaxEntries
	}
	target, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("unpack: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return nil, fmt.Errorf("unpack: %w", err)
	}
	staging, err := os.MkdirTemp(filepath.Dir(target), "."+filepath.Base(target)+".unpack-")
	if err != nil {
		return nil, fmt.Errorf("unpack: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			os.RemoveAll(staging)
		}
	}()
	root, err := os.OpenRoot(staging)
	if err != nil {
		return nil, fmt.Errorf("unpack: %w", err)
	}
	defer root.Close()

	a := &applier{
		ctx:      ctx,
		root:     root,
		opts:     opts,
		chown:    !opts.NoChown && os.Geteuid() == 0,
		symlinks: map[string]bool{},
		dirIdx:   map[string]int{},
		deferred: map[string]bool{},
		buf:      make([]byte, 1<<20),
	}
	if st, err := os.Lstat(target); err == nil && st.IsDir() {
		empty, err := isEmptyDir(target)
		if err != nil {
			return nil, fmt.Errorf("unpack: %w", err)
		}
		a.onto = !empty
	}
	res, err := a.read(r)
	a.dropDirFd()
	if err != nil {
		return nil, fmt.Errorf("unpack: %w", err)
	}
	if err := a.finishDirs(root); err != nil {
		return nil, fmt.Errorf("unpack: %w", err)
	}
	if err := commit(staging, target, a); err != nil {
		return nil, fmt.Errorf("unpack into %s: %w", target, err)
	}
	committed = true
	return res, nil
}

// applier extracts one tar stream into a staging root.
type applier struct {
	ctx       context.Context
	root      *os.Root
	opts      ApplyOptions
	chown     bool
	symlinks  map[string]bool // paths this archive made symlinks
	dirs      []*dirMeta      // explicit directory entries, metadata applied last
	dirIdx    map[string]int
	dirBytes  int64           // retained size of dirs, against maxDirMeta
	onto      bool            // applying onto a non-empty target: merge, not rename
	links     [][2]string     // hardlinks (target, name) to existing paths of the target
	deferred  map[string]bool // names of links: no later entry may be at or below one
	whiteouts []string        // paths to delete from an existing target
	opaques   []string        // directories whose existing target contents go
	entries   int64
	total     int64 // sum of entry sizes as extracted, against MaxBytes
	buf       []byte
	compRead  *hashingReader
	cached    *os.File // dirFd's cache
	cachedDir string
}

func (a *applier) read(r io.Reader) (*ApplyResult, error) {
	a.compRead = newHashingReader(r)
	frames := &zstdFrames{}
	br := bufio.NewReaderSize(io.TeeReader(a.compRead, frames), 1<<20)
	dec, comp, err := newDecompressor(br)
	if err != nil {
		return nil, err
	}
	defer dec.Close()
	tarRead := newHashingReader(&cappedReader{r: dec, max: a.opts.MaxBytes})
	ra := newReadAhead(tarRead, 1<<20, 4)
	defer ra.close() // before dec.Close: the goroutine reads dec
	tr := tar.NewReader(newSparseFilter(ra))
	for {
		if err := a.ctx.Err(); err != nil {
			return nil, context.Cause(a.ctx)
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read tar after %d entries: %w", a.entries, err)
		}
		a.entries++
		if a.entries > a.opts.MaxEntries {
			return nil, refuse(hdr.Name, "more than %d entries", a.opts.MaxEntries)
		}
		if err := a.apply(hdr, tr); err != nil {
			return nil, err
		}
		if a.opts.Progress != nil {
			a.opts.Progress(a.compRead.n.Load())
		}
	}
	// Read the tar padding and the rest of the compressed stream so that
	// digests cover every byte and a verifying source reaches EOF.
	if _, err := io.CopyBuffer(io.Discard, ra, a.buf); err != nil {
		return nil, fmt.Errorf("read tar trailer: %w", err)
	}
	ra.close() // the goroutine has returned at EOF: br and the counters are ours again
	if n, err := io.CopyBuffer(io.Discard, io.LimitReader(br, maxTrailing+1), a.buf); err != nil {
		return nil, fmt.Errorf("read stream end: %w", err)
	} else if n > maxTrailing {
		return nil, refuse("(stream)", "more than %d bytes after the end of the layer", maxTrailing)
	}
	res := &ApplyResult{
		Compression: comp,
		Digest:      a.compRead.digest(),
		Size:        a.compRead.n.Load(),
		TarDigest:   tarRead.digest(),
		TarSize:     tarRead.n.Load(),
		Entries:     a.entries,

		StreamChecksum: streamChecksum(comp, frames),
	}
	if a.opts.Digest != "" && a.opts.Digest != res.Digest {
		return nil, fmt.Errorf("layer digest %s, want %s: %w", res.Digest, a.opts.Digest, ErrDigestMismatch)
	}
	if a.opts.TarDigest != "" && a.opts.TarDigest != res.TarDigest {
		return nil, fmt.Errorf("tar digest %s, want %s: %w", res.TarDigest, a.opts.TarDigest, ErrDigestMismatch)
	}
	return res, nil
}

func (a *applier) apply(hdr *tar.Header, content io.Reader) error {
	if hdr.Typeflag == tar.TypeXGlobalHeader {
		return nil
	}
	sp, err := sparseOf(hdr, content)
	if err != nil {
		return err
	}
	name, err := cleanEntryName(hdr.Name)
	if err != nil {
		return err
	}
	if err := checkSizes(hdr, sp, &a.total, a.opts.MaxBytes); err != nil {
		return err
	}
	if hdr.Mode&0o6000 != 0 && !a.opts.Trusted {
		return refuse(hdr.Name, "setuid/setgid bits on an untrusted layer")
	}
	xattrs, err := a.checkXattrs(hdr)
	if err != nil {
		return err
	}
	if target, opaque, ok, err := splitWhiteout(name, hdr); err != nil {
		return err
	} else if ok {
		if opaque {
			return a.opaque(target, hdr)
		}
		return a.whiteout(target, hdr, hdr.PAXRecords[paxRemovedKey] == "1")
	}
	if name == "." {
		if hdr.Typeflag != tar.TypeDir {
			return refuse(hdr.Name, "the layer root must be a directory")
		}
		return a.dir(name, hdr)
	}
	if err := a.prepare(name, hdr.Typeflag == tar.TypeDir); err != nil {
		return err
	}
	switch hdr.Typeflag {
	case tar.TypeReg:
		return a.file(name, hdr, sp, content, xattrs)
	case tar.TypeDir:
		return a.dir(name, hdr)
	case tar.TypeSymlink:
		return a.symlink(name, hdr, xattrs)
	case tar.TypeLink:
		return a.hardlink(name, hdr)
	case tar.TypeFifo:
		return a.special(name, hdr, xattrs, func(fd int, base string) error {
			return unix.Mkfifoat(fd, base, uint32(hdr.Mode&0o777))
		})
	case tar.TypeChar:
		if hdr.Devmajor == 0 && hdr.Devminor == 0 {
			return a.whiteout(name, hdr, false) // an overlay whiteout stored raw
		}
		return refuse(hdr.Name, "character device %d:%d", hdr.Devmajor, hdr.Devminor)
	case tar.TypeBlock:
		return refuse(hdr.Name, "block device %d:%d", hdr.Devmajor, hdr.Devminor)
	}
	return refuse(hdr.Name, "unsupported entry type %q", hdr.Typeflag)
}

// checkXattrs returns the attributes an entry may set, refusing the rest.
func (a *applier) checkXattrs(hdr *tar.Header) (map[string]string, error) {
	x := paxXattrs(hdr.PAXRecords)
	if len(x) > maxXattrsEntry {
		return nil, refuse(hdr.Name, "%d xattrs", len(x))
	}
	for k, v := range x {
		switch {
		case strings.HasPrefix(k, "user."):
		case k == xattrCapable:
			if !a.opts.Trusted {
				return nil, refuse(hdr.Name, "file capabilities on an untrusted layer")
			}
		default:
			return nil, refuse(hdr.Name, "xattr %s is not allowed in a layer", k)
		}
		if len(v) > maxXattrValue {
			return nil, refuse(hdr.Name, "xattr %s larger than %d bytes", k, maxXattrValue)
		}
	}
	return x, nil
}

// underSymlink reports a path whose parent is (below) a symlink this
// archive created: writing there would write through the link.
func (a *applier) underSymlink(name string) bool {
	if len(a.symlinks) == 0 {
		return false
	}
	for p := path.Dir(name); p != "."; p = path.Dir(p) {
		if a.symlinks[p] {
			return true
		}
	}
	return false
}

// prepare makes name's parent directories and clears whatever sits at
// name, unless both are directories.
func (a *applier) prepare(name string, isDir bool) error {
	if a.underSymlink(name) {
		return refuse(name, "write through a symlink")
	}
	for p := name; len(a.deferred) > 0 && p != "."; p = path.Dir(p) {
		if a.deferred[p] {
			// The link is only made when merging, after everything
			// staged has moved in: it would replace this entry, or
			// what this entry was written through.
			return refuse(name, "reuses the name of hardlink %q to the existing tree", p)
		}
	}
	fd, err := a.dirFd(path.Dir(name))
	if err != nil {
		return &EntryError{Name: name, Reason: "make parent: " + err.Error(), Err: err}
	}
	var st unix.Stat_t
	err = unix.Fstatat(fd, path.Base(name), &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return &EntryError{Name: name, Reason: err.Error(), Err: err}
	}
	if isDir && st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return nil
	}
	return a.removeStaged(name)
}

// dirFd returns an fd of the staged directory dir, making it (and its
// parents) if missing. The last one is cached: archives list a
// directory's entries together, and each lookup through os.Root costs a
// system call per path component.
func (a *applier) dirFd(dir string) (int, error) {
	if a.cached != nil && a.cachedDir == dir {
		return int(a.cached.Fd()), nil
	}
	a.dropDirFd()
	f, err := a.root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		if err = a.root.MkdirAll(dir, 0o755); err == nil {
			f, err = a.root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
		}
	}
	if err != nil {
		return -1, err
	}
	a.cached, a.cachedDir = f, dir
	return int(f.Fd()), nil
}

func (a *applier) dropDirFd() {
	if a.cached != nil {
		a.cached.Close()
		a.cached, a.cachedDir = nil, ""
	}
}

func (a *applier) removeStaged(name string) error {
	a.dropDirFd()
	for p, i := range a.dirIdx {
		if hasPrefixPath(p, name) {
			a.dirs[i] = nil
			delete(a.dirIdx, p)
		}
	}
	for p := range a.symlinks {
		if hasPrefixPath(p, name) {
			delete(a.symlinks, p)
		}
	}
	if len(a.links) > 0 {
		// Deferred hardlinks below name are replaced like staged entries.
		a.links = slices.DeleteFunc(a.links, func(l [2]string) bool {
			if hasPrefixPath(l[1], name) {
				delete(a.deferred, l[1])
				return true
			}
			return false
		})
	}
	if err := a.root.RemoveAll(name); err != nil {
		return &EntryError{Name: name, Reason: "replace: " + err.Error(), Err: err}
	}
	return nil
}

// file writes a regular file: its data where it has any, holes where it
// has none (a sparse entry's holes, and whole blocks of zeros of any
// other: a layer from elsewhere may hold a sparse file written out).
func (a *applier) file(name string, hdr *tar.Header, sp *sparseFile, content io.Reader, xattrs map[string]string) error {
	dfd, err := a.dirFd(path.Dir(name))
	if err != nil {
		return &EntryError{Name: name, Reason: err.Error(), Err: err}
	}
	fd, err := unix.Openat(dfd, path.Base(name), unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return &EntryError{Name: name, Reason: err.Error(), Err: err}
	}
	f := os.NewFile(uintptr(fd), name)
	if sp != nil {
		err = writeSpans(f, sp.spans, hdr.Size, content, a.buf)
	} else if err = writeData(f, 0, content, hdr.Size, a.buf); err == nil {
		err = f.Truncate(hdr.Size)
	}
	if err == nil {
		err = a.fileMeta(f, hdr, xattrs)
	}
	if err == nil {
		err = futimens(f, hdr)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	var ee *EntryError
	if errors.As(err, &ee) {
		return err
	}
	if err != nil {
		return &EntryError{Name: name, Reason: err.Error(), Err: err}
	}
	return nil
}

// dir makes a directory; its metadata is applied by finishDirs, once its
// contents stop changing its mtime.
func (a *applier) dir(name string, hdr *tar.Header) error {
	if name != "." {
		dfd, err := a.dirFd(path.Dir(name))
		if err == nil {
			err = unix.Mkdirat(dfd, path.Base(name), 0o700)
		}
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return &EntryError{Name: name, Reason: err.Error(), Err: err}
		}
	}
	d := &dirMeta{
		name:   name,
		mode:   uint32(hdr.Mode & 0o7777),
		uid:    hdr.Uid,
		gid:    hdr.Gid,
		mtime:  hdr.ModTime,
		atime:  hdr.AccessTime,
		xattrs: paxXattrs(hdr.PAXRecords), // checked by checkXattrs
	}
	if i, ok := a.dirIdx[name]; ok {
		if old := a.dirs[i]; old != nil {
			a.dirBytes -= old.size()
		}
		a.dirs[i] = d
	} else {
		a.dirIdx[name] = len(a.dirs)
		a.dirs = append(a.dirs, d)
	}
	if a.dirBytes += d.size(); a.dirBytes > maxDirMeta {
		return refuse(hdr.Name, "directory metadata over %d bytes", maxDirMeta)
	}
	return nil
}

// dirMeta is what finishDirs needs of a directory entry: never the whole
// header, whose PAX records may be large.
type dirMeta struct {
	name         string
	mode         uint32
	uid, gid     int
	mtime, atime time.Time
	xattrs       map[string]string
}

func (d *dirMeta) size() int64 {
	n := int64(dirMetaOverhead + len(d.name))
	for k, v := range d.xattrs {
		n += int64(len(k) + len(v))
	}
	return n
}

// checkSizes refuses an entry whose data would take the data of the
// entries so far, *total, over max: what counts is what a file stores, so
// a sparse file's holes are free (they cost no disk and no time; sparse.go)
// and an apparent size beyond max is fine.
func checkSizes(hdr *tar.Header, sp *sparseFile, total *int64, max int64) error {
	size := hdr.Size
	if sp != nil {
		size = dataBytes(sp.spans)
	}
	if size < 0 || size > max {
		return refuse(hdr.Name, "size %d exceeds the %d-byte cap", size, max)
	}
	if *total += size; *total > max {
		return refuse(hdr.Name, "entries total more than the %d-byte cap", max)
	}
	return nil
}

func (a *applier) symlink(name string, hdr *tar.Header, xattrs map[string]string) error {
	if hdr.Linkname == "" || strings.IndexByte(hdr.Linkname, 0) >= 0 || len(hdr.Linkname) > maxNameLen {
		return refuse(hdr.Name, "bad symlink target")
	}
	if err := a.root.Symlink(hdr.Linkname, name); err != nil {
		return &EntryError{Name: name, Reason: err.Error(), Err: err}
	}
	a.symlinks[name] = true
	return a.nodeMeta(a.root, name, hdr, xattrs)
}

func (a *applier) hardlink(name string, hdr *tar.Header) error {
	target, err := cleanEntryName(hdr.Linkname)
	if err != nil {
		return refuse(hdr.Name, "hardlink target %q: leaves the root", hdr.Linkname)
	}
	if target == "." || a.underSymlink(target) {
		return refuse(hdr.Name, "hardlink target %q leaves the layer", hdr.Linkname)
	}
	st, err := a.root.Lstat(target)
	if err != nil && a.onto {
		// A delta may link to a path of the tree it is applied onto: link
		// it when merging, after checking that path there. No later entry
		// may use name (prepare).
		a.links = append(a.links, [2]string{target, name})
		a.deferred[name] = true
		return nil
	}
	if err != nil {
		return refuse(hdr.Name, "hardlink target %q is not in the layer", hdr.Linkname)
	}
	if st.IsDir() {
		return refuse(hdr.Name, "hardlink to directory %q", hdr.Linkname)
	}
	if err := a.root.Link(target, name); err != nil {
		return &EntryError{Name: name, Reason: err.Error(), Err: err}
	}
	if a.symlinks[target] {
		a.symlinks[name] = true
	}
	return nil
}

func (a *applier) special(name string, hdr *tar.Header, xattrs map[string]string, mk func(fd int, base string) error) error {
	if err := atParent(a.root, name, mk); err != nil {
		return &EntryError{Name: name, Reason: err.Error(), Err: err}
	}
	return a.nodeMeta(a.root, name, hdr, xattrs)
}

// whiteout handles ".wh.<name>" (or a raw 0/0 device) hiding name.
// removed marks a delta's "gone since the base", which never becomes a
// device: it only deletes.
func (a *applier) whiteout(name string, hdr *tar.Header, removed bool) error {
	if name == "." {
		return refuse(hdr.Name, "whiteout of the layer root")
	}
	if err := a.prepare(name, false); err != nil {
		return err
	}
	a.whiteouts = append(a.whiteouts, name)
	if a.opts.Mode != ModeUpper || removed {
		return nil
	}
	h := *hdr
	h.Mode &= 0o777
	return a.special(name, &h, nil, func(fd int, base string) error {
		return unix.Mknodat(fd, base, unix.S_IFCHR|uint32(h.Mode), 0)
	})
}

// opaque handles ".wh..wh..opq" in dir.
func (a *applier) opaque(dir string, hdr *tar.Header) error {
	if dir != "." {
		if err := a.prepare(dir, true); err != nil {
			return err
		}
		if err := a.root.MkdirAll(dir, 0o755); err != nil {
			return &EntryError{Name: hdr.Name, Reason: err.Error(), Err: err}
		}
	}
	a.opaques = append(a.opaques, dir)
	return nil
}
