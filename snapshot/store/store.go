// Package store keeps layer objects: a local directory (the embedded
// default) or a Cloud Storage bucket, behind one interface with atomic,
// conditional puts and digest-verified gets.
//
// An object's sha256 is computed while it is put and recorded with it (an
// extended attribute for Dir, object metadata for GCS). Get returns a
// reader that checks it at EOF and returns ErrDigestMismatch instead of
// io.EOF when the bytes do not match: a corrupted object is never served
// as if it were good.
package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"time"
)

// Store keeps named objects. Names are slash-separated relative paths such
// as "snapshots/sb-1.tar.zst"; components must not be empty, ".", ".." or
// start with "." (those are reserved for temporary files).
type Store interface {
	// Put streams r into the object name. It becomes visible only when
	// complete; an interrupted Put leaves the previous object (or none).
	Put(ctx context.Context, name string, r io.Reader, opts PutOptions) (Info, error)
	// Get streams the object. The reader verifies the recorded digest at
	// EOF. A missing object is ErrNotFound.
	Get(ctx context.Context, name string) (io.ReadCloser, error)
	// Stat describes the object, or returns ErrNotFound.
	Stat(ctx context.Context, name string) (Info, error)
	// Delete removes the object, or returns ErrNotFound.
	Delete(ctx context.Context, name string) error
	// DeleteIf removes the object only if its current generation is
	// generation: ErrPreconditionFailed if it is another, ErrNotFound if
	// there is none.
	DeleteIf(ctx context.Context, name string, generation int64) error
	// Read returns the whole content of a small object (at most max
	// bytes, else an error) and the Info of exactly the version read: its
	// Generation is what a conditional Put or DeleteIf names.
	Read(ctx context.Context, name string, max int64) ([]byte, Info, error)
	// List returns the objects whose names start with prefix, sorted.
	List(ctx context.Context, prefix string) ([]Info, error)
	// Close releases the store's resources.
	Close() error
}

// PutOptions are the preconditions of a Put. The zero value replaces any
// existing object.
type PutOptions struct {
	// IfNotExist makes Put fail with ErrPreconditionFailed if the object
	// already exists ("must not exist").
	IfNotExist bool
	// IfGenerationMatch, when not 0, makes Put fail with
	// ErrPreconditionFailed unless the object exists at this generation:
	// a compare-and-swap, which the leases of several services sharing a
	// store are built on.
	IfGenerationMatch int64
	// Digest, when set, is called once r has returned io.EOF and must
	// return the sha256 ("sha256:<hex>") of exactly the bytes r yielded.
	// Callers that hash the stream anyway (snapshot.Pack does) set it to
	// spare the store a second pass of hashing; the store records it as
	// the object's digest.
	Digest func() string
}

// Info describes a stored object.
type Info struct {
	Name     string
	Size     int64
	Digest   string // "sha256:<hex>", or "" if none was recorded
	Modified time.Time
	// Generation identifies this version of the object: every put makes
	// a new one (Cloud Storage's own; for Dir, recorded with the object).
	Generation int64
}

var (
	// ErrNotFound reports a missing object. It also matches
	// fs.ErrNotExist, the one "does not exist" every layer of sandgate
	// relates its own to.
	ErrNotFound error = &notExist{"object not found"}
	// ErrPreconditionFailed reports a Put whose precondition did not hold.
	ErrPreconditionFailed = errors.New("precondition failed")
	// ErrDigestMismatch reports stored bytes that do not match their
	// recorded digest, size or checksum (snapshot.ErrDigestMismatch is
	// this same value: a layer that does not match its manifest).
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrNoDigest reports an object whose digest was never recorded: one
	// written into the store by something else (the reference service's
	// snapshots, made by tar), or copied without its attributes. A Dir's
	// Get of it ends with this error instead of io.EOF; it matches
	// ErrDigestMismatch too (nothing vouches for the bytes), and
	// AcceptUnrecorded reads such an object for a caller that checks its
	// bytes itself, by their own framing.
	ErrNoDigest error = noDigest{}
	// ErrBadName reports a name the stores refuse.
	ErrBadName = errors.New("bad object name")
	// ErrBadLocation reports a store or object location that is not a
	// path, file:///path or gs://bucket/path.
	ErrBadLocation = errors.New("bad store location")
)

// noDigest is ErrNoDigest: it also matches ErrDigestMismatch.
type noDigest struct{}

func (noDigest) Error() string        { return "no digest recorded" }
func (noDigest) Is(target error) bool { return target == ErrDigestMismatch }

// AcceptUnrecorded returns a Get's reader that ends with io.EOF where it
// would end with ErrNoDigest (an object whose size is as stored, but whose
// digest was never recorded), for a caller that verifies the bytes by
// their own framing (a gzip's checksum and length, a tar's structure).
// Every other mismatch is still reported.
func AcceptUnrecorded(r io.Reader) io.Reader { return unrecorded{r} }

type unrecorded struct{ r io.Reader }

func (u unrecorded) Read(p []byte) (int, error) {
	n, err := u.r.Read(p)
	if errors.Is(err, ErrNoDigest) {
		err = io.EOF
	}
	return n, err
}

// notExist is a "not found" sentinel that also matches fs.ErrNotExist.
type notExist struct{ msg string }

func (e *notExist) Error() string        { return e.msg }
func (e *notExist) Is(target error) bool { return target == fs.ErrNotExist }

// CheckName validates an object name (see Store).
func CheckName(name string) error {
	if name == "" || len(name) > 1024 {
		return fmt.Errorf("%w: %q: want 1..1024 bytes", ErrBadName, name)
	}
	if strings.HasPrefix(name, "/") || strings.HasSuffix(name, "/") {
		return fmt.Errorf("%w: %q: no leading or trailing slash", ErrBadName, name)
	}
	for _, c := range strings.Split(name, "/") {
		if c == "" || strings.HasPrefix(c, ".") || strings.ContainsAny(c, "\x00\n\r") {
			return fmt.Errorf("%w: %q: components must be non-empty and not start with '.'", ErrBadName, name)
		}
	}
	return nil
}
