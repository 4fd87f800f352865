package transforms

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

// refScrub is the specification, written the slow obvious way: a byte is
// masked when it lies in a window of MinPartialRun bytes that occurs in a
// secret at least that long; then, left to right, at each byte the longest
// secret that starts there is replaced by its placeholder and skipped;
// otherwise the byte is copied, or PartialMask when it is masked.
func refScrub(in string, secrets []*Secret) string {
	masked := make([]bool, len(in))
	for i := 0; i+MinPartialRun <= len(in); i++ {
		for _, s := range secrets {
			if len(s.value) >= MinPartialRun && strings.Contains(s.value, in[i:i+MinPartialRun]) {
				for k := i; k < i+MinPartialRun; k++ {
					masked[k] = true
				}
			}
		}
	}
	var b strings.Builder
	for i := 0; i < len(in); {
		best := -1
		for k, s := range secrets {
			if strings.HasPrefix(in[i:], s.value) && (best < 0 || len(s.value) > len(secrets[best].value)) {
				best = k
			}
		}
		if best < 0 {
			if masked[i] {
				b.WriteByte(PartialMask)
			} else {
				b.WriteByte(in[i])
			}
			i++
			continue
		}
		b.WriteString(secrets[best].placeholder)
		i += len(secrets[best].value)
	}
	return b.String()
}

// chunkReader yields its chunks one per Read.
type chunkReader struct{ chunks [][]byte }

func (r *chunkReader) Read(p []byte) (int, error) {
	for len(r.chunks) > 0 && len(r.chunks[0]) == 0 {
		r.chunks = r.chunks[1:]
	}
	if len(r.chunks) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.chunks[0])
	r.chunks[0] = r.chunks[0][n:]
	return n, nil
}

func chunks(s string, cuts ...int) *chunkReader {
	r := &chunkReader{}
	prev := 0
	for _, c := range cuts {
		r.chunks = append(r.chunks, []byte(s[prev:c]))
		prev = c
	}
	r.chunks = append(r.chunks, []byte(s[prev:]))
	return r
}

func scrubAll(t testing.TB, r io.Reader, secrets []*Secret) string {
	t.Helper()
	out, err := io.ReadAll(NewScrubReader(r, secrets))
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return string(out)
}

var scrubCases = []struct {
	name    string
	in      string
	secrets [][2]string // value, placeholder
	want    string
}{
	{"none", "hello world", [][2]string{{"SECRET-123", "<P>"}}, "hello world"},
	{"one", "a SECRET-123 b", [][2]string{{"SECRET-123", "<P>"}}, "a <P> b"},
	{"at ends", "SECRET-123SECRET-123", [][2]string{{"SECRET-123", "<P>"}}, "<P><P>"},
	{"self-overlap", "aaaaaaaaaaaaaaaaa", [][2]string{{"aaaaaaaa", "<A>"}}, "<A><A>a"},
	{"periodic", "abababababababab", [][2]string{{"abababab", "<AB>"}}, "<AB><AB>"},
	{"near miss then hit", "SECRET-12SECRET-123", [][2]string{{"SECRET-123", "<P>"}}, "SECRET-12<P>"},
	{"prefix at eof", "xx SECRET-12", [][2]string{{"SECRET-123", "<P>"}}, "xx SECRET-12"},
	{"longest wins", "key=prefix-secret-long!", [][2]string{{"prefix-secret", "<S>"}, {"prefix-secret-long", "<L>"}}, "key=<L>!"},
	// The whole shorter secret is replaced; what follows it is part of a
	// run of the longer one (prefix-secret-lon, 17 bytes): masked.
	{"shorter when longer fails", "prefix-secret-lonX", [][2]string{{"prefix-secret-long", "<L>"}, {"prefix-secret", "<S>"}}, "<S>****X"},
	{"overlap leftmost wins", "AAAABBBBCCCC", [][2]string{{"BBBBCCCC", "<BC>"}, {"AAAABBBB", "<AB>"}}, "<AB>CCCC"},
	{"two secrets", "x=ONE-SECRET y=TWO-SECRET", [][2]string{{"ONE-SECRET", "<1>"}, {"TWO-SECRET", "<2>"}}, "x=<1> y=<2>"},
	{"placeholder longer than secret", "[SECRET-123]", [][2]string{{"SECRET-123", "sandgate-placeholder-SECRET"}}, "[sandgate-placeholder-SECRET]"},
	{"dup value first placeholder", "SECRET-123", [][2]string{{"SECRET-123", "<1>"}, {"SECRET-123", "<2>"}}, "<1>"},
	{"empty", "", [][2]string{{"SECRET-123", "<P>"}}, ""},
	{"binary", "\x00\xffSECRET-123\x00", [][2]string{{"SECRET-123", "<P>"}}, "\x00\xff<P>\x00"},
}

