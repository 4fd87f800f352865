package transforms

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// The credential guard: a sandbox holds placeholders, never the secrets of
// its rules. Whatever the service is asked to put into a sandbox (a command,
// its variables and working directory, its stdin, a file, a tar) passes a
// Guard first; what the response scrub would mask is refused before any
// byte of it goes in: a secret whole, and any run of MinPartialRun (12) or
// more of its consecutive bytes (a prefix, a suffix, a middle). It finds
// a secret as written, byte for byte: an encoding of it (base64, hex,
// escapes, pieces shorter than MinPartialRun) is the caller's own doing
// and beyond what a substring search can see.

// CredentialPhrase starts the message of every [CredentialError]: protocol
// 1's reference client recognises a refusal by it.
const CredentialPhrase = "Credentials stay outside the sandbox"

// ErrCredential matches every [CredentialError]: errors.Is(err,
// ErrCredential) tells a refused credential from any other failure.
var ErrCredential = errors.New("transforms: a held credential bound for the sandbox")

// CredentialError is a held secret found in something bound for the
// sandbox. It names the place, never the secret or any part of it.
type CredentialError struct {
	// Where is what held the secret ("the command", "the file's
	// content"): the caller's words. Empty reads as "the input".
	Where string
}

func (e *CredentialError) Error() string {
	where := e.Where
	if where == "" {
		where = "the input"
	}
	return CredentialPhrase + ": " + where + " holds a credential of this sandbox's transformations. " +
		"Give the sandbox the credential's placeholder instead: the proxy swaps the credential in on the way out"
}

// Is makes errors.Is(err, ErrCredential) true.
func (e *CredentialError) Is(target error) bool { return target == ErrCredential }

// Guard finds held secrets in values and streams bound for a sandbox: a
// secret shorter than [MinPartialRun] whole, and of a longer one any run of
// MinPartialRun or more of its consecutive bytes, which is what the
// response scrub masks. A Guard is immutable and safe for concurrent use;
// each stream gets its own [Scanner], Reader or Writer. A nil or empty
// Guard finds nothing and its wrappers pass everything through.
//
// Like a [Secret], a Guard prints, logs and marshals as [Redacted].
type Guard struct {
	redacted
	secrets []guardSecret // those shorter than MinPartialRun, found whole
	// runs finds the runs of the secrets of MinPartialRun bytes or more
	// (and the short ones whole, for Check); nil when there are none.
	runs    *scrubber
	longest int
}

// guardSecret is one secret and its KMP failure function, so a stream can
// be followed byte by byte across any chunking.
type guardSecret struct {
	s    string
	b    []byte
	fail []int // fail[i]: the longest proper prefix of s[:i+1] that is also its suffix
}

// NewGuard returns a guard of the given secrets. Empty strings are ignored
// (a guard of none finds nothing); duplicates count once.
func NewGuard(secrets ...string) *Guard {
	g := &Guard{}
	seen := map[string]bool{}
	var all []*Secret
	for _, s := range secrets {
		if s == "" || seen[s] {
			continue
		}
		seen[s] = true
		all = append(all, &Secret{value: s})
		g.longest = max(g.longest, len(s))
		if len(s) < MinPartialRun {
			g.secrets = append(g.secrets, guardSecret{s: s, b: []byte(s), fail: failure(s)})
		}
	}
	g.runs = buildScrubber(all)
	return g
}

// failure is the KMP failure function of p.
func failure(p string) []int {
	f := make([]int, len(p))
	k := 0
	for i := 1; i < len(p); i++ {
		for k > 0 && p[i] != p[k] {
			k = f[k-1]
		}
		if p[i] == p[k] {
			k++
		}
		f[i] = k
	}
	return f
}

// step advances q, the length of the stream's longest suffix that begins
// the secret, by byte c. It returns len(s) when the secret just ended.
func (gs *guardSecret) step(q int, c byte) int {
	if q == len(gs.s) {
		q = gs.fail[q-1]
	}
	for q > 0 && gs.s[q] != c {
		q = gs.fail[q-1]
	}
	if gs.s[q] == c {
		q++
	}
	return q
}

