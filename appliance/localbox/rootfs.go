package localbox

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// A sandbox's root is assembled on the host, by the monitor (host root, on
// a thread with a mount namespace of its own), before its init exists:
// prepareRoot mounts the scaffold, the layers (idmapped where the sandbox
// has a user namespace), the overlay(s), /dev, /tmp, the bind mounts and the
// masks, and hands the init a descriptor of the result. The init is then
// started in new namespaces — a user namespace first, where there is one —
// so that its mount namespace is a copy of that one: every mount made here
// is locked there (a process of the sandbox, whatever its capabilities,
// cannot unmount one to see what lies beneath), and the init adds only
// what must be made from inside its namespaces (proc, sysfs, devpts,
// /dev/shm) before it pivots into the root.

// An exposure is a host directory that a sandbox's image shows, and where:
// the configured rootfs at the root, or one of hostDirs at its own name in
// the default image.
type exposure struct {
	host string // host path
	at   string // path inside the sandbox, relative to its root ("" is the root)
}

// exposures returns what the image of cfg shows of the host.
func exposures(rootfs string) []exposure {
	if !isDefaultImage(rootfs) {
		return []exposure{{host: rootfs}}
	}
	var out []exposure
	for _, d := range imageDirs() {
		out = append(out, exposure{host: "/" + d, at: d})
	}
	return out
}

// A mask is a place inside a sandbox covered so that what the host keeps
// there (the state directory, a snapshot store) is never seen.
type mask struct {
	rel string // inside the sandbox, relative to its root
	dir bool
}

// planMasks returns where each hidden host path appears inside a sandbox
// whose image shows exposed. Where a path lies is judged by identity (the
// file system and the place within it, as mountinfo says), not by its
// name, so that a bind-mount alias of the rootfs or of a hidden path is
// seen through. An image that lies inside a hidden path is refused: it
// could not be masked without masking the image itself.
func planMasks(exposed []exposure, hidden []string) ([]mask, error) {
	type place struct {
		dev, path string
		dir       bool
	}
	placeOf := func(p string) (place, bool, error) {
		fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOENT) {
			return place{}, false, nil
		}
		if err != nil {
			return place{}, false, fmt.Errorf("%s: %w", p, err)
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return place{}, false, fmt.Errorf("%s: %w", p, err)
		}
		dir := st.Mode&unix.S_IFMT == unix.S_IFDIR
		if dev, fp, ok := fsPlace(fd); ok {
			return place{dev, fp, dir}, true, nil
		}
		real, err := filepath.EvalSymlinks(p)
		if err != nil {
			return place{}, false, fmt.Errorf("%s: %w", p, err)
		}
		return place{strconv.FormatUint(st.Dev, 10), real, dir}, true, nil
	}
	var out []mask
	seen := map[string]bool{}
	for _, e := range exposed {
		ep, ok, err := placeOf(e.host)
		if err != nil || !ok {
			continue // an image directory that is gone shows nothing
		}
		for _, h := range hidden {
			if h == "" {
				continue
			}
			hp, ok, err := placeOf(h)
			if err != nil {
				return nil, fmt.Errorf("%w: hidden path %v", ErrBadInput, err)
			}
			if !ok || hp.dev != ep.dev {
				continue
			}
			if within(ep.path, hp.path) {
				return nil, fmt.Errorf("%w: the image directory %s lies inside %s, which no sandbox may see (the state directory, a snapshot store, or a path hidden by --mask): choose an image outside it", ErrBadInput, e.host, h)
			}
			if !within(hp.path, ep.path) {
				continue
			}
			rel, err := filepath.Rel(ep.path, hp.path)
			if err != nil {
				continue
			}
			rel = filepath.Join(e.at, rel)
			if !seen[rel] {
				seen[rel] = true
				out = append(out, mask{rel: rel, dir: hp.dir})
			}
		}
	}
	return out, nil
}

