package snapshot

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Sparse files. A file with holes (`truncate -s 4G f`) is written as a PAX
// entry in GNU's sparse format 1.0, which GNU tar and archive/tar read:
// extended records GNU.sparse.major=1, GNU.sparse.minor=0,
// GNU.sparse.name=<path> and GNU.sparse.realsize=<size>, a placeholder
// header name (GNUSparseFile.0/<base>), and a data area that starts with
// the sparse map — decimal numbers, one a line: how many data spans, then
// each one's offset and length, padded to a 512-byte block — followed by
// the spans' bytes only. A layer's size and the time to save and apply it
// so follow the data a file holds, not its apparent size, and applying it
// seeks over the holes, which stay holes.
//
// archive/tar writes no sparse entry (its Writer drops GNU.sparse.*
// records), so writeSparseEntry writes the two header blocks itself. On
// the read side archive/tar would turn a sparse entry back into its whole
// apparent size, zeros made up for the holes: work no stream cap sees (a
// petabyte-sized file of one byte), and holes applied as data. So every
// layer reader puts sparseFilter in front of it, which follows the tar
// stream's blocks and changes the one byte of GNU.sparse.major=1 to
// sparseMarker; archive/tar then reads the entry as a plain file of its
// stored bytes (map and spans), and sparseOf reads the map itself and
// hands back the header with its real name and size and the spans. An
// entry the filter could not follow (a stream archive/tar itself refuses,
// or an old V7 header) keeps GNU.sparse.major=1 and is refused. Sparse
// formats other than 1.0 (GNU's 0.x, its old 'S' headers) are refused
// too: sandgate writes none, and archive/tar would expand them.

// GNU sparse 1.0 PAX records.
const (
	paxSparseMajor    = "GNU.sparse.major"
	paxSparseMinor    = "GNU.sparse.minor"
	paxSparseName     = "GNU.sparse.name"
	paxSparseRealSize = "GNU.sparse.realsize"
	paxSparseSize     = "GNU.sparse.size" // 0.x's name for realsize, also read by archive/tar
	paxSparsePrefix   = "GNU.sparse."
	// sparseMarker replaces the "1" of GNU.sparse.major=1 in the stream
	// archive/tar reads (sparseFilter): a version it does not know, so it
	// leaves the entry's bytes as they are stored.
	sparseMarker = "s"
)

// Bounds of a sparse entry's map.
const (
	// maxSparseSpans bounds a file's data spans; a file with more is
	// written with its smallest holes as data (coalesceSpans).
	maxSparseSpans = 1 << 16
	// maxSparseNumber is the longest decimal number of a map.
	maxSparseNumber = 19
	// maxSparseSize bounds a sparse file's apparent size (ext4's largest
	// file is 16 TiB; XFS's 8 EiB): holes cost nothing, but no file
	// system holds more.
	maxSparseSize = 1 << 56
	// sparseBlock is the granularity of holes found in data on extraction
	// (a file system block).
	sparseBlock = 4096
)

// Span is a run of data in a sparse file: Length bytes at Offset.
type Span struct{ Offset, Length int64 }

func (s Span) end() int64 { return s.Offset + s.Length }

// DataSpans lists the data of f, whose size is size, with SEEK_DATA and
// SEEK_HOLE: what is not in a span is a hole, read as zeros. A file
// system without them reports one span, the whole file.
func DataSpans(f *os.File, size int64) ([]Span, error) {
	var spans []Span
	for off := int64(0); off < size; {
		d, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole from off to the end
		}
		if err != nil {
			return nil, err
		}
		h, err := unix.Seek(int(f.Fd()), d, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		h = min(h, size) // the file may have grown since size was taken
		if h <= d {
			break
		}
		spans = append(spans, Span{d, h - d})
		off = h
	}
	return spans, nil
}

// dataBytes is the bytes the spans hold.
func dataBytes(spans []Span) int64 {
	var n int64
	for _, s := range spans {
		n += s.Length
	}
	return n
}

// coalesceSpans merges spans across their smallest holes until there are
// at most max: the holes merged over become data (read as zeros).
func coalesceSpans(spans []Span, max int) []Span {
	for gap := int64(sparseBlock); len(spans) > max; gap *= 2 {
		out := spans[:1:1]
		for _, s := range spans[1:] {
			last := &out[len(out)-1]
			if s.Offset-last.end() <= gap {
				last.Length = s.end() - last.Offset
				continue
			}
			out = append(out, s)
		}
		spans = out
	}
	return spans
}

