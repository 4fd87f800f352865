package transforms

import (
	"bytes"
	"io"
	"math/bits"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
)

// scrubReadSize is how much a scrub reader asks its source for at a time.
const scrubReadSize = 32 << 10

// maxEmptyReads bounds how often a source may return (0, nil) in a row.
const maxEmptyReads = 100

// MinPartialRun is the shortest run of a secret's consecutive bytes that is
// scrubbed where it is not the whole secret: any MinPartialRun or more
// consecutive bytes of a secret at least that long, anywhere in a body or
// a header, are replaced by [PartialMask] bytes, so an upstream that echoes
// a key truncated (an error quoting all but its last byte, say) does not
// hand it to the sandbox. Shorter runs are ordinary text: 11 bytes of a
// key's alphabet turn up by chance, and a run that short of a random key is
// far from the key. Secrets shorter than MinPartialRun are only replaced
// whole.
const MinPartialRun = 12

// PartialMask replaces each byte of a partial run of a secret. Whole
// secrets are replaced by their placeholders, as they always were; a run
// that is not the whole secret gets a mask of its own length instead:
// handing the sandbox its placeholder there would say more than is known
// (that the run was the credential, and whole), while the mask only keeps
// the run's length and the text around it (a JSON string stays a string).
const PartialMask = '*'

const (
	// gramLen is how many bytes the run filter looks at in each probe,
	// and gramStride how far apart its probes are: a run of MinPartialRun
	// bytes holds the gramLen bytes of one probe wherever it starts, so a
	// body is probed at one byte in gramStride, and read again only where
	// a probe hits.
	gramLen    = 4
	gramStride = MinPartialRun - gramLen + 1
	// minFilterBits and maxFilterBits bound the log2 of the run filter's
	// size in bits (4 KiB to 32 KiB). It is the least that keeps the
	// filter at most 1/64 full (so that text holding no secret rarely
	// hits it) until the largest: a host whose rules held many secrets
	// (see held.go) has many windows.
	minFilterBits = 15
	maxFilterBits = 18
)

// gramAt is where a gramLen-byte window occurs: in long[sec], at off.
type gramAt struct{ sec, off int }

// pattern is one secret to find whole and the placeholder that replaces it.
type pattern struct {
	find []byte
	repl []byte
	long bool // at least MinPartialRun bytes: found inside the runs
}

// scrubber finds secrets, and runs of secrets, in text.
//
// What it replaces is defined in two steps over the whole input (a stream
// gives the same result however it is cut into reads):
//
//  1. whole secrets, left to right without overlap; where several start at
//     the same byte the longest wins; each is replaced by its placeholder;
//  2. of the bytes left, each inside a window of MinPartialRun bytes that
//     occurs in a secret of at least that length is replaced by
//     PartialMask. The union of those windows is every maximal run of
//     MinPartialRun or more consecutive bytes of a secret, however the runs
//     of several secrets overlap.
//
// Runs are found by probing the input every gramStride bytes: the
// gramLen bytes at a probe are looked up in a bitmap of the hashes of the
// long secrets' gramLen-byte windows (one load, one multiply, one bit),
// and only on a hit in the table of where those windows occur, from which
// each occurrence is extended into the longest match around the probe. A
// long secret's whole occurrences lie inside runs, so they are searched for
// there only; short secrets are searched for with bytes.Index.
type scrubber struct {
	pats     []pattern // distinct finds, longest first
	maxLen   int
	maxHold  int       // the most a stream holds back: max(maxLen, MinPartialRun) - 1
	first    [256]bool // first bytes of the finds
	hasShort bool      // a find shorter than MinPartialRun

	long   [][]byte            // the finds at least MinPartialRun long
	filter *gramFilter         // a bit per hash of their gramLen-byte windows; nil when there are none
	grams  map[uint32][]gramAt // where each of those windows (load32 of it) occurs
	inLong [256]bool           // the bytes they hold
}

