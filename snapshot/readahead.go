package snapshot

import (
	"io"
	"sync"
)

// readAhead reads r in its own goroutine, up to depth chunks ahead of the
// consumer, so that decompressing and hashing a layer overlap with the
// file system calls that apply it. It owns that goroutine: close stops it
// and waits for it (at most one read of r).
type readAhead struct {
	full   chan raChunk
	free   chan []byte
	stop   chan struct{}
	wg     sync.WaitGroup
	once   sync.Once
	curBuf []byte // the buffer cur points into
	cur    []byte
	err    error
}

type raChunk struct {
	b   []byte
	err error
}

func newReadAhead(r io.Reader, chunk, depth int) *readAhead {
	ra := &readAhead{
		full: make(chan raChunk, depth),
		free: make(chan []byte, depth+1), // room for every buffer: returning one never blocks
		stop: make(chan struct{}),
	}
	for range depth + 1 {
		ra.free <- make([]byte, chunk)
	}
	ra.wg.Add(1)
	go ra.fill(r)
	return ra
}

// fill is the reading goroutine; it returns after the first error or EOF.
func (ra *readAhead) fill(r io.Reader) {
	defer ra.wg.Done()
	for {
		var b []byte
		select {
		case b = <-ra.free:
		case <-ra.stop:
			return
		}
		n, err := fillBuf(r, b)
		select {
		case ra.full <- raChunk{b[:n], err}:
		case <-ra.stop:
			return
		}
		if err != nil {
			return
		}
	}
}

// Read implements io.Reader for the one consuming goroutine.
func (ra *readAhead) Read(p []byte) (int, error) {
	for len(ra.cur) == 0 {
		if ra.curBuf != nil {
			ra.free <- ra.curBuf
			ra.curBuf = nil
		}
		if ra.err != nil {
			return 0, ra.err
		}
		c := <-ra.full
		ra.curBuf, ra.cur, ra.err = c.b[:cap(c.b)], c.b, c.err
	}
	n := copy(p, ra.cur)
	ra.cur = ra.cur[n:]
	return n, nil
}

func (ra *readAhead) close() {
	ra.once.Do(func() { close(ra.stop) })
	ra.wg.Wait()
}

// fillBuf reads into b until it is full or r fails; r's error (io.EOF
// included) is returned as is.
func fillBuf(r io.Reader, b []byte) (int, error) {
	n, empty := 0, 0
	for n < len(b) {
		k, err := r.Read(b[n:])
		n += k
		if err != nil {
			return n, err
		}
		if k > 0 {
			empty = 0
		} else if empty++; empty >= 100 {
			return n, io.ErrNoProgress
		}
	}
	return n, nil
}
