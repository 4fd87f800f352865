package agent

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/hashicorp/yamux"

	"github.com/sandgate/sandgate/snapshot"
)

// DefaultMaxWriteBytes caps a WriteFile whose options set no cap.
const DefaultMaxWriteBytes = 1 << 30

// DefaultMaxTarBytes caps the uncompressed tar stream of a TarIn whose
// options set no cap.
const DefaultMaxTarBytes = 16 << 30

// cleanPath checks that p is an absolute path and returns it cleaned. The
// agent serves the whole sandbox file system (the sandbox is the boundary),
// so only relative paths, whose meaning would depend on the agent's own
// working directory, are refused.
func cleanPath(p string) (string, error) {
	if !filepath.IsAbs(p) {
		return "", invalid("path %q: want an absolute path", p)
	}
	for _, c := range p {
		if c == 0 {
			return "", invalid("path contains a NUL byte")
		}
	}
	return filepath.Clean(p), nil
}

// readFile streams a file: a response with its size and mode, data frames,
// then End (or an error, if reading failed midway).
func (s *server) readFile(st *yamux.Stream, f *framer, req request) {
	p, err := cleanPath(req.Path)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	file, err := os.Open(p)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	defer file.Close()
	fi, err := file.Stat()
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	if !fi.Mode().IsRegular() {
		f.msg(response{Error: toWire(invalid("read %s: not a regular file (%s)", p, fi.Mode().Type()))})
		return
	}
	if f.msg(response{Stat: statOf(fi)}) != nil {
		return
	}
	stop := watchPeerClose(st)
	defer stop()
	buf := make([]byte, dataChunk)
	if _, err := io.CopyBuffer(dataWriter{f, kindData}, file, buf); err != nil {
		f.msg(response{Error: toWire(fmt.Errorf("read %s: %w", p, err))})
		return
	}
	f.msg(response{End: true})
}

// watchPeerClose cuts st's pending writes when the client closes its side
// before the data is done (it gave up reading), so the sender does not wait
// for a window that will never open. It stops at stop.
func watchPeerClose(st *yamux.Stream) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		var b [1]byte
		// The client sends nothing after its request; EOF or an error means
		// it is gone. A byte is a protocol error: treat it the same.
		st.Read(b[:])
		select {
		case <-done:
		default:
			st.SetWriteDeadline(timeZero1)
		}
	}()
	return func() {
		close(done)
		// Unblock the watcher's Read without disturbing the stream: the
		// handler is about to close it anyway.
		st.SetReadDeadline(timeZero1)
		<-finished
	}
}

// writeFile receives a file: request, "ready" response, data frames from
// the client ended by End, then the final response. The file is written to
// a temporary name beside the target and renamed into place only when
// complete, so a failed or abandoned write leaves the old file.
func (s *server) writeFile(st *yamux.Stream, f *framer, req request) {
	fail := func(err error) { f.msg(response{Error: toWire(err)}) }
	p, err := cleanPath(req.Path)
	if err != nil {
		fail(err)
		return
	}
	mode := fs.FileMode(req.Mode).Perm()
	if req.Mode == 0 {
		mode = 0o644
	}
	if req.Mode&^0o777 != 0 {
		fail(invalid("write %s: mode %#o: want permission bits only (at most 0777)", p, req.Mode))
		return
	}
	limit := req.MaxBytes
	if limit <= 0 {
		limit = DefaultMaxWriteBytes
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		fail(err)
		return
	}
	if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
		fail(&Error{Code: codeExists, Message: fmt.Sprintf("write %s: is a directory", p)})
		return
	}
	tmp, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".sandgate-*")
	if err != nil {
		fail(err)
		return
	}
	committed := false
	discard := func() {
		if !committed {
			committed = true // once
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}
	defer discard()
	// Failures after this point remove the temporary file before they are
	// reported, so a caller that sees the error sees no leftover.
	fail = func(err error) {
		discard()
		f.msg(response{Error: toWire(err)})
	}
	if f.msg(response{}) != nil {
		return
	}
	dr := &dataReader{r: st}
	n, err := io.CopyBuffer(tmp, io.LimitReader(dr, limit+1), make([]byte, dataChunk))
	switch {
	case err != nil:
		fail(fmt.Errorf("write %s: %w", p, err))
		return
	case n > limit:
		fail(&Error{Code: codeTooLarge, Message: fmt.Sprintf("write %s: more than the %d-byte cap; raise WriteOptions.MaxBytes", p, limit)})
		return
	}
	// The limit stopped the copy exactly at the cap: the End must follow.
	if _, err := dr.Read(make([]byte, 1)); err != io.EOF {
		if err == nil {
			err = &Error{Code: codeTooLarge, Message: fmt.Sprintf("write %s: more than the %d-byte cap; raise WriteOptions.MaxBytes", p, limit)}
		}
		fail(err)
		return
	}
	if err := tmp.Chmod(mode); err != nil {
		fail(err)
		return
	}
	if err := tmp.Close(); err != nil {
		fail(err)
		return
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		fail(err)
		return
	}
	committed = true
	f.msg(response{Written: n})
}

