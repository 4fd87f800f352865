package snapshot

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// commit makes the staged tree visible at target: a rename when target is
// missing or an empty directory, otherwise a merge that applies the layer's
// deletions to target and moves the staged entries in.
func commit(staging, target string, a *applier) error {
	st, err := os.Lstat(target)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if _, ok := a.dirIdx["."]; !ok {
			if err := os.Chmod(staging, 0o755); err != nil {
				return err
			}
		}
		return os.Rename(staging, target)
	case err != nil:
		return err
	case !st.IsDir():
		return fmt.Errorf("%s exists and is not a directory", target)
	}
	if empty, err := isEmptyDir(target); err != nil {
		return err
	} else if empty {
		if _, ok := a.dirIdx["."]; !ok {
			// Keep the target's own mode: the layer did not set one.
			if err := os.Chmod(staging, st.Mode().Perm()); err != nil {
				return err
			}
		}
		// Removed, then renamed onto: overlayfs refuses a rename onto an
		// existing directory (EEXIST) where other file systems replace it.
		if err := os.Remove(target); err != nil {
			return err
		}
		if err := os.Rename(staging, target); err != nil {
			os.Mkdir(target, st.Mode().Perm())
			return err
		}
		return nil
	}
	troot, err := os.OpenRoot(target)
	if err != nil {
		return err
	}
	defer troot.Close()
	m := &merger{a: a, src: a.root, dst: troot, touched: map[string][2]unix.Timespec{}}
	if err := m.merge(); err != nil {
		return err
	}
	return os.RemoveAll(staging)
}

func isEmptyDir(dir string) (bool, error) {
	f, err := os.Open(dir)
	if err != nil {
		return false, err
	}
	defer f.Close()
	names, err := f.Readdirnames(1)
	if len(names) == 0 && err != nil {
		return true, nil
	}
	return false, nil
}

// merger moves a staged layer into an existing tree.
type merger struct {
	a       *applier
	src     *os.Root // staging
	dst     *os.Root // target
	touched map[string][2]unix.Timespec
}

// touch records the times of the target directory holding rel before the
// merge changes its entries.
func (m *merger) touch(rel string) {
	d := path.Dir(rel)
	if _, ok := m.touched[d]; ok {
		return
	}
	st, err := m.dst.Lstat(d)
	if err != nil || !st.IsDir() {
		return
	}
	sys := st.Sys().(*syscall.Stat_t)
	m.touched[d] = [2]unix.Timespec{unix.Timespec(sys.Atim), unix.Timespec(sys.Mtim)}
}

// link makes name a hardlink to target, an existing non-directory of the
// target tree reached without symlinks.
func (m *merger) link(target, name string) error {
	if !m.realDir(path.Dir(target)) || !m.realDir(path.Dir(name)) {
		return refuse(name, "hardlink target %q is not in the tree", target)
	}
	st, err := m.dst.Lstat(target)
	if err != nil || st.IsDir() {
		return refuse(name, "hardlink target %q is not in the tree", target)
	}
	m.touch(name)
	if err := m.dst.RemoveAll(name); err != nil {
		return err
	}
	return m.dst.Link(target, name)
}

func (m *merger) merge() error {
	// Refuse before changing anything: a refused layer leaves the target
	// as it was.
	if err := m.checkLinks(); err != nil {
		return err
	}
	// Opaque directories hide everything the target had below them.
	for _, d := range m.a.opaques {
		if !m.realDir(d) {
			continue
		}
		names, err := readDirNames(m.dst, d)
		if err != nil {
			return err
		}
		for _, n := range names {
			m.touch(path.Join(d, n))
			if err := m.dst.RemoveAll(path.Join(d, n)); err != nil {
				return err
			}
		}
	}
	for _, w := range m.a.whiteouts {
		if !m.realDir(path.Dir(w)) {
			continue // the parent is not a directory in the target: nothing to hide
		}
		m.touch(w)
		if err := m.dst.RemoveAll(w); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	if err := m.moveDir("."); err != nil {
		return err
	}
	for _, l := range m.a.links {
		if err := m.link(l[0], l[1]); err != nil {
			return err
		}
	}
	// Directories the merge touched keep their times unless the layer
	// sets them (finishDirs, next).
	for d, ts := range m.touched {
		err := atParent(m.dst, d, func(fd int, base string) error {
			return unix.UtimesNanoAt(fd, base, ts[:], unix.AT_SYMLINK_NOFOLLOW)
		})
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("restore times of %s: %w", d, err)
		}
	}
	// Explicit directories take the layer's metadata, deepest first.
	if err := m.a.finishDirs(m.dst); err != nil {
		return err
	}
	return nil
}

