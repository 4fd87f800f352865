package snapshot

import (
	"archive/tar"
	"path"
	"strings"
)

const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
	maxNameLen     = 4096
	maxComponent   = 255
)

// cleanEntryName turns a tar entry name into a clean relative path, or
// refuses it. "." (the layer root) is returned as ".".
func cleanEntryName(name string) (string, error) {
	if name == "" {
		return "", refuse(name, "empty name")
	}
	if len(name) > maxNameLen {
		return "", refuse(name[:64]+"...", "name longer than %d bytes", maxNameLen)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", refuse(name, "name contains NUL")
	}
	if strings.HasPrefix(name, "/") {
		return "", refuse(name, "absolute name")
	}
	trimmed := strings.TrimSuffix(name, "/")
	if trimmed == "" {
		return "", refuse(name, "absolute name")
	}
	for _, c := range strings.Split(trimmed, "/") {
		if c == ".." {
			return "", refuse(name, "name contains '..'")
		}
		if len(c) > maxComponent {
			return "", refuse(name, "path component longer than %d bytes", maxComponent)
		}
	}
	clean := path.Clean(trimmed)
	if clean == ".." || strings.HasPrefix(clean, "../") || strings.HasPrefix(clean, "/") {
		return "", refuse(name, "name escapes the root")
	}
	return clean, nil
}

// splitWhiteout reports whether the entry hdr, named clean, is an OCI
// whiteout. For a plain whiteout it returns the path it hides; for an opaque
// marker it returns the directory made opaque and opaque=true. An entry
// marked literal (paxLiteralKey) is a file whose own name starts with
// ".wh.", never a whiteout.
func splitWhiteout(clean string, hdr *tar.Header) (target string, opaque, ok bool, err error) {
	dir, base := path.Split(clean)
	if !strings.HasPrefix(base, whiteoutPrefix) || hdr.PAXRecords[paxLiteralKey] == "1" {
		return "", false, false, nil
	}
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	if base == opaqueMarker {
		return dir, true, true, nil
	}
	hidden := strings.TrimPrefix(base, whiteoutPrefix)
	if hidden == "" || hidden == "." || hidden == ".." || strings.HasPrefix(hidden, whiteoutPrefix) {
		return "", false, false, refuse(clean, "unknown whiteout form")
	}
	return path.Join(dir, hidden), false, true, nil
}

// hasPrefixPath reports whether p is dir or lies below dir.
func hasPrefixPath(p, dir string) bool {
	if dir == "." {
		return true
	}
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// markLiteral marks an entry whose name starts with ".wh." as a file of
// that name, so applying the layer recreates it instead of reading a
// whiteout (OCI reserves the prefix; a sandbox may still use it).
func markLiteral(hdr *tar.Header, rel string) {
	if strings.HasPrefix(path.Base(rel), whiteoutPrefix) {
		if hdr.PAXRecords == nil {
			hdr.PAXRecords = map[string]string{}
		}
		hdr.PAXRecords[paxLiteralKey] = "1"
	}
}
