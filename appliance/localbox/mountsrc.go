package localbox

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Rules for a bind mount's source. A source is a host path the operator
// names, but what it leads to is checked on the opened object (symlinks
// resolved): once by Run and Fork, so that a mistake is refused with
// ErrBadInput before anything is created, and again by the init just before
// it mounts that same opened object, so that a path changed in between
// cannot slip through.

// kernelFS are file systems that are interfaces to the kernel rather than
// storage: bound into a sandbox they would hand it the host's processes,
// devices, cgroups or kernel knobs. The magic numbers catch them through
// fstatfs; devtmpfs shares tmpfs's magic, so the mount's type is also read
// from mountinfo.
var kernelFS = map[string]bool{
	"proc": true, "sysfs": true, "devtmpfs": true, "devpts": true, "cgroup": true, "cgroup2": true,
	"securityfs": true, "debugfs": true, "tracefs": true, "bpf": true, "efivarfs": true,
	"configfs": true, "pstore": true, "nsfs": true, "binfmt_misc": true, "fusectl": true,
	"mqueue": true, "hugetlbfs": true, "autofs": true,
}

var kernelFSMagic = map[int64]string{
	unix.PROC_SUPER_MAGIC: "proc", unix.SYSFS_MAGIC: "sysfs", unix.DEVPTS_SUPER_MAGIC: "devpts",
	unix.CGROUP_SUPER_MAGIC: "cgroup", unix.CGROUP2_SUPER_MAGIC: "cgroup2",
	unix.SECURITYFS_MAGIC: "securityfs", unix.DEBUGFS_MAGIC: "debugfs", unix.TRACEFS_MAGIC: "tracefs",
	unix.BPF_FS_MAGIC: "bpf", unix.EFIVARFS_MAGIC: "efivarfs", unix.NSFS_MAGIC: "nsfs",
}

// openMountSource opens a bind mount's source (O_PATH, following
// symlinks) and checks it against the rules; the caller closes the
// descriptor and mounts through it.
func openMountSource(source, stateDir string) (int, error) {
	fd, err := unix.Open(source, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("%w: mount source %q: %v", ErrBadInput, source, err)
	}
	if err := checkMountSource(fd, source, stateDir); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// checkMountSource applies the rules to the opened source fd.
func checkMountSource(fd int, source, stateDir string) error {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return fmt.Errorf("mount source %q: %w", source, err)
	}
	fstype := kernelFSMagic[int64(sfs.Type)]
	if fstype == "" {
		var stx unix.Statx_t
		if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &stx); err == nil && stx.Mask&unix.STATX_MNT_ID != 0 {
			if t := mountType(stx.Mnt_id); kernelFS[t] {
				fstype = t
			}
		}
	}
	if fstype != "" {
		return fmt.Errorf("%w: mount source %q is on a %s file system: kernel interfaces (proc, sysfs, devtmpfs, devpts, cgroup and the like) are never bound into a sandbox; bind a directory of a regular file system", ErrBadInput, source, fstype)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("mount source %q: %w", source, err)
	}
	if m := st.Mode & unix.S_IFMT; m == unix.S_IFCHR || m == unix.S_IFBLK {
		return fmt.Errorf("%w: mount source %q is a device node: devices are never bound into a sandbox", ErrBadInput, source)
	}
	return checkMountSourcePlace(fd, st, source, stateDir)
}

// fileID is what identifies a file on the host whatever the path to it:
// a bind mount shows the same (st_dev, st_ino) under another path.
type fileID struct{ dev, ino uint64 }

func idOfStat(st *unix.Stat_t) fileID { return fileID{uint64(st.Dev), st.Ino} }

// maxDepth bounds the walks up a directory tree by "..".
const maxDepth = 4096

