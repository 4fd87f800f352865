package audit

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// SegmentWriter stores the segments of sandboxes' events (see
// appliance's store layout).
type SegmentWriter interface {
	// WriteSegment stores segment name of sandbox: data is its lines,
	// compressed (EncodeSegment). A segment still being filled is written
	// again, whole, each time it grew: the same name replaces the bytes
	// stored before.
	WriteSegment(ctx context.Context, sandbox, name string, data []byte) error
}

// JournalsConfig configures Journals. Zero values take the defaults.
type JournalsConfig struct {
	// Writer stores the segments. Required.
	Writer SegmentWriter
	// Log, when set, is the audit log: every event's line is written to
	// it too, the same bytes, encoded once.
	Log *JSONLines
	// SegmentBytes seals a segment (its last write, and a new one begun)
	// once its lines reach this many bytes; default 512 KiB.
	SegmentBytes int
	// MaxSegments is how many segments of one sandbox may be held in
	// memory, the one being filled included; default 3. When the store
	// falls that far behind, the oldest held is dropped, and its events
	// counted (Metrics, and a warning in Logger).
	MaxSegments int
	// FlushEvery is how often a segment being filled is written to the
	// store (a sealed one is written at once); default 10 s. It bounds
	// what a crash of the service (kill -9) loses of a running sandbox's
	// audit; a suspend, a destroy and Close write everything.
	FlushEvery time.Duration
	// Logger receives warnings (a store that fails); nil discards.
	Logger *slog.Logger
	// Metrics, when set, counts segment writes and dropped events.
	Metrics *Metrics
}

