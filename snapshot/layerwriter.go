package snapshot

import (
	"archive/tar"
	"bufio"
	"io"
	"time"
)

// layerWriter is the write side of a layer: tar → hash/count → compressor →
// hash/count → w, one streaming pass.
type layerWriter struct {
	comp   Compression
	bw     *bufio.Writer
	compHC *hashCounter
	enc    io.WriteCloser
	tarHC  *hashCounter
	tw     *tar.Writer
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
	lw.tw = tar.NewWriter(lw.tarHC)
	return lw, nil
}

// close finishes the stream (even after an error, to stop encoder
// goroutines) and returns the manifest's measured fields.
func (lw *layerWriter) close(err error, entries int64) (*Manifest, error) {
	if err == nil {
		err = lw.tw.Close()
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
