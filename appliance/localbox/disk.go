package localbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/snapshot"
)

// Disk quotas. A sandbox run with a quota (Config.Disk) keeps its writable
// layer — the overlay's upper and work directories — on a file system of
// its own: an ext4 image of exactly that size, sparse, loop-mounted at
// <sandbox>/layer on the host. What the sandbox writes can never take more
// of the host than the image's size, and past it a write in the sandbox
// fails with ENOSPC ("No space left on device"), as on a full disk; df in
// the sandbox shows its own size. The image is deleted with the sandbox.
//
// Why an image per sandbox and not project quotas on one shared file
// system (what Docker's overlay2 does on XFS): project quotas need a
// kernel built with them (ext4: CONFIG_QFMT_V2; XFS: CONFIG_XFS_QUOTA),
// which not every kernel is (this project's own machines are not); ext4
// lets a process with CAP_SYS_RESOURCE — the overlay's mounter — past
// them; and in a sandbox without a user namespace its root could move files
// out of its project (chattr -p). An image needs only the loop driver and
// mke2fs, which templates need already. Its cost is an mke2fs per size,
// not per sandbox: the first sandbox of a size makes an empty file system
// of that size once (a "blank", kept in the state directory's .disk area),
// and every sandbox then starts from a sparse copy of it (its few hundred
// KiB of metadata; under a millisecond).
//
// The image has no journal (a sandbox's durability is its snapshot: its
// layer is never mounted again after a crash except to be read), no room
// reserved for root, and no reserved group descriptors (it is never
// resized), so that it holds as little as possible beside the sandbox's
// files.

// The disk area under the state directory (like templatesDir, its name
// cannot be a sandbox id) and what a sandbox directory holds for its
// quota.
const (
	diskDir    = ".disk"
	layerImage = "layer.img" // the sandbox's file system image
	layerMount = "layer"     // where it is mounted; holds upper/ and work*/
)

// maxBlanks bounds how many blanks (one per quota size in use) the disk
// area keeps; the least recently used goes first.
const maxBlanks = 16

// ErrNoDiskQuota marks a host where a disk quota cannot be set up (not
// root, no loop driver, no mke2fs): the operator must give the sandbox CLI
// what it needs, or run without quotas knowingly.
var ErrNoDiskQuota = errors.New("disk quotas are unavailable on this host")

// layerRoot is where the sandbox in dir keeps its overlay upper and work
// directories: on its own file system when it has a quota, else in dir.
func layerRoot(dir string, cfg *Config) string {
	if cfg.Disk > 0 {
		return filepath.Join(dir, layerMount)
	}
	return dir
}

func (m *Runtime) diskArea() string { return filepath.Join(m.dir, diskDir) }

// CheckDisk makes sure that sandboxes with a disk quota of size bytes can
// be made here: it makes the blank of that size (if there is none yet)
// and mounts a copy of it once, so that what a quota needs (root, the loop
// driver, mke2fs) is known to work before the first sandbox needs it.
// A host that cannot is ErrNoDiskQuota, with what is missing and how to
// give it.
func (m *Runtime) CheckDisk(ctx context.Context, size int64) error {
	if err := checkDiskSize(size); err != nil {
		return err
	}
	dir, err := os.MkdirTemp(m.diskArea(), ".check-")
	if err != nil {
		if err := os.MkdirAll(m.diskArea(), 0o700); err != nil {
			return fmt.Errorf("%w: %v", ErrNoDiskQuota, err)
		}
		if dir, err = os.MkdirTemp(m.diskArea(), ".check-"); err != nil {
			return fmt.Errorf("%w: %v", ErrNoDiskQuota, err)
		}
	}
	defer os.RemoveAll(dir)
	if err := m.makeLayer(ctx, dir, size); err != nil {
		return err
	}
	return unmountLayer(dir)
}

// checkDiskSize refuses a quota too small to hold an ext4 file system.
func checkDiskSize(size int64) error {
	if size < MinDisk {
		return fmt.Errorf("%w: disk quota %d bytes: give at least %dm", ErrBadInput, size, MinDisk>>20)
	}
	return nil
}

// MinDisk is the smallest disk quota (sandboxcli.MinDisk).
const MinDisk = sandboxcli.MinDisk

// makeLayer gives the sandbox directory dir its file system: a sparse
// copy of the blank of size bytes at dir/layer.img, mounted at dir/layer.
// A quota larger than what the host's file system has free is refused:
// the host would fill before the sandbox reached its quota.
func (m *Runtime) makeLayer(ctx context.Context, dir string, size int64) error {
	var sfs unix.Statfs_t
	if err := unix.Statfs(m.dir, &sfs); err == nil {
		if free := int64(sfs.Bavail) * int64(sfs.Bsize); free < size {
			return fmt.Errorf("%w: disk quota %s: the file system holding %s has only %s free, so the host would fill before the sandbox reached its quota; free space there, or give a smaller quota", ErrBadInput, FormatSize(size), m.dir, FormatSize(free))
		}
	}
	blank, err := m.blank(ctx, size)
	if err != nil {
		return err
	}
	img := filepath.Join(dir, layerImage)
	if err := copySparse(blank, img); err != nil {
		return fmt.Errorf("the sandbox's file system: %w", err)
	}
	mnt := filepath.Join(dir, layerMount)
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return err
	}
	if err := mountImage(img, mnt, false, "noinit_itable"); err != nil {
		return fmt.Errorf("%w: the sandbox's file system: %v (run as root on a host with the loop driver, modprobe loop)", ErrNoDiskQuota, err)
	}
	return nil
}

