package localbox

import (
	"github.com/sandgate/sandgate/appliance/sandboxcli"

	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/snapshot"
)

// Templates. A template is a layer unpacked once per host and mounted
// read-only, between the sandbox's own upper and the rootfs, under every
// sandbox made from it: many sandboxes share one copy on disk, creating one
// costs no extraction, and a sandbox's upper (what Tar exports) holds only
// what it changed.
//
// Each template is a file system image of its own (ext4, no journal, made
// with mke2fs) in the state directory's template area, loop-mounted
// read-only on first use. A file system of its own because overlayfs
// refuses a lower layer inside another lower layer, and the rootfs (by
// default the host's /) holds the state directory. The area is inside the
// state directory, which every sandbox's root hides, so no sandbox reads a
// template except through its own overlay.

// templatesDir is the template area under the state directory. Its name
// cannot be a sandbox id (ids start with a letter or digit). It holds
// <name>.img (the image) and <name>/ (where it is mounted), whose root/ is
// the layer.
const templatesDir = ".templates"

// CheckTemplateName reports whether name can name a template
// (sandboxcli.CheckTemplateName).
func CheckTemplateName(name string) error { return sandboxcli.CheckTemplateName(name) }

func (m *Runtime) templateArea() string          { return filepath.Join(m.dir, templatesDir) }
func (m *Runtime) templateImage(n string) string { return filepath.Join(m.templateArea(), n+".img") }
func (m *Runtime) templateMount(n string) string { return filepath.Join(m.templateArea(), n) }

// templateLower is the directory a sandbox made from template name mounts
// as its lower layer (inside the image: its root holds lost+found).
func templateLower(stateDir, name string) string {
	return filepath.Join(stateDir, templatesDir, name, "root")
}

// TemplateSize is what ImportTemplate sizes a template's image by: the
// layer's uncompressed tar size and entry count (a manifest's TarSize and
// Entries). Zero means: read the layer once to measure it.
type TemplateSize struct {
	TarSize, Entries int64
}

// ImportTemplate unpacks layer (a layer tar, any compression the snapshot
// package reads; its whiteouts hide rootfs files) as template name. The
// template appears whole or not at all; a name already taken is ErrExists
// (templates are immutable: remove it first, or import under a new name).
// A layer that is not an io.ReadSeeker needs its size.
func (m *Runtime) ImportTemplate(ctx context.Context, name string, layer io.Reader, size TemplateSize) error {
	if err := CheckTemplateName(name); err != nil {
		return err
	}
	if size.TarSize <= 0 {
		rs, ok := layer.(io.ReadSeeker)
		if !ok {
			return fmt.Errorf("%w: template %q: the layer's size is needed to size its image (give TemplateSize, or a file)", ErrBadInput, name)
		}
		res, err := snapshot.Inspect(ctx, rs, nil)
		if err != nil {
			return fmt.Errorf("template %q: %w", name, err)
		}
		size = TemplateSize{TarSize: res.TarSize, Entries: res.Entries}
		if _, err := rs.Seek(0, io.SeekStart); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(m.templateArea(), 0o700); err != nil {
		return err
	}
	if _, err := os.Lstat(m.templateImage(name)); err == nil {
		return fmt.Errorf("%w: template %q (remove it first, or import under another name)", ErrExists, name)
	}
	// Built under temporary names (a dot first: Templates never lists
	// them) and published by one rename that never replaces.
	work, err := os.MkdirTemp(m.templateArea(), "."+name+".tmp-")
	if err != nil {
		return err
	}
	defer func() {
		_ = unix.Unmount(filepath.Join(work, "mnt"), unix.MNT_DETACH)
		os.RemoveAll(work)
	}()
	img, mnt := filepath.Join(work, "img"), filepath.Join(work, "mnt")
	if err := makeImage(ctx, img, size); err != nil {
		return fmt.Errorf("template %q: %w", name, err)
	}
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return err
	}
	if err := mountImage(img, mnt, false, ""); err != nil {
		return fmt.Errorf("template %q: %w", name, err)
	}
	_, uerr := snapshot.Unpack(ctx, layer, filepath.Join(mnt, "root"), snapshot.ApplyOptions{Mode: snapshot.ModeUpper, Trusted: true})
	if err := unix.Unmount(mnt, 0); err != nil && uerr == nil {
		uerr = fmt.Errorf("unmount: %w", err)
	}
	if uerr != nil {
		if errors.Is(uerr, unix.ENOSPC) {
			return fmt.Errorf("template %q: its image (sized for %d tar bytes, %d entries) is full: %w", name, size.TarSize, size.Entries, uerr)
		}
		return fmt.Errorf("template %q: %w", name, uerr)
	}
	if err := unix.Renameat2(unix.AT_FDCWD, img, unix.AT_FDCWD, m.templateImage(name), unix.RENAME_NOREPLACE); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("%w: template %q (imported meanwhile by another process)", ErrExists, name)
		}
		return fmt.Errorf("template %q: %w", name, err)
	}
	return nil
}

// makeImage makes an empty ext4 file system in file (sparse) with room for
// a layer of the given size: its bytes with slack, a block per entry for
// the small ones, and an inode each.
func makeImage(ctx context.Context, file string, size TemplateSize) error {
	const block = 4096 // mkfsImage's
	bytes := size.TarSize + size.TarSize/4 + size.Entries*block + 64<<20
	bytes = (bytes + block - 1) / block * block
	inodes := size.Entries + size.Entries/4 + 1024
	err := mkfsImage(ctx, file, bytes, "-O", "^has_journal", "-N", strconv.FormatInt(inodes, 10), "-E", "root_owner=0:0")
	if errors.Is(err, errNoMkfs) {
		return fmt.Errorf("templates need mke2fs: %w", err)
	}
	return err
}

