package transforms

import (
	"bytes"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"
)

func BenchmarkApply(b *testing.B) {
	var doc strings.Builder
	doc.WriteString("[")
	for i := range 5 {
		fmt.Fprintf(&doc, `{"match":{"host":"h%d.example","path":{"regex":"^/v1/"},"headers":[{"key":{"exact":"anthropic-version"}}]},"transform":{"headers":{"x":"y"}}},`, i)
	}
	doc.WriteString(`{"match":{"host":"api.anthropic.com","path":{"startsWith":"/v1/"},"method":["POST"]},"transform":{"headers":{"x-api-key":{"env":"CANARY"}}}}]`)
	rules, err := ParseRules([]byte(doc.String()), canaryEnv)
	if err != nil {
		b.Fatal(err)
	}
	set := NewRuleSet(rules...)
	base := newReq(b, "POST", "https://api.anthropic.com/v1/messages", "Anthropic-Version", "2023-06-01",
		"Authorization", "Bearer sandgate-placeholder-CANARY", "Content-Type", "application/json", "Accept-Encoding", "gzip, br")
	b.ReportAllocs()
	for b.Loop() {
		req := base.Clone(base.Context())
		if a := set.Apply(req); len(a.Secrets) != 1 {
			b.Fatal("no secret applied")
		}
	}
}

func BenchmarkScrubReader(b *testing.B) {
	secrets := makeSecrets([][2]string{{"sk-ant-api03-0123456789abcdef", "sandgate-placeholder-K"}})
	body := []byte(strings.Repeat("data: {\"type\":\"content_block_delta\",\"text\":\"some streamed tokens sk\"}\n\n", 20000))
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		r := NewScrubReader(strings.NewReader(string(body)), secrets)
		if _, err := io.Copy(io.Discard, r); err != nil {
			b.Fatal(err)
		}
	}
}

// benchKey looks like an Anthropic key: its prefix and 95 characters of
// base64url, the same every run.
var benchKey = makeBenchKey(7)

// makeBenchKey makes a key like benchKey from seed.
func makeBenchKey(seed uint32) string {
	const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
	b := []byte("sk-ant-api03-")
	x := seed
	for range 95 {
		x = x*1664525 + 1013904223
		b = append(b, alphabet[x>>26])
	}
	return string(b)
}

// jsonish returns n bytes of streamed-JSON-like text, the same every run:
// event lines with ids of random base62 (the alphabet of keys) and words.
func jsonish(n int) []byte {
	const base62 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
	words := strings.Fields("the model streamed tokens of text and then stopped because it reached " +
		"end_turn with usage input_tokens output_tokens cache_read lorem ipsum dolor sit amet consectetur")
	var b strings.Builder
	x := uint32(1)
	rnd := func() uint32 { x = x*1664525 + 1013904223; return x >> 8 }
	for i := 0; b.Len() < n; i++ {
		b.WriteString(`data: {"type":"content_block_delta","id":"msg_`)
		for range 24 {
			b.WriteByte(base62[rnd()%62])
		}
		fmt.Fprintf(&b, `","index":%d,"delta":{"type":"text_delta","text":"`, i%7)
		for range 8 {
			b.WriteString(words[rnd()%uint32(len(words))])
			b.WriteByte(' ')
		}
		b.WriteString("\"}}\n\n")
	}
	return []byte(b.String()[:n])
}

// withSecrets puts the key whole, and all of it but its last byte, into
// every 4 KiB of body.
func withSecrets(body []byte) []byte { return withTwo(body, benchKey, benchKey[:len(benchKey)-1]) }

// withTwo puts a in the middle of every 4 KiB of body, and b after it.
func withTwo(body []byte, a, b string) []byte {
	var out []byte
	for len(body) > 0 {
		n := min(4<<10, len(body))
		out = append(out, body[:n/2]...)
		out = append(out, a...)
		out = append(out, body[n/2:n]...)
		out = append(out, b...)
		body = body[n:]
	}
	return out
}