// CheckImage reports whether a sandbox with image rootfs ("" is the
// default image) can be kept from seeing the hidden host paths (by masking
// them): an image inside one of them cannot, and is ErrBadInput.
func CheckImage(rootfs string, hidden []string) error {
	if !isDefaultImage(rootfs) {
		if fi, err := os.Stat(rootfs); err != nil || !fi.IsDir() {
			return fmt.Errorf("%w: rootfs %q must be an existing directory", ErrBadInput, rootfs)
		}
	}
	_, err := planMasks(exposures(rootfs), hidden)
	return err
}

// prepareRoot assembles the root of the sandbox in dir at dir/root and
// returns an O_PATH descriptor of it. It runs in the monitor on a locked
// thread that has a mount namespace of its own (unshared, all mounts
// private), so that nothing it mounts is ever on the host; the init,
// started from that thread, gets a copy of it. idBase is the host id of
// the sandbox's root, 0 for no user namespace.
func prepareRoot(dir string, cfg *Config, masks []mask, idBase int) (rootFD int, err error) {
	scaffold := filepath.Join(dir, scaffoldDir)
	root := filepath.Join(dir, rootDir)
	if err := unix.Mount("tmpfs", scaffold, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=755"); err != nil {
		return -1, fmt.Errorf("scaffold: %w", err)
	}
	rootFD = -1
	defer func() {
		if err != nil {
			if rootFD >= 0 {
				unix.Close(rootFD)
			}
			_ = unix.Unmount(root, unix.MNT_DETACH)
			_ = unix.Unmount(scaffold, unix.MNT_DETACH)
		}
	}()
	top, base, mnt := filepath.Join(scaffold, "top"), filepath.Join(scaffold, "base"), filepath.Join(scaffold, "mnt")
	for _, d := range []string{top, base, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return -1, err
		}
	}
	// The overlays are mounted from the scaffold, by paths relative to it:
	// mountinfo shows an overlay's options as they were given, and none of
	// the host's paths (the state directory's, a template's image, the
	// rootfs) is then among them. Every layer is attached in the scaffold
	// first (layer). This thread's working directory is its own (it
	// unshared its mount namespace), and every other path here is absolute.
	if err := unix.Chdir(scaffold); err != nil {
		return -1, fmt.Errorf("scaffold: %w", err)
	}
	uid := hostID(idBase, 0)
	userns := -1
	if idBase != 0 {
		if userns, err = newUserns(idBase); err != nil {
			return -1, &usernsError{err}
		}
		defer unix.Close(userns)
	}
	// Fresh work directories: an overlay mounted volatile leaves a mark in
	// its own that refuses the next mount (a first attempt, with a user
	// namespace, may have made one).
	layerDir := layerRoot(dir, cfg)
	for _, w := range append([]string{workDir}, workDirs(cfg.Rootfs)...) {
		p := filepath.Join(layerDir, w)
		if err := os.RemoveAll(p); err != nil {
			return -1, err
		}
		if err := os.Mkdir(p, 0o700); err != nil {
			return -1, err
		}
	}
	// layer attaches a copy of the mount of layer path (idmapped, where
	// the sandbox has a user namespace) under mnt, and returns where an
	// overlay takes it: mnt/<n>, relative to the scaffold.
	n := 0
	layer := func(path string) (string, error) {
		var fd int
		if userns < 0 {
			if fd, err = unix.OpenTree(unix.AT_FDCWD, path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC); err != nil {
				return "", fmt.Errorf("a layer's mount, %s: open_tree: %w", path, err)
			}
		} else if fd, err = idmapped(path, userns); err != nil {
			return "", &usernsError{err}
		}
		defer unix.Close(fd)
		n++
		at := filepath.Join("mnt", strconv.Itoa(n))
		if err := os.Mkdir(filepath.Join(scaffold, at), 0o700); err != nil {
			return "", err
		}
		if err := unix.MoveMount(fd, "", unix.AT_FDCWD, filepath.Join(scaffold, at), unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return "", fmt.Errorf("attach the mount of %s: %w", path, err)
		}
		return at, nil
	}
	image := cfg.Rootfs
	subdirs := []string(nil)
	if isDefaultImage(cfg.Rootfs) {
		if err := buildBase(base, cfg.ID, uid, uid, cfg.TrustCA); err != nil {
			return -1, fmt.Errorf("the default image: %w", err)
		}
		image = "base" // the scaffold's, relative to it
		subdirs = imageDirs()
		// Each host directory of the image is an overlay of its own, whose
		// upper is the same directory of the sandbox's upper, so that its
		// changes are in the sandbox's layer like any other.
		for _, d := range subdirs {
			if err := ensureDir(filepath.Join(layerDir, upperDir), d, "/"+d); err != nil {
				return -1, err
			}
		}
	} else if image, err = layer(cfg.Rootfs); err != nil {
		return -1, err
	}
	lookup := func(rel string) (fs.FileInfo, int, int, bool) {
		if isDefaultImage(cfg.Rootfs) {
			fi, err := os.Lstat(filepath.Join(base, rel))
			if err != nil || !fi.IsDir() {
				return nil, 0, 0, false
			}
			st := fi.Sys().(*syscall.Stat_t)
			return fi, int(st.Uid), int(st.Gid), true
		}
		fi, err := os.Lstat(filepath.Join(cfg.Rootfs, rel))
		if err != nil || !fi.IsDir() {
			return nil, 0, 0, false
		}
		st := fi.Sys().(*syscall.Stat_t)
		return fi, hostID(idBase, int(st.Uid)), hostID(idBase, int(st.Gid)), true
	}
	if err := buildScaffold(top, cfg, lookup, uid); err != nil {
		return -1, fmt.Errorf("scaffold: %w", err)
	}
	sandbox, err := layer(layerDir)
	if err != nil {
		return -1, err
	}
	lower := "top" // the scaffold's, relative to it
	var tmpl string
	if cfg.Template != "" {
		tmplRoot := templateLower(filepath.Dir(dir), cfg.Template)
		if tmpl, err = layer(tmplRoot); err != nil {
			return -1, err
		}
		lower += ":" + escapeOverlay(tmpl)
	}
	lower += ":" + escapeOverlay(image)
	// The overlays of the image's host directories are mounted first, aside,
	// and moved into the root after: the other order makes the kernel take
	// a sub-overlay's upper (inside the root's upper) for one in use.
	aside := map[string]string{}
	for _, d := range subdirs {
		host, err := layer("/" + d)
		if err != nil {
			return -1, err
		}
		lower := escapeOverlay(host)
		if tmpl != "" {
			if fi, err := os.Lstat(filepath.Join(templateLower(filepath.Dir(dir), cfg.Template), d)); err == nil && fi.IsDir() {
				t, err := layer(filepath.Join(templateLower(filepath.Dir(dir), cfg.Template), d))
				if err != nil {
					return -1, err
				}
				lower = escapeOverlay(t) + ":" + lower
			}
		}
		at := filepath.Join(mnt, "image-"+d)
		if err := os.Mkdir(at, 0o700); err != nil {
			return -1, err
		}
		if err := asMounter(uid, func() error {
			return mountOverlay(at, lower, filepath.Join(sandbox, upperDir, d), filepath.Join(sandbox, workDir+"-"+d))
		}); err != nil {
			return -1, overlayError(err, idBase)
		}
		aside[d] = at
	}
	if err := asMounter(uid, func() error {
		return mountOverlay(root, lower, filepath.Join(sandbox, upperDir), filepath.Join(sandbox, workDir))
	}); err != nil {
		return -1, overlayError(err, idBase)
	}
	if rootFD, err = unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return -1, err
	}
	r := &rootFS{path: root, fd: rootFD}
	for _, d := range subdirs {
		fd, err := r.open(d, unix.O_PATH|unix.O_DIRECTORY)
		if err != nil {
			return -1, fmt.Errorf("the image's /%s: %w", d, err)
		}
		err = unix.MoveMount(unix.AT_FDCWD, aside[d], fd, "", unix.MOVE_MOUNT_T_EMPTY_PATH)
		unix.Close(fd)
		if err != nil {
			return -1, fmt.Errorf("mount the image's /%s: %w", d, err)
		}
	}
	if err := r.mount("tmpfs", "tmp", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, fmt.Sprintf("mode=1777,size=%d,uid=%d,gid=%d", cfg.tmpSize(), uid, uid)); err != nil {
		return -1, err
	}
	if err := makeDev(r, uid); err != nil {
		return -1, err
	}
	for _, m := range masks {
		if err := r.hide(m); err != nil {
			return -1, err
		}
	}
	for _, m := range cfg.Mounts {
		attr := uint64(unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV)
		if m.ReadOnly {
			attr |= unix.MOUNT_ATTR_RDONLY
		}
		// Checked again on the object mounted: the path may have changed
		// since Run checked it.
		src, err := openMountSource(m.Source, filepath.Dir(dir))
		if err != nil {
			return -1, err
		}
		if err := r.mountPointInTmp(m.Destination, src, uid); err != nil {
			unix.Close(src)
			return -1, err
		}
		// With a user namespace, the source is seen with its host ids
		// shifted into the sandbox's (host root is the sandbox's root),
		// as it was before there were user namespaces: an operator who
		// shares a directory read-write means the sandbox's root to
		// write it. A file system that cannot be idmapped is bound as
		// it is, its host ids then governing (the sandbox's root is
		// nobody there).
		done := false
		if userns >= 0 {
			if done, err = r.bindIdmapped(src, m.Destination, attr, userns); err != nil {
				unix.Close(src)
				return -1, err
			}
		}
		if !done {
			err = r.bind(fdPath(src), m.Destination, attr)
		}
		unix.Close(src)
		if err != nil {
			return -1, err
		}
	}
	if !cfg.Write {
		for _, d := range append([]string{"."}, subdirs...) {
			fd, err := r.open(d, unix.O_PATH|unix.O_DIRECTORY)
			if err != nil {
				return -1, err
			}
			err = unix.Mount("", fdPath(fd), "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NODEV, "")
			unix.Close(fd)
			if err != nil {
				return -1, fmt.Errorf("read-only root: %w", err)
			}
		}
	}
	return rootFD, nil
}