// encodeSparseMap is a sparse map of spans for a file of size bytes, padded
// to a block. A file that ends in a hole gets a last span of no data at its
// end, as GNU tar writes it (its older versions size the file by the map).
func encodeSparseMap(spans []Span, size int64) []byte {
	if len(spans) == 0 || spans[len(spans)-1].end() < size {
		spans = append(slices.Clip(spans), Span{size, 0})
	}
	var b bytes.Buffer
	b.WriteString(strconv.Itoa(len(spans)) + "\n")
	for _, s := range spans {
		b.WriteString(strconv.FormatInt(s.Offset, 10) + "\n" + strconv.FormatInt(s.Length, 10) + "\n")
	}
	if r := b.Len() % blockSize; r != 0 {
		b.Write(make([]byte, blockSize-r))
	}
	return b.Bytes()
}

const blockSize = 512

// readSparseMap reads a sparse map (format 1.0) from the start of an
// entry's stored bytes, physical bytes in all, for a file of size bytes.
// It returns the spans and the bytes the map took (whole blocks); what
// follows is the spans' data, exactly physical-mapLen bytes. A map that
// is malformed, out of order, overlapping, beyond size, or whose spans
// do not add up to the stored bytes is refused.
func readSparseMap(r io.Reader, size, physical int64) (spans []Span, mapLen int64, err error) {
	var blk [blockSize]byte
	var tok []byte
	var nums []int64
	want := int64(-1) // numbers the map holds, once its count is read
	for want < 0 || int64(len(nums)) < want {
		if mapLen+blockSize > physical {
			return nil, 0, errors.New("the sparse map runs past the entry's data")
		}
		if _, err := io.ReadFull(r, blk[:]); err != nil {
			return nil, 0, fmt.Errorf("sparse map: %w", err)
		}
		mapLen += blockSize
		for _, c := range blk {
			if want >= 0 && int64(len(nums)) == want {
				break // the rest of the block is padding
			}
			switch {
			case c >= '0' && c <= '9':
				if len(tok) == maxSparseNumber {
					return nil, 0, errors.New("a number of the sparse map is too long")
				}
				tok = append(tok, c)
				continue
			case c != '\n' || len(tok) == 0:
				return nil, 0, fmt.Errorf("sparse map: unexpected byte %q", c)
			}
			n, err := strconv.ParseInt(string(tok), 10, 64)
			if err != nil {
				return nil, 0, fmt.Errorf("sparse map: %w", err)
			}
			tok = tok[:0]
			if want < 0 {
				if n > maxSparseSpans {
					return nil, 0, fmt.Errorf("the sparse map has %d spans, more than %d", n, maxSparseSpans)
				}
				want = 2 * n
				continue
			}
			nums = append(nums, n)
		}
	}
	var prevEnd, data int64
	for i := 0; i < len(nums); i += 2 {
		s := Span{nums[i], nums[i+1]}
		if s.Offset < prevEnd || s.Length > size-s.Offset {
			return nil, 0, fmt.Errorf("sparse map: span %d (%d bytes at %d) is out of order, overlaps or lies beyond the file's %d bytes", i/2, s.Length, s.Offset, size)
		}
		prevEnd, data = s.end(), data+s.Length
		if s.Length > 0 {
			spans = append(spans, s)
		}
	}
	if data != physical-mapLen {
		return nil, 0, fmt.Errorf("sparse map: its spans hold %d bytes, the entry stores %d", data, physical-mapLen)
	}
	return spans, mapLen, nil
}

// sparseFile is what sparseOf makes of a sparse entry: the spans of data
// its stored bytes hold after the map (size, the apparent size, is the
// header's Size).
type sparseFile struct {
	spans []Span
}

// sparseOf reads the map of a sparse entry (one sparseFilter marked) from
// r, the entry's stored bytes, and rewrites hdr as the file it stands for:
// its real name and apparent size, without the GNU.sparse records. What
// r then yields is the spans' data. It returns nil for an entry that is
// not sparse, and refuses a sparse entry in any other form.
func sparseOf(hdr *tar.Header, r io.Reader) (*sparseFile, error) {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return nil, refuse(hdr.Name, "old GNU sparse entry (sandgate reads PAX sparse format 1.0: GNU tar --posix --sparse)")
	}
	var sparse bool
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, paxSparsePrefix) {
			sparse = true
			break
		}
	}
	if !sparse {
		return nil, nil
	}
	if hdr.PAXRecords[paxSparseMajor] != sparseMarker || hdr.PAXRecords[paxSparseMinor] != "0" {
		return nil, refuse(hdr.Name, "sparse entry in a form sandgate does not read (GNU.sparse.major %q, minor %q): it reads PAX sparse format 1.0 (GNU tar --posix --sparse --sparse-version=1.0)",
			hdr.PAXRecords[paxSparseMajor], hdr.PAXRecords[paxSparseMinor])
	}
	if hdr.Typeflag != tar.TypeReg {
		return nil, refuse(hdr.Name, "sparse records on an entry that is not a regular file")
	}
	name := hdr.PAXRecords[paxSparseName]
	if name == "" {
		return nil, refuse(hdr.Name, "sparse entry without %s", paxSparseName)
	}
	sizeRec := hdr.PAXRecords[paxSparseRealSize]
	if sizeRec == "" {
		sizeRec = hdr.PAXRecords[paxSparseSize]
	}
	size, err := strconv.ParseInt(sizeRec, 10, 64)
	if err != nil || size < 0 || size > maxSparseSize {
		return nil, refuse(name, "sparse entry of size %q: want 0 to %d bytes", sizeRec, int64(maxSparseSize))
	}
	if hdr.Size < 0 {
		return nil, refuse(name, "negative size")
	}
	spans, _, err := readSparseMap(r, size, hdr.Size)
	if err != nil {
		return nil, refuse(name, "%v", err)
	}
	hdr.Name, hdr.Size = name, size
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, paxSparsePrefix) || k == "path" || k == "size" {
			delete(hdr.PAXRecords, k)
		}
	}
	return &sparseFile{spans: spans}, nil
}

