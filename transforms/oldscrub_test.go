package transforms

// The scanner this package had before partial runs were scrubbed (whole
// secrets only), kept verbatim but renamed as the baseline of the scrub
// benchmarks: BenchmarkScrub reports both in one run.

import (
	"bytes"
	"io"
	"slices"
	"strings"
	"sync"
)

const (
	oldScrubReadSize = 32 << 10
	oldMaxEmptyReads = 100
)

// oldPattern is one secret to find and the placeholder that replaces it.
type oldPattern struct {
	find []byte
	repl []byte
}

func newOldScrubReader(r io.Reader, secrets []*Secret) io.Reader {
	m := buildOldScrubber(secrets)
	if m == nil {
		return r
	}
	return &oldScrubReader{src: r, m: m, next: make([]int, len(m.pats))}
}

// oldScrubber finds secrets left to right without overlap; where several
// start at the same byte the longest wins.
type oldScrubber struct {
	pats   []oldPattern // distinct finds, longest first
	maxLen int
	first  [256]bool // first bytes of the finds
}

func buildOldScrubber(secrets []*Secret) *oldScrubber {
	m := &oldScrubber{}
	for _, s := range secrets {
		if s == nil || s.value == "" {
			continue
		}
		if slices.ContainsFunc(m.pats, func(p oldPattern) bool { return string(p.find) == s.value }) {
			continue // the same value under two names: the first placeholder wins
		}
		m.pats = append(m.pats, oldPattern{find: []byte(s.value), repl: []byte(s.placeholder)})
		m.maxLen = max(m.maxLen, len(s.value))
		m.first[s.value[0]] = true
	}
	if len(m.pats) == 0 {
		return nil
	}
	slices.SortStableFunc(m.pats, func(a, b oldPattern) int { return len(b.find) - len(a.find) })
	return m
}

// holdStart returns the smallest j >= from such that src[j:] is a proper
// prefix of some secret — the bytes that must wait for more input because a
// secret may start there — or len(src) when no such j exists. Only the last
// maxLen-1 bytes can qualify.
func (m *oldScrubber) holdStart(src []byte, from int) int {
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
func (m *oldScrubber) scan(dst, src []byte, eof bool, next []int) ([]byte, int) {
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
func (m *oldScrubber) scrubString(s string) string {
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

// oldScrubBufs pools the input and output buffers of scrub readers: a proxy
// scrubs every response to a credentialed request, and allocating 64 KiB
// for each small JSON answer shows up in its latency.
var oldScrubBufs = sync.Pool{New: func() any { return new([2][]byte) }}

func getOldBufs(n int) (in, out []byte) {
	b := oldScrubBufs.Get().(*[2][]byte)
	in, out = b[0][:0], b[1][:0]
	if cap(in) < n {
		in = make([]byte, 0, n)
	}
	return in, out
}

// release returns the buffers to the pool once the source is finished and
// everything decided has been read. It runs on the reading goroutine only.
func (r *oldScrubReader) release() {
	if r.in == nil || r.off < len(r.out) {
		return
	}
	if cap(r.in) <= 4*oldScrubReadSize && cap(r.out) <= 8*oldScrubReadSize {
		oldScrubBufs.Put(&[2][]byte{r.in[:0], r.out[:0]})
	}
	r.in, r.out, r.off = nil, nil, 0
}

// oldScrubReader is the reader NewScrubReader returns.
type oldScrubReader struct {
	src  io.Reader
	m    *oldScrubber
	next []int  // scratch for scan
	in   []byte // input held back from the last scan, then new input
	out  []byte // scrubbed output not yet read
	off  int    // read position in out
	err  error  // sticky error of src
}

func (r *oldScrubReader) Read(p []byte) (int, error) {
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
			r.in, r.out = getOldBufs(oldScrubReadSize + r.m.maxLen)
		}
		r.out, r.off = r.out[:0], 0
		held := len(r.in)
		n, err := r.src.Read(r.in[held:cap(r.in)])
		r.in = r.in[:held+n]
		if err != nil {
			r.err = err
		} else if n == 0 {
			if empty++; empty >= oldMaxEmptyReads {
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