// workDirs are the work directories of the overlays of the image's host
// directories (the default image's), beside the root's.
func workDirs(rootfs string) []string {
	if !isDefaultImage(rootfs) {
		return nil
	}
	var out []string
	for _, d := range imageDirs() {
		out = append(out, workDir+"-"+d)
	}
	return out
}

// mountPointInTmp makes the mount point of a bind mount whose destination
// lies in /tmp: the sandbox's own tmpfs, mounted over the scaffold that
// holds every other mount point, so it is made there (never in the layer),
// a directory or an empty file like the source src.
func (r *rootFS) mountPointInTmp(dest string, src, uid int) error {
	rel := strings.TrimPrefix(filepath.Clean(dest), "/")
	if !strings.HasPrefix(rel, "tmp/") {
		return nil
	}
	if fd, err := r.open(rel, unix.O_PATH); err == nil {
		unix.Close(fd)
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(src, &st); err != nil {
		return err
	}
	parts := strings.Split(rel, "/")
	cur := parts[0]
	for i, part := range parts[1:] {
		pfd, err := r.open(cur, unix.O_RDONLY|unix.O_DIRECTORY)
		if err != nil {
			return fmt.Errorf("mount point %s: %w", dest, err)
		}
		last := i == len(parts)-2
		if last && st.Mode&unix.S_IFMT != unix.S_IFDIR {
			var fd int
			fd, err = unix.Openat(pfd, part, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
			if err == nil {
				unix.Close(fd)
			}
		} else {
			err = unix.Mkdirat(pfd, part, 0o755)
		}
		if err == nil {
			err = unix.Fchownat(pfd, part, uid, uid, unix.AT_SYMLINK_NOFOLLOW)
		} else if errors.Is(err, unix.EEXIST) {
			err = nil
		}
		unix.Close(pfd)
		if err != nil {
			return fmt.Errorf("mount point %s: %w", dest, err)
		}
		cur += "/" + part
	}
	return nil
}

// bindIdmapped binds the opened source src (and what is mounted below it)
// at rel, its ids translated by userns, and sets attr on it. done is false
// when its file system cannot be idmapped: nothing was mounted.
func (r *rootFS) bindIdmapped(src int, rel string, attr uint64, userns int) (done bool, err error) {
	tree, err := unix.OpenTree(src, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH|unix.AT_RECURSIVE)
	if err != nil {
		return false, nil
	}
	defer unix.Close(tree)
	idmap := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns)}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &idmap); err != nil {
		return false, nil
	}
	target, err := r.open(rel, unix.O_PATH)
	if err != nil {
		return false, err
	}
	defer unix.Close(target)
	if err := unix.MoveMount(tree, "", target, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return false, fmt.Errorf("bind %s: %w", rel, err)
	}
	return true, r.setAttr(rel, attr)
}