// gramFilter is the run filter: a bitmap with a bit per hash of each
// window of gramLen bytes of the long secrets.
type gramFilter struct {
	bits  []uint64 // a power of two of them
	shift uint32   // 32 - log2(len(bits)*64)
}

// newGramFilter returns a filter sized for n windows.
func newGramFilter(n int) *gramFilter {
	b := uint32(minFilterBits)
	for b < maxFilterBits && 1<<b < 256*n {
		b++
	}
	return &gramFilter{bits: make([]uint64, 1<<b/64), shift: 32 - b}
}

// hash maps a gramLen-byte window to a bit of the filter (Fibonacci
// hashing: the top bits of a multiplication by 2^32/φ).
func (f *gramFilter) hash(x uint32) uint32 { return (x * 0x9e3779b1) >> f.shift }

func (f *gramFilter) set(x uint32) {
	h := f.hash(x)
	f.bits[h>>6] |= 1 << (h & 63)
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
	windows := 0
	for _, s := range secrets {
		if s != nil && len(s.value) >= MinPartialRun {
			windows += len(s.value) - gramLen + 1
		}
	}
	for _, s := range secrets {
		if s == nil || s.value == "" {
			continue
		}
		if slices.ContainsFunc(m.pats, func(p pattern) bool { return string(p.find) == s.value }) {
			continue // the same value under two names: the first placeholder wins
		}
		p := pattern{find: []byte(s.value), repl: []byte(s.placeholder), long: len(s.value) >= MinPartialRun}
		m.pats = append(m.pats, p)
		m.maxLen = max(m.maxLen, len(s.value))
		m.first[s.value[0]] = true
		if !p.long {
			m.hasShort = true
			continue
		}
		if m.filter == nil {
			m.filter = newGramFilter(windows)
			m.grams = make(map[uint32][]gramAt)
		}
		for i := 0; i+gramLen <= len(p.find); i++ {
			x := load32(p.find, i)
			m.filter.set(x)
			// A secret's occurrences in order of offset: the first
			// reaches furthest forward, so findRuns mostly skips the
			// others.
			m.grams[x] = append(m.grams[x], gramAt{len(m.long), i})
		}
		m.long = append(m.long, p.find)
		for _, c := range p.find {
			m.inLong[c] = true
		}
	}
	if len(m.pats) == 0 {
		return nil
	}
	m.maxHold = max(m.maxLen, MinPartialRun) - 1
	slices.SortStableFunc(m.pats, func(a, b pattern) int { return len(b.find) - len(a.find) })
	return m
}

// load32 reads the gramLen bytes of s at p, little-endian (one load on
// amd64).
func load32[T ~string | ~[]byte](s T, p int) uint32 {
	w := s[p : p+4]
	return uint32(w[0]) | uint32(w[1])<<8 | uint32(w[2])<<16 | uint32(w[3])<<24
}

// span is a run [lo, hi) of input bytes inside runs of secrets.
type span struct{ lo, hi int }

// findRuns appends to runs the runs of long secrets in src, merged and in
// order; with stop it returns at the first run found.
func findRuns[T ~string | ~[]byte](m *scrubber, runs []span, src T, stop bool) []span {
	f := m.filter
	if f == nil {
		return runs
	}
	// Probes at or before skip need no look: every window of
	// MinPartialRun bytes they stand for lies inside a run found.
	skip := -1
	for p := 0; ; p += gramStride {
		if p <= skip {
			continue
		}
		if p = probe(f, src, p); p < 0 {
			return runs
		}
		for _, g := range m.grams[load32(src, p)] {
			s := m.long[g.sec]
			// An occurrence whose match could not reach out of the last
			// run is skipped: a periodic secret has a window at many
			// offsets, and its input would cost a long match for each.
			if n := len(runs); n > 0 && runs[n-1].lo <= p-min(gramStride-1, g.off, p) && runs[n-1].hi >= p+len(s)-g.off {
				continue
			}
			// The match of s aligned with this occurrence, back to the
			// first window the probe stands for (those that start in
			// (p-gramStride, p]; earlier ones are earlier probes'), and
			// forward as far as it goes.
			lo, hi := p, p+gramLen
			for lo > p-gramStride+1 && lo > 0 && g.off > p-lo && src[lo-1] == s[g.off-(p-lo)-1] {
				lo--
			}
			hi += commonPrefix(src[hi:], s[g.off+gramLen:])
			if hi-lo < MinPartialRun {
				continue
			}
			// Merged with the runs it touches: runs stay disjoint and in
			// order (another occurrence at this probe may reach further
			// back than the last run).
			for n := len(runs); n > 0 && runs[n-1].hi >= lo; n-- {
				lo, hi = min(lo, runs[n-1].lo), max(hi, runs[n-1].hi)
				runs = runs[:n-1]
			}
			runs = append(runs, span{lo, hi})
			if stop {
				return runs
			}
			skip = max(skip, hi-MinPartialRun)
		}
	}
}

