package snapshot

import (
	"archive/tar"
	"errors"
	"fmt"
	"os"
	"path"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// futimens sets an open file's times (utimensat with a NULL path), saving
// the path walk setTimes needs.
func futimens(f *os.File, hdr *tar.Header) error {
	return futimensTimes(f, hdr.AccessTime, hdr.ModTime)
}

func futimensTimes(f *os.File, atime, mtime time.Time) error {
	if atime.IsZero() {
		atime = mtime
	}
	ts := [2]unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	_, _, errno := unix.Syscall6(unix.SYS_UTIMENSAT, f.Fd(), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if errno != 0 {
		return fmt.Errorf("set times: %w", errno)
	}
	return nil
}

func (a *applier) fileMeta(f *os.File, hdr *tar.Header, xattrs map[string]string) error {
	// Attributes first: setting them needs write permission, which the
	// final mode may not grant a non-root caller. Chown before chmod, as
	// chown clears setuid/setgid.
	fd := int(f.Fd())
	for k, v := range xattrs {
		if err := unix.Fsetxattr(fd, k, []byte(v), 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", k, err)
		}
	}
	if a.chown {
		if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
			return err
		}
	}
	return unix.Fchmod(fd, uint32(hdr.Mode&0o7777))
}

// finishDirs applies directory metadata deepest first, after their
// contents stopped changing their mtimes, and marks opaque directories.
// Each directory is opened beneath root without following any symlink
// (openDirNoFollow) and changed through that fd only: a path-based call
// would follow a symlink that replaced the directory.
func (a *applier) finishDirs(root *os.Root) error {
	if a.opts.Mode == ModeUpper {
		for _, d := range a.opaques {
			err := withDirNoFollow(root, d, func(f *os.File) error {
				return unix.Fsetxattr(int(f.Fd()), xattrOpaque, []byte("y"), 0)
			})
			if err != nil {
				return &EntryError{Name: d, Reason: "mark opaque: " + err.Error(), Err: err}
			}
		}
	}
	for i := len(a.dirs) - 1; i >= 0; i-- {
		d := a.dirs[i]
		if d == nil {
			continue
		}
		if err := withDirNoFollow(root, d.name, func(f *os.File) error { return a.dirMetaFd(f, d) }); err != nil {
			var ee *EntryError
			if errors.As(err, &ee) {
				return err
			}
			return &EntryError{Name: d.name, Reason: err.Error(), Err: err}
		}
	}
	return nil
}

// dirMetaFd sets a directory's attributes, owner, mode and times through
// its open fd.
func (a *applier) dirMetaFd(f *os.File, d *dirMeta) error {
	fd := int(f.Fd())
	for k, v := range d.xattrs {
		if err := unix.Fsetxattr(fd, k, []byte(v), 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", k, err)
		}
	}
	if a.chown {
		if err := unix.Fchown(fd, d.uid, d.gid); err != nil {
			return fmt.Errorf("chown: %w", err)
		}
	}
	if err := unix.Fchmod(fd, d.mode); err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	return futimensTimes(f, d.atime, d.mtime)
}

// withDirNoFollow opens the directory name beneath root one component at a
// time with O_NOFOLLOW|O_DIRECTORY, so no symlink is followed anywhere on
// the way (os.Root alone would follow one that stays inside root), and
// calls fn with it.
func withDirNoFollow(root *os.Root, name string, fn func(*os.File) error) error {
	f, err := root.OpenFile(".", os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	if name != "." {
		for _, c := range strings.Split(name, "/") {
			fd, err := unix.Openat(int(f.Fd()), c, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			f.Close()
			if err != nil {
				return fmt.Errorf("open directory: %w", err)
			}
			f = os.NewFile(uintptr(fd), name)
		}
	}
	defer f.Close()
	return fn(f)
}

// nodeMeta sets owner, mode, xattrs and times on name without following a
// final symlink.
func (a *applier) nodeMeta(root *os.Root, name string, hdr *tar.Header, xattrs map[string]string) error {
	isLink := hdr.Typeflag == tar.TypeSymlink
	for k, v := range xattrs {
		if err := setXattrAt(root, name, k, v); err != nil {
			return &EntryError{Name: name, Reason: "set xattr " + k + ": " + err.Error(), Err: err}
		}
	}
	if a.chown {
		if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
			return &EntryError{Name: name, Reason: err.Error(), Err: err}
		}
	}
	if !isLink {
		err := atParent(root, name, func(fd int, base string) error {
			return unix.Fchmodat(fd, base, uint32(hdr.Mode&0o7777), 0)
		})
		if err != nil {
			return &EntryError{Name: name, Reason: "chmod: " + err.Error(), Err: err}
		}
	}
	return a.setTimes(root, name, hdr)
}

func (a *applier) setTimes(root *os.Root, name string, hdr *tar.Header) error {
	at := hdr.AccessTime
	if at.IsZero() {
		at = hdr.ModTime
	}
	ts := []unix.Timespec{unix.NsecToTimespec(at.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
	err := atParent(root, name, func(fd int, base string) error {
		return unix.UtimesNanoAt(fd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
	})
	if err != nil {
		return &EntryError{Name: name, Reason: "set times: " + err.Error(), Err: err}
	}
	return nil
}

// atParent opens name's parent beneath root and calls fn with its fd and
// name's last component, so *at system calls never resolve outside root.
func atParent(root *os.Root, name string, fn func(fd int, base string) error) error {
	parent, base := path.Dir(name), path.Base(name)
	if name == "." {
		parent, base = ".", "."
	}
	d, err := root.OpenFile(parent, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer d.Close()
	return fn(int(d.Fd()), base)
}

// setXattrAt sets an attribute on name without following a final symlink,
// through /proc/self/fd of its parent opened beneath root.
func setXattrAt(root *os.Root, name, attr, value string) error {
	return atParent(root, name, func(fd int, base string) error {
		return unix.Lsetxattr(fmt.Sprintf("/proc/self/fd/%d/%s", fd, base), attr, []byte(value), 0)
	})
}
