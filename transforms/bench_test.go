package transforms

import (
	"fmt"
	"io"
	"strings"
	"testing"
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