// writeSparseEntry writes hdr (a regular file; Name, Size as its apparent
// size, Mode, Uid, Gid, ModTime, PAXRecords) as a sparse entry whose data
// is spans, read in order from data, to the tar stream raw beneath tw: its
// extended header, its header, the map and the spans' bytes, padded.
func writeSparseEntry(tw *tar.Writer, raw io.Writer, hdr *tar.Header, spans []Span, data io.Reader, buf []byte) error {
	if err := tw.Flush(); err != nil {
		return err
	}
	sparseMap := encodeSparseMap(spans, hdr.Size)
	physical := int64(len(sparseMap)) + dataBytes(spans)
	recs := map[string]string{}
	for k, v := range hdr.PAXRecords {
		if !strings.HasPrefix(k, paxSparsePrefix) {
			recs[k] = v
		}
	}
	recs[paxSparseMajor], recs[paxSparseMinor] = "1", "0"
	recs[paxSparseName], recs[paxSparseRealSize] = hdr.Name, strconv.FormatInt(hdr.Size, 10)
	if ns := hdr.ModTime.Nanosecond(); ns != 0 || !fitsOctal(hdr.ModTime.Unix(), 12) {
		recs["mtime"] = formatPAXTime(hdr.ModTime)
	}
	if !fitsOctal(int64(hdr.Uid), 8) {
		recs["uid"] = strconv.Itoa(hdr.Uid)
	}
	if !fitsOctal(int64(hdr.Gid), 8) {
		recs["gid"] = strconv.Itoa(hdr.Gid)
	}
	if !fitsOctal(physical, 12) {
		recs["size"] = strconv.FormatInt(physical, 10)
	}
	var x strings.Builder
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range recs {
			if !yield(k) {
				return
			}
		}
	}) {
		x.WriteString(paxRecord(k, recs[k]))
	}
	base := path.Base(strings.TrimSuffix(hdr.Name, "/"))
	xh := ustarHeader("./PaxHeaders.0/"+base, tar.TypeXHeader, 0o644, 0, 0, int64(x.Len()), hdr.ModTime)
	fh := ustarHeader("./GNUSparseFile.0/"+base, tar.TypeReg, hdr.Mode, hdr.Uid, hdr.Gid, physical, hdr.ModTime)
	for _, b := range [][]byte{xh, padBlock([]byte(x.String())), fh, sparseMap} {
		if _, err := raw.Write(b); err != nil {
			return err
		}
	}
	for _, s := range spans {
		n, err := io.CopyBuffer(onlyWriter{raw}, io.LimitReader(data, s.Length), buf)
		if err == nil && n != s.Length {
			err = fmt.Errorf("%d of a span's %d bytes", n, s.Length)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", hdr.Name, err)
		}
	}
	if r := dataBytes(spans) % blockSize; r != 0 {
		if _, err := raw.Write(make([]byte, blockSize-r)); err != nil {
			return err
		}
	}
	return nil
}

// paxRecord formats one PAX extended header record: "<len> <k>=<v>\n",
// len counting the whole record, itself included.
func paxRecord(k, v string) string {
	n := len(k) + len(v) + 3
	for {
		s := strconv.Itoa(n) + " " + k + "=" + v + "\n"
		if len(s) == n {
			return s
		}
		n = len(s)
	}
}

// formatPAXTime writes t as PAX does: seconds, and a fraction without
// trailing zeros.
func formatPAXTime(t time.Time) string {
	s := strconv.FormatInt(t.Unix(), 10)
	if ns := t.Nanosecond(); ns != 0 {
		s += strings.TrimRight(fmt.Sprintf(".%09d", ns), "0")
	}
	return s
}

// fitsOctal reports whether n fits a ustar numeric field of width bytes
// (octal digits and a NUL).
func fitsOctal(n int64, width int) bool {
	return n >= 0 && n < int64(1)<<(3*(width-1))
}

