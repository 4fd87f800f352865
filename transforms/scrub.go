package transforms

import (
	"bytes"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
)

// scrubReadSize is how much a scrub reader asks its source for at a time.
const scrubReadSize = 32 << 10

// maxEmptyReads bounds how often a source may return (0, nil) in a row.
const maxEmptyReads = 100

// pattern is one secret to find and the placeholder that replaces it.
type pattern struct {
	find []byte
	repl []byte
}

// scrubber finds secrets left to right without overlap; where several
// start at the same byte the longest wins.
type scrubber struct {
	pats   []pattern // distinct finds, longest first
	maxLen int
	first  [256]bool // first bytes of the finds
}

// newScrubber returns nil when there is nothing to scrub. A scrubber is
// immutable: one secret's is built once and shared.
func newScrubber(secrets []*Secret) *scrubber {
	if len(secrets) == 1 && secrets[0] != nil && secrets[0].scrub != nil {
		return secrets[0].scrub
	}
	return buildScrubber(secrets)
}

func buildScrubber(secrets []*Secret) *scrubber {
	m := &scrubber{}
	for _, s := range secrets {
		if s == nil || s.value == "" {
			continue
		}
		if slices.ContainsFunc(m.pats, func(p pattern) bool { return string(p.find) == s.value }) {
			continue // the same value under two names: the first placeholder wins
		}
		m.pats = append(m.pats, pattern{find: []byte(s.value), repl: []byte(s.placeholder)})
		m.maxLen = max(m.maxLen, len(s.value))
		m.first[s.value[0]] = true
	}
	if len(m.pats) == 0 {
		return nil
	}
	slices.SortStableFunc(m.pats, func(a, b pattern) int { return len(b.find) - len(a.find) })
	return m
}

// holdStart returns the smallest j >= from such that src[j:] is a proper
// prefix of some secret — the bytes that must wait for more input because a
// secret may start there — or len(src) when no such j exists. Only the last
// maxLen-1 bytes can qualify.
func (m *scrubber) holdStart(src []byte, from int) int {
	for j := max(from, len(src)-(m.maxLen-1)); j < len(src); j++ {
		if !m.first[src[j]] {
			continue
		}
		tail := src[j:]
		for _, p := range m.pats {
			if len(p.find) > len(tail) && bytes.HasPrefix(p.find, tail) {
				return j
			}
		}
	}
	return len(src)
}

// scan appends to dst the scrubbed form of a prefix of src and returns it
// with the length of that prefix. The rest of src (at most maxLen-1 bytes,
// each a possible start of a secret) must be presented again with more
// input after it; with eof everything is consumed.
//
// next caches, per pattern, the index of its next full match at or after
// the current position (-1: none in src); it is scratch space of len(pats).
func (m *scrubber) scan(dst, src []byte, eof bool, next []int) ([]byte, int) {
	for k, p := range m.pats {
		next[k] = bytes.Index(src, p.find)
	}
	i := 0
	hold := len(src)
	if !eof {
		hold = m.holdStart(src, 0)
	}
	for {
		// The leftmost full match; at a tie the longest (pats are sorted).
		best := -1
		for k := range m.pats {
			if next[k] >= 0 && (best < 0 || next[k] < next[best]) {
				best = k
			}
		}
		// A match at or after hold might be cut short or lengthened by the
		// next input; before hold, src[p:] is no proper prefix of any secret,
		// so the decision at p is final.
		if best < 0 || next[best] >= hold {
			return append(dst, src[i:hold]...), hold
		}
		p := next[best]
		dst = append(dst, src[i:p]...)
		dst = append(dst, m.pats[best].repl...)
		i = p + len(m.pats[best].find)
		for k, pt := range m.pats {
			if next[k] >= 0 && next[k] < i {
				if j := bytes.Index(src[i:], pt.find); j >= 0 {
					next[k] = i + j
				} else {
					next[k] = -1
				}
			}
		}
		if i > hold {
			hold = len(src)
			if !eof {
				hold = m.holdStart(src, i)
			}
		}
	}
}

// scrubString returns s with every secret replaced by its placeholder.
func (m *scrubber) scrubString(s string) string {
	if m == nil {
		return s
	}
	found := false
	for _, p := range m.pats {
		if strings.Contains(s, string(p.find)) {
			found = true
			break
		}
	}
	if !found {
		return s
	}
	out, _ := m.scan(nil, []byte(s), true, make([]int, len(m.pats)))
	return string(out)
}

// ScrubHeader replaces every occurrence of each secret in h's values, and
// in its names, by the secret's placeholder. Value slices are replaced, not
// written in place.
func ScrubHeader(h http.Header, secrets []*Secret) {
	newScrubber(secrets).scrubHeader(h)
}

