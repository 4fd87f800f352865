package audit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// memWriter is a SegmentWriter over a map: the store of these tests (the
// store-backed one is appliance's, tested there over a real store).
type memWriter struct {
	mu     sync.Mutex
	segs   map[string][]byte // sandbox/name → lines
	fail   error
	writes int
	gate   chan struct{} // when set, each write waits for it
}

func (w *memWriter) WriteSegment(ctx context.Context, sandbox, name string, data []byte) error {
	if w.gate != nil {
		select {
		case <-w.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fail != nil {
		return w.fail
	}
	lines, err := DecodeSegment(data)
	if err != nil {
		return err
	}
	if w.segs == nil {
		w.segs = map[string][]byte{}
	}
	w.segs[sandbox+"/"+name] = lines
	w.writes++
	return nil
}

// stored returns the sandbox's stored segments as a listing sees them.
func (w *memWriter) stored(sandbox string) []Segment {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []Segment
	for k, v := range w.segs {
		if name, ok := strings.CutPrefix(k, sandbox+"/"); ok {
			out = append(out, Segment{Name: name, Modified: time.Now(), Lines: func(context.Context) ([]byte, error) { return v, nil }})
		}
	}
	return out
}

func (w *memWriter) set(err error) {
	w.mu.Lock()
	w.fail = err
	w.mu.Unlock()
}

func newJournals(t *testing.T, w SegmentWriter, segBytes int) *Journals {
	t.Helper()
	js, err := NewJournals(JournalsConfig{Writer: w, SegmentBytes: segBytes, FlushEvery: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { js.Close(context.Background()) })
	return js
}

// list pages through everything of sandbox, held and stored, as the
// service lists it: held segments first.
func list(t *testing.T, js *Journals, w *memWriter, sandbox string, q Query) []string {
	t.Helper()
	var paths []string
	for range 1000 {
		p, err := Select(context.Background(), append(js.Held(sandbox), w.stored(sandbox)...), q)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range p.Lines {
			var e Event
			if err := e.UnmarshalJSON(l); err != nil {
				t.Fatal(err)
			}
			paths = append(paths, e.Path)
		}
		if !p.More {
			return paths
		}
		q.After = p.Next
	}
	t.Fatal("listing never ended")
	return nil
}

func numbered(n int) []string {
	var s []string
	for i := range n {
		s = append(s, fmt.Sprint(i))
	}
	return s
}

// Events go to segments, full ones to the store at once; a listing pages
// through held and stored ones alike, in order, and Seal leaves
// everything in the store and nothing in memory.
func TestJournalsSegmentsAndSeal(t *testing.T) {
	w := &memWriter{}
	js := newJournals(t, w, 1024)
	js.Open("a")
	for i := range 50 {
		js.Record(Event{Sandbox: "a", Kind: Route, Path: fmt.Sprint(i), Allow: i%2 == 0})
		js.write(context.Background(), js.get("a"), false) // as the loop does, in step
	}
	js.Record(Event{Sandbox: "never-opened", Path: "x"})
	if got := list(t, js, w, "a", Query{Limit: 7}); !slices.Equal(got, numbered(50)) {
		t.Errorf("listed %v", got)
	}
	if got := list(t, js, w, "never-opened", Query{}); len(got) != 0 {
		t.Errorf("a sandbox never opened kept %v", got)
	}
	if err := js.Seal(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	if n := js.HeldBytes("a"); n != 0 || js.Held("a") != nil {
		t.Errorf("after Seal %d bytes are held", n)
	}
	if got := list(t, js, w, "a", Query{}); !slices.Equal(got, numbered(50)) {
		t.Errorf("after Seal the store has %v", got)
	}
	if got := list(t, js, w, "a", Query{Decision: "deny", Limit: 3}); len(got) != 25 || got[0] != "1" {
		t.Errorf("denials: %v", got)
	}
	js.Record(Event{Sandbox: "a", Path: "late"})
	if got := list(t, js, w, "a", Query{}); len(got) != 50 {
		t.Errorf("an event after Seal was kept: %v", got)
	}
	js.Open("a") // resumed
	js.Record(Event{Sandbox: "a", Path: "50"})
	if got := list(t, js, w, "a", Query{}); !slices.Equal(got, numbered(51)) {
		t.Errorf("after a resume: %v", got)
	}
}

// What a store that does not take writes costs: at most MaxSegments
// segments held, the rest dropped and counted, and all is well again once
// it takes them.
func TestJournalsMemoryIsBounded(t *testing.T) {
	w := &memWriter{}
	w.set(errors.New("store down"))
	js := newJournals(t, w, 4096)
	js.Open("a")
	for i := range 5000 {
		js.Record(Event{Sandbox: "a", Kind: Connect, Path: fmt.Sprint(i), Reason: strings.Repeat("r", 100)})
		if n := js.HeldBytes("a"); n > 3*(4096+400) {
			t.Fatalf("after %d events %d bytes are held", i, n)
		}
	}
	w.set(nil)
	if err := js.Seal(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	got := list(t, js, w, "a", Query{Limit: MaxLimit})
	if len(got) == 0 || len(got) >= 5000 || got[len(got)-1] != "4999" {
		t.Errorf("kept %d events, the last %v; want the newest, some dropped", len(got), got[len(got)-1:])
	}
}

// Forget writes nothing more, even when a write was under way.
func TestJournalsForget(t *testing.T) {
	w := &memWriter{gate: make(chan struct{})}
	js := newJournals(t, w, 256)
	js.Open("a")
	for i := range 20 {
		js.Record(Event{Sandbox: "a", Path: fmt.Sprint(i)}) // seals, and the loop's write waits at the gate
	}
	forgotten := make(chan struct{})
	go func() { js.Forget("a"); close(forgotten) }()
	close(w.gate)
	<-forgotten
	w.mu.Lock()
	before := w.writes
	w.mu.Unlock()
	js.Record(Event{Sandbox: "a", Path: "after"})
	if err := js.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.writes != before {
		t.Errorf("%d writes after Forget", w.writes-before)
	}
}

// A follower gets each line with its position, which a listing resumes
// from.
func TestJournalsFollow(t *testing.T) {
	w := &memWriter{}
	js := newJournals(t, w, 1<<20)
	if _, _, ok := js.Follow("a"); ok {
		t.Fatal("followed a sandbox not open")
	}
	js.Open("a")
	js.Record(Event{Sandbox: "a", Path: "0"})
	f, stop, ok := js.Follow("a")
	if !ok {
		t.Fatal("cannot follow")
	}
	defer stop()
	js.Record(Event{Sandbox: "a", Path: "1"})
	js.Record(Event{Sandbox: "b", Path: "other"})
	l := <-f.C
	var e Event
	if err := e.UnmarshalJSON(l.Data); err != nil || e.Path != "1" || l.Pos.Index != 1 {
		t.Fatalf("followed %s at %v (%v)", l.Data, l.Pos, err)
	}
	p, err := Select(context.Background(), js.Held("a"), Query{After: Pos{Segment: l.Pos.Segment, Index: 0}})
	if err != nil || len(p.Lines) != 1 || string(p.Lines[0]) != string(l.Data) || p.Next != l.Pos {
		t.Errorf("listing after the first event: %q next %v (%v)", p.Lines, p.Next, err)
	}
}

// The log gets the same bytes the store does.
func TestJournalsLogSameBytes(t *testing.T) {
	var log lockedBuffer
	w := &memWriter{}
	js, err := NewJournals(JournalsConfig{Writer: w, Log: NewJSONLines(&log), FlushEvery: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	js.Open("a")
	for _, e := range goldenEvents() {
		e.Sandbox = "a"
		js.Record(e)
	}
	js.Record(Event{Sandbox: "not-open", Time: time.Unix(5, 0), Path: "/x"})
	if err := js.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	var stored []byte
	for _, s := range w.stored("a") {
		b, _ := s.Lines(context.Background())
		stored = append(stored, b...)
	}
	want := string(stored) + string(AppendJSON(nil, &Event{Sandbox: "not-open", Time: time.Unix(5, 0), Path: "/x"}))
	if log.String() != want {
		t.Errorf("log:\n%s\nstore (and the other sandbox's):\n%s", log.String(), want)
	}
}

func TestQueryFilters(t *testing.T) {
	at := time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
	var lines []byte
	for i, h := range []string{"api.example.com", "registry.npmjs.org", "evil.example.com", "API.Example.com"} {
		lines = AppendJSON(lines, &Event{Time: at.Add(time.Duration(i) * time.Hour), Host: h, Allow: i != 2, Path: fmt.Sprint(i)})
	}
	segs := []Segment{{Name: newSegmentName(at), Lines: func(context.Context) ([]byte, error) { return lines, nil }}}
	for _, c := range []struct {
		q    Query
		want string
	}{
		{Query{}, "0 1 2 3"},
		{Query{Host: "api.example.com"}, "0 3"},
		{Query{Host: "*.example.com"}, "0 2 3"},
		{Query{Decision: "deny"}, "2"},
		{Query{Since: at.Add(time.Hour), Until: at.Add(3 * time.Hour)}, "1 2"},
	} {
		p, err := Select(context.Background(), segs, c.q)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, l := range p.Lines {
			var e Event
			e.UnmarshalJSON(l)
			got = append(got, e.Path)
		}
		if strings.Join(got, " ") != c.want {
			t.Errorf("%+v: got %v, want %s", c.q, got, c.want)
		}
	}
	for _, bad := range []Query{{Decision: "maybe"}, {Limit: MaxLimit + 1}, {Since: at, Until: at}, {Host: "a b"}} {
		if _, err := Select(context.Background(), segs, bad); !errors.Is(err, ErrBadQuery) {
			t.Errorf("%+v: %v, want ErrBadQuery", bad, err)
		}
	}
}

func FuzzParseCursor(f *testing.F) {
	f.Add("20250601T120000.000000000Z-0a1b2c3d/17")
	f.Add("")
	f.Add("x/1")
	f.Add("20250601T120000.000000000Z-0a1b2c3d/-1")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParseCursor(s)
		if err != nil {
			return
		}
		if p.String() != s {
			t.Errorf("%q parsed as %+v, which prints as %q", s, p, p.String())
		}
	})
}

// Release writes what is held off the caller's path; a listing finds the
// events meanwhile, and memory is freed once they are written.
func TestJournalsRelease(t *testing.T) {
	w := &memWriter{gate: make(chan struct{})}
	js := newJournals(t, w, 1<<20)
	js.Open("a")
	for i := range 10 {
		js.Record(Event{Sandbox: "a", Path: fmt.Sprint(i)})
	}
	js.Release("a") // the write waits at the gate
	if got := list(t, js, w, "a", Query{}); !slices.Equal(got, numbered(10)) {
		t.Errorf("while it is written: %v", got)
	}
	js.Record(Event{Sandbox: "a", Path: "late"}) // kept, since not yet written
	close(w.gate)
	for deadline := time.Now().Add(time.Minute); js.HeldBytes("a") != 0 || js.get("a") != nil; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a minute after Release %d bytes are held", js.HeldBytes("a"))
		}
	}
	if got := list(t, js, w, "a", Query{}); len(got) != 11 {
		t.Errorf("in the store: %v", got)
	}
}

// A segment being filled that the periodic write already stored whole
// (a sandbox idle before its suspend) is let go by Seal and by Release
// too: nothing stays held of a suspended sandbox.
func TestJournalsSealAfterWholeWrite(t *testing.T) {
	for _, release := range []bool{false, true} {
		t.Run(fmt.Sprintf("release=%v", release), func(t *testing.T) {
			w := &memWriter{}
			js := newJournals(t, w, 1<<20)
			js.Open("a")
			for i := range 3 {
				js.Record(Event{Sandbox: "a", Path: fmt.Sprint(i)})
			}
			if err := js.write(context.Background(), js.get("a"), true); err != nil { // the periodic write
				t.Fatal(err)
			}
			if release {
				js.Release("a")
				for deadline := time.Now().Add(30 * time.Second); js.HeldBytes("a") != 0 || js.get("a") != nil; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatalf("30 s after Release %d bytes are held", js.HeldBytes("a"))
					}
				}
			} else {
				if err := js.Seal(context.Background(), "a"); err != nil {
					t.Fatal(err)
				}
				if n := js.HeldBytes("a"); n != 0 || js.get("a") != nil {
					t.Errorf("after Seal %d bytes are held", n)
				}
			}
			if got := list(t, js, w, "a", Query{}); !slices.Equal(got, numbered(3)) {
				t.Errorf("in the store: %v", got)
			}
		})
	}
}