// ensureLayer mounts the file system of the sandbox in dir if it is not
// mounted (a reboot unmounts it), read-only: only reading a crashed
// sandbox's layer needs it then.
func ensureLayer(dir string, cfg *Config) error {
	mnt := filepath.Join(dir, layerMount)
	if cfg.Disk <= 0 || mounted(mnt) {
		return nil
	}
	lock, err := lockSandbox(dir)
	if err != nil {
		return err
	}
	defer lock.Close()
	if mounted(mnt) {
		return nil
	}
	if err := mountImage(filepath.Join(dir, layerImage), mnt, true, ""); err != nil {
		return fmt.Errorf("the sandbox's file system: %w", err)
	}
	return nil
}

// unmountLayer detaches the file system of the sandbox in dir; its loop
// device goes with its last mount.
func unmountLayer(dir string) error {
	mnt := filepath.Join(dir, layerMount)
	for i := 0; mounted(mnt); i++ {
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil || i == 16 {
			return fmt.Errorf("unmount %s: %v", mnt, err)
		}
	}
	return nil
}

// blank returns the empty file system image of size bytes, making it
// first if there is none (under the disk area's lock, published by one
// rename, so that concurrent creators make it once and never see half of
// one).
func (m *Runtime) blank(ctx context.Context, size int64) (string, error) {
	name := filepath.Join(m.diskArea(), "blank-"+strconv.FormatInt(size, 10)+".img")
	now := time.Now()
	if err := os.Chtimes(name, now, now); err == nil {
		return name, nil // the mtime says when it was last used
	}
	if err := os.MkdirAll(m.diskArea(), 0o700); err != nil {
		return "", fmt.Errorf("%w: %v", ErrNoDiskQuota, err)
	}
	unlock, err := flockWait(filepath.Join(m.diskArea(), ".lock"), time.Minute)
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, err := os.Stat(name); err == nil {
		return name, nil
	}
	tmp := filepath.Join(m.diskArea(), ".blank-"+strconv.FormatInt(size, 10)+".tmp")
	os.Remove(tmp)
	if err := makeBlank(ctx, tmp, size); err != nil {
		os.Remove(tmp)
		return "", err
	}
	if err := os.Rename(tmp, name); err != nil {
		os.Remove(tmp)
		return "", err
	}
	m.pruneBlanks(name)
	return name, nil
}

// pruneBlanks removes the least recently used blanks beyond maxBlanks,
// never keep.
func (m *Runtime) pruneBlanks(keep string) {
	ents, _ := os.ReadDir(m.diskArea())
	type blankFile struct {
		name string
		used time.Time
	}
	var blanks []blankFile
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "blank-") {
			continue
		}
		if fi, err := e.Info(); err == nil {
			blanks = append(blanks, blankFile{filepath.Join(m.diskArea(), e.Name()), fi.ModTime()})
		}
	}
	slices.SortFunc(blanks, func(a, b blankFile) int { return b.used.Compare(a.used) })
	for i, b := range blanks {
		if i >= maxBlanks && b.name != keep {
			os.Remove(b.name)
		}
	}
}

// makeBlank makes an empty ext4 file system of size bytes in file
// (sparse): 4 KiB blocks, no journal, nothing reserved for root, no
// reserved group descriptors, inode tables left to read as the zeros a
// sparse file holds.
func makeBlank(ctx context.Context, file string, size int64) error {
	err := mkfsImage(ctx, file, size, "-O", "^has_journal,^resize_inode", "-E", "lazy_itable_init=1,nodiscard,root_owner=0:0")
	switch {
	case errors.Is(err, errNoMkfs):
		return fmt.Errorf("%w: disk quotas need mke2fs: %v", ErrNoDiskQuota, err)
	case err != nil:
		return fmt.Errorf("the file system of a %s disk quota: %w", FormatSize(size), err)
	}
	return nil
}

// copySparse copies the regular file src to a new file dst, its holes
// left holes: only the data SEEK_DATA finds is copied.
func copySparse(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = func() error {
		if err := out.Truncate(st.Size()); err != nil {
			return err
		}
		spans, err := snapshot.DataSpans(in, st.Size())
		if err != nil {
			return err
		}
		for _, s := range spans {
			off, end := s.Offset, s.Offset+s.Length
			for off < end {
				dOff := off
				n, err := unix.CopyFileRange(int(in.Fd()), &off, int(out.Fd()), &dOff, int(end-off), 0)
				if err != nil {
					return err
				}
				if n == 0 {
					return io.ErrUnexpectedEOF
				}
			}
		}
		return nil
	}()
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(dst)
	}
	return err
}

// flockWait takes an exclusive flock on name (made if missing), waiting at
// most wait; unlock releases it.
func flockWait(name string, wait time.Duration) (unlock func(), err error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(wait)
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			return nil, fmt.Errorf("%w: %s is locked by another sandgate process: %v", ErrBusy, name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// noSpace turns a failure to fill a sandbox's layer because its file
// system is full into an error that names the quota and the fix.
func noSpace(err error, cfg *Config, what string) error {
	if cfg.Disk <= 0 || !errors.Is(err, unix.ENOSPC) {
		return err
	}
	return fmt.Errorf("%w: %s does not fit the sandbox's disk quota of %s (%d bytes): give it a larger quota (sandgate sandbox run --disk; the service's limits.disk, or its default SANDGATE_SANDBOX_DISK): %v", ErrBadInput, what, FormatSize(cfg.Disk), cfg.Disk, err)
}

// FormatSize writes a byte count as ParseSize reads it (sandboxcli.FormatSize).
func FormatSize(n int64) string { return sandboxcli.FormatSize(n) }
