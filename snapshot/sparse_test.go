package snapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// sparseCase is a file with holes: its apparent size and its data.
type sparseCase struct {
	name string
	size int64
	data map[int64]string // offset → bytes
}

var sparseCases = []sparseCase{
	// The file: 4 GiB, a little data in the middle.
	{"big", 4 << 30, map[int64]string{2<<30 + 12345: "in the middle"}},
	{"all-hole", 1 << 30, nil},
	{"data-at-both-ends", 64 << 20, map[int64]string{0: "head", 64<<20 - 4: "tail"}},
	{"dir/many", 16 << 20, map[int64]string{0: "a", 1 << 20: "b", 3 << 20: strings.Repeat("c", 10000), 9<<20 + 7: "d"}},
}

// makeSparse writes the cases under dir.
func makeSparse(t testing.TB, dir string, cases ...sparseCase) {
	t.Helper()
	if cases == nil {
		cases = sparseCases
	}
	for _, c := range cases {
		p := filepath.Join(dir, c.name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		for off, d := range c.data {
			if _, err := f.WriteAt([]byte(d), off); err != nil {
				t.Fatal(err)
			}
		}
		if err := f.Truncate(c.size); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
}

// allocatedBytes is what path takes on disk (st_blocks).
func allocatedBytes(t testing.TB, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// checkSparse checks that dir holds the cases: size, data, and holes that
// take no disk (at most a block per piece of data).
func checkSparse(t testing.TB, dir string, cases ...sparseCase) {
	t.Helper()
	if cases == nil {
		cases = sparseCases
	}
	for _, c := range cases {
		p := filepath.Join(dir, c.name)
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := f.Stat()
		if st.Size() != c.size {
			t.Errorf("%s: size %d, want %d", c.name, st.Size(), c.size)
		}
		for off, d := range c.data {
			got := make([]byte, len(d))
			if _, err := f.ReadAt(got, off); err != nil || string(got) != d {
				t.Errorf("%s at %d: %q %v, want %q", c.name, off, got, err, d)
			}
		}
		// Every byte outside the data is a zero: the data spans hold only
		// the data (and the zeros of their blocks).
		spans, err := DataSpans(f, c.size)
		if err != nil {
			t.Fatal(err)
		}
		var inSpans int64
		for _, s := range spans {
			buf := make([]byte, s.Length)
			f.ReadAt(buf, s.Offset)
			for i, b := range buf {
				if b == 0 {
					continue
				}
				off := s.Offset + int64(i)
				ok := false
				for doff, d := range c.data {
					ok = ok || (off >= doff && off < doff+int64(len(d)))
				}
				if !ok {
					t.Fatalf("%s: byte %d at %d is not the data's", c.name, b, off)
				}
			}
			inSpans += s.Length
		}
		if a := allocatedBytes(t, p); a > int64(len(c.data)+1)*2*sparseBlock+int64(len(strings.Repeat("c", 10000))) {
			t.Errorf("%s: takes %d bytes of disk, want its holes kept (data spans %d bytes)", c.name, a, inSpans)
		}
		f.Close()
	}
}

// TestSparseFileKeepsItsHoles: a 4 GiB sparse file with a little data in
// the middle used to be saved as 4 GiB of zeros (23 s of both cores) and
// applied as 4 GiB of disk. It is saved as a sparse entry — the layer is
// small — and applied with its holes, in both modes; the index has the
// sha256 of its whole content; PackStream and MergeLayers keep it sparse.
func TestSparseFileKeepsItsHoles(t *testing.T) {
	src := mkdir(t, filepath.Join(t.TempDir(), "src"))
	makeSparse(t, src)
	layer, m := packDir(t, src, PackOptions{})
	if len(layer) > 64<<10 || m.TarSize > 128<<10 {
		t.Fatalf("the layer is %d bytes (tar %d): holes were saved as data", len(layer), m.TarSize)
	}
	for _, mode := range []Mode{ModeTree, ModeUpper} {
		if mode == ModeUpper && os.Geteuid() != 0 {
			continue
		}
		dst := filepath.Join(t.TempDir(), "dst")
		res, err := Unpack(context.Background(), bytes.NewReader(layer), dst, ApplyOptions{Mode: mode, Digest: m.Digest, TarDigest: m.TarDigest, MaxBytes: 1 << 20})
		if err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		if res.Entries != m.Entries || res.TarSize != m.TarSize {
			t.Errorf("%s: applied %d entries / %d tar bytes, the manifest says %d / %d", mode, res.Entries, res.TarSize, m.Entries, m.TarSize)
		}
		checkSparse(t, dst)
	}
	// A stream re-encoded (a sandbox CLI's tar) and a merge stay sparse.
	var restream bytes.Buffer
	if rm, err := PackStream(context.Background(), bytes.NewReader(layer), &restream, PackOptions{}); err != nil || rm.TarDigest != m.TarDigest {
		t.Errorf("PackStream of the layer: %v, tar %s, want the same tar %s", err, rm.TarDigest, m.TarDigest)
	}
	// The index has the sha256 of a sparse file's whole content (its data
	// and the zeros of its holes), from a directory and from a stream.
	small := mkdir(t, filepath.Join(t.TempDir(), "small"))
	makeSparse(t, small, sparseCases[2])
	ilayer, im := packDir(t, small, PackOptions{Index: true})
	h := sha256.New()
	b := make([]byte, 64<<20)
	copy(b, "head")
	copy(b[64<<20-4:], "tail")
	h.Write(b)
	want := FileInfo{Path: "data-at-both-ends", Type: "file", Size: 64 << 20, SHA256: hexOf(h.Sum(nil))}
	if i := slices.IndexFunc(im.Files, func(f FileInfo) bool { return f.Path == want.Path }); i < 0 || im.Files[i].SHA256 != want.SHA256 || im.Files[i].Size != want.Size {
		t.Errorf("index of %s: %+v, want the sha256 %s of its content", want.Path, im.Files, want.SHA256)
	}
	if sm, err := PackStream(context.Background(), bytes.NewReader(ilayer), io.Discard, PackOptions{Index: true}); err != nil || !slices.Equal(sm.Files, im.Files) {
		t.Errorf("PackStream's index: %v %+v, want Pack's %+v", err, sm.Files, im.Files)
	}
	other := mkdir(t, filepath.Join(t.TempDir(), "other"))
	os.WriteFile(filepath.Join(other, "x"), []byte("x"), 0o644)
	base, _ := packDir(t, other, PackOptions{})
	var merged bytes.Buffer
	if _, err := MergeLayers(context.Background(), bytes.NewReader(base), bytes.NewReader(layer), &merged, MergeOptions{MaxBytes: 1 << 20, TempDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	if merged.Len() > 64<<10 {
		t.Errorf("the merged layer is %d bytes", merged.Len())
	}
	dst := filepath.Join(t.TempDir(), "merged")
	if _, err := Unpack(context.Background(), &merged, dst, ApplyOptions{}); err != nil {
		t.Fatal(err)
	}
	checkSparse(t, dst)
}

func hexOf(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 2*len(b))
	for i, c := range b {
		out[2*i], out[2*i+1] = digits[c>>4], digits[c&15]
	}
	return string(out)
}

// GNU tar reads sandgate's sparse entries (tar -tvf lists the real names
// and sizes; tar -xf --sparse makes the same files with their holes), and
// sandgate applies GNU tar's, holes kept.
func TestSparseEntriesAgreeWithGNUTar(t *testing.T) {
	gnu, err := exec.LookPath("tar")
	if err != nil {
		t.Skip("no tar on PATH (apt-get install tar)")
	}
	if out, _ := exec.Command(gnu, "--version").Output(); !bytes.Contains(out, []byte("GNU tar")) {
		t.Skipf("tar is not GNU tar: %s", out)
	}
	src := mkdir(t, filepath.Join(t.TempDir(), "src"))
	makeSparse(t, src)
	var bare bytes.Buffer
	if _, err := Pack(context.Background(), src, &bare, PackOptions{Compression: None}); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "layer.tar")
	os.WriteFile(file, bare.Bytes(), 0o644)
	out, err := exec.Command(gnu, "-tvf", file).CombinedOutput()
	if err != nil {
		t.Fatalf("tar -tvf: %v\n%s", err, out)
	}
	for _, c := range sparseCases {
		if !regexpLine(string(out), " "+strconv.FormatInt(c.size, 10)+" ", " ./"+c.name) && !regexpLine(string(out), " "+strconv.FormatInt(c.size, 10)+" ", " "+c.name) {
			t.Errorf("tar -tvf does not list %s of %d bytes:\n%s", c.name, c.size, out)
		}
	}
	if strings.Contains(string(out), "GNUSparseFile") {
		t.Errorf("tar -tvf shows the placeholder names:\n%s", out)
	}
	x := t.TempDir()
	if out, err := exec.Command(gnu, "-xf", file, "--sparse", "-C", x).CombinedOutput(); err != nil {
		t.Fatalf("tar -xf --sparse: %v\n%s", err, out)
	}
	checkSparse(t, x)

	// GNU tar's own, in format 1.0, applied by sandgate.
	for _, version := range []string{"1.0"} {
		gfile := filepath.Join(t.TempDir(), "gnu.tar")
		args := []string{"--posix", "--sparse", "--sparse-version=" + version, "-cf", gfile, "-C", src, "."}
		if out, err := exec.Command(gnu, args...).CombinedOutput(); err != nil {
			t.Fatalf("tar %v: %v\n%s", args, err, out)
		}
		if fi, _ := os.Stat(gfile); fi.Size() > 1<<20 {
			t.Fatalf("GNU tar wrote %d bytes", fi.Size())
		}
		g, _ := os.ReadFile(gfile)
		dst := filepath.Join(t.TempDir(), "dst")
		if _, err := Unpack(context.Background(), bytes.NewReader(g), dst, ApplyOptions{MaxBytes: 1 << 20}); err != nil {
			t.Fatalf("GNU tar's sparse %s layer: %v", version, err)
		}
		checkSparse(t, dst)
	}
}

// regexpLine reports whether some line of s holds both a and b, a first.
func regexpLine(s, a, b string) bool {
	for _, l := range strings.Split(s, "\n") {
		if i := strings.Index(l, a); i >= 0 && strings.HasSuffix(l, b) {
			return true
		}
	}
	return false
}

// A layer from elsewhere holding a file written out in full, mostly
// zeros, is applied with holes where whole blocks are zeros.
func TestDenseZerosAppliedAsHoles(t *testing.T) {
	const size = 32 << 20
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "zeros", Size: size, Mode: 0o644, Format: tar.FormatPAX})
	b := make([]byte, size)
	copy(b[size/2:], "data")
	b[size-1] = 'z'
	tw.Write(b)
	tw.Close()
	dst := filepath.Join(t.TempDir(), "dst")
	if _, err := Unpack(context.Background(), bytes.NewReader(zstdOf(t, tb.Bytes())), dst, ApplyOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dst, "zeros"))
	if err != nil || !bytes.Equal(got, b) {
		t.Fatalf("content differs: %v", err)
	}
	if a := allocatedBytes(t, filepath.Join(dst, "zeros")); a > 4*sparseBlock {
		t.Errorf("32 MiB of zeros and 5 bytes take %d bytes of disk", a)
	}
}