// checkLinks checks, before the merge changes anything, that every
// deferred hardlink will find its target as link (below) requires it: a
// non-directory reached through real directories once deletions, moves
// and the links before it are done.
func (m *merger) checkLinks() error {
	if len(m.a.links) == 0 {
		return nil
	}
	whiteouts := make(map[string]bool, len(m.a.whiteouts))
	for _, w := range m.a.whiteouts {
		whiteouts[w] = true
	}
	opaques := make(map[string]bool, len(m.a.opaques))
	for _, o := range m.a.opaques {
		opaques[o] = true
	}
	hidden := func(q string) bool { return whiteouts[q] || opaques[path.Dir(q)] }
	made := map[string]bool{}
	for _, l := range m.a.links {
		target, name := l[0], l[1]
		if hasPrefixPath(target, name) {
			return refuse(name, "hardlink target %q is what the link replaces", target)
		}
		if m.finalKind(target, hidden, made) != kindOther {
			return refuse(name, "hardlink target %q is not in the tree", target)
		}
		if m.finalKind(path.Dir(name), hidden, made) != kindDir {
			return refuse(name, "parent of the hardlink is not a directory")
		}
		made[name] = true
	}
	return nil
}

type nodeKind int

const (
	kindNone nodeKind = iota
	kindDir
	kindOther
)

func lkind(r *os.Root, p string) nodeKind {
	st, err := r.Lstat(p)
	switch {
	case err != nil:
		return kindNone
	case st.IsDir():
		return kindDir
	}
	return kindOther
}

// finalKind predicts what p will be in the target after the merge's
// deletions (hidden), the moves of moveDir and the links in made: a staged
// entry replaces the target's unless both are directories, which merge.
// Every prefix is checked with lstat before anything below it, so nothing
// is resolved through a symlink.
func (m *merger) finalKind(p string, hidden func(string) bool, made map[string]bool) nodeKind {
	if p == "." {
		return kindDir
	}
	inSrc, inDst := true, true
	comps := strings.Split(p, "/")
	q := "."
	for i, c := range comps {
		q = path.Join(q, c)
		last := i == len(comps)-1
		if made[q] {
			if last {
				return kindOther
			}
			return kindNone
		}
		s, d := kindNone, kindNone
		if inSrc {
			s = lkind(m.src, q)
		}
		if inDst && !hidden(q) {
			d = lkind(m.dst, q)
		}
		if last {
			if s != kindNone {
				return s
			}
			return d
		}
		if s == kindOther {
			return kindNone
		}
		inSrc, inDst = s == kindDir, d == kindDir
		if !inSrc && !inDst {
			return kindNone
		}
	}
	return kindNone
}

// realDir reports whether every component of d is a directory (not a
// symlink) in the target.
func (m *merger) realDir(d string) bool {
	if d == "." {
		return true
	}
	if !m.realDir(path.Dir(d)) {
		return false
	}
	st, err := m.dst.Lstat(d)
	return err == nil && st.IsDir()
}

func (m *merger) moveDir(dir string) error {
	names, err := readDirNames(m.src, dir)
	if err != nil {
		return err
	}
	for _, n := range names {
		rel := path.Join(dir, n)
		sst, err := m.src.Lstat(rel)
		if err != nil {
			return err
		}
		dst, err := m.dst.Lstat(rel)
		exists := err == nil
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		if sst.IsDir() && exists && dst.IsDir() {
			if err := m.moveDir(rel); err != nil {
				return err
			}
			continue
		}
		m.touch(rel)
		if exists {
			if err := m.dst.RemoveAll(rel); err != nil {
				return err
			}
		}
		if err := m.rename(rel); err != nil {
			return fmt.Errorf("move %s: %w", rel, err)
		}
	}
	return nil
}

func (m *merger) rename(rel string) error {
	return atParent(m.src, rel, func(sfd int, base string) error {
		return atParent(m.dst, rel, func(dfd int, _ string) error {
			return unix.Renameat(sfd, base, dfd, base)
		})
	})
}

func readDirNames(root *os.Root, dir string) ([]string, error) {
	f, err := root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	slices.Sort(names)
	return names, err
}
