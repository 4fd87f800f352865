package snapshot

import (
	"archive/tar"
	"bufio"
	"io"
	"time"
)

// layerWriter is the write side of a layer: tar → count → (stage) →
// hash/count → compressor → hash/count → w, one streaming pass. The walk
// that writes the tar runs in the caller's goroutine; the tar's sha256 and
// the compressor's input run in a stage goroutine of their own, so that on
// two cores the walk (file system calls, tar headers) and the hashing
// overlap, and the compressor's own workers (zstd) take what is left.
type layerWriter struct {
	comp   Compression
	bw     *bufio.Writer
	compHC *hashCounter
	enc    io.WriteCloser
	tarHC  *hashCounter
	stage  *stageWriter
	// tarN counts the tar bytes written so far, in the walk's goroutine
	// (for progress reports).
	tarN *countWriter
	tw   *tar.Writer
}

func newLayerWriter(w io.Writer, comp Compression, level int) (*layerWriter, error) {
	if comp == "" {
		comp = Zstd
	}
	lw := &layerWriter{comp: comp, bw: bufio.NewWriterSize(w, 1<<20)}
	lw.compHC = newHashCounter(lw.bw)
	enc, err := newCompressor(lw.compHC, comp, level)
	if err != nil {
		return nil, err
	}
	lw.enc = enc
	lw.tarHC = newHashCounter(enc)
	lw.stage = newStageWriter(lw.tarHC)
	lw.tarN = &countWriter{w: lw.stage}
	lw.tw = tar.NewWriter(lw.tarN)
	return lw, nil
}

// close finishes the stream (even after an error, to stop encoder
// goroutines) and returns the manifest's measured fields.
func (lw *layerWriter) close(err error, entries int64) (*Manifest, error) {
	if err == nil {
		err = lw.tw.Close()
	}
	if cerr := lw.stage.Close(); err == nil {
		err = cerr
	}
	if cerr := lw.enc.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = lw.bw.Flush()
	}
	if err != nil {
		return nil, err
	}
	return &Manifest{
		FormatVersion: FormatVersion,
		Compression:   lw.comp,
		Digest:        lw.compHC.digest(),
		Size:          lw.compHC.n,
		TarDigest:     lw.tarHC.digest(),
		TarSize:       lw.tarHC.n,
		Entries:       entries,
		Created:       time.Now().UTC(),
	}, nil
}
