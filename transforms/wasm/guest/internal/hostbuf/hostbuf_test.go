package hostbuf

import (
	"slices"
	"testing"
	"unsafe"
)

func TestSplit(t *testing.T) {
	tests := []struct {
		in    string
		count uint32
		want  []string
	}{
		{"", 0, nil},
		{"accept\x00", 1, []string{"accept"}},
		{"content-type\x00content-length\x00", 2, []string{"content-type", "content-length"}},
		{"a\x00\x00", 2, []string{"a", ""}},
		{"\x00", 1, []string{""}},
		{"a\x00b", 2, []string{"a", "b"}}, // separated, not terminated
		{"a\x00b\x00", 1, []string{"a"}},  // count wins over extra bytes
		{"a\x00", 3, []string{"a", ""}},   // a short buffer ends the list
	}
	for _, tt := range tests {
		if got := Split([]byte(tt.in), tt.count); !slices.Equal(got, tt.want) {
			t.Errorf("Split(%q, %d) = %q, want %q", tt.in, tt.count, got, tt.want)
		}
	}
}

// fakeValue answers like an http-wasm host function: it writes v only if
// it fits in limit and always returns its length.
func fakeValue(v string, calls *int) func(unsafe.Pointer, uint32) uint32 {
	return func(buf unsafe.Pointer, limit uint32) uint32 {
		*calls++
		if uint32(len(v)) <= limit {
			copy(unsafe.Slice((*byte)(buf), limit), v)
		}
		return uint32(len(v))
	}
}

func TestGetRetriesWithReportedLength(t *testing.T) {
	for _, size := range []int{0, 1, scratchSize, scratchSize + 1, 5 * scratchSize} {
		v := string(make([]byte, size))
		calls := 0
		got := Get("test", fakeValue(v, &calls))
		if string(got) != v {
			t.Errorf("size %d: got %d bytes back", size, len(got))
		}
		want := 1
		if size > scratchSize {
			want = 2
		}
		if calls != want {
			t.Errorf("size %d: %d host calls, want %d", size, calls, want)
		}
	}
}

func TestGetListRetries(t *testing.T) {
	long := string(slices.Repeat([]byte("x"), scratchSize))
	enc := long + "\x00b\x00"
	calls := 0
	got := GetList("test", func(buf unsafe.Pointer, limit uint32) uint64 {
		calls++
		if uint32(len(enc)) <= limit {
			copy(unsafe.Slice((*byte)(buf), limit), enc)
		}
		return 2<<32 | uint64(len(enc))
	})
	if !slices.Equal(got, []string{long, "b"}) || calls != 2 {
		t.Errorf("got %d values after %d calls, want 2 values after 2 calls", len(got), calls)
	}
}

func TestGetPanicsOnAHostThatNeverSettles(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("no panic from a host reporting an ever longer value")
		}
	}()
	n := uint32(scratchSize)
	Get("growing", func(unsafe.Pointer, uint32) uint32 { n *= 2; return n })
}