// commonPrefix returns how many bytes a and b have in common at their
// start, comparing eight at a time.
func commonPrefix[T ~string | ~[]byte](a T, b []byte) int {
	n := min(len(a), len(b))
	i := 0
	for ; i+8 <= n; i += 8 {
		if x := load64(a, i) ^ load64(b, i); x != 0 {
			return i + bits.TrailingZeros64(x)/8
		}
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}

// load64 reads 8 bytes of s at p, little-endian (one load on amd64).
func load64[T ~string | ~[]byte](s T, p int) uint64 {
	w := s[p : p+8]
	return uint64(w[0]) | uint64(w[1])<<8 | uint64(w[2])<<16 | uint64(w[3])<<24 |
		uint64(w[4])<<32 | uint64(w[5])<<40 | uint64(w[6])<<48 | uint64(w[7])<<56
}

// probe returns the first of the probes p, p+gramStride, ... whose gramLen
// bytes hit the filter f, or -1. It is the loop every scrubbed byte goes
// through: nothing in it calls out or spills.
func probe[T ~string | ~[]byte](filter *gramFilter, src T, p int) int {
	f, shift := filter.bits, filter.shift&31
	// Four probes a turn, their bits or-ed: one branch for 4*gramStride
	// bytes.
	for ; p+3*gramStride+gramLen <= len(src); p += 4 * gramStride {
		w := src[p : p+3*gramStride+gramLen]
		h0 := load32(w, 0) * 0x9e3779b1 >> shift
		h1 := load32(w, gramStride) * 0x9e3779b1 >> shift
		h2 := load32(w, 2*gramStride) * 0x9e3779b1 >> shift
		h3 := load32(w, 3*gramStride) * 0x9e3779b1 >> shift
		if (f[h0>>6]>>(h0&63)|f[h1>>6]>>(h1&63)|f[h2>>6]>>(h2&63)|f[h3>>6]>>(h3&63))&1 != 0 {
			break // one of the four hit: the loop below says which
		}
	}
	for ; p+gramLen <= len(src); p += gramStride {
		if h := load32(src, p) * 0x9e3779b1 >> shift; f[h>>6]&(1<<(h&63)) != 0 {
			return p
		}
	}
	return -1
}

// finds reports whether s holds anything to replace.
func (m *scrubber) finds(s string) bool {
	if m.hasShort {
		for _, p := range m.pats {
			if !p.long && strings.Contains(s, string(p.find)) {
				return true
			}
		}
	}
	var buf [1]span
	return len(findRuns(m, buf[:0], s, true)) > 0
}

// findsBytes is finds for a byte slice.
func (m *scrubber) findsBytes(b []byte) bool {
	if m.hasShort {
		for _, p := range m.pats {
			if !p.long && bytes.Contains(b, p.find) {
				return true
			}
		}
	}
	var buf [1]span
	return len(findRuns(m, buf[:0], b, true)) > 0
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

// holdRun returns the smallest j >= from such that src[j:], shorter than
// MinPartialRun, occurs in a long secret — bytes that more input may make
// the start of a run — or len(src). Only the last MinPartialRun-1 bytes can
// qualify, and only a tail made of bytes the long secrets hold.
func (m *scrubber) holdRun(src []byte, from int) int {
	if m.filter == nil {
		return len(src)
	}
	lo := max(from, len(src)-(MinPartialRun-1))
	j := len(src)
	for j > lo && m.inLong[src[j-1]] {
		j--
	}
	// If src[j:] occurs in a secret so does every suffix of it: the first
	// j that does is the answer.
	for ; j < len(src); j++ {
		for _, s := range m.long {
			if bytes.Contains(s, src[j:]) {
				return j
			}
		}
	}
	return len(src)
}

// index returns the index of the first whole match of p in src at or after
// from, or -1. A long secret is looked for inside the runs only: each of
// its occurrences is one.
func (m *scrubber) index(src []byte, p *pattern, from int, runs []span) int {
	if !p.long {
		if j := bytes.Index(src[from:], p.find); j >= 0 {
			return from + j
		}
		return -1
	}
	for r := sort.Search(len(runs), func(r int) bool { return runs[r].hi > from }); r < len(runs); r++ {
		lo := max(runs[r].lo, from)
		if runs[r].hi-lo < len(p.find) {
			continue
		}
		if j := bytes.Index(src[lo:runs[r].hi], p.find); j >= 0 {
			return lo + j
		}
	}
	return -1
}

// scanState is a scan's scratch space, with room for the common case
// (a few secrets, a few runs) inside it.
type scanState struct {
	next    []int  // per pattern, the index of its next whole match (-1: none)
	runs    []span // the runs of the current src
	nextBuf [4]int
	runsBuf [4]span
}

func (m *scrubber) newState() *scanState {
	st := &scanState{}
	st.init(m)
	return st
}

func (st *scanState) init(m *scrubber) {
	st.next = st.nextBuf[:0]
	if len(m.pats) > len(st.nextBuf) {
		st.next = make([]int, 0, len(m.pats))
	}
	st.next = st.next[:len(m.pats)]
	st.runs = st.runsBuf[:0]
}

// context returns how many of the bytes before used a stream must present
// again, ahead of what it holds back, with its next input: a run of a
// secret may begin up to MinPartialRun-1 bytes before the end of an input
// and be seen whole only with the next (also when those bytes were
// released, as part of a whole secret, say), and every byte it covers
// after them is masked.
func (m *scrubber) context(used int) int {
	if m.filter == nil {
		return 0
	}
	return min(used, MinPartialRun-1)
}

// scan appends to dst the scrubbed form of src[start:k] and returns it with
// k, the end of what was consumed. src[:start] is context (see context):
// bytes already released, searched only for runs that reach past start.
// The rest of src, src[k:] (at most m.maxHold bytes: a possible start of a
// secret or of a run), must be presented again with more input after it,
// after m.context(k) bytes of context; with eof everything is consumed.
func (m *scrubber) scan(dst, src []byte, start int, eof bool, st *scanState) ([]byte, int) {
	runs := findRuns(m, st.runs[:0], src, false)
	st.runs = runs
	next := st.next
	for k := range m.pats {
		next[k] = m.index(src, &m.pats[k], start, runs)
	}
	hold := len(src)
	if !eof {
		hold = min(m.holdStart(src, start), m.holdRun(src, start))
	}
	i, r := start, 0 // r: the first run that may reach past i
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
			dst, _ = appendMasked(dst, src, i, hold, runs, r)
			return dst, hold
		}
		p := next[best]
		dst, r = appendMasked(dst, src, i, p, runs, r)
		dst = append(dst, m.pats[best].repl...)
		i = p + len(m.pats[best].find)
		for k := range m.pats {
			if next[k] >= 0 && next[k] < i {
				next[k] = m.index(src, &m.pats[k], i, runs)
			}
		}
		if i > hold {
			// Runs that begin in the match and reach past it are found
			// again next time, from the context.
			hold = len(src)
			if !eof {
				hold = min(m.holdStart(src, i), m.holdRun(src, i))
			}
		}
	}
}