// ustarHeader is a ustar header block. A name longer than the field, or
// with bytes other than printable ASCII, is cut and cleaned: the names it
// is given are placeholders, the real one being in PAX records. Numbers
// that do not fit are written as 0 (PAX records carry them).
func ustarHeader(name string, typ byte, mode int64, uid, gid int, size int64, mtime time.Time) []byte {
	b := make([]byte, blockSize)
	clean := []byte(name)
	for i, c := range clean {
		if c < 0x20 || c > 0x7e {
			clean[i] = '_'
		}
	}
	copy(b[0:99], clean)
	octal := func(field []byte, n int64) {
		if !fitsOctal(n, len(field)) {
			n = 0
		}
		copy(field, fmt.Sprintf("%0*o\x00", len(field)-1, n))
	}
	octal(b[100:108], mode&0o7777)
	octal(b[108:116], int64(uid))
	octal(b[116:124], int64(gid))
	octal(b[124:136], size)
	octal(b[136:148], max(mtime.Unix(), 0))
	b[156] = typ
	copy(b[257:265], "ustar\x0000")
	copy(b[148:156], "        ")
	sum := 0
	for _, c := range b {
		sum += int(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

// padBlock pads b with zeros to a whole number of blocks.
func padBlock(b []byte) []byte {
	if r := len(b) % blockSize; r != 0 {
		b = append(b, make([]byte, blockSize-r)...)
	}
	return b
}

// holeFeeder feeds a hash the content of a sparse file while its spans'
// data pass through Write: the zeros of each hole before a span's data,
// and of the last hole at close.
type holeFeeder struct {
	h     hash.Hash
	spans []Span
	pos   int64 // of the content fed so far
	size  int64
}

var zeros = make([]byte, 1<<20)

func (f *holeFeeder) zerosTo(off int64) {
	for f.pos < off {
		n := min(off-f.pos, int64(len(zeros)))
		f.h.Write(zeros[:n])
		f.pos += n
	}
}

func (f *holeFeeder) Write(p []byte) (int, error) {
	n0 := len(p)
	for len(p) > 0 && len(f.spans) > 0 {
		s := &f.spans[0]
		f.zerosTo(s.Offset)
		n := min(int64(len(p)), s.Length)
		f.h.Write(p[:n])
		f.pos += n
		s.Offset, s.Length = s.Offset+n, s.Length-n
		if s.Length == 0 {
			f.spans = f.spans[1:]
		}
		p = p[n:]
	}
	return n0, nil
}

// close feeds the last hole.
func (f *holeFeeder) close() { f.zerosTo(f.size) }

// newHoleFeeder is a holeFeeder of h for a file of size bytes with spans
// (not changed).
func newHoleFeeder(h hash.Hash, spans []Span, size int64) *holeFeeder {
	return &holeFeeder{h: h, spans: slices.Clone(spans), size: size}
}

// writeData writes n bytes of r to f from offset off, leaving a hole
// wherever a whole block of the file would be zeros: f is new, so what is
// never written reads as zeros. The caller sets f's size (Truncate): a
// file that ends in zeros ends in a hole.
func writeData(f *os.File, off int64, r io.Reader, n int64, buf []byte) error {
	for n > 0 {
		c := min(n, int64(len(buf)))
		if _, err := io.ReadFull(r, buf[:c]); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
		b, runOff, run := buf[:c], off, 0 // run: bytes of b from runOff to write
		for len(b) > run {
			piece := min(int64(len(b)-run), sparseBlock-(runOff+int64(run))%sparseBlock)
			blk := b[run : run+int(piece)]
			if piece == sparseBlock && isZero(blk) {
				if run > 0 {
					if _, err := f.WriteAt(b[:run], runOff); err != nil {
						return err
					}
				}
				b = b[run+int(piece):]
				runOff += int64(run) + piece
				run = 0
				continue
			}
			run += int(piece)
		}
		if run > 0 {
			if _, err := f.WriteAt(b[:run], runOff); err != nil {
				return err
			}
		}
		off, n = off+c, n-c
	}
	return nil
}

// writeSpans writes a sparse file's data, each span's bytes read in turn
// from r at its offset (writeData), and sets its size: holes are never
// written.
func writeSpans(f *os.File, spans []Span, size int64, r io.Reader, buf []byte) error {
	for _, s := range spans {
		if err := writeData(f, s.Offset, r, s.Length, buf); err != nil {
			return err
		}
	}
	return f.Truncate(size)
}

// isZero reports whether b holds only zeros.
func isZero(b []byte) bool {
	for len(b) > 0 {
		n := min(len(b), len(zeros))
		if !bytes.Equal(b[:n], zeros[:n]) {
			return false
		}
		b = b[n:]
	}
	return true
}
