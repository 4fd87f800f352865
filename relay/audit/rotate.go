package audit

import (
	"fmt"
	"os"
	"sync"
)

// DefaultLogBytes and DefaultLogKeep are an audit log file's defaults
// (FileOptions): rotated at 100 MiB, five old files kept.
const (
	DefaultLogBytes = 100 << 20
	DefaultLogKeep  = 5
)

// FileOptions say when an audit log file is rotated.
type FileOptions struct {
	// MaxBytes is the size past which the file is rotated: renamed to
	// path.1 (path.1 to path.2, and so on) and a new one begun. 0 means
	// DefaultLogBytes; negative never.
	MaxBytes int64
	// Keep is how many old files are kept (path.1 the newest); the oldest
	// beyond it is removed. Negative means none: the file is begun anew.
	// 0 means DefaultLogKeep.
	Keep int
}

// File is an audit log file rotated by size. Its writes are serialised,
// and each goes whole into one file: a JSONLines sink writes whole lines
// only (its batches), so no line is ever torn or split between two files.
// A file is rotated before a write that would take it past MaxBytes, so
// it exceeds it only by a batch written into a new file that is larger
// than MaxBytes alone.
type File struct {
	path string
	max  int64
	keep int

	mu   sync.Mutex
	f    *os.File
	size int64
	err  error // the last rotation's failure, until one succeeds
}

// OpenFile opens (appends to, or makes, mode 0600) the audit log file at
// path, rotated as o says.
func OpenFile(path string, o FileOptions) (*File, error) {
	if o.MaxBytes == 0 {
		o.MaxBytes = DefaultLogBytes
	}
	if o.Keep == 0 {
		o.Keep = DefaultLogKeep
	}
	f := &File{path: path, max: o.MaxBytes, keep: max(0, o.Keep)}
	if err := f.open(); err != nil {
		return nil, err
	}
	return f, nil
}

func (f *File) open() error {
	fh, err := os.OpenFile(f.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	fi, err := fh.Stat()
	if err != nil {
		fh.Close()
		return err
	}
	f.f, f.size = fh, fi.Size()
	return nil
}

// Write appends b, rotating the file first when b would take it past
// MaxBytes. A rotation that fails leaves the lines in the file as it is
// (tried again at the next write; RotateErr says why).
func (f *File) Write(b []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.f == nil {
		return 0, os.ErrClosed
	}
	if f.max > 0 && f.size > 0 && f.size+int64(len(b)) > f.max {
		f.err = f.rotate()
	}
	n, err := f.f.Write(b)
	f.size += int64(n)
	return n, err
}

// rotate renames path.i to path.i+1 (the oldest beyond keep removed),
// path to path.1, and begins a new path.
func (f *File) rotate() error {
	old := func(i int) string { return fmt.Sprintf("%s.%d", f.path, i) }
	if f.keep > 0 {
		if err := os.Remove(old(f.keep)); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("audit log: removing the oldest file: %w", err)
		}
	}
	for i := f.keep - 1; i >= 1; i-- {
		if err := os.Rename(old(i), old(i+1)); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("audit log: rotating: %w", err)
		}
	}
	if f.keep > 0 {
		if err := os.Rename(f.path, old(1)); err != nil {
			return fmt.Errorf("audit log: rotating: %w", err)
		}
	} else if err := os.Remove(f.path); err != nil {
		return fmt.Errorf("audit log: beginning it anew: %w", err)
	}
	prev := f.f
	if err := f.open(); err != nil {
		// Renamed but not reopened: go on writing to the renamed file.
		return fmt.Errorf("audit log: opening a new file: %w", err)
	}
	prev.Close()
	return nil
}

// RotateErr is why the last rotation failed, nil once one succeeded.
func (f *File) RotateErr() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// Close closes the file.
func (f *File) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.f == nil {
		return nil
	}
	err := f.f.Close()
	f.f = nil
	return err
}
