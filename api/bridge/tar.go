package bridge

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
)

// errUnsafeTar: the workspace tar the sandbox sent holds an entry that
// whoever unpacks it could be harmed by. The sandbox is hostile: its agent
// is one of its processes, so its tar is checked here, not trusted.
var errUnsafeTar = errors.New("unsafe workspace tar")

// repack copies the tar of /workspace the sandbox sent (src) to dst as the
// contract's persist answers it: every entry named ./<path> (the root
// ./), as GNU tar's `-C /workspace .` names them, without the entries the
// excludes name (and what is below them). It stores a symbolic link as a
// link, never what it points at, and refuses (errUnsafeTar) what could
// reach out of the directory it is unpacked into: an absolute or ".."
// name, an entry below a symbolic link of the tar, a hard link to
// anything but an earlier file of the tar. Device nodes are left out,
// set-user-id and set-group-id bits cleared, extended attributes dropped.
func repack(dst io.Writer, src io.Reader, excludes []string) error {
	tr := tar.NewReader(src)
	tw := tar.NewWriter(dst)
	links := map[string]bool{} // symbolic links written
	files := map[string]bool{} // regular files written (hard link targets)
	dirs := map[string]bool{}  // names entries were written below
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("reading the workspace tar: %w", err)
		}
		rel, err := entryPath(hdr.Name)
		if err != nil {
			return err
		}
		if excluded(rel, excludes) {
			continue
		}
		for d := path.Dir(rel); rel != "." && d != "."; d = path.Dir(d) {
			if links[d] {
				return fmt.Errorf("%w: %q is below the symbolic link %q", errUnsafeTar, rel, d)
			}
			dirs[d] = true
		}
		switch hdr.Typeflag {
		case tar.TypeChar, tar.TypeBlock:
			continue
		case tar.TypeSymlink:
			if rel == "." || dirs[rel] || files[rel] {
				return fmt.Errorf("%w: the symbolic link %q replaces an entry written before it", errUnsafeTar, rel)
			}
			links[rel] = true
		case tar.TypeLink:
			target, err := entryPath(hdr.Linkname)
			if err != nil || !files[target] {
				return fmt.Errorf("%w: the hard link %q names %q, no file before it in the tar", errUnsafeTar, rel, hdr.Linkname)
			}
			hdr.Linkname = "./" + target
		case tar.TypeReg, tar.TypeDir, tar.TypeFifo:
			if links[rel] {
				return fmt.Errorf("%w: %q replaces the symbolic link written before it", errUnsafeTar, rel)
			}
		default:
			return fmt.Errorf("%w: entry %q of type %q", errUnsafeTar, rel, hdr.Typeflag)
		}
		out := &tar.Header{
			Typeflag: hdr.Typeflag, Linkname: hdr.Linkname, Size: hdr.Size,
			Mode: hdr.Mode &^ 0o6000, Uid: hdr.Uid, Gid: hdr.Gid, Uname: hdr.Uname, Gname: hdr.Gname,
			ModTime: hdr.ModTime, Format: tar.FormatPAX,
		}
		switch {
		case rel == ".":
			out.Name = "./"
		case hdr.Typeflag == tar.TypeDir:
			out.Name = "./" + rel + "/"
		default:
			out.Name = "./" + rel
		}
		if hdr.Typeflag != tar.TypeReg {
			out.Size = 0
		}
		if err := tw.WriteHeader(out); err != nil {
			return err
		}
		if hdr.Typeflag == tar.TypeReg {
			if _, err := io.Copy(tw, tr); err != nil {
				return fmt.Errorf("reading the workspace tar: %w", err)
			}
			files[rel] = true
		}
	}
	return tw.Close()
}

// entryPath is an entry's path relative to the tar's root ("." for the
// root), refused when it is absolute or climbs out.
func entryPath(name string) (string, error) {
	if strings.HasPrefix(name, "/") || strings.IndexByte(name, 0) >= 0 {
		return "", fmt.Errorf("%w: entry name %q", errUnsafeTar, name)
	}
	for _, seg := range strings.Split(name, "/") {
		if seg == ".." {
			return "", fmt.Errorf("%w: entry name %q", errUnsafeTar, name)
		}
	}
	p := path.Clean(name)
	if p == "" {
		p = "."
	}
	return p, nil
}

// excluded reports whether rel, or a directory above it, is named by one
// of the excludes (paths relative to /workspace, where *, ? and [...]
// match within one segment).
func excluded(rel string, excludes []string) bool {
	if rel == "." {
		return false
	}
	for p := rel; p != "."; p = path.Dir(p) {
		for _, ex := range excludes {
			if ex == p {
				return true
			}
			if ok, err := path.Match(ex, p); ok && err == nil {
				return true
			}
		}
	}
	return false
}
