package audit

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/klauspost/compress/zstd"
)

// A segment is a run of one sandbox's event lines, kept in the store as
// one object of zstd-compressed JSON lines (`zstdcat` reads it). Its name
// is the time of its first event and a random suffix, so names sort in
// the order the segments began, on any instance.
const segmentLayout = "20060102T150405.000000000Z"

var segmentName = regexp.MustCompile(`^[0-9]{8}T[0-9]{6}\.[0-9]{9}Z-[0-9a-f]{8}$`)

// newSegmentName names a segment beginning at t.
func newSegmentName(t time.Time) string {
	var rnd [4]byte
	rand.Read(rnd[:])
	return t.UTC().Format(segmentLayout) + "-" + hex.EncodeToString(rnd[:])
}

// CheckSegmentName reports whether name is a segment's name.
func CheckSegmentName(name string) error {
	if !segmentName.MatchString(name) {
		return fmt.Errorf("%q is not an audit segment name", name)
	}
	return nil
}

// segmentStart is when the segment of that name began (zero if the name
// is not a segment's).
func segmentStart(name string) time.Time {
	t, _ := time.Parse(segmentLayout, strings.SplitN(name, "-", 2)[0])
	return t
}

// maxSegmentBytes bounds a segment's lines when read back: far above what
// Journals write (JournalsConfig.SegmentBytes), so a damaged or hostile
// object cannot make a reader hold more.
const maxSegmentBytes = 64 << 20

var (
	segEncoder = sync.OnceValue(func() *zstd.Encoder {
		e, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(1), zstd.WithLowerEncoderMem(true))
		if err != nil {
			panic(err) // only for bad options
		}
		return e
	})
	segDecoder = sync.OnceValue(func() *zstd.Decoder {
		d, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(maxSegmentBytes))
		if err != nil {
			panic(err)
		}
		return d
	})
)

// EncodeSegment compresses a segment's lines for the store.
func EncodeSegment(lines []byte) []byte { return segEncoder().EncodeAll(lines, nil) }

// DecodeSegment decompresses a stored segment into its lines.
func DecodeSegment(data []byte) ([]byte, error) {
	b, err := segDecoder().DecodeAll(data, nil)
	if err != nil {
		return nil, fmt.Errorf("audit segment: %w", err)
	}
	return b, nil
}

// Pos is where an event is: its segment and its index there (from 0).
// Positions order events: by segment name, then index.
type Pos struct {
	Segment string
	Index   int
}

// IsZero reports whether p names no event (before the first).
func (p Pos) IsZero() bool { return p.Segment == "" }

// Before reports whether p comes before q.
func (p Pos) Before(q Pos) bool {
	if p.Segment != q.Segment {
		return p.Segment < q.Segment
	}
	return p.Index < q.Index
}

// String is p as a cursor: "<segment>/<index>"; "" for the zero Pos.
func (p Pos) String() string {
	if p.IsZero() {
		return ""
	}
	return p.Segment + "/" + strconv.Itoa(p.Index)
}

// ErrBadCursor reports a cursor that is not one a page returned.
var ErrBadCursor = errors.New("bad audit cursor")

// ParseCursor reads a cursor (Pos.String); "" is the zero Pos.
func ParseCursor(s string) (Pos, error) {
	if s == "" {
		return Pos{}, nil
	}
	name, idx, ok := strings.Cut(s, "/")
	n, err := strconv.Atoi(idx)
	if !ok || err != nil || n < 0 || n > maxSegmentBytes || CheckSegmentName(name) != nil || strconv.Itoa(n) != idx {
		return Pos{}, fmt.Errorf("%w %q: pass the cursor a page of events returned, as it is", ErrBadCursor, truncateQ(s))
	}
	return Pos{Segment: name, Index: n}, nil
}

func truncateQ(s string) string { return Truncate(s, 80) }
