package store

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
)

// location is a parsed store or object location: a directory of the local
// file system or a Cloud Storage bucket with a path inside it.
type location struct {
	dir    string // local directory path ("" for gs)
	bucket string // Cloud Storage bucket ("" for a directory)
	path   string // gs: the slash-separated path inside the bucket, maybe ""
}

// parseLocation reads the one spelling of locations every store entry
// point shares: gs://bucket[/path], file:///absolute/path
// (file://localhost/… too), or a plain file system path (anything without
// "://"). A plain path must be absolute when absPath is set.
func parseLocation(loc string, absPath bool) (location, error) {
	if rest, ok := strings.CutPrefix(loc, "gs://"); ok {
		bucket, p, _ := strings.Cut(rest, "/")
		if bucket == "" {
			return location{}, fmt.Errorf("%w: %q: want gs://bucket[/path]", ErrBadLocation, loc)
		}
		return location{bucket: bucket, path: strings.Trim(p, "/")}, nil
	}
	if rest, ok := strings.CutPrefix(loc, "file://"); ok {
		rest = strings.TrimPrefix(rest, "localhost")
		if !strings.HasPrefix(rest, "/") {
			return location{}, fmt.Errorf("%w: %q: file locations take no host; write file:///absolute/path", ErrBadLocation, loc)
		}
		return location{dir: filepath.Clean(rest)}, nil
	}
	if strings.Contains(loc, "://") {
		return location{}, fmt.Errorf("%w: %q: want a path, file:///path or gs://bucket/path", ErrBadLocation, loc)
	}
	if loc == "" || (absPath && !filepath.IsAbs(loc)) {
		return location{}, fmt.Errorf("%w: %q: want an absolute path, file:///path or gs://bucket/path", ErrBadLocation, loc)
	}
	return location{dir: filepath.Clean(loc)}, nil
}

// Open opens the store at a location: a directory (file:///var/lib/sandgate/store
// or the absolute path itself; created if missing) or Cloud Storage
// (gs://bucket/prefix, with the default credentials, or the emulator that
// STORAGE_EMULATOR_HOST names). A location Open cannot read is
// ErrBadLocation.
func Open(ctx context.Context, loc string) (Store, error) {
	l, err := parseLocation(loc, true)
	if err != nil {
		return nil, err
	}
	if l.bucket != "" {
		return OpenGCS(ctx, l.bucket, l.path)
	}
	return NewDir(l.dir)
}

// OpenObject opens the store holding the object at loc and returns the
// object's name in it: gs://bucket/a/b.tar.zst is object a/b.tar.zst in the
// bucket (no prefix); a path (relative ones too) or file:///dir/b.tar.zst is
// object b.tar.zst in the directory store dir (created if missing). The
// caller closes the store. A location that names no object is
// ErrBadLocation or ErrBadName.
func OpenObject(ctx context.Context, loc string) (Store, string, error) {
	l, err := parseLocation(loc, false)
	if err != nil {
		return nil, "", err
	}
	if l.bucket != "" {
		if err := CheckName(l.path); err != nil {
			return nil, "", fmt.Errorf("%q: want gs://bucket/object: %w", loc, err)
		}
		s, err := OpenGCS(ctx, l.bucket, "")
		return s, l.path, err
	}
	name := filepath.Base(l.dir)
	if err := CheckName(name); err != nil || l.dir == "/" {
		return nil, "", fmt.Errorf("%w: %q: the file name must not be empty or start with '.'", ErrBadName, loc)
	}
	s, err := NewDir(filepath.Dir(l.dir))
	return s, name, err
}

// LocalPath returns the file system path an object location names (a
// path, or file:///path), or ok=false for a Cloud Storage location. It
// reads locations as OpenObject does, without opening anything, for a
// caller that reads a user's own file directly rather than through a store.
func LocalPath(loc string) (path string, ok bool, err error) {
	l, err := parseLocation(loc, false)
	if err != nil || l.bucket != "" {
		return "", false, err
	}
	return l.dir, true, nil
}

// BucketURL is the store location for the SNAPSHOT_BUCKET setting, which
// names a bucket.
func BucketURL(bucket string) string { return "gs://" + bucket }