// errNoMkfs: mke2fs is missing.
var errNoMkfs = errors.New("mke2fs is not installed (Debian and Ubuntu: apt-get install e2fsprogs)")

// mkfsImage makes file, a new sparse file of size bytes, an empty ext4
// file system with 4 KiB blocks, none reserved for root, and mke2fs's
// options opts beside. Without mke2fs it is errNoMkfs.
func mkfsImage(ctx context.Context, file string, size int64, opts ...string) error {
	f, err := os.OpenFile(file, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	mkfs, err := exec.LookPath("mke2fs")
	if err != nil {
		return fmt.Errorf("%w: %v", errNoMkfs, err)
	}
	args := append([]string{"-q", "-F", "-t", "ext4", "-m", "0", "-b", "4096"}, opts...)
	cmd := exec.CommandContext(ctx, mkfs, append(args, file)...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "MKE2FS_CONFIG=/dev/null"}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("mke2fs: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// mountImage attaches file to a free loop device (released when the mount
// goes: autoclear) and mounts its ext4 file system at dir, with the mount
// options data.
func mountImage(file, dir string, readOnly bool, data string) error {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loop devices: %w (templates and disk quotas need the loop driver: modprobe loop)", err)
	}
	defer ctl.Close()
	flags := 0
	mflags := uintptr(unix.MS_NODEV | unix.MS_NOSUID)
	if readOnly {
		flags = os.O_RDONLY
		mflags |= unix.MS_RDONLY
	} else {
		flags = os.O_RDWR
	}
	img, err := os.OpenFile(file, flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer img.Close()
	cfg := unix.LoopConfig{Fd: uint32(img.Fd())}
	cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
	if readOnly {
		cfg.Info.Flags |= unix.LO_FLAGS_READ_ONLY
	}
	// Another process may take the free device between asking and
	// configuring: ask again, a bounded number of times.
	for range 32 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return fmt.Errorf("loop devices: no free device: %w", err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		lf, err := os.OpenFile(dev, flags|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("loop device %s: %w", dev, err)
		}
		err = unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		if errors.Is(err, unix.EBUSY) {
			lf.Close()
			continue
		}
		if err != nil {
			lf.Close()
			return fmt.Errorf("loop device %s: %w", dev, err)
		}
		err = unix.Mount(dev, dir, "ext4", mflags, data)
		lf.Close() // with autoclear, the mount now holds the device
		if err != nil {
			return fmt.Errorf("mount %s on %s: %w", dev, dir, err)
		}
		return nil
	}
	return errors.New("loop devices: every free device was taken by another process; try again")
}

// lockTemplates serialises mounting and removing templates between
// processes (held for a mount or a removal).
func (m *Runtime) lockTemplates() (unlock func(), err error) {
	if err := os.MkdirAll(m.templateArea(), 0o700); err != nil {
		return nil, err
	}
	return flockWait(filepath.Join(m.templateArea(), ".lock"), time.Minute)
}

// mounted reports whether dir is a mount point (its device differs from
// its parent's).
func mounted(dir string) bool {
	var st, parent unix.Stat_t
	if unix.Stat(dir, &st) != nil || unix.Stat(filepath.Dir(dir), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

// Templates lists the templates of this state directory, sorted.
func (m *Runtime) Templates() ([]string, error) {
	ents, err := os.ReadDir(m.templateArea())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if name, ok := strings.CutSuffix(e.Name(), ".img"); ok && e.Type().IsRegular() && CheckTemplateName(name) == nil {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out, nil
}

// RemoveTemplate removes template name. A template that a sandbox of this
// state directory was made from (running or not, until it is deleted) is
// ErrBusy; a missing one is ErrNotFound.
func (m *Runtime) RemoveTemplate(name string) error {
	if err := CheckTemplateName(name); err != nil {
		return err
	}
	unlock, err := m.lockTemplates()
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := os.Lstat(m.templateImage(name)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: template %q", ErrNotFound, name)
		}
		return err
	}
	if users := m.templateUsers(name); len(users) > 0 {
		return fmt.Errorf("%w: template %q is the lower layer of sandboxes %v; delete them first", ErrBusy, name, users)
	}
	dir := m.templateMount(name)
	for i := 0; mounted(dir); i++ {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil || i == 16 {
			return fmt.Errorf("template %q: unmount %s: %v", name, dir, err)
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return os.Remove(m.templateImage(name))
}

// templateUsers lists the sandboxes whose configuration names template.
func (m *Runtime) templateUsers(template string) []string {
	ents, _ := os.ReadDir(m.dir)
	var users []string
	for _, e := range ents {
		if !e.IsDir() || CheckID(e.Name()) != nil {
			continue
		}
		var cfg Config
		if readJSON(filepath.Join(m.sandboxDir(e.Name()), configFile), &cfg) == nil && cfg.Template == template {
			users = append(users, e.Name())
		}
	}
	return users
}

// useTemplate makes sure the template a configuration names exists and is
// mounted (after a reboot it is not), read-only.
func (m *Runtime) useTemplate(cfg *Config) error {
	if cfg.Template == "" {
		return nil
	}
	if err := CheckTemplateName(cfg.Template); err != nil {
		return err
	}
	unlock, err := m.lockTemplates()
	if err != nil {
		return err
	}
	defer unlock()
	img := m.templateImage(cfg.Template)
	if _, err := os.Stat(img); err != nil {
		return fmt.Errorf("%w: template %q is not in %s (import it with 'sandgate sandbox template import')", ErrNotFound, cfg.Template, m.templateArea())
	}
	dir := m.templateMount(cfg.Template)
	if mounted(dir) {
		return nil
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return mountImage(img, dir, true, "")
}
