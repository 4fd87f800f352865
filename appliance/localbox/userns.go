package localbox

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// User namespaces. Where the kernel allows (UserNSAuto), every process of a
// sandbox, its init included, runs in a user namespace of its own whose ids
// 0..65535 are a range of the host's no one else uses (idSlot): root inside
// is an unprivileged user outside, so a host file that leaks into view is
// still governed by the host's permissions, and a capability inside counts
// only for what the sandbox's namespaces own.
//
// The sandbox's files keep their ids as the layer format has them (root is
// 0 in a layer, whatever the host range): every layer — the image, a
// template, the sandbox's own upper — is an idmapped mount (mount_setattr
// MOUNT_ATTR_IDMAP) translating between the two, and the overlay is mounted
// by the monitor, host root, before the init exists (see prepareRoot).

// UserNS modes (Config.UserNS).
const (
	// UserNSAuto runs the sandbox in a user namespace where the kernel
	// supports it (idmapped mounts under overlayfs: Linux 5.19 and file
	// systems that support idmapping), and without one elsewhere.
	UserNSAuto = ""
	// UserNSOn requires one: Run fails where it cannot be had.
	UserNSOn = "on"
	// UserNSOff never uses one: root inside is root outside, held by
	// capabilities, seccomp and no_new_privs only.
	UserNSOff = "off"
)

func checkUserNS(mode string) error {
	switch mode {
	case UserNSAuto, UserNSOn, UserNSOff:
		return nil
	}
	return fmt.Errorf("%w: user namespace mode %q: want auto, on or off", ErrBadInput, mode)
}

// The host id ranges of sandboxes: slot k maps a sandbox's ids 0..idRange-1
// to idBase+k*idRange...; idSlots slots lie between 2^30 and 2^31, far from
// the ids of the host's own users and of other container runtimes'
// /etc/subuid ranges (100000 and up, conventionally).
const (
	idRange = 1 << 16
	idBase  = 1 << 30
	idSlots = 1 << 14
)

// idRegistry is the host-wide directory of taken id slots: one file per
// slot, naming the sandbox directory that holds it. It is host-wide (not
// per state directory) because host ids are: two services on one host must
// not give their sandboxes the same range.
var idRegistry = "/run/sandgate/idmaps"

// allocIDs takes a free id slot for the sandbox in dir and returns the
// host id its root maps to. A slot whose sandbox directory is gone (a
// sandbox removed by hand, a state directory wiped) is taken back.
func allocIDs(dir string) (int, error) {
	unlock, err := lockIDRegistry()
	if err != nil {
		return 0, err
	}
	defer unlock()
	start := firstSlot(dir)
	for i := range idSlots {
		slot := (start + i) % idSlots
		p := filepath.Join(idRegistry, strconv.Itoa(slot))
		if b, err := os.ReadFile(p); err == nil {
			owner := string(b)
			if owner == dir {
				return idBase + slot*idRange, nil
			}
			if _, err := os.Stat(owner); err == nil || !errors.Is(err, fs.ErrNotExist) {
				continue
			}
			_ = os.Remove(p)
		}
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("user namespace ids: %w", err)
		}
		_, err = f.WriteString(dir)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(p)
			return 0, fmt.Errorf("user namespace ids: %w", err)
		}
		return idBase + slot*idRange, nil
	}
	return 0, fmt.Errorf("user namespace ids: all %d ranges are taken", idSlots)
}

// firstSlot is where allocIDs starts looking for the sandbox in dir: a
// digest of it, so that sandboxes made at once rarely meet.
func firstSlot(dir string) int {
	sum := sha256.Sum256([]byte(dir))
	return int(binary.BigEndian.Uint32(sum[:4]) % idSlots)
}

// releaseIDs gives back the slot of host id base if the sandbox in dir
// holds it.
func releaseIDs(dir string, base int) {
	if base < idBase || (base-idBase)%idRange != 0 {
		return
	}
	unlock, err := lockIDRegistry()
	if err != nil {
		return
	}
	defer unlock()
	p := filepath.Join(idRegistry, strconv.Itoa((base-idBase)/idRange))
	if b, err := os.ReadFile(p); err == nil && string(b) == dir {
		os.Remove(p)
	}
}

// lockIDRegistry takes the registry's lock (flock, held briefly).
func lockIDRegistry() (func(), error) {
	if err := os.MkdirAll(idRegistry, 0o700); err != nil {
		return nil, fmt.Errorf("user namespace ids: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(idRegistry, ".lock"), os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("user namespace ids: %w", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("user namespace ids: %w", err)
	}
	return func() { f.Close() }, nil
}

// idMappings is the mapping of a sandbox whose root is host id base.
func idMappings(base int) []syscall.SysProcIDMap {
	return []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: idRange}}
}