// ensureDir makes rel a directory inside upper (not following symbolic
// links), with the mode and owner of like on the host, unless it is one
// already. A layer that made it anything else is refused: the default
// image needs it to be a directory to mount the host's over.
func ensureDir(upper, rel, like string) error {
	p := filepath.Join(upper, rel)
	fi, err := os.Lstat(p)
	if err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("%w: the sandbox's layer replaces /%s with something other than a directory, which the default image cannot run (/%s is the host's)", ErrBadInput, rel, rel)
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	mode := os.FileMode(0o755)
	if hfi, err := os.Stat(like); err == nil {
		mode = hfi.Mode().Perm()
	}
	if err := os.Mkdir(p, mode); err != nil {
		return err
	}
	return os.Chmod(p, mode)
}

// overlayError marks an overlay that would not mount on idmapped layers
// as a user namespace failure: kernels before 5.19 refuse those (EINVAL).
func overlayError(err error, idBase int) error {
	if idBase != 0 && errors.Is(err, unix.EINVAL) {
		return &usernsError{err}
	}
	return err
}

// mountOverlay mounts an overlay at target.
func mountOverlay(target, lower, upper, work string) error {
	opts := "lowerdir=" + lower + ",upperdir=" + escapeOverlay(upper) + ",workdir=" + escapeOverlay(work) +
		",redirect_dir=off,metacopy=off,index=off,xino=off"
	// Volatile: no sync of the upper's file system, neither when a command
	// asks (fsync) nor when the overlay goes with the sandbox, which
	// otherwise writes back every dirty page of a layer that is about to
	// be saved or deleted (seconds, for an agent's install). A sandbox's
	// durability is its snapshot; its upper is never mounted again. A
	// kernel without it (before 5.10) mounts without.
	err := unix.Mount("overlay", target, "overlay", unix.MS_NODEV, opts+",volatile")
	if errors.Is(err, unix.EINVAL) {
		err = unix.Mount("overlay", target, "overlay", unix.MS_NODEV, opts)
	}
	if err != nil {
		return fmt.Errorf("mount overlay (%s): %w", opts, err)
	}
	return nil
}

