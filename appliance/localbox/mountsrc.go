package localbox

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
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
	real, err := os.Readlink(fdPath(fd))
	if err != nil {
		return fmt.Errorf("mount source %q: %w", source, err)
	}
	if real == "/" {
		return fmt.Errorf("%w: mount source %q is the host's root: / is never bound into a sandbox (it holds the host and every sandbox); bind the directories the sandbox needs", ErrBadInput, source)
	}
	if within(real, stateDir) {
		return fmt.Errorf("%w: mount source %q is inside the sandboxes' state directory %s, which holds every sandbox's layers and control socket: bind a directory outside it", ErrBadInput, source, stateDir)
	}
	if within(stateDir, real) {
		return fmt.Errorf("%w: mount source %q contains the sandboxes' state directory %s, which holds every sandbox's layers and control socket: bind a narrower directory", ErrBadInput, source, stateDir)
	}
	return nil
}

// within reports whether p is dir or beneath it (both clean and absolute).
func within(p, dir string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// mountType returns the file system type of the mount with this id in
// this process's mount namespace, or "".
func mountType(id uint64) string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	want := strconv.FormatUint(id, 10)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if mid, _, _ := strings.Cut(line, " "); mid != want {
			continue
		}
		if _, post, ok := strings.Cut(line, " - "); ok {
			if fields := strings.Fields(post); len(fields) > 0 {
				return fields[0]
			}
		}
		return ""
	}
	return ""
}

// checkMounts applies the source rules to every mount of cfg before the
// sandbox is created.
func (m *Manager) checkMounts(cfg *Config) error {
	for _, mt := range cfg.Mounts {
		fd, err := openMountSource(mt.Source, m.dir)
		if err != nil {
			return err
		}
		unix.Close(fd)
	}
	return nil
}
