package transforms

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
)

// guardSecretValue is the credential the guard tests hold; guardPH is its
// placeholder, which must pass everywhere.
const (
	guardSecretValue = "sk-canary/0a1b2c3d4e5f"
	guardPH          = "aisdkhc_placeholder_0123456789"
)

func guardWantCredential(t *testing.T, err error, what string) {
	t.Helper()
	var ce *CredentialError
	if !errors.Is(err, ErrCredential) || !errors.As(err, &ce) {
		t.Fatalf("%s: %v, want a *CredentialError", what, err)
	}
	if !strings.HasPrefix(err.Error(), CredentialPhrase+": ") || !strings.Contains(err.Error(), "placeholder") {
		t.Fatalf("%s: message %q does not start with %q and explain the placeholder", what, err, CredentialPhrase)
	}
	if strings.Contains(err.Error(), "sk-canary") || strings.Contains(fmt.Sprintf("%+v %#v", err, err), "0a1b2c") {
		t.Fatalf("%s: the error carries (part of) the secret: %v", what, err)
	}
}

func TestGuardCheck(t *testing.T) {
	g := NewGuard(guardSecretValue, "", "another-secret-value-0001", guardSecretValue)
	for _, tc := range []struct {
		name   string
		values []string
		refuse bool
	}{
		{"the command", []string{"echo " + guardSecretValue}, true},
		{"a variable value with a scheme", []string{"A=1", "KEY=Bearer " + guardSecretValue}, true},
		{"a variable name", []string{"A=1", guardSecretValue + "=1"}, true},
		{"a working directory", []string{"/workspace/" + guardSecretValue}, true},
		{"the second secret", []string{"x", "yy another-secret-value-0001 zz"}, true},
		{"the placeholder", []string{"echo " + guardPH, "KEY=" + guardPH}, false},
		{"a beginning shorter than a run", []string{guardSecretValue[:MinPartialRun-1]}, false},
		{"an end shorter than a run", []string{guardSecretValue[len(guardSecretValue)-MinPartialRun+1:]}, false},
		{"another case", []string{strings.ToUpper(guardSecretValue)}, false},
		{"nothing", nil, false},
		{"empty strings", []string{"", ""}, false},
	} {
		err := g.Check("the test", tc.values...)
		if tc.refuse {
			guardWantCredential(t, err, tc.name)
			if !strings.Contains(err.Error(), ": the test holds") {
				t.Errorf("%s: %q does not name the place", tc.name, err)
			}
		} else if err != nil {
			t.Errorf("%s: %v, want it to pass", tc.name, err)
		}
	}
	for _, g := range []*Guard{nil, NewGuard(), NewGuard("")} {
		if !g.Empty() || g.Check("x", guardSecretValue) != nil {
			t.Errorf("an empty guard refused something")
		}
		if r := g.Reader(strings.NewReader("x"), "x"); r == nil {
			t.Errorf("an empty guard's reader is nil")
		}
	}
	if (&CredentialError{}).Error() == "" || !strings.Contains((&CredentialError{}).Error(), "the input") {
		t.Errorf("a CredentialError without a place: %q", &CredentialError{})
	}
}