func makeSecrets(pairs [][2]string) []*Secret {
	var out []*Secret
	for _, p := range pairs {
		out = append(out, &Secret{name: "S", value: p[0], placeholder: p[1]})
	}
	return out
}

func TestScrubReaderCases(t *testing.T) {
	for _, tc := range scrubCases {
		t.Run(tc.name, func(t *testing.T) {
			checkScrub(t, tc.in, makeSecrets(tc.secrets), tc.want)
		})
	}
}

// checkScrub checks that the reference, ScrubString and the scrub reader,
// whatever its source's reads and wherever the input is cut in two or
// three, all turn in into want.
func checkScrub(t *testing.T, in string, secrets []*Secret, want string) {
	t.Helper()
	tc := struct{ in, want string }{in, want}
	if got := refScrub(tc.in, secrets); got != tc.want {
		t.Fatalf("reference: got %q, want %q", got, tc.want)
	}
	if got := ScrubString(tc.in, secrets); got != tc.want {
		t.Errorf("ScrubString: got %q, want %q", got, tc.want)
	}
	readers := map[string]io.Reader{
		"whole":     strings.NewReader(tc.in),
		"bytewise":  iotest.OneByteReader(strings.NewReader(tc.in)),
		"half":      iotest.HalfReader(strings.NewReader(tc.in)),
		"dataerr":   iotest.DataErrReader(strings.NewReader(tc.in)),
		"onebyteio": iotest.OneByteReader(iotest.DataErrReader(strings.NewReader(tc.in))),
	}
	for name, r := range readers {
		if got := scrubAll(t, r, secrets); got != tc.want {
			t.Errorf("%s: got %q, want %q", name, got, tc.want)
		}
	}
	// Every way of cutting the input in two and in three.
	for i := 0; i <= len(tc.in); i++ {
		if got := scrubAll(t, chunks(tc.in, i), secrets); got != tc.want {
			t.Errorf("cut at %d: got %q, want %q", i, got, tc.want)
		}
		for j := i; j <= len(tc.in); j++ {
			if got := scrubAll(t, chunks(tc.in, i, j), secrets); got != tc.want {
				t.Errorf("cut at %d,%d: got %q, want %q", i, j, got, tc.want)
			}
		}
	}
}

// TestScrubReaderEverySplitOfSecret places the secret at every offset of a
// body and cuts the stream at every position, with small and tiny reads.
func TestScrubReaderEverySplitOfSecret(t *testing.T) {
	secret := &Secret{value: "sk-ant-api03-Zx9", placeholder: "sandgate-placeholder-K"}
	secrets := []*Secret{secret}
	for pre := 0; pre <= 20; pre++ {
		body := strings.Repeat("s", pre) + secret.value + "k-" + secret.value[:5]
		want := strings.ReplaceAll(body, secret.value, secret.placeholder)
		for cut := 0; cut <= len(body); cut++ {
			if got := scrubAll(t, chunks(body, cut), secrets); got != want {
				t.Fatalf("pre %d cut %d: got %q, want %q", pre, cut, got, want)
			}
		}
		if got := scrubAll(t, iotest.OneByteReader(strings.NewReader(body)), secrets); got != want {
			t.Fatalf("pre %d bytewise: got %q, want %q", pre, got, want)
		}
	}
}

// TestScrubReaderHoldback checks what is released before more input comes:
// everything except the tail that could begin a secret.
func TestScrubReaderHoldback(t *testing.T) {
	secrets := makeSecrets([][2]string{{"sk-live-0123456789", "<K>"}, {"tok_abcdefgh", "<T>"}})
	for _, tc := range []struct {
		chunk, released string
	}{
		{"data: {\"x\":1}\n\n", "data: {\"x\":1}\n\n"},    // ends with no secret prefix: all out
		{"data: sk-live-0123456789\n\n", "data: <K>\n\n"}, // a whole secret inside: replaced, all out
		{"data: sk-live-01", "data: "},                    // tail is a prefix: held
		{"data: s", "data: "},
		{"data: tok_", "data: "},
		{"data: sk-x", "data: sk-x"}, // diverged: released
		{"ts", "t"},                  // "s" may start sk-
		{"data: sk-live-0123456789sk-", "data: <K>"},
	} {
		pr, pw := io.Pipe()
		r := NewScrubReader(pr, secrets)
		go func() { _, _ = pw.Write([]byte(tc.chunk)) }() // then blocks: no more input, no EOF
		released := make(chan string)
		go func() {
			buf := make([]byte, 1024)
			got := ""
			for len(got) < len(tc.released) {
				n, err := r.Read(buf)
				if err != nil {
					break
				}
				got += string(buf[:n])
			}
			released <- got
		}()
		var got string
		select {
		case got = <-released:
		case <-time.After(stepTimeout):
			pw.CloseWithError(errors.New("timed out"))
			t.Fatalf("%q: held back, want %q released before more input", tc.chunk, tc.released)
		}
		if got != tc.released {
			t.Errorf("%q: released %q, want %q", tc.chunk, got, tc.released)
		}
		// The held tail comes out at EOF.
		go func() { pw.Close() }()
		rest, err := io.ReadAll(r)
		if err != nil {
			t.Fatal(err)
		}
		if want := refScrub(tc.chunk, secrets); got+string(rest) != want {
			t.Errorf("%q: total %q, want %q", tc.chunk, got+string(rest), want)
		}
	}
}

