package snapshot

import (
	"archive/tar"
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"io"
	"runtime"
	"time"
)

// layerWriter is the write side of a layer: tar → count → compressor →
// hash/count → w, one streaming pass, with the tar's sha256 taken off the
// walk's goroutine:
//
//   - zstd: the walk only copies the tar into the compressor's 4 MiB
//     chunks; the workers encode them, and the sequencer, which writes the
//     frames in order, hashes each chunk (the tar) and each frame (the
//     object) as it goes;
//   - gzip and none: the walk hands the tar to a stage goroutine, which
//     hashes it and runs the (single-threaded) compressor.
//
// So on two cores the walk (file system calls, tar headers) overlaps with
// the hashing and the compression.
type layerWriter struct {
	comp    Compression
	bw      *bufio.Writer
	compHC  *hashCounter
	enc     io.WriteCloser
	tarHash hash.Hash    // fed by the sequencer (zstd) or the stage
	stage   *stageWriter // nil for zstd
	// tarN counts the tar bytes written so far, in the walk's goroutine
	// (for progress reports, and the manifest's size).
	tarN *countWriter
	tw   *tar.Writer
}

func newLayerWriter(w io.Writer, comp Compression, level int) (*layerWriter, error) {
	if comp == "" {
		comp = Zstd
	}
	lw := &layerWriter{comp: comp, bw: bufio.NewWriterSize(w, 1<<20), tarHash: sha256.New()}
	lw.compHC = newHashCounter(lw.bw)
	var tarIn io.Writer
	if comp == Zstd {
		if level == 0 {
			level = 1
		}
		z, err := newParallelZstd(lw.compHC, level, runtime.GOMAXPROCS(0), lw.tarHash)
		if err != nil {
			return nil, err
		}
		lw.enc, tarIn = z, z
	} else {
		enc, err := newCompressor(lw.compHC, comp, level)
		if err != nil {
			return nil, err
		}
		lw.enc = enc
		lw.stage = newStageWriter(io.MultiWriter(enc, lw.tarHash))
		tarIn = lw.stage
	}
	lw.tarN = &countWriter{w: tarIn}
	lw.tw = tar.NewWriter(lw.tarN)
	return lw, nil
}

// close finishes the stream (even after an error, to stop the stage and
// encoder goroutines) and returns the manifest's measured fields.
func (lw *layerWriter) close(err error, entries int64) (*Manifest, error) {
	if err == nil {
		err = lw.tw.Close()
	}
	if lw.stage != nil {
		if cerr := lw.stage.Close(); err == nil {
			err = cerr
		}
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
		TarDigest:     "sha256:" + hex.EncodeToString(lw.tarHash.Sum(nil)),
		TarSize:       lw.tarN.n,
		Entries:       entries,
		Created:       time.Now().UTC(),
	}, nil
}