// TestGuardRefusesWhatTheScrubMasks: the guard refused the whole secret
// only, while the response scrub masks any run of MinPartialRun bytes of
// it, so a command, a file or a stdin could carry the secret into the
// sandbox less a byte, or in two overlapping halves. Every such spelling
// is refused now, in values and in streams however they are cut.
func TestGuardRefusesWhatTheScrubMasks(t *testing.T) {
	const v = guardSecretValue
	g := newTestGuard(v)
	run := MinPartialRun
	for _, tc := range []struct {
		name  string
		input string
	}{
		{"less its last byte", v[:len(v)-1]},
		{"less its first byte", v[1:]},
		{"a window from the middle", "x" + v[5:5+run] + "y"},
		{"its first run", v[:run]},
		{"its last run", v[len(v)-run:]},
		{"two overlapping halves", v[:run] + " " + v[len(v)-run:]},
		{"a run inside a longer word", "KEY=zz" + v[3:3+run+2] + "zz"},
	} {
		if err := g.Check("the test", tc.input); err == nil {
			t.Errorf("%s: %q passed Check", tc.name, tc.input)
		} else {
			guardWantCredential(t, err, tc.name)
		}
		in := []byte("echo " + tc.input + "\n")
		if !guardThrough(t, g, in, []int{1 << 20}, tc.name+", whole") {
			t.Errorf("%s: a stream passed", tc.name)
		}
		// Cut at every byte: a run at a chunk boundary, split across two
		// writes; and byte by byte.
		for cut := 1; cut < len(in); cut++ {
			guardThrough(t, g, in, []int{cut, 1 << 20}, fmt.Sprintf("%s, cut at %d", tc.name, cut))
		}
		guardThrough(t, g, in, []int{1}, tc.name+", byte by byte")
	}
	// Runs one byte too short pass, in values and in streams: the secret
	// in pieces shorter than a run is beyond the guard, as it is beyond
	// the scrub.
	for _, in := range []string{v[:run-1], v[len(v)-run+1:], "a" + v[4:4+run-1] + "b", v[:len(v)/2] + "-" + v[len(v)/2:]} {
		if err := g.Check("the test", in); err != nil {
			t.Errorf("%q (a run of %d) refused: %v", in, run-1, err)
		}
		if guardThrough(t, g, []byte(in+"\n"), []int{3}, in) {
			t.Errorf("%q (a run of %d) refused in a stream", in, run-1)
		}
	}
}

// A Guard holds the secrets: it must not show them in any format.
func TestGuardPrintsRedacted(t *testing.T) {
	g := NewGuard(guardSecretValue)
	var logged bytes.Buffer
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("guard", "g", g, "v", *g)
	js, _ := json.Marshal(map[string]any{"g": g})
	for _, s := range []string{fmt.Sprint(g), fmt.Sprintf("%v %+v %#v %s %q %x", g, g, g, g, g, g), fmt.Sprintf("%+v", *g),
		fmt.Sprintf("%+v", struct{ G *Guard }{g}), fmt.Sprintf("%+v", struct{ G Guard }{*g}), logged.String(), string(js)} {
		if strings.Contains(s, "canary") || strings.Contains(s, "0a1b2c") {
			t.Errorf("a guard printed its secret: %s", s)
		}
	}
}

// guardChunkReader returns its input in the given chunk sizes (the last one
// repeated), as a network body might.
type guardChunkReader struct {
	data  []byte
	sizes []int
}

func (c *guardChunkReader) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := len(c.data)
	if len(c.sizes) > 0 {
		n = min(n, c.sizes[0])
		if len(c.sizes) > 1 {
			c.sizes = c.sizes[1:]
		}
	}
	n = copy(p, c.data[:n])
	c.data = c.data[n:]
	return n, nil
}

// testGuard is a guard and the secrets it was made of, for guardFirst.
type testGuard struct {
	*Guard
	secrets []string
}

func newTestGuard(secrets ...string) testGuard { return testGuard{NewGuard(secrets...), secrets} }

// guardFirst is where the first thing a guard of secrets refuses starts
// in b, found the slow way: a secret shorter than MinPartialRun whole, or
// MinPartialRun bytes that occur in a longer one; len(b) when none does.
func guardFirst(secrets []string, b []byte) int {
	for i := range b {
		for _, s := range secrets {
			switch {
			case s == "":
			case len(s) < MinPartialRun:
				if bytes.HasPrefix(b[i:], []byte(s)) {
					return i
				}
			case i+MinPartialRun <= len(b) && strings.Contains(s, string(b[i:i+MinPartialRun])):
				return i
			}
		}
	}
	return len(b)
}