// masks is a supply of PartialMask bytes.
var masks = bytes.Repeat([]byte{PartialMask}, 64)

// appendMasked appends src[from:to] to dst with the bytes inside runs
// replaced by PartialMask. r is the first run that may reach past from; the
// first that may reach past to is returned.
func appendMasked(dst, src []byte, from, to int, runs []span, r int) ([]byte, int) {
	for from < to {
		for r < len(runs) && runs[r].hi <= from {
			r++
		}
		if r == len(runs) || runs[r].lo >= to {
			return append(dst, src[from:to]...), r
		}
		if lo := runs[r].lo; lo > from {
			dst = append(dst, src[from:lo]...)
			from = lo
		}
		for end := min(runs[r].hi, to); from < end; {
			n := min(end-from, len(masks))
			dst = append(dst, masks[:n]...)
			from += n
		}
	}
	return dst, r
}

// scrubString returns s with every secret replaced by its placeholder and
// every run of a secret masked.
func (m *scrubber) scrubString(s string) string {
	if m == nil || !m.finds(s) {
		return s
	}
	out, _ := m.scan(nil, []byte(s), 0, true, m.newState())
	return string(out)
}

// scrubBytes returns b scrubbed: b itself when there is nothing to replace.
func (m *scrubber) scrubBytes(b []byte) []byte {
	if m == nil || !m.findsBytes(b) {
		return b
	}
	out, _ := m.scan(nil, b, 0, true, m.newState())
	return out
}