// Sparse entries are refused where their map is malformed, or claims
// what the entry does not hold, or in a sparse form sandgate does not
// read; their data (never their holes) counts against MaxBytes.
func TestSparseEntriesRefused(t *testing.T) {
	raw := func(recs string, body []byte) []byte {
		var buf bytes.Buffer
		buf.Write(ustarBlock("PaxHeaders/f", tar.TypeXHeader, int64(len(recs))))
		buf.Write(padBlock([]byte(recs)))
		buf.Write(ustarBlock("GNUSparseFile.0/f", tar.TypeReg, int64(len(body))))
		buf.Write(padBlock(body))
		buf.Write(make([]byte, 1024))
		return buf.Bytes()
	}
	entry := func(realsize int64, sparseMap string, data string) []byte {
		return sparseTarWith("f", realsize, sparseMap, []byte(data))
	}
	ok := entry(1<<40, "2\n0\n3\n1099511627000\n2\n", "abcxy")
	dst := filepath.Join(t.TempDir(), "ok")
	if _, err := Unpack(context.Background(), bytes.NewReader(ok), dst, ApplyOptions{MaxBytes: 8192}); err != nil {
		t.Fatalf("a 1 TiB sparse file of 5 bytes under an 8 KiB cap: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(dst, "f")); err != nil || fi.Size() != 1<<40 {
		t.Fatalf("applied: %v %v", fi, err)
	}
	for name, layer := range map[string][]byte{
		"spans overlap":        entry(100, "2\n0\n3\n2\n2\n", "abcxy"),
		"span beyond the file": entry(100, "1\n99\n2\n", "ab"),
		"spans hold more":      entry(100, "1\n0\n2\n", "abc"),
		"spans hold less":      entry(100, "1\n0\n4\n", "abc"),
		"not a number":         entry(100, "1\n0x\n3\n", "abc"),
		"negative":             entry(100, "1\n-1\n3\n", "abc"),
		"too many spans":       entry(100, strconv.Itoa(maxSparseSpans+1)+"\n", ""),
		"number too long":      entry(100, "1\n"+strings.Repeat("1", 30)+"\n3\n", "abc"),
		"map past the data":    entry(100, "1\n0\n", ""),
		"bad real size":        entry(-5, "1\n0\n3\n", "abc"),
		"data over the cap":    entry(1<<30, "1\n0\n9000\n", strings.Repeat("d", 9000)),
		"format 0.1": raw(paxRecord("GNU.sparse.major", "0")+paxRecord("GNU.sparse.minor", "1")+paxRecord("GNU.sparse.name", "f")+
			paxRecord("GNU.sparse.size", "100")+paxRecord("GNU.sparse.numblocks", "1")+paxRecord("GNU.sparse.map", "0,3"), []byte("abc")),
		"format 0.0": raw(paxRecord("GNU.sparse.size", "100")+paxRecord("GNU.sparse.numblocks", "1")+
			paxRecord("GNU.sparse.offset", "0")+paxRecord("GNU.sparse.numbytes", "3"), []byte("abc")),
		"no name": bytes.Replace(entry(100, "1\n0\n3\n", "abc"), []byte("GNU.sparse.name"), []byte("GNU.sparse.nxme"), 1),
	} {
		dst := filepath.Join(t.TempDir(), "dst")
		_, err := Unpack(context.Background(), bytes.NewReader(layer), dst, ApplyOptions{MaxBytes: 8192})
		if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "sparse") && !strings.Contains(err.Error(), "cap") {
			t.Errorf("%s: %v, want refused", name, err)
		}
		if _, serr := os.Stat(dst); serr == nil {
			t.Errorf("%s: left the target", name)
		}
	}
}

