package snapshot

import (
	"bytes"
	"io"
	"strconv"
	"strings"
)

// sparseFilter passes a tar stream through unchanged but for one byte: in
// the extended header (PAX 'x') that makes the next entry a sparse file of
// format 1.0, the "1" of GNU.sparse.major=1 becomes sparseMarker, so that
// archive/tar reads that entry's stored bytes as they are (see sparse.go).
//
// To find those headers it follows the stream's blocks as archive/tar
// does: a header block; then its data, whose size is the header's or, for
// an entry, the "size" record of the extended header before it, none for
// the types archive/tar gives no data (links, directories, devices,
// fifos). Anything it does not read exactly as archive/tar does — a bad
// checksum, a size archive/tar would refuse, an extended header it cannot
// parse, an old V7 regular file (whose data archive/tar decides by its
// name), GNU's old sparse headers, the end of the archive — ends the
// filtering: the rest passes untouched, so a sparse entry after it keeps
// GNU.sparse.major=1 and is refused (sparseOf). It never changes a byte
// archive/tar reads as anything but that record's value.
type sparseFilter struct {
	r    io.Reader
	out  []byte // read and passed on, not yet returned
	hdr  [blockSize]byte
	data int64 // bytes of the current entry's data (padded) left to pass
	// size is the "size" record of the last extended header, -1 none.
	size int64
	done bool // passing the rest untouched
}

func newSparseFilter(r io.Reader) *sparseFilter { return &sparseFilter{r: r, size: -1} }

// maxPAXHeader is archive/tar's bound on an extended header's data.
const maxPAXHeader = 1 << 20

func (f *sparseFilter) Read(p []byte) (int, error) {
	for {
		if len(f.out) > 0 {
			n := copy(p, f.out)
			f.out = f.out[n:]
			return n, nil
		}
		if f.done {
			return f.r.Read(p)
		}
		if f.data > 0 {
			n, err := f.r.Read(p[:min(int64(len(p)), f.data)])
			f.data -= int64(n)
			return n, err
		}
		if err := f.next(); err != nil {
			if len(f.out) > 0 {
				continue // what was read before the error goes first
			}
			return 0, err
		}
	}
}

// next reads a header block (and an extended header's data) into out and
// decides what follows.
func (f *sparseFilter) next() error {
	n, err := io.ReadFull(f.r, f.hdr[:])
	f.out = f.hdr[:n]
	if err != nil {
		f.done = true
		return err
	}
	h := f.hdr[:]
	if !checksumOK(h) {
		f.done = true // archive/tar refuses it, or it is the end of the archive
		return nil
	}
	size, ok := numeric(h[124:136])
	if !ok {
		f.done = true
		return nil
	}
	switch typ := h[156]; typ {
	case 'x':
		if size > maxPAXHeader {
			f.done = true
			return nil
		}
		padded := (size + blockSize - 1) / blockSize * blockSize
		buf := make([]byte, blockSize+padded)
		copy(buf, h)
		n, err := io.ReadFull(f.r, buf[blockSize:])
		f.out = buf[:blockSize+n]
		if err != nil {
			f.done = true
			return err
		}
		f.size, ok = f.extended(buf[blockSize : blockSize+size])
		if !ok {
			f.done = true
		}
	case 'g', 'L', 'K':
		f.data = padTo(size)
		if typ == 'g' {
			f.size = -1 // archive/tar forgets an extended header before a global one
		}
	case 'S', 0:
		f.done = true
	default:
		if f.size >= 0 {
			size = f.size
		}
		f.size = -1
		switch typ {
		case '1', '2', '3', '4', '5', '6':
			size = 0 // archive/tar reads no data for these, whatever the size says
		}
		f.data = padTo(size)
	}
	return nil
}

// extended parses an extended header's records as archive/tar does,
// marks the major version of a sparse 1.0 entry (in data, in place), and
// returns the "size" record (-1: none). ok is false where archive/tar
// would refuse the records, or read their size otherwise.
func (f *sparseFilter) extended(data []byte) (size int64, ok bool) {
	size = -1
	major, minor := -1, ""
	for off := 0; off < len(data); {
		rest := data[off:]
		sp := bytes.IndexByte(rest, ' ')
		if sp <= 0 {
			return 0, false
		}
		n, err := strconv.ParseInt(string(rest[:sp]), 10, 0)
		if err != nil || n < 5 || n > int64(len(rest)) || n <= int64(sp+1) || rest[n-1] != '\n' {
			return 0, false
		}
		rec := rest[sp+1 : n-1]
		eq := bytes.IndexByte(rec, '=')
		if eq <= 0 {
			return 0, false
		}
		k, v := string(rec[:eq]), string(rec[eq+1:])
		if strings.ContainsRune(k, 0) || ((k == "path" || k == "linkpath" || k == "uname" || k == "gname") && strings.ContainsRune(v, 0)) {
			return 0, false
		}
		switch k {
		case "size":
			if size, err = strconv.ParseInt(v, 10, 64); err != nil || size < 0 {
				return 0, false
			}
		case paxSparseMajor:
			major = -1
			if v == "1" {
				major = off + sp + 1 + eq + 1 // where the value's byte is
			}
		case paxSparseMinor:
			minor = v
		case "GNU.sparse.offset", "GNU.sparse.numbytes":
			return 0, false // GNU sparse 0.0: archive/tar checks their order itself
		}
		off += int(n)
	}
	if major >= 0 && minor == "0" {
		data[major] = sparseMarker[0]
	}
	return size, true
}

// padTo is n rounded up to whole blocks.
func padTo(n int64) int64 { return (n + blockSize - 1) / blockSize * blockSize }

// checksumOK reports whether a header block's checksum is right, as
// archive/tar checks it (unsigned or signed sum, the field read as
// octal). An all-zero block (the end of an archive) is not.
func checksumOK(h []byte) bool {
	want, ok := octal(h[148:156])
	if !ok {
		return false
	}
	var unsigned, signed int64
	for i, c := range h {
		if i >= 148 && i < 156 {
			c = ' '
		}
		unsigned += int64(c)
		signed += int64(int8(c))
	}
	return want == unsigned || want == signed
}

// numeric reads a header's number field as archive/tar does: base-256
// when its top bit is set, else octal. ok is false for what it would
// refuse, or read as negative.
func numeric(b []byte) (int64, bool) {
	if len(b) > 0 && b[0]&0x80 != 0 {
		if b[0]&0x40 != 0 {
			return 0, false // negative
		}
		var x uint64
		for i, c := range b {
			if i == 0 {
				c &= 0x7f
			}
			if x>>56 != 0 {
				return 0, false
			}
			x = x<<8 | uint64(c)
		}
		if x>>63 != 0 {
			return 0, false
		}
		return int64(x), true
	}
	return octal(b)
}

// octal reads an octal field as archive/tar does: spaces and NULs trimmed
// at both ends, cut at a NUL within.
func octal(b []byte) (int64, bool) {
	b = bytes.Trim(b, " \x00")
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	if len(b) == 0 {
		return 0, true
	}
	x, err := strconv.ParseUint(string(b), 8, 64)
	if err != nil || x>>63 != 0 {
		return 0, false
	}
	return int64(x), true
}