func (s *server) stat(f *framer, req request) {
	p, err := cleanPath(req.Path)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	fi, err := os.Stat(p)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	f.msg(response{Stat: statOf(fi)})
}

func statOf(fi fs.FileInfo) *wireStat {
	return &wireStat{Name: fi.Name(), Size: fi.Size(), Mode: uint32(fi.Mode()), ModTime: fi.ModTime().UnixNano()}
}

func (s *server) mkdir(f *framer, req request) {
	p, err := cleanPath(req.Path)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	mode := fs.FileMode(req.Mode).Perm()
	if req.Mode == 0 {
		mode = 0o755
	}
	if err := os.MkdirAll(p, mode); err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	f.msg(response{})
}

func (s *server) remove(f *framer, req request) {
	p, err := cleanPath(req.Path)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	if req.Recursive {
		if p == "/" {
			f.msg(response{Error: toWire(refused("remove /: refusing to remove the root recursively"))})
			return
		}
		err = os.RemoveAll(p)
	} else {
		err = os.Remove(p)
	}
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	f.msg(response{})
}

// tarIn applies a tar stream (bare, gzip or zstd) to a directory with the
// snapshot package's safe extraction in tree mode: absolute names, "..",
// writes through symlinks, hardlink escapes, devices and setuid bits are
// refused, and a refused stream leaves the directory as it was.
func (s *server) tarIn(st *yamux.Stream, f *framer, req request) {
	p, err := cleanPath(req.Path)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	if p == "/" {
		f.msg(response{Error: toWire(invalid("tar into /: name a directory below the root"))})
		return
	}
	limit := req.MaxBytes
	if limit <= 0 {
		limit = DefaultMaxTarBytes
	}
	if f.msg(response{}) != nil {
		return
	}
	dr := &dataReader{r: st}
	if _, err := snapshot.Unpack(s.ctx, dr, p, snapshot.ApplyOptions{Mode: snapshot.ModeTree, MaxBytes: limit}); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) && dr.err == io.ErrUnexpectedEOF {
			err = fmt.Errorf("tar into %s: the stream ended before its End message (the sender gave up); nothing was applied", p)
		}
		f.msg(response{Error: toWire(err)})
		return
	}
	f.msg(response{})
}

// tarOut streams a directory as a bare PAX tar, packed by the snapshot
// package (a plain tree is a layer without whiteouts).
func (s *server) tarOut(st *yamux.Stream, f *framer, req request) {
	p, err := cleanPath(req.Path)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	fi, err := os.Stat(p)
	if err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	if !fi.IsDir() {
		f.msg(response{Error: toWire(invalid("tar out of %s: not a directory", p))})
		return
	}
	if f.msg(response{}) != nil {
		return
	}
	stop := watchPeerClose(st)
	defer stop()
	if _, err := snapshot.Pack(s.ctx, p, dataWriter{f, kindData}, snapshot.PackOptions{Compression: snapshot.None}); err != nil {
		f.msg(response{Error: toWire(err)})
		return
	}
	f.msg(response{End: true})
}
