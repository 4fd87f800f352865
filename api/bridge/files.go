package bridge

import (
	"archive/tar"
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"strconv"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/transforms"
)

// filePath is a file route's path: everything after /file/, percent-
// decoded, taken as absolute and resolved inside /workspace (403
// otherwise), as the contract does.
func filePath(r *http.Request) (string, error) {
	raw := r.PathValue("path")
	if raw == "" {
		return "", invalid("file path must not be empty")
	}
	p, ok := resolveWorkspace("/" + raw)
	if !ok {
		return "", fail(http.StatusForbidden, codeInvalid, "path must resolve to a location within /workspace")
	}
	return p, nil
}

// readFile streams a file out: no size cap, no shell. A missing file is
// 404 workspace_read_not_found.
func (b *Bridge) readFile(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if _, err := sessionHeader(r); err != nil {
		return err
	}
	p, err := filePath(r)
	if err != nil {
		return err
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	rc, fi, err := b.b.ReadFile(r.Context(), id, p)
	if errors.Is(err, fs.ErrNotExist) {
		return fail(http.StatusNotFound, codeReadNotFound, "File not found: %s", p)
	}
	if err != nil {
		if errors.Is(err, fs.ErrInvalid) && !errors.Is(err, transforms.ErrCredential) {
			return answer(fmt.Errorf("%s: not a regular file", p), readFailure) // a directory, say
		}
		return err
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	if fi != nil && fi.Mode().IsRegular() {
		w.Header().Set("Content-Length", strconv.FormatInt(fi.Size(), 10))
	}
	w.WriteHeader(http.StatusOK)
	if _, err := io.Copy(w, rc); err != nil && r.Context().Err() == nil {
		// Cut the connection, so the caller sees a broken body rather
		// than a file that merely looks short.
		b.log.Info("bridge: a file read broke off", "sandbox", id, "err", err)
		panic(http.ErrAbortHandler)
	}
	return nil
}

// writeFile streams the body into a file (parents made), replacing it only
// once the whole body arrived, through the credential guard. Bodies over
// MaxBody are 413 payload_too_large, and change nothing.
func (b *Bridge) writeFile(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if _, err := sessionHeader(r); err != nil {
		return err
	}
	p, err := filePath(r)
	if err != nil {
		return err
	}
	if r.ContentLength > b.cfg.MaxBody {
		return b.tooLarge(r.ContentLength)
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	if fi, err := b.b.Stat(r.Context(), id, p); err == nil && fi.IsDir() {
		return answer(fmt.Errorf("%s is a directory", p), writeFailure)
	}
	body := &capped{r: r.Body, max: b.cfg.MaxBody}
	if _, err := b.b.WriteFile(r.Context(), id, p, body); err != nil {
		if body.over || errors.Is(err, agent.ErrTooLarge) {
			return b.tooLarge(body.n)
		}
		return err
	}
	ok(w)
	return nil
}

func (b *Bridge) tooLarge(n int64) error {
	return fail(http.StatusRequestEntityTooLarge, codePayloadTooLong, "payload too large: %d bytes or more exceeds the %d-byte limit (SANDGATE_BRIDGE_MAX_BODY)", n, b.cfg.MaxBody)
}

// hydrate unpacks a tar (bare, gzip or zstd) into /workspace, over what is
// there, through the agent's safe extraction: all or nothing; a tar with
// absolute or ".." names, hard links out, devices or set-user-id files is
// refused whole (400), and an entry below a symbolic link already there
// replaces the link rather than write through it.
func (b *Bridge) hydrate(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if r.ContentLength > b.cfg.MaxBody {
		return invalid("tar payload too large: %d bytes exceeds the %d-byte limit (SANDGATE_BRIDGE_MAX_BODY)", r.ContentLength, b.cfg.MaxBody)
	}
	body := &capped{r: r.Body, max: b.cfg.MaxBody}
	br := bufio.NewReaderSize(body, 64<<10)
	head, err := br.Peek(512)
	switch {
	case len(head) == 0 && err == io.EOF:
		return invalid("Empty tar payload")
	case err != nil && err != io.EOF && !body.over:
		return invalid("Could not read request body: %v", err)
	case !looksLikeTar(head):
		return invalid("the body is not a tar (bare, gzip or zstd)")
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	if err := b.b.TarIn(r.Context(), id, Workspace, br); err != nil {
		if body.over || errors.Is(err, agent.ErrTooLarge) {
			return invalid("tar payload too large: %d bytes or more exceeds the %d-byte limit (SANDGATE_BRIDGE_MAX_BODY)", body.n, b.cfg.MaxBody)
		}
		return err
	}
	ok(w)
	return nil
}

// capped reads at most max bytes of r, then fails (over).
type capped struct {
	r    io.Reader
	max  int64
	n    int64
	over bool
}

var errCapped = errors.New("the request body is over the bridge's size limit")

func (c *capped) Read(p []byte) (int, error) {
	if c.over {
		return 0, errCapped
	}
	if rest := c.max + 1 - c.n; int64(len(p)) > rest {
		p = p[:rest]
	}
	n, err := c.r.Read(p)
	c.n += int64(n)
	if c.n > c.max {
		c.over = true
		return n - int(c.n-c.max), errCapped
	}
	return n, err
}

// persist streams /workspace as a tar: members named ./… as GNU tar names
// them, without what ?excludes= names, symbolic links stored as links
// (never the bytes of what they point at), and nothing a sandbox could
// use against whoever unpacks it (see repack).
func (b *Bridge) persist(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	ex, err := parseExcludes(r.URL.Query().Get("excludes"))
	if err != nil {
		return err
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := b.b.TarOut(r.Context(), id, Workspace, pw)
		pw.CloseWithError(err)
		done <- err
	}()
	lw := &lazyWriter{w: w}
	err = repack(lw, pr, ex)
	pr.CloseWithError(err)
	if terr := <-done; err == nil {
		err = terr
	}
	if err == nil {
		return nil
	}
	if !lw.started {
		return answer(err, persistFailure)
	}
	b.log.Info("bridge: a persisted tar broke off", "sandbox", id, "err", err)
	panic(http.ErrAbortHandler) // a cut connection, not a tar that looks whole
}

// lazyWriter sends the 200 and the tar's headers with the first byte, so
// that a failure before any byte is still the contract's error reply.
type lazyWriter struct {
	w       http.ResponseWriter
	started bool
}

func (l *lazyWriter) Write(p []byte) (int, error) {
	if !l.started {
		l.started = true
		l.w.Header().Set("Content-Type", "application/octet-stream")
		l.w.WriteHeader(http.StatusOK)
	}
	return l.w.Write(p)
}

// looksLikeTar says whether a body's first bytes begin a tar: gzip's or
// zstd's magic (the agent reads those), or a tar header block whose
// checksum holds.
func looksLikeTar(head []byte) bool {
	if bytes.HasPrefix(head, []byte{0x1f, 0x8b}) || bytes.HasPrefix(head, []byte{0x28, 0xb5, 0x2f, 0xfd}) {
		return true
	}
	if len(head) < 512 {
		return false
	}
	_, err := tar.NewReader(bytes.NewReader(head[:512])).Next()
	return err == nil || err == io.EOF || err == io.ErrUnexpectedEOF
}