func (c JournalsConfig) withDefaults() JournalsConfig {
	if c.SegmentBytes <= 0 {
		c.SegmentBytes = 512 << 10
	}
	if c.MaxSegments < 2 {
		c.MaxSegments = 3
	}
	if c.FlushEvery <= 0 {
		c.FlushEvery = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Journals keep each open sandbox's events as segments of JSON lines and
// write them to a SegmentWriter: a segment being filled every FlushEvery,
// a full one at once, everything when a sandbox's journal is sealed
// (suspend) and at Close. It is a Sink; recording costs encoding the line
// once and appending it under the sandbox's own lock (the store is written
// from a goroutine of its own, never on the proxy's). Memory per sandbox
// is bounded by MaxSegments × SegmentBytes plus one line per segment (an
// event's strings are cut at 2 KiB each) and its chunks' slack (an eighth):
// about 1.7 MiB by default, whatever its traffic.
//
// Only the sandboxes Opened are kept: an event of another (a connection
// that outlived its sandbox's suspend or destroy) goes to the log alone.
type Journals struct {
	cfg JournalsConfig

	// by maps open sandboxes to their journals: an immutable map, replaced
	// (under mu) when one opens or goes, so that a Record reads it without
	// a lock.
	mu sync.Mutex
	by atomic.Pointer[map[string]*journal]

	kick chan struct{} // a segment was sealed
	stop context.CancelFunc
	done chan struct{}
}

type journal struct {
	id string
	mu sync.Mutex // guards what follows, but wmu
	// segs are held in memory, oldest first; the last one is being filled
	// unless it is sealed.
	segs      []*segment
	lastStart time.Time // the last segment's name's time
	dropped   int       // events dropped since the store last took a write
	subs      map[*Follower]struct{}
	closing   bool // sealed for a suspend: removed once written
	gone      bool // removed from Journals

	wmu sync.Mutex // held while writing to the store
}

type segment struct {
	name string
	// chunks hold the lines, in order, a line never split: appending
	// never copies what is there (a buffer grown by append would copy it
	// over and over), and bytes before a chunk's length never change.
	chunks  [][]byte
	size    int // bytes in chunks
	lines   int
	sealed  bool
	stored  int  // how many of its bytes the store holds
	writing bool // a write of it is under way
}

// Chunks of a segment: a new one begins when the last has less room than
// chunkRoom (a longer line makes its chunk grow).
const (
	chunkBytes = 32 << 10
	chunkRoom  = 4 << 10
)

// add appends a line.
func (s *segment) add(line []byte) {
	if n := len(s.chunks); n == 0 || cap(s.chunks[n-1])-len(s.chunks[n-1]) < max(chunkRoom, len(line)) {
		var c []byte
		if len(line) <= chunkRoom {
			c = (*chunkPool.Get().(*[]byte))[:0]
		} else {
			c = make([]byte, 0, max(chunkBytes, len(line)))
		}
		s.chunks = append(s.chunks, c)
	}
	c := &s.chunks[len(s.chunks)-1]
	*c = append(*c, line...)
	s.size += len(line)
	s.lines++
}

// lineBufs are the buffers events are encoded into, outside any lock.
var lineBufs = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// snapshot returns the lines as they are now, to be read outside the
// lock while the segment is being written.
func (s *segment) snapshot() [][]byte { return append([][]byte(nil), s.chunks...) }

// release gives the chunks of a segment nothing reads any more (written
// and dropped, or dropped unwritten) back for other segments.
func (s *segment) release() {
	for _, c := range s.chunks {
		if cap(c) == chunkBytes {
			c = c[:0]
			chunkPool.Put(&c)
		}
	}
	s.chunks = nil
}

var chunkPool = sync.Pool{New: func() any { b := make([]byte, 0, chunkBytes); return &b }}

// encodeChunks compresses a segment's chunks, one zstd frame each (a
// reader of the object decodes them as one stream), into a buffer of
// encodedBufs.
func encodeChunks(chunks [][]byte) *[]byte {
	out := encodedBufs.Get().(*[]byte)
	*out = (*out)[:0]
	for _, c := range chunks {
		*out = segEncoder().EncodeAll(c, *out)
	}
	return out
}

var encodedBufs = sync.Pool{New: func() any { return new([]byte) }}

func chunksLen(chunks [][]byte) int {
	n := 0
	for _, c := range chunks {
		n += len(c)
	}
	return n
}

// joinChunks joins a segment's chunks into one buffer.
func joinChunks(chunks [][]byte) []byte {
	n := 0
	for _, c := range chunks {
		n += len(c)
	}
	b := make([]byte, 0, n)
	for _, c := range chunks {
		b = append(b, c...)
	}
	return b
}

// NewJournals starts Journals; Close stops them.
func NewJournals(cfg JournalsConfig) (*Journals, error) {
	if cfg.Writer == nil {
		return nil, errors.New("audit: JournalsConfig.Writer is required")
	}
	js := &Journals{cfg: cfg.withDefaults(), kick: make(chan struct{}, 1), done: make(chan struct{})}
	js.by.Store(&map[string]*journal{})
	ctx, stop := context.WithCancel(context.Background())
	js.stop = stop
	go js.loop(ctx)
	return js, nil
}

// Open keeps sandbox's events from now on (again, if it was sealed).
func (js *Journals) Open(sandbox string) {
	js.mu.Lock()
	defer js.mu.Unlock()
	if j := js.get(sandbox); j != nil {
		j.mu.Lock()
		j.closing = false
		j.mu.Unlock()
		return
	}
	js.update(func(m map[string]*journal) { m[sandbox] = &journal{id: sandbox, subs: map[*Follower]struct{}{}} })
}

func (js *Journals) get(sandbox string) *journal { return (*js.by.Load())[sandbox] }

// update replaces the map of journals by a copy that edit changed; the
// caller holds mu.
func (js *Journals) update(edit func(map[string]*journal)) {
	m := maps.Clone(*js.by.Load())
	edit(m)
	js.by.Store(&m)
}

// all returns every open journal.
func (js *Journals) all() []*journal { return slices.Collect(maps.Values(*js.by.Load())) }

// Record implements Sink.
func (js *Journals) Record(e Event) {
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	// Encoded before any lock is taken: under the sandbox's lock the
	// line is only copied, so its connections do not queue for each
	// other's encoding.
	bp := lineBufs.Get().(*[]byte)
	line := AppendJSON((*bp)[:0], &e)
	if j := js.get(e.Sandbox); j != nil {
		js.keep(j, e.Time, line)
	}
	if js.cfg.Log != nil {
		js.cfg.Log.recordLine(line)
	}
	if cap(line) <= 64<<10 {
		*bp = line[:0]
		lineBufs.Put(bp)
	}
}

// keep adds line, of an event at t, to j's segment being filled.
func (js *Journals) keep(j *journal, t time.Time, line []byte) {
	j.mu.Lock()
	if j.gone {
		j.mu.Unlock()
		return
	}
	s := j.filling(t)
	pos := Pos{Segment: s.name, Index: s.lines}
	s.add(line)
	for f := range j.subs {
		f.send(Line{Pos: pos, Data: append([]byte(nil), line[:len(line)-1]...)})
	}
	sealed := s.size >= js.cfg.SegmentBytes
	if sealed {
		s.sealed = true
	}
	js.trim(j)
	j.mu.Unlock()
	if sealed {
		select {
		case js.kick <- struct{}{}:
		default:
		}
	}
}

// filling returns the segment being filled, beginning one at t if none
// is. A new segment's name sorts after every earlier one of the sandbox
// even if the clock went back.
func (j *journal) filling(t time.Time) *segment {
	if n := len(j.segs); n > 0 && !j.segs[n-1].sealed {
		return j.segs[n-1]
	}
	if !t.After(j.lastStart) {
		t = j.lastStart.Add(time.Nanosecond)
	}
	j.lastStart = t
	s := &segment{name: newSegmentName(t)}
	j.segs = append(j.segs, s)
	return s
}

// trim drops the oldest segments held past MaxSegments (not one being
// written), counting their events as dropped.
func (js *Journals) trim(j *journal) {
	for len(j.segs) > js.cfg.MaxSegments {
		i := 0
		for i < len(j.segs)-1 && j.segs[i].writing {
			i++
		}
		s := j.segs[i]
		j.segs = append(j.segs[:i], j.segs[i+1:]...)
		defer s.release()
		if s.stored < s.size {
			if j.dropped == 0 {
				js.cfg.Logger.Warn("the audit store falls behind: events of a sandbox are dropped until it takes a write", "sandbox", j.id, "segment", s.name)
			}
			j.dropped += s.lines
			if js.cfg.Metrics != nil {
				js.cfg.Metrics.auditDropped.Add(float64(s.lines))
			}
		}
	}
}

// loop writes sealed segments as they come and growing ones every
// FlushEvery, until Close.
func (js *Journals) loop(ctx context.Context) {
	defer close(js.done)
	tick := time.NewTicker(js.cfg.FlushEvery)
	defer tick.Stop()
	for {
		growing := false
		select {
		case <-ctx.Done():
			return
		case <-js.kick:
		case <-tick.C:
			growing = true
		}
		all := js.all()
		// A few sandboxes at once: a store's latency, not its bandwidth,
		// bounds how many it can take in a FlushEvery.
		sem := make(chan struct{}, writers)
		var wg sync.WaitGroup
		for _, j := range all {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				wctx, cancel := context.WithTimeout(ctx, time.Minute)
				js.write(wctx, j, growing)
				cancel()
				js.removeIfDone(j)
			})
		}
		wg.Wait()
	}
}