func (m *scrubber) scrubHeader(h http.Header) {
	if m == nil || h == nil {
		return
	}
	for k, vs := range h {
		var nv []string
		for i, v := range vs {
			if w := m.scrubString(v); w != v {
				if nv == nil {
					nv = slices.Clone(vs)
				}
				nv[i] = w
			}
		}
		if nk := m.scrubString(k); nk != k {
			delete(h, k)
			if nv == nil {
				nv = vs
			}
			h[nk] = append(h[nk], nv...)
		} else if nv != nil {
			h[k] = nv
		}
	}
}

// NewScrubReader returns a reader of r's bytes with every occurrence of
// each secret replaced by its placeholder: left to right, without overlap,
// the longest secret winning where several start at the same byte.
//
// It streams: each Read returns as soon as a Read of r yields anything that
// can be released, and reads r again only when all r gave is held back. A secret split across r's reads is still caught, because the
// reader holds back the tail of its input that could begin a secret — at
// most len(longest secret)-1 bytes, and only when those bytes are a proper
// prefix of a secret. So a chunk (an SSE event, say) whose end cannot begin
// a secret is released whole and at once. At io.EOF everything held is
// released. Memory is bounded by a read buffer of 32 KiB plus the longest
// secret. An error other than io.EOF from r is returned after what was
// decided; held-back bytes are then dropped.
//
// With no secrets, r is returned as is.
func NewScrubReader(r io.Reader, secrets []*Secret) io.Reader {
	m := newScrubber(secrets)
	if m == nil {
		return r
	}
	return &scrubReader{src: r, m: m, next: make([]int, len(m.pats))}
}

// scrubBufs pools the input and output buffers of scrub readers: a proxy
// scrubs every response to a credentialed request, and allocating 64 KiB
// for each small JSON answer shows up in its latency.
var scrubBufs = sync.Pool{New: func() any { return new([2][]byte) }}

func getScrubBufs(n int) (in, out []byte) {
	b := scrubBufs.Get().(*[2][]byte)
	in, out = b[0][:0], b[1][:0]
	if cap(in) < n {
		in = make([]byte, 0, n)
	}
	return in, out
}

// release returns the buffers to the pool once the source is finished and
// everything decided has been read. It runs on the reading goroutine only.
func (r *scrubReader) release() {
	if r.in == nil || r.off < len(r.out) {
		return
	}
	if cap(r.in) <= 4*scrubReadSize && cap(r.out) <= 8*scrubReadSize {
		scrubBufs.Put(&[2][]byte{r.in[:0], r.out[:0]})
	}
	r.in, r.out, r.off = nil, nil, 0
}

// scrubReader is the reader NewScrubReader returns.
type scrubReader struct {
	src  io.Reader
	m    *scrubber
	next []int  // scratch for scan
	in   []byte // input held back from the last scan, then new input
	out  []byte // scrubbed output not yet read
	off  int    // read position in out
	err  error  // sticky error of src
}

func (r *scrubReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for empty := 0; ; {
		if r.off < len(r.out) {
			n := copy(p, r.out[r.off:])
			r.off += n
			return n, nil
		}
		if r.err != nil {
			r.release()
			return 0, r.err
		}
		if r.in == nil {
			r.in, r.out = getScrubBufs(scrubReadSize + r.m.maxLen)
		}
		r.out, r.off = r.out[:0], 0
		held := len(r.in)
		n, err := r.src.Read(r.in[held:cap(r.in)])
		r.in = r.in[:held+n]
		if err != nil {
			r.err = err
		} else if n == 0 {
			if empty++; empty >= maxEmptyReads {
				return 0, io.ErrNoProgress
			}
			continue
		}
		var used int
		r.out, used = r.m.scan(r.out, r.in, err == io.EOF, r.next)
		if err != nil {
			used = len(r.in)
		}
		r.in = r.in[:copy(r.in, r.in[used:])]
	}
}

// ScrubString returns s with every occurrence of each secret replaced by its
// placeholder. The proxy passes every message that may quote upstream bytes
// (a parser error, say) through it before it reaches a sandbox or a log.
func ScrubString(s string, secrets []*Secret) string {
	if s == "" || len(secrets) == 0 {
		return s
	}
	return newScrubber(secrets).scrubString(s)
}

// ScrubString scrubs s of a.Scrub; see [ScrubString].
func (a Applied) ScrubString(s string) string {
	if s == "" || len(a.Scrub) == 0 {
		return s
	}
	return a.scrubber().scrubString(s)
}
