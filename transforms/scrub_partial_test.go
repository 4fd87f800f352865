package transforms

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// partialKey is a secret long enough for its runs to be scrubbed.
const partialKey = "sk-live-ABCDEFGHIJKLMNOPQRSTUV" // 30 bytes

func stars(n int) string { return strings.Repeat(string(PartialMask), n) }

var partialCases = []struct {
	name    string
	in      string
	secrets [][2]string // value, placeholder
	want    string
}{
	{"prefix and suffix echo",
		"prefix:" + partialKey[:len(partialKey)-1] + " suffix:" + partialKey[1:],
		[][2]string{{partialKey, "<K>"}},
		"prefix:" + stars(29) + " suffix:" + stars(29)},
	{"middle run", "x" + partialKey[5:20] + "y", [][2]string{{partialKey, "<K>"}}, "x" + stars(15) + "y"},
	{"run of exactly 11 is left", "[" + partialKey[3:14] + "]", [][2]string{{partialKey, "<K>"}}, "[" + partialKey[3:14] + "]"},
	{"run of exactly 12 is masked", "[" + partialKey[3:15] + "]", [][2]string{{partialKey, "<K>"}}, "[" + stars(12) + "]"},
	{"runs at both ends of the input", partialKey[:12] + "--" + partialKey[18:], [][2]string{{partialKey, "<K>"}}, stars(12) + "--" + stars(12)},
	{"whole then run", partialKey + partialKey[:15], [][2]string{{partialKey, "<K>"}}, "<K>" + stars(15)},
	{"run then whole", partialKey[10:] + partialKey, [][2]string{{partialKey, "<K>"}}, stars(20) + "<K>"},
	{"two runs back to back", partialKey[:15] + partialKey[2:20], [][2]string{{partialKey, "<K>"}}, stars(15 + 18)},
	{"run begins inside a whole match", "aaaaaaaaaaaab", [][2]string{{"aaaaaaaaaaab", "0"}, {"aa", "02"}}, "020202020202" + stars(1)},
	// 0123456789ABCDEF is a run of the first, 89ABCDEF-zzzz-98 of the
	// second: the union of the two is masked.
	{"two secrets overlapping", "x0123456789ABCDEF-zzzz-98y",
		[][2]string{{"aaaa-0123456789ABCDEF", "<A>"}, {"89ABCDEF-zzzz-9876", "<B>"}},
		"x" + stars(24) + "y"},
	{"one secret whole, another in part", "aaaa-0123456789ABCDEF 89ABCDEF-zzzz-987",
		[][2]string{{"aaaa-0123456789ABCDEF", "<A>"}, {"89ABCDEF-zzzz-9876", "<B>"}},
		"<A> " + stars(17)},
	{"short secret only whole", "x short-key-1 short-key- y", [][2]string{{"short-key-1", "<S>"}}, "x <S> short-key- y"},
	{"secret of exactly 12", "twelve-bytes twelve-byte", [][2]string{{"twelve-bytes", "<T>"}}, "<T> twelve-byte"},
	{"periodic secret", "x" + strings.Repeat("abc", 7) + "y", [][2]string{{strings.Repeat("abc", 6), "<P>"}}, "x<P>" + stars(3) + "y"},
	{"binary around a run", "\x00" + partialKey[1:13] + "\xff", [][2]string{{partialKey, "<K>"}}, "\x00" + stars(12) + "\xff"},
	{"no run", "sk-live- and ABCDEFGHIJK and live-ABCDE", [][2]string{{partialKey, "<K>"}}, "sk-live- and ABCDEFGHIJK and live-ABCDE"},
}

// TestScrubPartialRuns: runs of MinPartialRun or more bytes of a secret are
// masked, maximal, however the stream is cut (every split point in two and
// in three, byte by byte).
func TestScrubPartialRuns(t *testing.T) {
	for _, tc := range partialCases {
		t.Run(tc.name, func(t *testing.T) {
			checkScrub(t, tc.in, makeSecrets(tc.secrets), tc.want)
		})
	}
}

