package snapshot

import (
	"errors"
	"fmt"

	"github.com/sandgate/sandgate/snapshot/store"
)

// ErrRefused is the category of every error about an archive entry that
// extraction will not apply (traversal, device, setuid, size cap...). Test
// with errors.Is; the concrete *EntryError names the entry. The agent's
// refusals (agent.ErrRefused) are this same value.
var ErrRefused = errors.New("refused")

// ErrDigestMismatch reports bytes that did not hash to the digest (or size)
// they were expected to have: a layer against its manifest or ApplyOptions,
// or an object against what its store recorded. It is store.ErrDigestMismatch
// itself, one value under both names, so errors.Is matches whichever layer
// found the mismatch.
var ErrDigestMismatch = store.ErrDigestMismatch

// ErrUnsupported reports a source directory the packer cannot represent
// faithfully (for example an overlay upper using redirect_dir or metacopy).
var ErrUnsupported = errors.New("unsupported")

// EntryError is an error about one archive entry or one source path.
type EntryError struct {
	Name   string // entry name as it appears in the archive or source tree
	Reason string // what is wrong, for humans
	Err    error  // category: ErrRefused, ErrUnsupported or an I/O error
}

func (e *EntryError) Error() string {
	return fmt.Sprintf("entry %q: %s", e.Name, e.Reason)
}

func (e *EntryError) Unwrap() error { return e.Err }

func refuse(name, format string, args ...any) error {
	return &EntryError{Name: name, Reason: fmt.Sprintf(format, args...), Err: ErrRefused}
}

func unsupported(name, format string, args ...any) error {
	return &EntryError{Name: name, Reason: fmt.Sprintf(format, args...), Err: ErrUnsupported}
}