// through runs input through a Reader and a Writer of g, cut in chunks of
// the given sizes, and checks what each let through: all of it when no
// secret is in it, otherwise nothing from the first secret on.
func guardThrough(t *testing.T, tg testGuard, input []byte, sizes []int, what string) (refused bool) {
	t.Helper()
	g := tg.Guard
	first := guardFirst(tg.secrets, input) // where the first thing refused starts
	holds := first < len(input)
	// Reader: the bytes it returned before failing.
	out, err := io.ReadAll(g.Reader(&guardChunkReader{data: input, sizes: sizes}, "the stream"))
	guardCheckLetThrough(t, g, input, out, err, holds, first, what+" (Reader)")
	// Writer: what reached the destination.
	var dst bytes.Buffer
	w := g.Writer(&dst, "the stream")
	err = nil
	for rest, i := input, 0; len(rest) > 0 && err == nil; i++ {
		n := len(rest)
		if len(sizes) > 0 {
			n = min(n, sizes[min(i, len(sizes)-1)])
		}
		_, err = w.Write(rest[:n])
		rest = rest[n:]
	}
	if err == nil {
		err = w.Close()
	}
	guardCheckLetThrough(t, g, input, dst.Bytes(), err, holds, first, what+" (Writer)")
	// Scanner: the same verdict, and never more held back than a secret
	// minus one byte.
	s := g.Scanner("the stream")
	err = nil
	for rest, i := input, 0; len(rest) > 0 && err == nil; i++ {
		n := len(rest)
		if len(sizes) > 0 {
			n = min(n, sizes[min(i, len(sizes)-1)])
		}
		_, err = s.Write(rest[:n])
		rest = rest[n:]
		if s.Held() >= max(1, g.longest) {
			t.Fatalf("%s: %d bytes held back, with secrets of at most %d", what, s.Held(), g.longest)
		}
	}
	if holds != (err != nil) {
		t.Fatalf("%s (Scanner): %v, want refused=%v", what, err, holds)
	}
	return holds
}

func guardCheckLetThrough(t *testing.T, g *Guard, input, out []byte, err error, holds bool, first int, what string) {
	t.Helper()
	if !bytes.HasPrefix(input, out) {
		t.Fatalf("%s: let through %q, not a prefix of the input", what, out)
	}
	if !holds {
		if err != nil || len(out) != len(input) {
			t.Fatalf("%s: %v after %d of %d bytes, want all of them", what, err, len(out), len(input))
		}
		return
	}
	guardWantCredential(t, err, what)
	if len(out) > first {
		t.Fatalf("%s: let %d bytes through; the secret starts at %d", what, len(out), first)
	}
}

// The secret split across a stream's chunks at every offset, alone and in
// text, in two and in three pieces.
func TestGuardStreamEverySplit(t *testing.T) {
	g := newTestGuard(guardSecretValue, "zzzz-second-secret-zzzz")
	for _, input := range []string{
		guardSecretValue,
		"hello " + guardSecretValue + " world",
		"sk-canary sk-canary/0a1b " + guardSecretValue, // false starts before it
		"sk-canary/0a1b2c3d4e5" + guardSecretValue,     // a near miss running into it
	} {
		at := strings.Index(input, guardSecretValue)
		for i := 0; i <= len(guardSecretValue); i++ {
			guardThrough(t, g, []byte(input), []int{at + i, 1 << 20}, fmt.Sprintf("%q cut at %d", input, at+i))
			for j := i; j <= len(guardSecretValue); j += 3 {
				guardThrough(t, g, []byte(input), []int{at + i, j - i, 1 << 20}, fmt.Sprintf("%q cut at %d and %d", input, at+i, at+j))
			}
		}
		guardThrough(t, g, []byte(input), []int{1}, fmt.Sprintf("%q byte by byte", input))
	}
	// The placeholder, and runs of the secret shorter than MinPartialRun,
	// pass whole.
	for _, input := range []string{guardPH, "x " + guardPH + " y", "sk-canary/0", "sk-canary/", "ary/0a1b2c3 y", "echo b2c3d4e5f\n", "ls\n", ""} {
		for _, size := range []int{1, 2, 7, 1 << 20} {
			if guardThrough(t, g, []byte(input), []int{size}, fmt.Sprintf("%q in chunks of %d", input, size)) {
				t.Fatalf("%q refused", input)
			}
		}
	}
}

// File contents with the secret across a 64 KiB boundary, as a file upload
// or stdin arrives.
func TestGuardStreamAt64KiB(t *testing.T) {
	g := newTestGuard(guardSecretValue)
	for _, off := range []int{-len(guardSecretValue), -len(guardSecretValue) + 1, -7, -1, 0} {
		data := bytes.Repeat([]byte{'a'}, 200<<10)
		copy(data[64<<10+off:], guardSecretValue)
		guardThrough(t, g, data, []int{64 << 10}, fmt.Sprintf("secret at 64KiB%+d", off))
		guardThrough(t, g, data, []int{32 << 10}, fmt.Sprintf("secret at 64KiB%+d, 32 KiB reads", off))
		guardThrough(t, g, data, []int{64<<10 + off + 3, 1 << 20}, fmt.Sprintf("secret at 64KiB%+d, cut inside", off))
	}
	clean := bytes.Repeat([]byte("0123456789abcdef"), 16<<10)
	guardThrough(t, g, clean, []int{64 << 10}, "256 KiB without the secret")
}