// writers is how many sandboxes' segments are written at once.
const writers = 8

// write stores j's segments that have bytes the store lacks: the sealed
// ones, and with growing the one being filled; each at most once. It
// returns the first failure.
func (js *Journals) write(ctx context.Context, j *journal, growing bool) error {
	j.wmu.Lock()
	defer j.wmu.Unlock()
	done := map[*segment]bool{}
	for {
		j.mu.Lock()
		j.letGoStored()
		var s *segment
		for _, c := range j.segs {
			if !done[c] && c.stored < c.size && (c.sealed || growing || j.closing) {
				s = c
				break
			}
		}
		if s == nil || j.gone {
			j.mu.Unlock()
			return nil
		}
		if j.closing {
			s.sealed = true // late events of a sealed journal: written and let go too
		}
		done[s] = true
		s.writing = true
		name, chunks := s.name, s.snapshot()
		j.mu.Unlock()

		out := encodeChunks(chunks)
		err := js.cfg.Writer.WriteSegment(ctx, j.id, name, *out)
		encodedBufs.Put(out)
		if js.cfg.Metrics != nil {
			js.cfg.Metrics.segmentWrite(err)
		}
		j.mu.Lock()
		s.writing = false
		if err != nil {
			j.mu.Unlock()
			js.cfg.Logger.Warn("writing a sandbox's audit segment to the store failed; it is tried again", "sandbox", j.id, "segment", name, "err", err)
			return err
		}
		s.stored = max(s.stored, chunksLen(chunks))
		if j.dropped > 0 {
			js.cfg.Logger.Warn("the audit store takes writes again", "sandbox", j.id, "dropped_events", j.dropped)
			j.dropped = 0
		}
		j.letGoStored()
		j.mu.Unlock()
	}
}

// letGoStored drops the sealed segments the store holds whole and that no
// write is reading: among them one being filled that a periodic write had
// stored whole before a suspend sealed it (a sandbox idle before its
// suspend), which no write would pick again. The caller holds j.mu.
func (j *journal) letGoStored() {
	j.segs = slices.DeleteFunc(j.segs, func(s *segment) bool {
		if s.sealed && !s.writing && s.stored == s.size {
			s.release()
			return true
		}
		return false
	})
}

// removeIfDone removes a journal sealed for a suspend once the store holds
// all of it.
func (js *Journals) removeIfDone(j *journal) {
	j.mu.Lock()
	done := j.closing && len(j.segs) == 0 && !j.gone
	if done {
		j.gone = true
	}
	j.mu.Unlock()
	if done {
		js.mu.Lock()
		if js.get(j.id) == j {
			js.update(func(m map[string]*journal) { delete(m, j.id) })
		}
		js.mu.Unlock()
	}
}