// ancestry returns the identity of the directory fd and of each of its
// ancestors up to the root, nearest first, walking ".." from the opened
// directory (so through the mounts it was reached by, never by path).
func ancestry(fd int) ([]fileID, error) {
	cur, err := unix.Openat(fd, ".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer func() { unix.Close(cur) }()
	var ids []fileID
	for range maxDepth {
		var st unix.Stat_t
		if err := unix.Fstat(cur, &st); err != nil {
			return nil, err
		}
		id := idOfStat(&st)
		if len(ids) > 0 && ids[len(ids)-1] == id {
			return ids, nil // ".." of the root is the root
		}
		ids = append(ids, id)
		parent, err := unix.Openat(cur, "..", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		unix.Close(cur)
		cur = parent
	}
	return nil, fmt.Errorf("more than %d directories deep", maxDepth)
}

// checkMountSourcePlace refuses a source that is the host's root, that is
// or contains the state directory, or that lies inside it, comparing
// identities (st_dev, st_ino) and places within file systems rather than
// paths, so that a bind mount of any of them under another path is caught
// as well.
func checkMountSourcePlace(fd int, st unix.Stat_t, source, stateDir string) error {
	src := idOfStat(&st)
	var rst unix.Stat_t
	if err := unix.Stat("/", &rst); err != nil {
		return fmt.Errorf("mount source %q: /: %w", source, err)
	}
	if src == idOfStat(&rst) {
		return fmt.Errorf("%w: mount source %q is the host's root: / is never bound into a sandbox (it holds the host and every sandbox); bind the directories the sandbox needs", ErrBadInput, source)
	}
	containsErr := fmt.Errorf("%w: mount source %q contains the sandboxes' state directory %s, which holds every sandbox's layers and control socket: bind a narrower directory", ErrBadInput, source, stateDir)
	insideErr := fmt.Errorf("%w: mount source %q is inside the sandboxes' state directory %s, which holds every sandbox's layers and control socket: bind a directory outside it", ErrBadInput, source, stateDir)
	sfd, err := unix.Open(stateDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("mount source %q: the state directory: %w", source, err)
	}
	defer unix.Close(sfd)
	stateChain, err := ancestry(sfd)
	if err != nil {
		return fmt.Errorf("mount source %q: the state directory %s: %w", source, stateDir, err)
	}
	if src == stateChain[0] {
		return insideErr // the state directory itself
	}
	if slices.Contains(stateChain, src) {
		return containsErr
	}
	// The source's own ancestors: from the directory itself, or from the
	// directory its path names for anything else (checked to hold it).
	dfd := fd
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		real, err := os.Readlink(fdPath(fd))
		if err != nil {
			return fmt.Errorf("mount source %q: %w", source, err)
		}
		pfd, err := unix.Open(filepath.Dir(real), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("mount source %q: its directory: %w", source, err)
		}
		defer unix.Close(pfd)
		var in unix.Stat_t
		if err := unix.Fstatat(pfd, filepath.Base(real), &in, unix.AT_SYMLINK_NOFOLLOW); err != nil || idOfStat(&in) != src {
			return fmt.Errorf("%w: mount source %q changed while it was checked: try again", ErrBadInput, source)
		}
		dfd = pfd
	}
	srcChain, err := ancestry(dfd)
	if err != nil {
		return fmt.Errorf("mount source %q: %w", source, err)
	}
	if slices.Contains(srcChain, stateChain[0]) {
		return insideErr
	}
	// A bind mount of a directory inside the state directory has its own
	// ancestors (those of where it is mounted): compare places within the
	// file system instead, from the mounts' roots in mountinfo.
	sdev, spath, sok := fsPlace(sfd)
	dev, p, ok := fsPlace(fd)
	if sok && ok && dev == sdev {
		if within(p, spath) {
			return insideErr
		}
		if within(spath, p) {
			return containsErr
		}
	}
	return nil
}

// fsPlace returns the file system (mountinfo's major:minor) and the path
// within it of the object fd refers to: the root of its mount (mountinfo's
// fourth field) joined with its path below the mount point. ok is false
// when that cannot be told (a deleted file, an unreadable mountinfo).
func fsPlace(fd int) (dev, p string, ok bool) {
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &stx); err != nil || stx.Mask&unix.STATX_MNT_ID == 0 {
		return "", "", false
	}
	real, err := os.Readlink(fdPath(fd))
	if err != nil || !strings.HasPrefix(real, "/") || strings.HasSuffix(real, " (deleted)") {
		return "", "", false
	}
	fields := mountInfo(stx.Mnt_id)
	if len(fields) < 5 {
		return "", "", false
	}
	root, point := unescapeMountInfo(fields[3]), unescapeMountInfo(fields[4])
	if !within(real, point) {
		return "", "", false
	}
	rel, err := filepath.Rel(point, real)
	if err != nil {
		return "", "", false
	}
	return fields[2], filepath.Join(root, rel), true
}

// unescapeMountInfo undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountInfo(f string) string {
	if !strings.Contains(f, `\`) {
		return f
	}
	var b strings.Builder
	for i := 0; i < len(f); i++ {
		if f[i] == '\\' && i+3 < len(f) {
			if n, err := strconv.ParseUint(f[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(f[i])
	}
	return b.String()
}

// within reports whether p is dir or beneath it (both clean and absolute).
func within(p, dir string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// mountType returns the file system type of the mount with this id in
// this process's mount namespace, or "".
func mountType(id uint64) string {
	fields := mountInfo(id)
	for i, f := range fields {
		if f == "-" && i+1 < len(fields) {
			return fields[i+1]
		}
	}
	return ""
}

// mountInfo returns the fields of the line of /proc/self/mountinfo for
// the mount with this id, or nil.
func mountInfo(id uint64) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	want := strconv.FormatUint(id, 10)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if mid, _, _ := strings.Cut(line, " "); mid == want {
			return strings.Fields(line)
		}
	}
	return nil
}

// checkMounts applies the source rules to every mount of cfg before the
// sandbox is created.
func (m *Runtime) checkMounts(cfg *Config) error {
	for _, mt := range cfg.Mounts {
		fd, err := openMountSource(mt.Source, m.dir)
		if err != nil {
			return err
		}
		unix.Close(fd)
	}
	return nil
}
