package snapshot

import (
	"bytes"
	"errors"
	"testing"
)

// A stage writes everything, in order, by the time Close returns.
func TestStageWriterKeepsOrder(t *testing.T) {
	var out bytes.Buffer
	s := newStageWriter(&out)
	var want bytes.Buffer
	for i := range 3000 {
		p := bytes.Repeat([]byte{byte(i)}, i%5000)
		want.Write(p)
		if _, err := s.Write(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), want.Bytes()) {
		t.Fatalf("wrote %d bytes, want %d, in order", out.Len(), want.Len())
	}
}

type failAfter struct{ n int }

func (f *failAfter) Write(p []byte) (int, error) {
	if f.n -= len(p); f.n < 0 {
		return 0, errors.New("disk full")
	}
	return len(p), nil
}

// The stage's error reaches the writer (a later Write, or Close), and the
// stage goroutine ends.
func TestStageWriterReportsErrors(t *testing.T) {
	s := newStageWriter(&failAfter{n: 3 * stageChunk})
	chunk := make([]byte, stageChunk)
	var err error
	for range 100 {
		if _, err = s.Write(chunk); err != nil {
			break
		}
	}
	if cerr := s.Close(); cerr == nil || err != nil && err.Error() != "disk full" {
		t.Fatalf("Write: %v, Close: %v; want disk full", err, cerr)
	}
	if _, err := s.Write(chunk); err == nil {
		t.Fatal("Write after Close succeeded")
	}
}
