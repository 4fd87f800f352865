package transforms

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// FuzzParseRules: ParseRules never panics, never lets the environment's
// value into an error or a printed rule, and a document it accepts parses
// to rules that apply without panicking.
func FuzzParseRules(f *testing.F) {
	for _, s := range []string{
		`[]`,
		`[{"match":{"host":"api.anthropic.com","path":{"startsWith":"/v1/"},"method":["POST"]},"transform":{"headers":{"x-api-key":{"env":"ANTHROPIC_API_KEY"}}}}]`,
		`[{"match":{"host":"*.example.com","queryString":[{"key":{"exact":"a"},"value":{"regex":"^b$"}}],"headers":[{"key":{"regex":"(?i)x-"}}]},"transform":{"headers":{"authorization":{"env":"K","prefix":"Bearer ","placeholder":"ph-K"},"x":"lit"}}}]`,
		`[{"match":{"host":"h.example","path":{"regex":"("}},"transform":{"headers":{"x":"y"}}}]`,
		`[{"match":{"host":"h"},"transform":{"headers":{"x":{"env":"K","placeholder":"a-` + canary + `-b"}}}}]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		env := func(string) (string, bool) { return canary, true }
		rules, err := ParseRules(data, env)
		inInput := strings.Contains(string(data), canary) // then text echoed from the file may hold it
		if err != nil {
			if rules != nil {
				t.Fatalf("got rules with error %v", err)
			}
			if !inInput && strings.Contains(fmt.Sprintf("%v %+v %#v", err, err, err), canary) {
				t.Fatalf("error carries the secret: %v", err)
			}
			return
		}
		if inInput {
			return
		}
		var b strings.Builder
		for _, r := range rules {
			fmt.Fprintf(&b, "%v %+v %#v %s %q %x", r, r, r, r, r, r)
			j, _ := json.Marshal(r)
			b.Write(j)
			slog.New(slog.NewJSONHandler(&b, nil)).Info("rule", "r", r, "s", r.Secrets())
		}
		if strings.Contains(b.String(), canary) {
			t.Fatalf("a rule prints the secret: %s", b.String())
		}
		set := NewRuleSet(rules...)
		for _, r := range rules {
			host := strings.TrimPrefix(r.Host(), "*.")
			req := &http.Request{Method: "POST", Header: http.Header{"X-A": {"b"}},
				URL: &url.URL{Scheme: "https", Host: "x." + host, Path: "/v1/a", RawQuery: "a=b"}}
			set.Apply(req)
		}
	})
}

// FuzzScrubReader: whatever the secrets and however the input is cut into
// reads, the scrub reader's output equals the specification (refScrub: the
// left-to-right, non-overlapping, longest-first replacement of whole
// secrets — strings.ReplaceAll for one secret shorter than MinPartialRun —
// with runs of MinPartialRun bytes of a secret masked), and it never holds
// back more than it must.
func FuzzScrubReader(f *testing.F) {
	f.Add("a SECRET-123 b", "SECRET-123", "", "<P>", []byte{3, 1, 7})
	f.Add("aaaaaaaaaaaaaaaaaaa", "aaaa", "aa", "X", []byte{1})
	f.Add("abababababab", "abab", "bab", "", []byte{2, 5})
	f.Add("data: {\"k\":\"sk-ant-01\"}\n\ndata: sk-ant-0123\n\n", "sk-ant-0123", "sk-ant-01", "sandgate-placeholder-K", []byte{9, 4, 16})
	f.Fuzz(func(t *testing.T, in, s1, s2, ph string, cuts []byte) {
		if len(s1) == 0 || len(s1) > 64 || len(s2) > 64 || len(in) > 4096 {
			t.Skip()
		}
		secrets := []*Secret{{value: s1, placeholder: ph}}
		if s2 != "" {
			secrets = append(secrets, &Secret{value: s2, placeholder: ph + "2"})
		}
		want := refScrub(in, secrets)
		if (s2 == "" || s2 == s1) && len(s1) < MinPartialRun {
			if rep := strings.ReplaceAll(in, s1, ph); rep != want {
				t.Fatalf("reference %q differs from strings.ReplaceAll %q", want, rep)
			}
		}
		// Cut the input into reads of the sizes given (1 to 32 bytes).
		cr := &chunkReader{}
		rest := in
		for i := 0; len(rest) > 0; i++ {
			n := len(rest)
			if len(cuts) > 0 {
				n = min(int(cuts[i%len(cuts)])%32+1, len(rest))
			}
			cr.chunks = append(cr.chunks, []byte(rest[:n]))
			rest = rest[n:]
		}
		r := NewScrubReader(cr, secrets).(*scrubReader)
		var out strings.Builder
		buf := make([]byte, 1+len(cuts)%50)
		for {
			n, err := r.Read(buf)
			out.Write(buf[:n])
			if held := len(r.in) - r.ctx; r.err == nil && (held > r.m.maxHold || r.ctx >= MinPartialRun) {
				t.Fatalf("holding %d bytes and %d of context, want at most %d (the longest secret or MinPartialRun, less one) and %d",
					held, r.ctx, r.m.maxHold, MinPartialRun-1)
			}
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		if out.String() != want {
			t.Fatalf("got %q, want %q", out.String(), want)
		}
	})
}