// scan follows the stream on by p from state q: found, or the new state.
// A long p is searched with bytes.Contains (fast) and only its ends are
// stepped through: its first len(s)-1 bytes finish any occurrence begun
// before it, its last len(s)-1 bytes give the new state.
func (gs *guardSecret) scan(q int, p []byte) (int, bool) {
	n := len(gs.s)
	if len(p) <= 2*n {
		for _, c := range p {
			if q = gs.step(q, c); q == n {
				return q, true
			}
		}
		return q, false
	}
	for _, c := range p[:n-1] {
		if q = gs.step(q, c); q == n {
			return q, true
		}
	}
	if bytes.Contains(p, gs.b) {
		return n, true
	}
	q = 0
	for _, c := range p[len(p)-(n-1):] {
		q = gs.step(q, c) // never n: p holds no whole secret
	}
	return q, false
}

// Empty reports whether the guard holds no secret (then it finds nothing).
func (g *Guard) Empty() bool { return g == nil || g.runs == nil }

// Check returns a *CredentialError naming where when any value contains a
// held secret shorter than MinPartialRun, or a run of MinPartialRun or more
// bytes of a longer one; and nil otherwise.
func (g *Guard) Check(where string, values ...string) error {
	if g.Empty() {
		return nil
	}
	for _, v := range values {
		if g.runs.finds(v) {
			return &CredentialError{Where: where}
		}
	}
	return nil
}

// Scanner follows one stream through a Guard, in chunks of any size: it
// fails as soon as a held secret, or a run of MinPartialRun bytes of one,
// has passed, and says how many of the last bytes so far must be held back
// because they could begin one (so that what is let through can never be
// completed into one by what follows).
type Scanner struct {
	g     *Guard
	where string
	state []int // per short secret: the stream's longest suffix that begins it
	// tail is the stream's last MinPartialRun-1 bytes (fewer at its
	// start): a run that crosses into the next chunk begins there.
	tail  [MinPartialRun - 1]byte
	ntail int
	held  int
	err   error
}

// Scanner starts following a stream; where names it in the error.
func (g *Guard) Scanner(where string) *Scanner {
	s := &Scanner{g: g, where: where}
	if !g.Empty() {
		s.state = make([]int, len(g.secrets))
	}
	return s
}

// Write takes the stream's next bytes. Once a held secret, or a run of
// one, has passed it returns a *CredentialError, and does so for every
// later call too.
func (s *Scanner) Write(p []byte) (int, error) {
	if s.err != nil {
		return 0, s.err
	}
	if s.g.Empty() {
		return len(p), nil
	}
	held := 0
	for i := range s.g.secrets {
		q, found := s.g.secrets[i].scan(s.state[i], p)
		if found {
			s.err = &CredentialError{Where: s.where}
			return 0, s.err
		}
		s.state[i] = q
		held = max(held, q)
	}
	if m := s.g.runs; m.filter != nil {
		// A run that begins in the tail ends in p's first MinPartialRun-1
		// bytes or goes through them; one that begins in p is p's.
		var edge [2 * (MinPartialRun - 1)]byte
		n := copy(edge[:], s.tail[:s.ntail])
		n += copy(edge[n:], p)
		var buf [1]span
		if len(findRuns(m, buf[:0], edge[:n], true)) > 0 || len(findRuns(m, buf[:0], p, true)) > 0 {
			s.err = &CredentialError{Where: s.where}
			return 0, s.err
		}
		if len(p) >= len(s.tail) {
			s.ntail = copy(s.tail[:], p[len(p)-len(s.tail):])
		} else {
			s.ntail = copy(s.tail[:], edge[max(0, n-len(s.tail)):n])
		}
		// The longest suffix that occurs in a long secret could begin a
		// run.
		held = max(held, s.ntail-m.holdRun(s.tail[:s.ntail], 0))
	}
	s.held = held
	return len(p), nil
}

// Held is how many of the last bytes written could begin what the guard
// refuses: the longest suffix that begins a held secret shorter than
// MinPartialRun, or that occurs in a longer one (fewer than MinPartialRun
// bytes). Everything before them can be let through; they can be too
// once the stream ends.
func (s *Scanner) Held() int { return s.held }