// hide covers m: an empty read-only tmpfs over a directory, the sandbox's
// /dev/null over a file. A place the sandbox's layers already hide (a
// symbolic link, a file or nothing where the host's directory would be
// seen) needs no cover.
func (r *rootFS) hide(m mask) error {
	fd, err := r.open(m.rel, unix.O_PATH)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		err = unix.Mount("tmpfs", fdPath(fd), "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0555,size=4k")
	} else {
		null, nerr := r.open("dev/null", unix.O_PATH)
		if nerr != nil {
			return nerr
		}
		err = unix.Mount(fdPath(null), fdPath(fd), "", unix.MS_BIND, "")
		unix.Close(null)
	}
	if err != nil {
		return fmt.Errorf("hide /%s: %w", m.rel, err)
	}
	return nil
}

// makeDev makes the sandbox's /dev: a tmpfs with the harmless character
// devices, the mount points of devpts and /dev/shm (which the init mounts,
// from inside its namespaces), and the fd symlinks.
func makeDev(r *rootFS, uid int) error {
	if err := r.mount("tmpfs", "dev", "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, fmt.Sprintf("mode=755,size=64k,uid=%d,gid=%d", uid, uid)); err != nil {
		return err
	}
	dfd, err := r.open("dev", unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	for _, d := range []struct {
		name         string
		major, minor uint32
	}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}} {
		if err := unix.Mknodat(dfd, d.name, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil {
			return fmt.Errorf("/dev/%s: %w", d.name, err)
		}
		if err := unix.Fchownat(dfd, d.name, uid, uid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("/dev/%s: %w", d.name, err)
		}
	}
	for _, d := range []struct {
		name string
		mode uint32
	}{{"pts", 0o755}, {"shm", 0o1777}} {
		if err := unix.Mkdirat(dfd, d.name, d.mode); err != nil {
			return fmt.Errorf("/dev/%s: %w", d.name, err)
		}
		if err := unix.Fchownat(dfd, d.name, uid, uid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("/dev/%s: %w", d.name, err)
		}
	}
	for link, target := range map[string]string{
		"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2",
	} {
		if err := unix.Symlinkat(target, dfd, link); err != nil {
			return fmt.Errorf("/dev/%s: %w", link, err)
		}
		if err := unix.Fchownat(dfd, link, uid, uid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("/dev/%s: %w", link, err)
		}
	}
	return nil
}

