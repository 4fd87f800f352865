package store

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// digestXattr holds an object's sha256 on its file, generationXattr its
// generation. Both are set on the temporary file before the rename, so
// object, digest and generation appear together.
const (
	digestXattr     = "user.sandgate.sha256"
	generationXattr = "user.sandgate.generation"
)

// lockName is the file at the store's root that the processes sharing a
// directory store lock (flock) around every change of an object, so that
// a conditional put or delete checks and changes it atomically.
const lockName = ".lock"

// Dir is a Store in a local directory: the embedded default. A put writes a
// hidden temporary file beside the object, fsyncs it, records its digest,
// then renames it into place (or links it, for IfNotExist, so an existing
// object is never replaced) and fsyncs the directory. A crash at any moment
// leaves the old object or the new one, never a partial one; stray
// temporary files are hidden from List and Get.
type Dir struct {
	path string
	root *os.Root
	// xattrs: the file system keeps user attributes, so every object has
	// its digest recorded and one without it is damaged (or was copied
	// without its attributes), not merely stored where they cannot be.
	xattrs bool

	// mu and lock serialise changes of objects: mu among this process's
	// goroutines, an flock of lock among processes (flock excludes other
	// open files, not the same one).
	mu   sync.Mutex
	lock *os.File
}

var _ Store = (*Dir)(nil)

// NewDir opens (creating if needed) a directory store at dir.
func NewDir(dir string) (*Dir, error) {
	if dir == "" {
		return nil, errors.New("dir store: empty path")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("dir store: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("dir store: %w", err)
	}
	return &Dir{path: dir, root: root, xattrs: probeUserXattrs(root)}, nil
}

// probeUserXattrs reports whether the file system of root keeps user
// attributes: it sets one on a hidden temporary file or, when the store is
// not writable, asks for one on the directory (ENODATA: it could hold one).
func probeUserXattrs(root *os.Root) bool {
	var rnd [8]byte
	rand.Read(rnd[:])
	tmp := ".tmp-xattr-probe-" + hex.EncodeToString(rnd[:])
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		d, err := root.OpenFile(".", os.O_RDONLY, 0)
		if err != nil {
			return false
		}
		defer d.Close()
		_, err = unix.Fgetxattr(int(d.Fd()), digestXattr, nil)
		return err == nil || errors.Is(err, unix.ENODATA)
	}
	defer root.Remove(tmp)
	defer f.Close()
	return unix.Fsetxattr(int(f.Fd()), digestXattr, []byte("probe"), 0) == nil
}

// Close releases the directory.
func (d *Dir) Close() error {
	d.mu.Lock()
	if d.lock != nil {
		d.lock.Close()
		d.lock = nil
	}
	d.mu.Unlock()
	return d.root.Close()
}

// locked runs f while holding the store's lock, against this process's
// goroutines and every other process sharing the directory.
func (d *Dir) locked(f func() error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.lock == nil {
		l, err := d.root.OpenFile(lockName, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return fmt.Errorf("dir store: its lock file: %w", err)
		}
		d.lock = l
	}
	for {
		err := unix.Flock(int(d.lock.Fd()), unix.LOCK_EX)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("dir store: locking: %w", err)
		}
	}
	defer unix.Flock(int(d.lock.Fd()), unix.LOCK_UN)
	return f()
}

// newGeneration is a new object generation: random, positive, never 0.
func newGeneration() int64 {
	var b [8]byte
	for {
		rand.Read(b[:])
		if g := int64(binary.BigEndian.Uint64(b[:]) >> 1); g != 0 {
			return g
		}
	}
}