// TestScrubPartialRunEverySplit places runs of every length from 10 to the
// whole key at every offset of a body and cuts it at every position.
func TestScrubPartialRunEverySplit(t *testing.T) {
	secrets := makeSecrets([][2]string{{partialKey, "<K>"}})
	for n := 10; n <= len(partialKey); n++ {
		for _, run := range []string{partialKey[:n], partialKey[len(partialKey)-n:]} {
			for pre := 0; pre <= 13; pre += 13 {
				body := strings.Repeat(".", pre) + run + ", " + run
				want := refScrub(body, secrets)
				if n >= MinPartialRun && strings.Contains(want, run[:MinPartialRun]) {
					t.Fatalf("the reference leaves a run of %d: %q", n, want)
				}
				for cut := 0; cut <= len(body); cut++ {
					if got := scrubAll(t, chunks(body, cut), secrets); got != want {
						t.Fatalf("run %q, pre %d, cut %d: got %q, want %q", run, pre, cut, got, want)
					}
				}
			}
		}
	}
}

func TestScrubPartialRunsInHeaders(t *testing.T) {
	secrets := makeSecrets([][2]string{{partialKey, "<K>"}})
	h := http.Header{
		"X-Echo":                      {"key=" + partialKey[:29], "clean", "whole " + partialKey},
		"X-" + partialKey[2:16]:       {"named by a run"},
		"Www-Authenticate":            {`Bearer error="invalid_token", token="` + partialKey[1:] + `"`},
		"X-Eleven-" + partialKey[:11]: {"too short to be a run"},
	}
	ScrubHeader(h, secrets)
	want := http.Header{
		"X-Echo":                      {"key=" + stars(29), "clean", "whole <K>"},
		"X-" + stars(14):              {"named by a run"},
		"Www-Authenticate":            {`Bearer error="invalid_token", token="` + stars(29) + `"`},
		"X-Eleven-" + partialKey[:11]: {"too short to be a run"},
	}
	if got, w := headerString(h), headerString(want); got != w {
		t.Errorf("got %q, want %q", got, w)
	}
}

// TestScrubPartialHoldback: a stream holds back only the tail that more
// input could make part of a run (at most MinPartialRun-1 bytes, each in
// the secret), releases the rest of a run at once, and the held tail at EOF.
func TestScrubPartialHoldback(t *testing.T) {
	secrets := makeSecrets([][2]string{{partialKey, "<K>"}})
	for _, tc := range []struct {
		chunk, released string
	}{
		{"data: {\"k\":1}\n\n", "data: {\"k\":1}\n\n"},
		{"data: " + partialKey[2:20], "data: " + stars(7)}, // a run: its last 11 bytes may go on
		{"data: live", "data: "},                           // may begin a run
		{"data: abc", "data: abc"},                         // "a" is not in the key
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

// fuzzSecret keeps the bytes of s a secret may hold in FuzzScrubPartial:
// none of the placeholders' or the mask's, so that a window of the output
// holding a replacement byte can never be a window of a secret, and the
// check that no window of a secret survives is exact.
func fuzzSecret(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '<' || r == '>' || r == '#' || r == PartialMask {
			return -1
		}
		return r
	}, s)
}

// fuzzInput interleaves pieces of text with pieces of the secrets, as recipe
// says (three bytes a step: what, where, how long), so that runs of every
// length land everywhere.
func fuzzInput(text string, recipe []byte, secrets []string) string {
	var b strings.Builder
	for ; len(recipe) >= 3; recipe = recipe[3:] {
		op, a, n := int(recipe[0]), int(recipe[1]), int(recipe[2])
		if op%4 == 0 || len(secrets) == 0 {
			k := min(n%16+1, len(text))
			b.WriteString(text[:k])
			text = text[k:]
			continue
		}
		s := secrets[op%len(secrets)]
		if op%4 == 3 {
			b.WriteString(s)
			continue
		}
		lo := a % (len(s) + 1)
		b.WriteString(s[lo : lo+n%(len(s)-lo+1)])
	}
	b.WriteString(text)
	return b.String()
}