// FuzzSparseMap: any bytes as a sparse map never panic, and a map read
// holds spans in order, within the file, adding up to the stored bytes.
func FuzzSparseMap(f *testing.F) {
	f.Add([]byte("2\n0\n3\n1099511627000\n2\n"), int64(1<<40), int64(517))
	f.Add(encodeSparseMap([]Span{{0, 4}, {8192, 100}}, 1<<20), int64(1<<20), int64(512+104))
	f.Add([]byte("0\n"), int64(0), int64(512))
	f.Fuzz(func(t *testing.T, b []byte, size, physical int64) {
		if size < 0 || physical < 0 {
			return
		}
		spans, mapLen, err := readSparseMap(bytes.NewReader(b), size, physical)
		if err != nil {
			return
		}
		if mapLen%blockSize != 0 || mapLen > int64(len(b)) || dataBytes(spans) != physical-mapLen {
			t.Fatalf("map of %d bytes, spans %v, physical %d", mapLen, spans, physical)
		}
		var end int64
		for _, s := range spans {
			if s.Offset < end || s.Length <= 0 || s.end() > size {
				t.Fatalf("span %v after %d in a file of %d", s, end, size)
			}
			end = s.end()
		}
		back, _, err := readSparseMap(bytes.NewReader(encodeSparseMap(spans, size)), size, dataBytes(spans)+int64(len(encodeSparseMap(spans, size))))
		if err != nil || !slices.Equal(back, spans) {
			t.Fatalf("encode and read back %v: %v %v", spans, back, err)
		}
	})
}