// BenchmarkScrub compares, in one run, this package's scrub (whole secrets
// and partial runs) with the scanner it replaced (whole secrets only,
// oldscrub_test.go), on bodies with no secret and with secrets, streamed
// through a scrub reader ("stream") and, for small bodies, the check that
// a body of known length holds anything to scrub ("check", what Exchange
// does before scrubbing a small body whole).
func BenchmarkScrub(b *testing.B) {
	// Scrubbers are built once, as the proxy does (one per secret, or one
	// per set of rules, cached).
	secrets := []*Secret{newSecret("ANTHROPIC_API_KEY", benchKey, "sandgate-placeholder-ANTHROPIC_API_KEY")}
	oldM, newM := buildOldScrubber(secrets), secrets[0].scrub
	for _, body := range []struct {
		name string
		data []byte
	}{
		{"nosecret-1MiB", jsonish(1 << 20)},
		{"nosecret-4KiB", jsonish(4 << 10)},
		{"secrets-1MiB", withSecrets(jsonish(1 << 20))},
		{"secrets-4KiB", withSecrets(jsonish(4 << 10))},
	} {
		for _, impl := range []struct {
			name string
			r    func(io.Reader) io.Reader
		}{
			{"old", func(r io.Reader) io.Reader {
				return &oldScrubReader{src: r, m: oldM, next: make([]int, len(oldM.pats))}
			}},
			{"new", func(r io.Reader) io.Reader { return NewScrubReader(r, secrets) }},
		} {
			b.Run("stream/"+body.name+"/"+impl.name, func(b *testing.B) {
				b.SetBytes(int64(len(body.data)))
				b.ReportAllocs()
				for b.Loop() {
					if _, err := io.Copy(io.Discard, impl.r(bytes.NewReader(body.data))); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
		if len(body.data) > 64<<10 {
			continue
		}
		b.Run("check/"+body.name+"/old", func(b *testing.B) {
			b.SetBytes(int64(len(body.data)))
			for b.Loop() {
				for _, p := range oldM.pats {
					if bytes.Contains(body.data, p.find) {
						break
					}
				}
			}
		})
		b.Run("check/"+body.name+"/new", func(b *testing.B) {
			b.SetBytes(int64(len(body.data)))
			for b.Loop() {
				newM.findsBytes(body.data)
			}
		})
	}
}

// BenchmarkScrubRetired measures what secrets retired from a host's rules
// cost the scrub of its responses: the same body streamed through the
// scrub of a host whose rules hold one key (the baseline) and of one whose
// rules held R other keys before it (R rotations of the key), with no key
// in the body, and with the current key and the first retired one in
// every 4 KiB. Each iteration scrubs the body with every scrubber in turn,
// so that a loaded machine slows them alike; the metrics are the median,
// over the iterations, of each one's time over the baseline's
// (retired-R/current), and the baseline's time (ns/op is all of them).
func BenchmarkScrubRetired(b *testing.B) {
	keyRules := func(key string) []Rule {
		rules, err := ParseRules([]byte(`[{"match":{"host":"api.anthropic.com"},"transform":{"headers":{"x-api-key":{"env":"ANTHROPIC_API_KEY"}}}}]`),
			func(string) (string, bool) { return key, true })
		if err != nil {
			b.Fatal(err)
		}
		return rules
	}
	// retiredKey is the i-th key before benchKey.
	retiredKey := func(i int) string { return makeBenchKey(uint32(100 + i)) }
	scrubberOf := func(retired int) *scrubber {
		set := NewRuleSet()
		for i := retired - 1; i >= 0; i-- {
			set.Set(keyRules(retiredKey(i))...)
		}
		set.Set(keyRules(benchKey)...)
		return set.cur.Load().targets("api.anthropic.com").m
	}
	counts := []int{0, 1, 4, 16}
	ms := make([]*scrubber, len(counts))
	for i, r := range counts {
		ms[i] = scrubberOf(r)
	}
	for _, body := range []struct {
		name string
		data []byte
	}{
		{"nosecret-1MiB", jsonish(1 << 20)},
		{"keys-1MiB", withTwo(jsonish(1<<20), benchKey, retiredKey(0))},
		{"nosecret-4KiB", jsonish(4 << 10)},
	} {
		b.Run(body.name, func(b *testing.B) {
			b.SetBytes(int64(len(body.data) * len(ms)))
			took := make([][]time.Duration, len(ms))
			for b.Loop() {
				for i, m := range ms {
					start := time.Now()
					if _, err := io.Copy(io.Discard, newScrubReader(bytes.NewReader(body.data), m)); err != nil {
						b.Fatal(err)
					}
					took[i] = append(took[i], time.Since(start))
				}
			}
			for i, r := range counts[1:] {
				ratios := make([]float64, len(took[0]))
				for j := range ratios {
					ratios[j] = float64(took[i+1][j]) / float64(took[0][j])
				}
				slices.Sort(ratios)
				b.ReportMetric(ratios[len(ratios)/2], fmt.Sprintf("retired-%d/current", r))
			}
			base := slices.Clone(took[0])
			slices.Sort(base)
			b.ReportMetric(float64(base[len(base)/2].Nanoseconds()), "current-ns")
		})
	}
}