// guardStopAfter returns its chunks, then fails the test if read again: a
// reader that must not wait for more input than it needs.
type guardStopAfter struct {
	t      *testing.T
	chunks []string
}

func (s *guardStopAfter) Read(p []byte) (int, error) {
	if len(s.chunks) == 0 {
		s.t.Fatal("read past what was available: the guard waited for input it did not need")
	}
	n := copy(p, s.chunks[0])
	s.chunks = s.chunks[1:]
	return n, nil
}

// An interactive stdin is not held back: only bytes that begin a secret
// wait for what follows.
func TestGuardReaderHoldsBackOnlyASecretsBeginning(t *testing.T) {
	g := NewGuard(guardSecretValue)
	r := g.Reader(&guardStopAfter{t: t, chunks: []string{"ls -l\n", "echo sk-can"}}, "stdin")
	buf := make([]byte, 100)
	if n, err := r.Read(buf); err != nil || string(buf[:n]) != "ls -l\n" {
		t.Fatalf("first read: %q %v", buf[:n], err)
	}
	if n, err := r.Read(buf); err != nil || string(buf[:n]) != "echo " {
		t.Fatalf("second read: %q %v, want %q (\"sk-can\" held back)", buf[:n], err, "echo ")
	}
}

// guardTarEntry is one entry of a test tar.
type guardTarEntry struct {
	hdr  tar.Header
	body []byte
}