// generationOf is the generation of the object open as f: the one put
// recorded, or, for an object stored without it (before generations were
// recorded, or where the file system keeps no attributes), one made of
// its inode and change time, which a replacement changes too.
func generationOf(f *os.File) (int64, error) {
	buf := make([]byte, 24)
	if n, err := unix.Fgetxattr(int(f.Fd()), generationXattr, buf); err == nil {
		if g, err := strconv.ParseInt(string(buf[:n]), 10, 64); err == nil && g > 0 {
			return g, nil
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, err
	}
	h := sha256.New()
	binary.Write(h, binary.BigEndian, [4]int64{int64(st.Dev), int64(st.Ino), st.Ctim.Sec, st.Ctim.Nsec})
	g := int64(binary.BigEndian.Uint64(h.Sum(nil)) >> 1)
	return max(g, 1), nil
}

// currentGeneration is the generation of the object name, or 0 if there
// is none.
func (d *Dir) currentGeneration(name string) (int64, error) {
	f, err := d.root.OpenFile(name, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return generationOf(f)
}

// Put implements Store.
func (d *Dir) Put(ctx context.Context, name string, r io.Reader, opts PutOptions) (info Info, err error) {
	if err := CheckName(name); err != nil {
		return Info{}, err
	}
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	if err := d.mkdirAll(dir); err != nil {
		return Info{}, fmt.Errorf("put %s: %w", name, err)
	}
	if opts.IfNotExist && opts.IfGenerationMatch != 0 {
		return Info{}, fmt.Errorf("put %s: IfNotExist and IfGenerationMatch together: %w", name, ErrPreconditionFailed)
	}
	// Fail before reading a byte; the check under the lock below is what
	// makes it atomic.
	if err := d.precondition(name, opts); err != nil {
		return Info{}, err
	}
	var rnd [8]byte
	rand.Read(rnd[:])
	tmp := path.Join(dir, ".tmp-"+base+"-"+hex.EncodeToString(rnd[:]))
	f, err := d.root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return Info{}, fmt.Errorf("put %s: %w", name, err)
	}
	defer func() {
		if f != nil {
			f.Close()
		}
		if err != nil {
			d.root.Remove(tmp)
		}
	}()
	h := sha256.New()
	var dst io.Writer = &writeback{f: f}
	if opts.Digest == nil {
		dst = io.MultiWriter(dst, h)
	}
	buf := copyBufs.Get().(*[]byte)
	_, err = io.CopyBuffer(dst, ctxReader{ctx, r}, *buf)
	copyBufs.Put(buf)
	if err != nil {
		return Info{}, fmt.Errorf("put %s: %w", name, err)
	}
	if err := f.Sync(); err != nil {
		return Info{}, fmt.Errorf("put %s: %w", name, err)
	}
	digest := "sha256:" + hex.EncodeToString(h.Sum(nil))
	if opts.Digest != nil {
		digest = opts.Digest()
	}
	if err := unix.Fsetxattr(int(f.Fd()), digestXattr, []byte(digest), 0); err != nil && (d.xattrs || !errors.Is(err, unix.ENOTSUP)) {
		// Where attributes are kept, an object stored without its digest
		// would be refused by every Get.
		return Info{}, fmt.Errorf("put %s: record digest: %w", name, err)
	}
	if d.xattrs {
		if err := unix.Fsetxattr(int(f.Fd()), generationXattr, []byte(strconv.FormatInt(newGeneration(), 10)), 0); err != nil {
			return Info{}, fmt.Errorf("put %s: record generation: %w", name, err)
		}
	}
	if err := f.Close(); err != nil {
		f = nil
		return Info{}, fmt.Errorf("put %s: %w", name, err)
	}
	f = nil
	if err := ctx.Err(); err != nil {
		return Info{}, fmt.Errorf("put %s: %w", name, err)
	}
	err = d.locked(func() error {
		if err := d.precondition(name, opts); err != nil {
			return err
		}
		if opts.IfNotExist {
			// link(2) fails if name exists: an atomic "create if absent",
			// whoever else writes the directory.
			if err := d.root.Link(tmp, name); err != nil {
				if errors.Is(err, fs.ErrExist) {
					return fmt.Errorf("put %s: exists: %w", name, ErrPreconditionFailed)
				}
				return fmt.Errorf("put %s: %w", name, err)
			}
			d.root.Remove(tmp)
			return nil
		}
		if err := d.root.Rename(tmp, name); err != nil {
			return fmt.Errorf("put %s: %w", name, err)
		}
		return nil
	})
	if err != nil {
		return Info{}, err
	}
	if err := d.syncDir(dir); err != nil {
		return Info{}, fmt.Errorf("put %s: sync dir: %w", name, err)
	}
	return d.Stat(ctx, name)
}

// copyBufs are Put's copy buffers: a put of a small object (an audit
// segment, a record) does not allocate and clear a MiB.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, 1<<20); return &b }}

// precondition checks opts' preconditions against the object name as it
// is now.
func (d *Dir) precondition(name string, opts PutOptions) error {
	switch {
	case opts.IfNotExist:
		if _, err := d.root.Lstat(name); err == nil {
			return fmt.Errorf("put %s: exists: %w", name, ErrPreconditionFailed)
		}
	case opts.IfGenerationMatch != 0:
		g, err := d.currentGeneration(name)
		if err != nil {
			return fmt.Errorf("put %s: %w", name, err)
		}
		if g != opts.IfGenerationMatch {
			return fmt.Errorf("put %s: generation %d, not %d: %w", name, g, opts.IfGenerationMatch, ErrPreconditionFailed)
		}
	}
	return nil
}

// writeback writes to f and starts writing each written 8 MiB back to disk
// at once (sync_file_range), so the fsync at the end of a put has little
// left to do and big puts do not stall on it.
type writeback struct {
	f       *os.File
	off     int64
	flushed int64
}

func (w *writeback) Write(p []byte) (int, error) {
	n, err := w.f.Write(p)
	w.off += int64(n)
	if w.off-w.flushed >= 8<<20 {
		unix.SyncFileRange(int(w.f.Fd()), w.flushed, w.off-w.flushed, unix.SYNC_FILE_RANGE_WRITE)
		w.flushed = w.off
	}
	return n, err
}

// mkdirAll creates dir and its missing parents, fsyncing the parent of each
// directory it creates: an object renamed into a new directory survives a
// crash only if the directory's own entry does.
func (d *Dir) mkdirAll(dir string) error {
	if dir == "." {
		return nil
	}
	parent := "."
	for _, c := range strings.Split(dir, "/") {
		p := path.Join(parent, c)
		if err := d.root.Mkdir(p, 0o755); err == nil {
			if err := d.syncDir(parent); err != nil {
				return err
			}
		} else if !errors.Is(err, fs.ErrExist) {
			return err
		}
		parent = p
	}
	return nil
}

func (d *Dir) syncDir(dir string) error {
	f, err := d.root.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// Get implements Store.
func (d *Dir) Get(ctx context.Context, name string) (io.ReadCloser, error) {
	v, _, err := d.open(name)
	if err != nil {
		return nil, err
	}
	return v, nil
}

// open opens the object name for a verified read, with the Info of the
// version opened.
func (d *Dir) open(name string) (*verifyingReader, Info, error) {
	if err := CheckName(name); err != nil {
		return nil, Info{}, err
	}
	f, err := d.root.OpenFile(name, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, Info{}, d.mapErr("get", name, err)
	}
	info, err := d.statFile(name, f)
	if err != nil {
		f.Close()
		return nil, Info{}, err
	}
	v := newVerifyingReader(f, name, info.Size, info.Digest, nil)
	if info.Digest == "" && d.xattrs {
		// Like any other damage, reported at EOF instead of io.EOF.
		v.missing = "no digest recorded (attribute " + digestXattr + " missing or unreadable)"
	}
	return v, info, nil
}

func (d *Dir) statFile(name string, f *os.File) (Info, error) {
	st, err := f.Stat()
	if err != nil {
		return Info{}, d.mapErr("stat", name, err)
	}
	if !st.Mode().IsRegular() {
		return Info{}, fmt.Errorf("stat %s: %w", name, ErrNotFound)
	}
	info := Info{Name: name, Size: st.Size(), Modified: st.ModTime()}
	if info.Generation, err = generationOf(f); err != nil {
		return Info{}, d.mapErr("stat", name, err)
	}
	buf := make([]byte, 128)
	if n, err := unix.Fgetxattr(int(f.Fd()), digestXattr, buf); err == nil {
		info.Digest = string(buf[:n])
	}
	return info, nil
}

// Stat implements Store.
func (d *Dir) Stat(ctx context.Context, name string) (Info, error) {
	if err := CheckName(name); err != nil {
		return Info{}, err
	}
	f, err := d.root.OpenFile(name, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return Info{}, d.mapErr("stat", name, err)
	}
	defer f.Close()
	return d.statFile(name, f)
}

// Delete implements Store.
func (d *Dir) Delete(ctx context.Context, name string) error {
	return d.delete(name, 0)
}

// DeleteIf implements Store.
func (d *Dir) DeleteIf(ctx context.Context, name string, generation int64) error {
	if generation == 0 {
		return fmt.Errorf("delete %s: generation 0: %w", name, ErrPreconditionFailed)
	}
	return d.delete(name, generation)
}

// delete removes name, if its generation is generation when that is not 0.
func (d *Dir) delete(name string, generation int64) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return d.locked(func() error {
		st, err := d.root.Lstat(name)
		if err != nil {
			return d.mapErr("delete", name, err)
		}
		if st.IsDir() {
			return fmt.Errorf("delete %s: %w", name, ErrNotFound)
		}
		if generation != 0 {
			g, err := d.currentGeneration(name)
			if err != nil {
				return d.mapErr("delete", name, err)
			}
			if g != generation {
				return fmt.Errorf("delete %s: generation %d, not %d: %w", name, g, generation, ErrPreconditionFailed)
			}
		}
		if err := d.root.Remove(name); err != nil {
			return d.mapErr("delete", name, err)
		}
		return d.syncDir(path.Dir(name))
	})
}

// Read implements Store.
func (d *Dir) Read(ctx context.Context, name string, max int64) ([]byte, Info, error) {
	v, info, err := d.open(name)
	if err != nil {
		return nil, Info{}, err
	}
	defer v.Close()
	b, err := readMax(v, name, max)
	return b, info, err
}

// List implements Store.
func (d *Dir) List(ctx context.Context, prefix string) ([]Info, error) {
	var out []Info
	start := "."
	if i := strings.LastIndex(prefix, "/"); i > 0 {
		start = prefix[:i]
	}
	err := fs.WalkDir(d.root.FS(), start, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p == start {
				return fs.SkipAll
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if p != "." && strings.HasPrefix(e.Name(), ".") {
			if e.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if e.Type().IsRegular() && strings.HasPrefix(p, prefix) {
			info, err := d.Stat(ctx, p)
			if err != nil {
				return err
			}
			out = append(out, info)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list %q: %w", prefix, err)
	}
	slices.SortFunc(out, func(a, b Info) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// RemoveStale removes the temporary files of puts that never finished (the
// process died mid-put) and were last written more than olderThan ago: a
// put in progress writes its file continuously, and one that stalls that
// long fails at its rename instead of leaving a partial object. It returns
// how many files and bytes it removed; it stops at ctx's end.
func (d *Dir) RemoveStale(ctx context.Context, olderThan time.Duration) (files int, bytes int64, err error) {
	cutoff := time.Now().Add(-olderThan)
	err = fs.WalkDir(d.root.FS(), ".", func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if !e.Type().IsRegular() || !strings.HasPrefix(e.Name(), ".tmp-") {
			return nil
		}
		fi, err := e.Info()
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) { // renamed into place meanwhile
				return nil
			}
			return err
		}
		if fi.ModTime().After(cutoff) {
			return nil
		}
		if err := d.root.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		files++
		bytes += fi.Size()
		return nil
	})
	if err != nil {
		return files, bytes, fmt.Errorf("dir store: removing stale temporary files: %w", err)
	}
	return files, bytes, nil
}

func (d *Dir) mapErr(op, name string, err error) error {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ELOOP) {
		return fmt.Errorf("%s %s: %w", op, name, ErrNotFound)
	}
	return fmt.Errorf("%s %s: %w", op, name, err)
}
