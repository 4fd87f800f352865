package snapshot

import (
	"errors"
	"io"
	"sync"
)

// Stage buffers: what the writer may run ahead of its stage.
const (
	stageChunk = 1 << 20
	stageDepth = 4
)

// stageWriter hands what is written to it to w in a goroutine of its own,
// in stageChunk pieces, at most stageDepth of them ahead: a pipeline
// stage. The writer's goroutine only copies; w's work (hashing,
// compressing) overlaps with the writer's. The first error of w is
// returned by the next Write and by Close. Close flushes, stops the
// goroutine and waits for it; it must be called, even after an error.
type stageWriter struct {
	buf  []byte
	full chan []byte
	free chan []byte
	done chan struct{}

	mu     sync.Mutex
	err    error
	closed bool
}

func newStageWriter(w io.Writer) *stageWriter {
	s := &stageWriter{
		full: make(chan []byte, stageDepth),
		free: make(chan []byte, stageDepth+1),
		done: make(chan struct{}),
	}
	for range stageDepth + 1 {
		s.free <- make([]byte, 0, stageChunk)
	}
	s.buf = <-s.free
	go s.run(w)
	return s
}

// run is the stage: it writes each chunk to w, in order, and recycles it.
// After an error it only recycles.
func (s *stageWriter) run(w io.Writer) {
	defer close(s.done)
	for b := range s.full {
		if s.failed() == nil {
			if _, err := w.Write(b); err != nil {
				s.mu.Lock()
				s.err = err
				s.mu.Unlock()
			}
		}
		s.free <- b[:0]
	}
}

func (s *stageWriter) failed() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Write implements io.Writer.
func (s *stageWriter) Write(p []byte) (int, error) {
	if s.closed {
		return 0, errors.New("write after close")
	}
	if err := s.failed(); err != nil {
		return 0, err
	}
	n := len(p)
	for len(p) > 0 {
		k := min(stageChunk-len(s.buf), len(p))
		s.buf = append(s.buf, p[:k]...)
		p = p[k:]
		if len(s.buf) == stageChunk {
			s.full <- s.buf
			s.buf = <-s.free
		}
	}
	return n, nil
}

// Close hands over what is buffered and waits for the stage to finish.
func (s *stageWriter) Close() error {
	if !s.closed {
		s.closed = true
		if len(s.buf) > 0 {
			s.full <- s.buf
		}
		close(s.full)
	}
	<-s.done
	return s.failed()
}