// Err is the *CredentialError once a secret has passed, else nil.
func (s *Scanner) Err() error { return s.err }

// guardReadSize is how much a guard's reader asks its source for at a time.
const guardReadSize = 32 << 10

// guardMaxEmptyReads bounds how often a source may return (0, nil) in a row.
const guardMaxEmptyReads = 100

// Reader returns r's bytes once they cannot be part of a held secret: bytes
// that begin one are held back (fewer than the longest secret's length)
// until what follows settles it, or r ends. When a secret passes, Read
// returns a *CredentialError, and nothing of the secret, nor of the chunk
// it arrived in, is returned. An empty guard returns r itself.
func (g *Guard) Reader(r io.Reader, where string) io.Reader {
	if g.Empty() {
		return r
	}
	return &guardReader{s: g.Scanner(where), r: r}
}

type guardReader struct {
	s   *Scanner
	r   io.Reader
	buf []byte // buf[start:end] scanned, not yet returned
	// ready: buf[start:ready] may be returned; buf[ready:end] is held.
	start, ready, end int
	err               error // the source's end or failure, or the credential
}

func (r *guardReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for empty := 0; r.ready == r.start; {
		if r.err != nil {
			if r.err == io.EOF && r.end > r.start {
				r.ready = r.end // the stream ended: the held bytes begin nothing
				break
			}
			return 0, r.err
		}
		if r.start > 0 {
			n := copy(r.buf, r.buf[r.start:r.end])
			r.ready -= r.start
			r.start, r.end = 0, n
		}
		if len(r.buf)-r.end < guardReadSize {
			r.buf = append(r.buf[:r.end], make([]byte, guardReadSize)...)
			r.buf = r.buf[:cap(r.buf)]
		}
		n, err := r.r.Read(r.buf[r.end:])
		if n > 0 {
			if _, serr := r.s.Write(r.buf[r.end : r.end+n]); serr != nil {
				r.err, r.buf, r.start, r.ready, r.end = serr, nil, 0, 0, 0
				return 0, serr
			}
			r.end += n
			r.ready = max(r.start, r.end-r.s.Held())
		}
		switch {
		case err != nil:
			r.err = err
		case n == 0:
			if empty++; empty >= guardMaxEmptyReads {
				r.err = io.ErrNoProgress
			}
		}
	}
	n := copy(p, r.buf[r.start:r.ready])
	r.start += n
	return n, nil
}

// Writer returns a writer that passes bytes on to w once they cannot be
// part of a held secret, as Reader does. When a secret passes, Write
// returns a *CredentialError and writes nothing of the secret or of that
// call's bytes. Close says the stream ended: it writes the bytes still held
// back (they begin no secret after all) and does not close w.
func (g *Guard) Writer(w io.Writer, where string) io.WriteCloser {
	return &guardWriter{s: g.Scanner(where), w: w}
}

type guardWriter struct {
	s    *Scanner
	w    io.Writer
	held []byte
	err  error
}

func (w *guardWriter) Write(p []byte) (int, error) {
	if w.err != nil {
		return 0, w.err
	}
	if _, err := w.s.Write(p); err != nil {
		w.err, w.held = err, nil
		return 0, err
	}
	w.held = append(w.held, p...)
	release := len(w.held) - w.s.Held()
	if release > 0 {
		if _, err := w.w.Write(w.held[:release]); err != nil {
			w.err = err
			return 0, err
		}
		w.held = w.held[:copy(w.held, w.held[release:])]
	}
	return len(p), nil
}

func (w *guardWriter) Close() error {
	if w.err != nil {
		return w.err
	}
	w.err = errors.New("transforms: write to a closed guard writer")
	if len(w.held) > 0 {
		_, err := w.w.Write(w.held)
		w.held = nil
		return err
	}
	return nil
}