// ScrubHeader replaces every occurrence of each secret in h's values, and
// in its names, by the secret's placeholder, and masks every run of
// [MinPartialRun] or more of its bytes (see [NewScrubReader]). Value slices
// are replaced, not written in place.
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
// each secret replaced by its placeholder — left to right, without overlap,
// the longest secret winning where several start at the same byte — and,
// in what is left, every run of [MinPartialRun] or more consecutive bytes
// of a secret replaced by as many [PartialMask] bytes (see scrubber).
//
// It streams: each Read returns as soon as a Read of r yields anything that
// can be released, and reads r again only when all r gave is held back. A
// secret or a run split across r's reads is still caught, because the
// reader holds back the tail of its input that could begin one: at most
// max(len(longest secret), MinPartialRun)-1 bytes, and only bytes that are
// a proper prefix of a secret or, in the last MinPartialRun-1, occur in
// one. So a chunk (an SSE event, say) whose end cannot begin a secret is
// released whole and at once. At io.EOF everything held is released.
// Memory is bounded by a read buffer of 32 KiB plus the longest secret. An
// error other than io.EOF from r is returned after what was decided;
// held-back bytes are then dropped. The output is the same however r cuts
// its input into reads.
//
// With no secrets, r is returned as is.
func NewScrubReader(r io.Reader, secrets []*Secret) io.Reader {
	m := newScrubber(secrets)
	if m == nil {
		return r
	}
	return newScrubReader(r, m)
}

func newScrubReader(r io.Reader, m *scrubber) *scrubReader {
	sr := &scrubReader{src: r, m: m}
	sr.st.init(m)
	return sr
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
	src io.Reader
	m   *scrubber
	st  scanState
	in  []byte // context and input held back from the last scan, then new input
	ctx int    // bytes of context at the start of in
	out []byte // scrubbed output not yet read
	off int    // read position in out
	err error  // sticky error of src
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
			r.in, r.out = getScrubBufs(scrubReadSize + r.m.maxHold + MinPartialRun)
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
		r.out, used = r.m.scan(r.out, r.in, r.ctx, err == io.EOF, &r.st)
		if err != nil {
			used = len(r.in)
		}
		r.ctx = r.m.context(used)
		r.in = r.in[:copy(r.in, r.in[used-r.ctx:])]
	}
}

// ScrubString returns s with every occurrence of each secret replaced by its
// placeholder and every run of [MinPartialRun] or more of its bytes masked
// (see [NewScrubReader]). The proxy passes every message that may quote
// upstream bytes (a parser error, say) through it before it reaches a
// sandbox or a log.
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
