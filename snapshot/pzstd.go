package snapshot

import (
	"errors"
	"hash"
	"io"
	"sync"

	"github.com/klauspost/compress/zstd"
)

// frameSize is the input compressed as one independent zstd frame. Frames
// are concatenated, which every zstd decoder reads as one stream.
const frameSize = 4 << 20

// parallelZstd compresses a stream with one encoder goroutine per core:
// input is cut into frameSize chunks, each encoded as its own frame by
// whichever worker is free, and a sequencer writes the frames in order.
// The encoders of klauspost/compress only overlap one block with the
// caller; this keeps every core busy. Close stops all its goroutines.
type parallelZstd struct {
	w       io.Writer
	raw     hash.Hash // when set, fed the input in order by the sequencer
	buf     []byte
	sent    bool
	jobs    chan zjob
	order   chan chan zresult
	free    chan []byte // input chunk buffers
	outFree chan []byte // frame buffers
	workers sync.WaitGroup
	seqDone chan struct{}
	mu      sync.Mutex
	err     error
	closed  bool
}

type zjob struct {
	src []byte
	res chan zresult
}

type zresult struct {
	out []byte
	src []byte
}

// newParallelZstd returns the compressor; raw, when not nil, is fed
// everything written, in order, by the sequencer goroutine (so that hashing
// the input costs its writer nothing).
func newParallelZstd(w io.Writer, level, workers int, raw hash.Hash) (*parallelZstd, error) {
	workers = max(workers, 1)
	z := &parallelZstd{
		w:       w,
		raw:     raw,
		jobs:    make(chan zjob),
		order:   make(chan chan zresult, 2*workers),
		free:    make(chan []byte, 2*workers+1),
		outFree: make(chan []byte, 2*workers+1),
		seqDone: make(chan struct{}),
	}
	encs := make([]*zstd.Encoder, workers)
	for i := range encs {
		enc, err := zstd.NewWriter(nil,
			zstd.WithEncoderLevel(zstd.EncoderLevelFromZstd(level)),
			zstd.WithEncoderConcurrency(1),
			zstd.WithWindowSize(frameSize),
			zstd.WithEncoderCRC(false), // the manifest's sha256 covers the bytes
			// Level 1 is for suspend latency: skipping Huffman coding of
			// literals costs ~2% in size on agent installs and saves ~17%
			// of the encoding time.
			zstd.WithNoEntropyCompression(level <= 1))
		if err != nil {
			return nil, err
		}
		encs[i] = enc
	}
	for _, enc := range encs {
		z.workers.Add(1)
		go z.encodeLoop(enc)
	}
	go z.sequence()
	z.buf = z.getBuf()
	return z, nil
}

func (z *parallelZstd) getBuf() []byte {
	select {
	case b := <-z.free:
		return b[:0]
	default:
		return make([]byte, 0, frameSize)
	}
}

func (z *parallelZstd) putBuf(b []byte) {
	if cap(b) < frameSize {
		return
	}
	select {
	case z.free <- b:
	default:
	}
}

// encodeLoop is a worker: it owns one encoder.
func (z *parallelZstd) encodeLoop(enc *zstd.Encoder) {
	defer z.workers.Done()
	defer enc.Close()
	for j := range z.jobs {
		var out []byte
		select {
		case out = <-z.outFree:
		default:
			out = make([]byte, 0, frameSize+frameSize/64+1<<16)
		}
		out = enc.EncodeAll(j.src, out[:0])
		j.res <- zresult{out: out, src: j.src}
	}
}

// sequence writes finished frames in submission order.
func (z *parallelZstd) sequence() {
	defer close(z.seqDone)
	for res := range z.order {
		r := <-res
		if z.raw != nil {
			z.raw.Write(r.src)
		}
		z.putBuf(r.src)
		if z.failed() != nil {
			continue
		}
		if _, err := z.w.Write(r.out); err != nil {
			z.setErr(err)
		}
		select {
		case z.outFree <- r.out:
		default:
		}
	}
}

func (z *parallelZstd) failed() error {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.err
}

func (z *parallelZstd) setErr(err error) {
	z.mu.Lock()
	defer z.mu.Unlock()
	if z.err == nil {
		z.err = err
	}
}

func (z *parallelZstd) submit() {
	res := make(chan zresult, 1)
	z.order <- res
	z.jobs <- zjob{src: z.buf, res: res}
	z.sent = true
	z.buf = z.getBuf()
}

// Write implements io.Writer.
func (z *parallelZstd) Write(p []byte) (int, error) {
	if z.closed {
		return 0, errors.New("zstd: write after close")
	}
	if err := z.failed(); err != nil {
		return 0, err
	}
	n := len(p)
	for len(p) > 0 {
		k := min(frameSize-len(z.buf), len(p))
		z.buf = append(z.buf, p[:k]...)
		p = p[k:]
		if len(z.buf) == frameSize {
			z.submit()
		}
	}
	return n, nil
}

// Close flushes the last frame and stops the goroutines.
func (z *parallelZstd) Close() error {
	if z.closed {
		return z.failed()
	}
	z.closed = true
	if len(z.buf) > 0 || !z.sent {
		z.submit() // an empty stream is still one (empty) frame
	}
	close(z.order)
	close(z.jobs)
	<-z.seqDone
	z.workers.Wait()
	return z.failed()
}