// FuzzScrubPartial: for any input and any cutting of it into reads, the
// streaming scrub equals the one-shot scrub (ScrubString) and the
// specification (refScrub), and no window of MinPartialRun bytes of any
// secret survives in the output.
func FuzzScrubPartial(f *testing.F) {
	f.Add("prefix: suffix: tail", partialKey, "", []byte{0, 0, 7, 1, 0, 29, 0, 0, 8, 1, 1, 29}, []byte{5})
	f.Add("x y", "aaaa-0123456789ABCDEF", "89ABCDEF-zzzz-9876", []byte{0, 0, 0, 1, 5, 16, 2, 0, 16, 0, 0, 0}, []byte{1})
	f.Add("abc", "aaaaaaaaaaab", "aa", []byte{1, 0, 12, 2, 0, 2, 1, 1, 11}, []byte{0, 3, 31})
	f.Add("data: {}\n\n", strings.Repeat("ab", 9), "", []byte{1, 1, 14, 0, 0, 3, 3, 0, 0, 1, 0, 12}, []byte{10, 2})
	f.Add("", "twelve-bytes", "short-key", []byte{3, 0, 0, 1, 0, 11, 1, 1, 12, 2, 0, 9}, []byte{})
	f.Fuzz(func(t *testing.T, text, s1, s2 string, recipe, cuts []byte) {
		s1, s2 = fuzzSecret(s1), fuzzSecret(s2)
		if s1 == "" || len(s1) > 80 || len(s2) > 80 || len(text) > 2048 || len(recipe) > 300 {
			t.Skip()
		}
		secrets := []*Secret{{value: s1, placeholder: "<#>"}}
		values := []string{s1}
		if s2 != "" {
			secrets = append(secrets, &Secret{value: s2, placeholder: "<##>"})
			values = append(values, s2)
		}
		in := fuzzInput(text, recipe, values)
		want := refScrub(in, secrets)
		if got := ScrubString(in, secrets); got != want {
			t.Fatalf("one-shot: got %q, want %q", got, want)
		}
		cr := &chunkReader{}
		rest := in
		for i := 0; len(rest) > 0; i++ {
			n := len(rest)
			if len(cuts) > 0 {
				n = min(int(cuts[i%len(cuts)])%40+1, len(rest))
			}
			cr.chunks = append(cr.chunks, []byte(rest[:n]))
			rest = rest[n:]
		}
		out := scrubAll(t, cr, secrets)
		if out != want {
			t.Fatalf("streamed: got %q, want %q (one-shot)", out, want)
		}
		for _, s := range values {
			for i := 0; i+MinPartialRun <= len(s); i++ {
				if strings.Contains(out, s[i:i+MinPartialRun]) {
					t.Fatalf("%q of a secret survives in %q", s[i:i+MinPartialRun], out)
				}
			}
		}
	})
}

// The run filter grows with the windows it holds (a host whose rules held
// many keys): with 40 keys it is at its largest, and the scrub is still
// the specification's, one-shot and streamed.
func TestScrubManySecretsLargeFilter(t *testing.T) {
	x := uint32(3)
	rnd := func(n int) int { x = x*1664525 + 1013904223; return int(x>>8) % n }
	const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
	var secrets []*Secret
	var values []string
	for i := range 40 {
		b := []byte("sk-many-")
		for range 40 + rnd(40) {
			b = append(b, alphabet[rnd(len(alphabet))])
		}
		values = append(values, string(b))
		secrets = append(secrets, &Secret{value: string(b), placeholder: fmt.Sprintf("<#%d>", i)})
	}
	m := buildScrubber(secrets)
	if m.filter == nil || len(m.filter.bits)*64 != 1<<maxFilterBits {
		t.Fatalf("the filter of 40 keys has %d bits, want the largest, %d", len(m.filter.bits)*64, 1<<maxFilterBits)
	}
	recipe := make([]byte, 900)
	for i := range recipe {
		recipe[i] = byte(rnd(256))
	}
	in := fuzzInput(strings.Repeat("some text of an answer, ", 200), recipe, values)
	want := refScrub(in, secrets)
	if got := ScrubString(in, secrets); got != want {
		t.Fatalf("one-shot: got %q, want %q", got, want)
	}
	for _, size := range []int{1, 7, 100, 1 << 20} {
		cr := &chunkReader{}
		for rest := in; len(rest) > 0; {
			n := min(size, len(rest))
			cr.chunks = append(cr.chunks, []byte(rest[:n]))
			rest = rest[n:]
		}
		if out := scrubAll(t, cr, secrets); out != want {
			t.Fatalf("streamed in %d: differs from the specification", size)
		}
	}
}
