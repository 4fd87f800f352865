package audit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Query selects a sandbox's events: those of a time range, a decision and
// a host, a page at a time, oldest first. The zero Query is every event,
// the first DefaultLimit of them.
type Query struct {
	// Since (inclusive) and Until (exclusive) bound the events' times;
	// zero is unbounded.
	Since, Until time.Time
	// Decision is "allow", "deny", or "" for both.
	Decision string
	// Host is a destination host (any case), or "*.example.com" for its
	// subdomains, or "" for every host.
	Host string
	// After resumes a listing after this event (a page's Next).
	After Pos
	// Limit caps the events of a page: 0 means DefaultLimit, at most
	// MaxLimit.
	Limit int
}

// Page limits.
const (
	DefaultLimit = 1000
	MaxLimit     = 10000
)

// ErrBadQuery reports a Query that cannot be answered; its message names
// the field.
var ErrBadQuery = errors.New("bad audit query")

// Check reports what is wrong with q, naming the field.
func (q Query) Check() error {
	switch {
	case q.Decision != "" && q.Decision != "allow" && q.Decision != "deny":
		return fmt.Errorf("%w: decision %q: want allow or deny", ErrBadQuery, truncateQ(q.Decision))
	case q.Limit < 0 || q.Limit > MaxLimit:
		return fmt.Errorf("%w: limit %d: want 1 to %d", ErrBadQuery, q.Limit, MaxLimit)
	case !q.Since.IsZero() && !q.Until.IsZero() && !q.Until.After(q.Since):
		return fmt.Errorf("%w: until (%s) must be after since (%s)", ErrBadQuery, q.Until.Format(time.RFC3339), q.Since.Format(time.RFC3339))
	case len(q.Host) > 255 || strings.ContainsAny(q.Host, " \t\r\n/"):
		return fmt.Errorf("%w: host %q: want a host name, or *.domain", ErrBadQuery, truncateQ(q.Host))
	}
	return nil
}

func (q Query) limit() int {
	if q.Limit == 0 {
		return DefaultLimit
	}
	return q.Limit
}

// Match reports whether the event of line is selected by q's time range,
// decision and host (not by After or Limit). A line that cannot be read
// is not.
func (q Query) Match(line []byte) bool {
	k, err := readKeys(line)
	if err != nil {
		return false
	}
	return q.matchKeys(k)
}

func (q Query) matchKeys(k lineKeys) bool {
	if !q.Since.IsZero() && k.Time.Before(q.Since) || !q.Until.IsZero() && !k.Time.Before(q.Until) {
		return false
	}
	if q.Decision != "" && k.Decision != q.Decision {
		return false
	}
	if q.Host != "" {
		h := strings.ToLower(strings.TrimSuffix(k.Host, "."))
		want := strings.ToLower(strings.TrimSuffix(q.Host, "."))
		if suffix, ok := strings.CutPrefix(want, "*."); ok {
			return strings.HasSuffix(h, "."+suffix)
		}
		return h == want
	}
	return true
}

// Segment is one segment of a sandbox's events as a listing sees it.
type Segment struct {
	Name string
	// Modified is when its last version was stored; zero for one held in
	// memory (it may be newer than the store's).
	Modified time.Time
	// Lines returns its lines (JSON lines, each ending in "\n").
	Lines func(ctx context.Context) ([]byte, error)
}

// Page is one page of a listing.
type Page struct {
	// Lines are the selected events' lines, without their newlines.
	Lines [][]byte
	// Next is the position of the last event looked at: a Query with After
	// set to it lists what comes next (or, later, what came since).
	Next Pos
	// More says the page was cut at its limit: there may be more now.
	More bool
}

// skew is how far an event's time may lie outside its segment's bounds
// (its name's time, its last write) and still be found: the time is taken
// before the event is added.
const skew = time.Minute

// Select pages through segs by q: segments are read in name order (one
// named twice is read once, the first given: pass those held in memory
// first), those wholly outside q's time range not at all.
func Select(ctx context.Context, segs []Segment, q Query) (Page, error) {
	if err := q.Check(); err != nil {
		return Page{}, err
	}
	slices.SortStableFunc(segs, func(a, b Segment) int { return strings.Compare(a.Name, b.Name) })
	segs = slices.CompactFunc(segs, func(a, b Segment) bool { return a.Name == b.Name })
	page := Page{Next: q.After}
	limit := q.limit()
	for _, s := range segs {
		if !q.After.IsZero() && s.Name < q.After.Segment {
			continue
		}
		if !q.Until.IsZero() && segmentStart(s.Name).After(q.Until.Add(skew)) {
			break // every later segment began later still
		}
		if !q.Since.IsZero() && !s.Modified.IsZero() && s.Modified.Before(q.Since.Add(-skew)) {
			continue
		}
		data, err := s.Lines(ctx)
		if err != nil {
			return page, fmt.Errorf("audit segment %s: %w", s.Name, err)
		}
		for i := 0; len(data) > 0; i++ {
			line := data
			if n := bytes.IndexByte(data, '\n'); n >= 0 {
				line, data = data[:n], data[n+1:]
			} else {
				data = nil
			}
			pos := Pos{Segment: s.Name, Index: i}
			if !q.After.IsZero() && !q.After.Before(pos) {
				continue
			}
			if len(page.Lines) == limit {
				page.More = true
				return page, nil
			}
			page.Next = pos
			if q.Match(line) {
				page.Lines = append(page.Lines, line)
			}
		}
	}
	return page, nil
}