// tarEntry is what archive/tar reads of an entry: its header and data
// (the first bytes of).
type tarEntry struct {
	hdr  tar.Header
	data []byte
	err  error
}

func readEntries(r io.Reader) []tarEntry {
	tr := tar.NewReader(r)
	var out []tarEntry
	for range 64 {
		h, err := tr.Next()
		if err != nil {
			out = append(out, tarEntry{err: err})
			return out
		}
		data, err := io.ReadAll(io.LimitReader(tr, 1<<16))
		out = append(out, tarEntry{hdr: *h, data: data, err: err})
	}
	return out
}

// FuzzSparseFilter: the filter changes a stream only in the value of
// GNU.sparse.major records that archive/tar takes for a sparse 1.0
// entry's; archive/tar reads the filtered stream as the same entries, the
// sparse ones as their stored bytes (with the mark), every other one with
// the same header and data.
func FuzzSparseFilter(f *testing.F) {
	for _, c := range hostileCases {
		if b, err := os.ReadFile(filepath.Join("testdata", "hostile", c.file)); err == nil {
			f.Add(b)
		}
	}
	src := mkdir(f, filepath.Join(f.TempDir(), "src"))
	os.WriteFile(filepath.Join(src, "plain"), []byte("plain"), 0o644)
	sp, _ := os.Create(filepath.Join(src, "sparse"))
	sp.WriteAt([]byte("x"), 1<<20)
	sp.Truncate(2 << 20)
	sp.Close()
	var bare bytes.Buffer
	if _, err := Pack(context.Background(), src, &bare, PackOptions{Compression: None}); err != nil {
		f.Fatal(err)
	}
	f.Add(bare.Bytes())
	f.Add(sparseTar(2, 1<<20))
	f.Fuzz(func(t *testing.T, in []byte) {
		out, err := io.ReadAll(newSparseFilter(bytes.NewReader(in)))
		if err != nil || len(out) != len(in) {
			t.Fatalf("filtered %d bytes into %d: %v", len(in), len(out), err)
		}
		for i := range in {
			if in[i] != out[i] && !(in[i] == '1' && out[i] == sparseMarker[0] && bytes.HasSuffix(in[:i], []byte(paxSparseMajor+"="))) {
				t.Fatalf("byte %d changed from %q to %q", i, in[i], out[i])
			}
		}
		raw, filtered := readEntries(bytes.NewReader(in)), readEntries(bytes.NewReader(out))
		for i := range raw {
			if i >= len(filtered) {
				t.Fatalf("%d entries raw, %d filtered", len(raw), len(filtered))
			}
			r, f := raw[i], filtered[i]
			if r.err != nil && f.err == nil && f.hdr.PAXRecords[paxSparseMajor] == sparseMarker {
				break // archive/tar refused the sparse map it read; sparseOf reads it itself
			}
			if (r.err == nil) != (f.err == nil) {
				t.Fatalf("entry %d: raw %v, filtered %v", i, r.err, f.err)
			}
			if r.err != nil {
				break
			}
			if f.hdr.PAXRecords[paxSparseMajor] == sparseMarker {
				if r.hdr.PAXRecords[paxSparseMajor] != "1" || r.hdr.PAXRecords[paxSparseMinor] != "0" {
					t.Fatalf("entry %d marked sparse, raw %v", i, r.hdr.PAXRecords)
				}
				continue
			}
			if r.hdr.Name != f.hdr.Name || r.hdr.Size != f.hdr.Size || r.hdr.Typeflag != f.hdr.Typeflag || !bytes.Equal(r.data, f.data) {
				t.Fatalf("entry %d differs: raw %q %d %q, filtered %q %d %q", i, r.hdr.Name, r.hdr.Size, r.data, f.hdr.Name, f.hdr.Size, f.data)
			}
		}
	})
}