// buildScaffold makes the scaffold layer in top: the mount points (/proc,
// /dev, /sys, /tmp and every bind destination) as a lower layer above the
// image, so that they exist in any image without ever being written into
// the upper, and so into a layer. Directories it adds copy the image's
// mode and owner where the image has them (lookup), else are the
// sandbox's root's (uid). It lives on the scaffold's tmpfs: overlayfs
// refuses a lower layer inside another one, and a rootfs (/, say) may hold
// the state directory.
func buildScaffold(top string, cfg *Config, lookup func(rel string) (fi fs.FileInfo, uid, gid int, ok bool), uid int) error {
	mkdir := func(rel string) error {
		cur := top
		for _, part := range strings.Split(strings.Trim(rel, "/"), "/") {
			cur = filepath.Join(cur, part)
			relPath := strings.TrimPrefix(cur, top)
			if err := os.Mkdir(cur, 0o755); err != nil {
				if errors.Is(err, fs.ErrExist) {
					continue
				}
				return err
			}
			if fi, u, g, ok := lookup(relPath); ok {
				_ = os.Chmod(cur, fi.Mode().Perm()|fi.Mode()&(fs.ModeSticky|fs.ModeSetgid))
				_ = os.Lchown(cur, u, g)
			} else {
				_ = os.Lchown(cur, uid, uid)
			}
		}
		return nil
	}
	for _, d := range []string{"proc", "dev", "sys", "tmp"} {
		if err := mkdir(d); err != nil {
			return err
		}
	}
	for _, mt := range cfg.Mounts {
		fi, err := os.Stat(mt.Source)
		if err != nil {
			return fmt.Errorf("%w: mount source: %v", ErrBadInput, err)
		}
		if fi.IsDir() {
			if err := mkdir(mt.Destination); err != nil {
				return err
			}
			continue
		}
		if err := mkdir(filepath.Dir(mt.Destination)); err != nil {
			return err
		}
		f, err := os.OpenFile(filepath.Join(top, mt.Destination), os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return fmt.Errorf("mount destination %s: %w", mt.Destination, err)
		}
		f.Close()
		_ = os.Lchown(filepath.Join(top, mt.Destination), uid, uid)
	}
	return nil
}