// guardBuildTar writes the entries and returns the tar and where each entry's
// header (its PAX record included) starts.
func guardBuildTar(t *testing.T, entries ...guardTarEntry) ([]byte, []int) {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	var starts []int
	for _, e := range entries {
		tw.Flush()
		starts = append(starts, b.Len())
		h := e.hdr
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag == tar.TypeReg || h.Typeflag == 0 {
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatalf("header %q: %v", h.Name, err)
		}
		if _, err := tw.Write(e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes(), starts
}

// A tar's secret in every place an extraction puts it: nothing of the
// entry that holds it is let through, and a tar of placeholders passes
// byte for byte.
func TestGuardTar(t *testing.T) {
	g := NewGuard(guardSecretValue)
	big := bytes.Repeat([]byte{'x'}, 200<<10)
	copy(big[64<<10-5:], guardSecretValue)
	// A ustar name longer than 100 bytes is split at a slash into the
	// prefix and name fields: here at the secret's own slash, so the raw
	// bytes never hold it whole.
	split := "d/" + guardSecretValue + strings.Repeat("f", 100-len("0a1b2c3d4e5f"))
	ok := guardTarEntry{hdr: tar.Header{Name: "workspace/ok.txt", Typeflag: tar.TypeReg}, body: []byte("fine " + guardPH)}
	for _, tc := range []struct {
		name  string
		entry guardTarEntry
		raw   bool // the raw tar holds the secret whole
		// content: the secret is in the entry's content, so its header
		// may go through (but nothing from the secret on).
		content bool
	}{
		{"a file's content", guardTarEntry{hdr: tar.Header{Name: "f.txt", Typeflag: tar.TypeReg}, body: []byte("key=" + guardSecretValue + "\n")}, true, true},
		{"a file's content at 64 KiB", guardTarEntry{hdr: tar.Header{Name: "big.bin", Typeflag: tar.TypeReg}, body: big}, true, true},
		{"a file name", guardTarEntry{hdr: tar.Header{Name: "dir/" + guardSecretValue + ".txt", Typeflag: tar.TypeReg}}, true, false},
		{"a long file name (PAX path)", guardTarEntry{hdr: tar.Header{Name: strings.Repeat("a/", 80) + guardSecretValue, Typeflag: tar.TypeReg, Format: tar.FormatPAX}}, true, false},
		{"a long file name (GNU)", guardTarEntry{hdr: tar.Header{Name: strings.Repeat("a/", 80) + guardSecretValue, Typeflag: tar.TypeReg, Format: tar.FormatGNU}}, true, false},
		{"a name across the ustar prefix and name", guardTarEntry{hdr: tar.Header{Name: split, Typeflag: tar.TypeReg, Format: tar.FormatUSTAR}}, false, false},
		{"a directory name", guardTarEntry{hdr: tar.Header{Name: guardSecretValue + "/", Typeflag: tar.TypeDir, Mode: 0o755}}, true, false},
		{"a symlink target", guardTarEntry{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "/etc/" + guardSecretValue}}, true, false},
		{"a hardlink target", guardTarEntry{hdr: tar.Header{Name: "hard", Typeflag: tar.TypeLink, Linkname: "x/" + guardSecretValue}}, true, false},
		{"a PAX record's value", guardTarEntry{hdr: tar.Header{Name: "p", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"SCHILY.xattr.user.key": guardSecretValue}}}, true, false},
		{"a PAX record's key", guardTarEntry{hdr: tar.Header{Name: "p", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"SCHILY.xattr.user." + guardSecretValue: "v"}}}, true, false},
		{"a user-defined PAX record", guardTarEntry{hdr: tar.Header{Name: "p", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"VENDOR.note": guardSecretValue}}}, true, false},
		{"an owner name", guardTarEntry{hdr: tar.Header{Name: "o", Typeflag: tar.TypeReg, Uname: guardSecretValue}}, true, false},
	} {
		data, starts := guardBuildTar(t, ok, tc.entry, ok)
		if got := bytes.Contains(data, []byte(guardSecretValue)); got != tc.raw {
			t.Fatalf("%s: the raw tar holds the secret: %v, want %v (the case tests the wrong thing)", tc.name, got, tc.raw)
		}
		limit := starts[1]
		if tc.content {
			limit = bytes.Index(data, []byte(guardSecretValue))
		}
		for _, size := range []int{1 << 20, 512, 100, 1} {
			out, err := io.ReadAll(g.TarReader(&guardChunkReader{data: data, sizes: []int{size}}, "the tar"))
			guardWantCredential(t, err, fmt.Sprintf("%s, read in %d", tc.name, size))
			if !bytes.HasPrefix(data, out) || len(out) > limit {
				t.Fatalf("%s, read in %d: let %d bytes through, want at most %d", tc.name, size, len(out), limit)
			}
		}
	}
	// The same places with the placeholder: all of it passes, byte for byte.
	data, _ := guardBuildTar(t, ok,
		guardTarEntry{hdr: tar.Header{Name: "dir/" + guardPH + ".txt", Typeflag: tar.TypeReg}, body: bytes.Repeat([]byte(guardPH), 5000)},
		guardTarEntry{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "/etc/" + guardPH}},
		guardTarEntry{hdr: tar.Header{Name: strings.Repeat("a/", 80) + guardPH, Typeflag: tar.TypeReg, PAXRecords: map[string]string{"SCHILY.xattr.user.k": guardPH}}},
		guardTarEntry{hdr: tar.Header{Name: "sk-canary/", Typeflag: tar.TypeDir, Mode: 0o755}},
	)
	data = append(data, make([]byte, 10240)...) // a record's padding after the end
	for _, size := range []int{1 << 20, 512, 7} {
		out, err := io.ReadAll(g.TarReader(&guardChunkReader{data: data, sizes: []int{size}}, "the tar"))
		if err != nil || !bytes.Equal(out, data) {
			t.Fatalf("a tar of placeholders, read in %d: %d of %d bytes, %v", size, len(out), len(data), err)
		}
	}
	// After the archive's end, bytes are still scanned.
	tail := append(append([]byte(nil), data...), guardSecretValue...)
	if _, err := io.ReadAll(g.TarReader(bytes.NewReader(tail), "the tar")); !errors.Is(err, ErrCredential) {
		t.Errorf("the secret after the archive's end: %v", err)
	}
	// Not a tar: the parser's error, nothing let through.
	out, err := io.ReadAll(g.TarReader(strings.NewReader(strings.Repeat("not a tar ", 100)), "the tar"))
	if err == nil || errors.Is(err, ErrCredential) || len(out) != 0 {
		t.Errorf("not a tar: %d bytes, %v", len(out), err)
	}
	// An empty guard passes the stream itself.
	if _, same := NewGuard().TarReader(bytes.NewReader(data), "x").(*bytes.Reader); !same {
		t.Errorf("an empty guard wrapped the tar")
	}
}

