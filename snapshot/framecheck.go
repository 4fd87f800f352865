package snapshot

import "encoding/binary"

// zstdFrames walks the frame and block headers of a zstd stream as it is
// written to it (a tee of what the decoder reads), without decoding, to
// learn whether every frame carried a content checksum: the decoder
// verifies a checksum when a frame has one, and is silent when it has none.
// It never fails; on bytes that are not zstd it stops counting (the
// decoder, not this, refuses a broken stream).
type zstdFrames struct {
	frames      int  // data frames seen to their end
	checksummed int  // of which carried a checksum
	stopped     bool // stopped walking: not zstd, or trailing bytes
	hdr         [18]byte
	have, want  int   // header bytes collected, needed
	skip        int64 // bytes to pass over before the next header
	state       frameState
	checksum    bool // the current frame's flag
	last        bool // the current block is its frame's last
}

type frameState int

const (
	stMagic      frameState = iota // want 4 bytes of magic
	stFHD                          // want the frame header descriptor
	stFrameRest                    // want the rest of the frame header
	stBlock                        // want a 3-byte block header
	stSkippable                    // want a skippable frame's 4-byte size
	stAfterBlock                   // block content passed
)

// Write implements io.Writer for io.TeeReader.
func (z *zstdFrames) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 && !z.stopped {
		if z.skip > 0 {
			k := min(int64(len(p)), z.skip)
			z.skip -= k
			p = p[k:]
			if z.skip == 0 {
				z.afterSkip()
			}
			continue
		}
		if z.want == 0 {
			z.expect()
		}
		k := copy(z.hdr[z.have:z.want], p)
		z.have += k
		p = p[k:]
		if z.have == z.want {
			z.header()
		}
	}
	return n, nil
}

// expect sets how many header bytes the current state needs.
func (z *zstdFrames) expect() {
	z.have = 0
	switch z.state {
	case stMagic, stSkippable:
		z.want = 4
	case stFHD:
		z.want = 1
	case stBlock:
		z.want = 3
	}
}

// header consumes a complete header of the current state.
func (z *zstdFrames) header() {
	z.want = 0
	switch z.state {
	case stMagic:
		m := binary.LittleEndian.Uint32(z.hdr[:4])
		switch {
		case m == 0xFD2FB528:
			z.state = stFHD
		case m&0xFFFFFFF0 == 0x184D2A50:
			z.state = stSkippable
		default:
			z.stopped = true // not zstd, or bytes after the stream
		}
	case stSkippable:
		z.skip = int64(binary.LittleEndian.Uint32(z.hdr[:4]))
		z.state = stMagic
		if z.skip == 0 {
			z.afterSkip()
		}
	case stFHD:
		fhd := z.hdr[0]
		single := fhd&(1<<5) != 0
		z.checksum = fhd&(1<<2) != 0
		if fhd&(1<<3) != 0 { // reserved bit
			z.stopped = true
			return
		}
		rest := []int64{0, 1, 2, 4}[fhd&3] // dictionary id
		if !single {
			rest++ // window descriptor
		}
		switch fhd >> 6 { // frame content size
		case 0:
			if single {
				rest++
			}
		case 1:
			rest += 2
		case 2:
			rest += 4
		case 3:
			rest += 8
		}
		z.state = stBlock
		z.skip = rest // then the first block header
	case stBlock:
		b := uint32(z.hdr[0]) | uint32(z.hdr[1])<<8 | uint32(z.hdr[2])<<16
		z.last = b&1 != 0
		typ, size := (b>>1)&3, int64(b>>3)
		switch typ {
		case 1: // RLE: one byte stands for size bytes
			size = 1
		case 3:
			z.stopped = true
			return
		}
		z.state = stAfterBlock
		z.skip = size
		if size == 0 {
			z.afterSkip()
		}
	}
}

// afterSkip moves on once the bytes of a header's tail, a block or a
// skippable frame have passed.
func (z *zstdFrames) afterSkip() {
	if z.state != stAfterBlock {
		return // a header's tail (state already stBlock) or a skippable frame (stMagic)
	}
	if !z.last {
		z.state = stBlock
		return
	}
	z.frames++
	z.state = stMagic
	if z.checksum {
		z.checksummed++
		z.skip = 4 // the checksum itself
	}
}

// all reports whether the stream held at least one frame and every frame
// carried a checksum.
func (z *zstdFrames) all() bool {
	return z.frames > 0 && z.checksummed == z.frames && z.state == stMagic && z.skip == 0
}

// streamChecksum names the check a compressed stream carried itself (see
// ApplyResult.StreamChecksum).
func streamChecksum(c Compression, z *zstdFrames) string {
	switch {
	case c == Gzip:
		return "crc32"
	case c == Zstd && z.all():
		return "xxhash64"
	}
	return ""
}