func TestScrubReaderLarge(t *testing.T) {
	secret := &Secret{value: "SECRET-0123456789", placeholder: "<P>"}
	var b strings.Builder
	for i := range 20000 {
		b.WriteString("lorem ipsum dolor sit amet ")
		if i%997 == 0 {
			b.WriteString(secret.value)
		}
	}
	in := b.String()
	want := strings.ReplaceAll(in, secret.value, secret.placeholder)
	for _, size := range []int{1, 7, 4096, scrubReadSize - 3, scrubReadSize, 1 << 20} {
		r := NewScrubReader(iotest.HalfReader(strings.NewReader(in)), []*Secret{secret})
		var out bytes.Buffer
		buf := make([]byte, size)
		if _, err := io.CopyBuffer(&out, struct{ io.Reader }{r}, buf); err != nil {
			t.Fatal(err)
		}
		if out.String() != want {
			t.Errorf("read size %d: output differs (len %d, want %d)", size, out.Len(), len(want))
		}
	}
}

func TestScrubReaderErrors(t *testing.T) {
	secrets := makeSecrets([][2]string{{"SECRET-123", "<P>"}})
	// An error after data: the decided data first, then the error; the held
	// prefix of a secret is dropped.
	r := NewScrubReader(io.MultiReader(strings.NewReader("ok SECRET-123 SECR"), iotest.ErrReader(io.ErrClosedPipe)), secrets)
	out, err := io.ReadAll(r)
	if err != io.ErrClosedPipe {
		t.Errorf("got error %v, want %v", err, io.ErrClosedPipe)
	}
	if got, want := string(out), "ok <P> "; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	// A source that never makes progress.
	r = NewScrubReader(emptyReader{}, secrets)
	if _, err := r.Read(make([]byte, 8)); err != io.ErrNoProgress {
		t.Errorf("got %v, want io.ErrNoProgress", err)
	}
	// No secrets: the reader itself.
	src := strings.NewReader("x")
	if got := NewScrubReader(src, nil); got != io.Reader(src) {
		t.Errorf("with no secrets got a wrapper %T", got)
	}
	if n, err := NewScrubReader(strings.NewReader("x"), secrets).Read(nil); n != 0 || err != nil {
		t.Errorf("Read(nil): got %d, %v; want 0, nil", n, err)
	}
}

type emptyReader struct{}

func (emptyReader) Read([]byte) (int, error) { return 0, nil }

func TestScrubHeader(t *testing.T) {
	secrets := makeSecrets([][2]string{{"SECRET-123", "<P>"}, {"OTHER-4567", "<O>"}})
	h := http.Header{
		"X-Echo":           {"key=SECRET-123", "clean", "OTHER-4567 and SECRET-123"},
		"X-Clean":          {"nothing here"},
		"X-SECRET-123":     {"named by the secret"},
		"Www-Authenticate": {"Bearer realm=SECRET-123"},
	}
	orig := h["X-Echo"]
	ScrubHeader(h, secrets)
	want := http.Header{
		"X-Echo":           {"key=<P>", "clean", "<O> and <P>"},
		"X-Clean":          {"nothing here"},
		"X-<P>":            {"named by the secret"},
		"Www-Authenticate": {"Bearer realm=<P>"},
	}
	if got, w := headerString(h), headerString(want); got != w {
		t.Errorf("got %q, want %q", got, w)
	}
	if orig[0] != "key=SECRET-123" {
		t.Errorf("value slice written in place: %q", orig[0])
	}
	ScrubHeader(nil, secrets) // no panic
}

func headerString(h http.Header) string {
	var b strings.Builder
	_ = h.WriteSubset(&b, nil)
	return b.String()
}