// newUserns returns a descriptor of a new user namespace mapping ids
// 0..idRange-1 to base...: a child is started in it, stopped at its first
// instruction (it is traced from its start and never runs), and killed
// once its namespace is held.
func newUserns(base int) (int, error) {
	runtime.LockOSThread() // the tracer is this thread
	defer runtime.UnlockOSThread()
	pid, err := syscall.ForkExec("/proc/self/exe", []string{"sandgate-sandbox-userns"}, &syscall.ProcAttr{
		Env: []string{runtimeEnv},
		Sys: &syscall.SysProcAttr{
			Cloneflags:                 unix.CLONE_NEWUSER,
			UidMappings:                idMappings(base),
			GidMappings:                idMappings(base),
			GidMappingsEnableSetgroups: true,
			Ptrace:                     true,
			Pdeathsig:                  unix.SIGKILL,
		},
	})
	if err != nil {
		return -1, fmt.Errorf("user namespace: %w", err)
	}
	defer func() {
		_ = unix.Kill(pid, unix.SIGKILL)
		for {
			var ws unix.WaitStatus
			if _, err := unix.Wait4(pid, &ws, unix.WALL, nil); !errors.Is(err, unix.EINTR) {
				return
			}
		}
	}()
	for {
		var ws unix.WaitStatus
		_, err := unix.Wait4(pid, &ws, unix.WALL, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return -1, fmt.Errorf("user namespace: %w", err)
		}
		if !ws.Stopped() {
			return -1, fmt.Errorf("user namespace: its holder ended (%v)", ws)
		}
		break
	}
	fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/ns/user", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("user namespace: %w", err)
	}
	return fd, nil
}

// idmapped returns a detached copy of the mount at path (that directory as
// its root) whose ids are translated by the user namespace userns: a file
// of id n on disk is seen as the host id n maps to, and the other way
// round for what is written through it.
func idmapped(path string, userns int) (int, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("idmapped mount of %s: open_tree: %w", path, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns)}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("idmapped mount of %s: %w", path, err)
	}
	return fd, nil
}

// usernsError marks a failure to give a sandbox a user namespace that a
// sandbox without one would not meet (the kernel or the file system cannot
// do it): with UserNSAuto the sandbox is started without one.
type usernsError struct{ err error }

func (e *usernsError) Error() string { return e.err.Error() }
func (e *usernsError) Unwrap() error { return e.err }

// hostID is the host id of on-disk id n in a sandbox whose root is host
// id base (0: no user namespace): ids beyond the range are nobody's.
func hostID(base, n int) int {
	if base == 0 {
		return n
	}
	if n < 0 || n >= idRange {
		n = 65534
	}
	return base + n
}

// userNSNote says, for init.log and errors, why a sandbox runs without a
// user namespace.
func userNSNote(err error) string {
	msg := err.Error()
	if i := strings.Index(msg, ": "); i > 0 && len(msg) > 300 {
		msg = msg[:300]
	}
	return "no user namespace for this sandbox (root inside is root outside, held by capabilities, seccomp and no_new_privs): " + msg
}

// asMounter runs mount (an overlay's) with this thread's file system ids
// set to the sandbox's root, host id uid, and its capabilities kept: an
// overlay does its own work (its work directory, whiteouts, copy-up) with
// its mounter's credentials, and through an idmapped upper those must map
// to an id of the sandbox (host root maps to none: EOVERFLOW). The thread
// is locked; its ids are restored before asMounter returns.
func asMounter(uid int, mount func() error) error {
	if uid == 0 {
		return mount()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if _, err := unix.SetfsuidRetUid(uid); err != nil {
		return fmt.Errorf("setfsuid: %w", err)
	}
	if _, err := unix.SetfsgidRetGid(uid); err != nil {
		_, _ = unix.SetfsuidRetUid(0)
		return fmt.Errorf("setfsgid: %w", err)
	}
	defer func() {
		_, _ = unix.SetfsgidRetGid(0)
		_, _ = unix.SetfsuidRetUid(0) // back to 0: the file capabilities come back too
	}()
	// Leaving fsuid 0 dropped the file capabilities (CAP_CHOWN,
	// CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_MKNOD, ...) from the effective
	// set: the overlay needs them, so they are raised again.
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[0].Effective, data[1].Effective = data[0].Permitted, data[1].Permitted
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return mount()
}