// TarReader returns the bytes of the tar stream r (bare: decompress it
// first) once they are cleared: a header's bytes (PAX and GNU long-name
// records included) only after the entry's name, link target, owner names
// and PAX records passed Check, and the rest (file contents, padding, what
// follows the archive's end) as Reader clears them. A secret split where
// only the tar's parser joins it (a ustar name across its prefix and name
// fields) is found as surely as one written whole. A *CredentialError, or
// the parser's error for a stream that is no tar, ends it before any byte
// of the entry concerned is returned. An empty guard returns r itself.
func (g *Guard) TarReader(r io.Reader, where string) io.Reader {
	if g.Empty() {
		return r
	}
	t := &tarGuard{g: g, where: where, s: g.Scanner(where), src: r, buf: make([]byte, guardReadSize)}
	t.tr = tar.NewReader(tarRecorder{t})
	return t
}

// tarGuard parses the stream it passes on. archive/tar reads exactly the
// bytes it needs, never ahead, so what it has consumed is a prefix of the
// stream: raw holds that prefix's bytes not yet returned.
type tarGuard struct {
	g     *Guard
	where string
	s     *Scanner
	src   io.Reader
	tr    *tar.Reader
	raw   []byte // consumed by the parser (and scanned), not yet returned
	ready int    // raw[:ready] is cleared
	phase tarPhase
	buf   []byte
	err   error
}

type tarPhase int

const (
	tarHeader  tarPhase = iota // next: an entry's header
	tarContent                 // in an entry's content
	tarAfter                   // after the archive's end: raw to EOF
)

// tarRecorder is the parser's source: every byte it reads is kept and
// scanned.
type tarRecorder struct{ t *tarGuard }

func (rec tarRecorder) Read(p []byte) (int, error) {
	n, err := rec.t.src.Read(p)
	if n > 0 {
		rec.t.raw = append(rec.t.raw, p[:n]...)
		if _, serr := rec.t.s.Write(p[:n]); serr != nil {
			return n, serr
		}
	}
	return n, err
}

func (t *tarGuard) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for empty := 0; t.ready == 0; {
		if t.err != nil {
			return 0, t.err
		}
		before, phase := len(t.raw), t.phase
		t.step()
		if len(t.raw) == before && t.phase == phase && t.err == nil {
			if empty++; empty >= guardMaxEmptyReads {
				t.err = io.ErrNoProgress
			}
		} else {
			empty = 0
		}
	}
	n := copy(p, t.raw[:t.ready])
	t.raw = t.raw[:copy(t.raw, t.raw[n:])]
	t.ready -= n
	return n, nil
}

// step moves the parser on by a header, a piece of content or a piece of
// what follows the end, and clears what it may.
func (t *tarGuard) step() {
	var err error
	switch t.phase {
	case tarHeader:
		var hdr *tar.Header
		hdr, err = t.tr.Next()
		switch {
		case t.s.Err() != nil:
		case err == io.EOF:
			t.phase, err = tarAfter, nil
		case err != nil:
			err = fmt.Errorf("reading the tar: %w", err)
		default:
			if err = t.g.Check(t.where, tarHeaderValues(hdr)...); err == nil {
				t.phase = tarContent
			}
		}
	case tarContent:
		_, err = t.tr.Read(t.buf)
		switch {
		case t.s.Err() != nil:
		case err == io.EOF:
			t.phase, err = tarHeader, nil
		case err != nil:
			err = fmt.Errorf("reading the tar: %w", err)
		}
	case tarAfter:
		_, err = tarRecorder{t}.Read(t.buf)
		if err == io.EOF && t.s.Err() == nil {
			t.ready = len(t.raw) // the stream ended: the held bytes begin nothing
			t.err = io.EOF
			return
		}
	}
	if serr := t.s.Err(); serr != nil {
		err = serr
	}
	if err != nil {
		t.err, t.raw, t.ready = err, nil, 0
		return
	}
	t.ready = max(0, len(t.raw)-t.s.Held())
}

// tarHeaderValues is what of a header reaches the extracted tree, or may.
func tarHeaderValues(h *tar.Header) []string {
	out := []string{h.Name, h.Linkname, h.Uname, h.Gname}
	for k, v := range h.PAXRecords {
		out = append(out, k, v)
	}
	return out
}
