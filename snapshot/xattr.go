package snapshot

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

const (
	paxXattr       = "SCHILY.xattr."
	xattrOpaque    = "trusted.overlay.opaque"
	xattrCapable   = "security.capability"
	overlayPrefix  = "trusted.overlay."
	paxRemovedKey  = "SANDGATE.removed" // a delta whiteout: "gone since the base", not "hide the image's copy"
	paxLiteralKey  = "SANDGATE.literal" // a file named .wh.*, not a whiteout
	maxXattrValue  = 64 << 10
	maxXattrsEntry = 256
)

// overlayBookkeeping are trusted.overlay.* attributes that only cache inode
// identity for the mount that wrote them; they carry no content and are
// dropped. Every other trusted.overlay.* attribute but opaque changes what
// the upper means (redirect, metacopy, ...) and is refused.
var overlayBookkeeping = map[string]bool{
	"trusted.overlay.origin": true,
	"trusted.overlay.impure": true,
	"trusted.overlay.nlink":  true,
	"trusted.overlay.upper":  true,
	"trusted.overlay.uuid":   true,
}

// readXattrs returns the attributes of path (not following a symlink) that a
// layer carries: user.* and security.capability, plus whether the directory
// is overlay-opaque (trusted.overlay.opaque=y; any other value is refused).
// Semantic overlay attributes are refused.
func readXattrs(path, name string) (map[string]string, bool, error) {
	names, err := listXattrs(path)
	if err != nil || len(names) == 0 {
		return nil, false, err
	}
	var out map[string]string
	opaque := false
	for _, n := range names {
		switch {
		case n == xattrOpaque:
			v, err := getXattr(path, n)
			if err != nil {
				return nil, false, err
			}
			if v != "y" {
				// "x" (Linux 6.7+) marks a directory holding xattr
				// whiteouts, which a layer cannot express; anything else is
				// not overlayfs's.
				return nil, false, unsupported(name, "overlay attribute %s=%q: only %q (opaque) can be in a layer", n, v, "y")
			}
			opaque = true
		case strings.HasPrefix(n, overlayPrefix):
			if overlayBookkeeping[n] {
				continue
			}
			return nil, false, unsupported(name, "overlay attribute %s: make the upper with redirect_dir=off,metacopy=off", n)
		case strings.HasPrefix(n, "user.") || n == xattrCapable:
			v, err := getXattr(path, n)
			if err != nil {
				return nil, false, err
			}
			if out == nil {
				out = map[string]string{}
			}
			out[n] = v
		}
	}
	return out, opaque, nil
}

func listXattrs(path string) ([]string, error) {
	buf := make([]byte, 1024)
	for range 8 {
		n, err := unix.Llistxattr(path, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, &EntryError{Name: path, Reason: "list xattrs: " + err.Error(), Err: err}
		}
		var names []string
		for _, b := range bytes.Split(buf[:n], []byte{0}) {
			if len(b) > 0 {
				names = append(names, string(b))
			}
		}
		return names, nil
	}
	return nil, &EntryError{Name: path, Reason: "xattr list too large", Err: unix.ERANGE}
}

func getXattr(path, attr string) (string, error) {
	buf := make([]byte, 256)
	for range 8 {
		n, err := unix.Lgetxattr(path, attr, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if err != nil {
			return "", &EntryError{Name: path, Reason: "get xattr " + attr + ": " + err.Error(), Err: err}
		}
		return string(buf[:n]), nil
	}
	return "", &EntryError{Name: path, Reason: "xattr too large: " + attr, Err: unix.ERANGE}
}

// xattrsDigest is the index's fingerprint of a set of attributes.
func xattrsDigest(x map[string]string) string {
	if len(x) == 0 {
		return ""
	}
	keys := make([]string, 0, len(x))
	for k := range x {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	h := sha256.New()
	for _, k := range keys {
		h.Write([]byte(k))
		h.Write([]byte{0})
		h.Write([]byte(x[k]))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))
}

// paxXattrs extracts SCHILY.xattr.* records.
func paxXattrs(rec map[string]string) map[string]string {
	var out map[string]string
	for k, v := range rec {
		if name, ok := strings.CutPrefix(k, paxXattr); ok {
			if out == nil {
				out = map[string]string{}
			}
			out[name] = v
		}
	}
	return out
}