// FuzzGuardStream: any chunking of any input finds exactly what a one-shot
// search finds, lets all of a clean input through, and nothing of an
// input that holds a secret from the secret's first byte on; it never
// holds back a secret's length or more.
func FuzzGuardStream(f *testing.F) {
	f.Add("sk-canary/0a1b2c3d4e5f", "abab", []byte("hello sk-canary/0a1b2c3d4e5f world"), []byte{3, 9, 1})
	f.Add("aaab", "aab", []byte("aaaaaaab"), []byte{1})
	f.Add("abcabd", "", []byte("abcabcabdab"), []byte{2, 2, 2})
	f.Add("x", "xy", []byte("yyyyx"), []byte{0})
	f.Add("", "", []byte("anything"), []byte{})
	f.Add("ls", "secret-with-long-tail", []byte("echo ls\n"), []byte{4})
	// Runs of a secret that are not the secret: a window from the middle,
	// cut at a chunk boundary, split across two writes.
	f.Add("sk-canary/0a1b2c3d4e5f", "", []byte("x ary/0a1b2c3d y"), []byte{7, 1})
	f.Add("sk-canary/0a1b2c3d4e5f", "", []byte("sk-canary/0a1b2c3d4e5"), []byte{11, 10})
	f.Add("sk-canary/0a1b2c3d4e5f", "zzzz-second-secret-zzzz", []byte("k-canary/0a1b2 zz-second-sec"), []byte{13, 2, 20})
	f.Fuzz(func(t *testing.T, a, b string, data, cuts []byte) {
		g := newTestGuard(a, b)
		sizes := make([]int, 0, len(cuts))
		for _, c := range cuts {
			sizes = append(sizes, int(c)%97+1)
		}
		refused := guardThrough(t, g, data, sizes, "fuzz")
		if oneShot := g.Check("fuzz", string(data)) != nil; oneShot != refused {
			t.Fatalf("the stream says %v, a one-shot search %v", refused, oneShot)
		}
	})
}

// FuzzGuardTarReader: whatever the bytes, a guarded tar lets through a
// prefix of them (all of them when it does not fail), never a secret, and
// refuses exactly what a secret in the raw bytes or in a parsed header
// explains.
func FuzzGuardTarReader(f *testing.F) {
	const secret = "sk-canary/0a1b2c3d4e5f"
	var seeds [][]byte
	for _, hdr := range []tar.Header{
		{Name: "ok.txt", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "d/" + secret + strings.Repeat("f", 88), Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatUSTAR},
		{Name: "l", Typeflag: tar.TypeSymlink, Linkname: secret, Mode: 0o777},
		{Name: "p", Typeflag: tar.TypeReg, Mode: 0o644, PAXRecords: map[string]string{"SCHILY.xattr.user.k": secret}},
		{Name: "run-" + secret[3:17], Typeflag: tar.TypeReg, Mode: 0o644},
	} {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		tw.WriteHeader(&hdr)
		tw.Close()
		seeds = append(seeds, b.Bytes())
	}
	seeds = append(seeds, []byte("not a tar"), nil)
	for _, s := range seeds {
		f.Add(s, uint16(512))
		f.Add(s, uint16(1))
	}
	f.Fuzz(func(t *testing.T, data []byte, size uint16) {
		g := NewGuard(secret)
		out, err := io.ReadAll(g.TarReader(&guardChunkReader{data: data, sizes: []int{int(size) + 1}}, "the tar"))
		if !bytes.HasPrefix(data, out) || guardFirst([]string{secret}, out) < len(out) {
			t.Fatalf("let %q through of %q", out, data)
		}
		if err == nil && !bytes.Equal(out, data) {
			t.Fatalf("no error, but %d of %d bytes", len(out), len(data))
		}
		raw := guardFirst([]string{secret}, data) < len(data)
		if err == nil && raw {
			t.Fatal("the raw bytes hold the secret, and it passed")
		}
		if errors.Is(err, ErrCredential) && !raw {
			headers := false
			tr := tar.NewReader(bytes.NewReader(data))
			for {
				h, err := tr.Next()
				if err != nil {
					break
				}
				if g.Check("x", tarHeaderValues(h)...) != nil {
					headers = true
				}
			}
			if !headers {
				t.Fatal("refused, but neither the raw bytes nor a header hold the secret")
			}
		}
	})
}