// Seal writes everything held of sandbox's events to the store and stops
// keeping them (a suspend): memory is freed once the store holds it all.
// When the store fails, what it could not take stays held and is tried
// again every FlushEvery; the error says so. Events recorded afterwards go
// to the log alone, until Open.
func (js *Journals) Seal(ctx context.Context, sandbox string) error {
	j := js.get(sandbox)
	if j == nil {
		return nil
	}
	j.mu.Lock()
	j.closing = true
	if n := len(j.segs); n > 0 {
		j.segs[n-1].sealed = true
	}
	j.mu.Unlock()
	err := js.write(ctx, j, true)
	js.removeIfDone(j)
	return err
}

// Release stops keeping sandbox's events (a suspend) as Seal does, but
// without waiting for the store: the writing goroutine writes what is held
// at once, and memory is freed once the store has it all. Until then a
// listing finds the events held (Held), and Close writes them.
func (js *Journals) Release(sandbox string) {
	j := js.get(sandbox)
	if j == nil {
		return
	}
	j.mu.Lock()
	j.closing = true
	if n := len(j.segs); n > 0 {
		j.segs[n-1].sealed = true
	}
	j.mu.Unlock()
	select {
	case js.kick <- struct{}{}:
	default:
	}
}

// Forget drops what is held of sandbox's events without writing it (a
// destroy), once a write of it under way has finished: nothing of it
// reaches the store afterwards.
func (js *Journals) Forget(sandbox string) {
	js.mu.Lock()
	j := js.get(sandbox)
	if j != nil {
		js.update(func(m map[string]*journal) { delete(m, sandbox) })
	}
	js.mu.Unlock()
	if j == nil {
		return
	}
	j.mu.Lock()
	j.gone, j.segs = true, nil
	j.mu.Unlock()
	j.wmu.Lock() // a write under way ends
	j.wmu.Unlock()
}

// Close stops the writing goroutine and writes everything held, within
// ctx. It returns the first failure.
func (js *Journals) Close(ctx context.Context) error {
	js.stop()
	<-js.done
	var first error
	for _, j := range js.all() {
		if err := js.write(ctx, j, true); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// Held returns the segments held in memory of sandbox's events (none when
// it is not open), for a listing: their lines as they are now.
func (js *Journals) Held(sandbox string) []Segment {
	j := js.get(sandbox)
	if j == nil {
		return nil
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	out := make([]Segment, 0, len(j.segs))
	for _, s := range j.segs {
		lines := joinChunks(s.chunks) // a copy: the chunks are reused once written
		out = append(out, Segment{Name: s.name, Lines: func(context.Context) ([]byte, error) { return lines, nil }})
	}
	return out
}

// HeldBytes is how many bytes of sandbox's event lines are held in memory.
func (js *Journals) HeldBytes(sandbox string) int {
	j := js.get(sandbox)
	if j == nil {
		return 0
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	n := 0
	for _, s := range j.segs {
		n += s.size
	}
	return n
}

// Line is one event's line and where it is.
type Line struct {
	Pos  Pos
	Data []byte // without the newline
}

// Follower receives a sandbox's events as they are recorded
// (Journals.Follow).
type Follower struct {
	// C delivers the events. It is buffered; when a reader falls that far
	// behind, events are dropped and counted in Dropped rather than the
	// proxy waiting for it (a reader can list what it missed from its last
	// Pos on).
	C       chan Line
	dropped atomic.Int64
}

// followBuffer is how many events a Follower holds before dropping.
const followBuffer = 1024

func (f *Follower) send(l Line) {
	select {
	case f.C <- l:
	default:
		f.dropped.Add(1)
	}
}

// Dropped counts the events C could not take.
func (f *Follower) Dropped() int64 { return f.dropped.Load() }

// Follow returns a Follower of open sandbox's events from now on and a
// func that stops it; ok is false when sandbox is not open.
func (js *Journals) Follow(sandbox string) (f *Follower, stop func(), ok bool) {
	j := js.get(sandbox)
	if j == nil {
		return nil, nil, false
	}
	f = &Follower{C: make(chan Line, followBuffer)}
	j.mu.Lock()
	if j.gone {
		j.mu.Unlock()
		return nil, nil, false
	}
	j.subs[f] = struct{}{}
	j.mu.Unlock()
	return f, func() {
		j.mu.Lock()
		delete(j.subs, f)
		j.mu.Unlock()
	}, true
}
