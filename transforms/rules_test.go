package transforms

import (
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"regexp/syntax"
	"strings"
	"testing"
)

func noEnv(string) (string, bool) { return "", false }

// ruleJSON wraps a match object into a one-rule document setting X-Set: yes.
func ruleJSON(match string) string {
	return `[{"match":` + match + `,"transform":{"headers":{"X-Set":"yes"}}}]`
}

func newReq(t testing.TB, method, url string, hdr ...string) *http.Request {
	t.Helper()
	r, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	return r
}

func TestMatchers(t *testing.T) {
	type req struct {
		method, url string
		hdr         []string
		want        bool
	}
	get := func(url string, want bool, hdr ...string) req { return req{"GET", url, hdr, want} }
	for _, tc := range []struct {
		name  string
		match string
		reqs  []req
	}{
		{"host exact", `{"host":"api.example.com"}`, []req{
			get("https://api.example.com/x", true),
			get("https://API.Example.COM./x", true),
			get("https://api.example.com:443/x", true),
			get("https://sub.api.example.com/x", false),
			get("https://api.example.com.evil.net/x", false),
			get("https://example.com/x", false),
		}},
		{"host exact written with caps and dot", `{"host":"API.example.com."}`, []req{
			get("https://api.example.com/", true),
		}},
		{"host wildcard", `{"host":"*.example.com"}`, []req{
			get("https://a.example.com/", true),
			get("https://a.b.example.com/", true),
			get("https://A.EXAMPLE.com./", true),
			get("https://example.com/", false),
			get("https://aexample.com/", false),
			get("https://example.com.evil.net/", false),
		}},
		{"host ip", `{"host":"192.0.2.7"}`, []req{
			get("https://192.0.2.7/", true),
			get("https://192.0.2.70/", false),
		}},
		{"host ipv6", `{"host":"2001:DB8::1"}`, []req{
			get("https://[2001:db8:0::1]:443/", true),
			get("https://[2001:db8::2]/", false),
		}},
		{"path exact", `{"host":"h.example","path":{"exact":"/v1/messages"}}`, []req{
			get("https://h.example/v1/messages", true),
			get("https://h.example/v1/messages?x=1", true),
			get("https://h.example/v1/messages/", false),
			get("https://h.example/V1/messages", false),
		}},
		{"path startsWith", `{"host":"h.example","path":{"startsWith":"/v1/"}}`, []req{
			get("https://h.example/v1/messages", true),
			get("https://h.example/v1/", true),
			get("https://h.example/v2/v1/", false),
			get("https://h.example/v1/../admin", false),
			get("https://h.example/v1/%2e%2E/admin", false),
			get("https://h.example/v1/./x", false),
		}},
		{"path regex unanchored", `{"host":"h.example","path":{"regex":"/models/[a-z]+"}}`, []req{
			get("https://h.example/v1/models/abc/x", true),
			get("https://h.example/v1/models/123", false),
		}},
		{"path regex anchored", `{"host":"h.example","path":{"regex":"^/v1/models$"}}`, []req{
			get("https://h.example/v1/models", true),
			get("https://h.example/v1/models/x", false),
		}},
		{"path matches the wire form", `{"host":"h.example","path":{"exact":"/a%41b"}}`, []req{
			get("https://h.example/a%41b", true),
			get("https://h.example/aAb", false),
		}},
		// Regression (review): paths an upstream may read as another path
		// match no path matcher, so the secret is not sent to them.
		{"ambiguous paths fail closed", `{"host":"h.example","path":{"startsWith":"/v1/public/"}}`, []req{
			get("https://h.example/v1/public/x", true),
			get("https://h.example/v1/public/..;/admin", false),
			get("https://h.example/v1/public/..%2Fadmin", false),
			get("https://h.example/v1/public/%2e%2e%2fadmin", false),
			get("https://h.example/v1/public/%252e%252e/admin", false),
			get("https://h.example/v1/public/a%2Fb", false),
			get("https://h.example/v1/public/a%5Cb", false),
			get("https://h.example/v1/public/verylongsegment/..", false),
		}},
		{"method", `{"host":"h.example","method":["post","PUT"]}`, []req{
			{"POST", "https://h.example/", nil, true},
			{"PUT", "https://h.example/", nil, true},
			{"GET", "https://h.example/", nil, false},
		}},
		{"query exact key, regex value", `{"host":"h.example","queryString":[{"key":{"exact":"beta"},"value":{"regex":"^(true|1)$"}}]}`, []req{
			get("https://h.example/?beta=true", true),
			get("https://h.example/?a=b&beta=1", true),
			get("https://h.example/?beta=false", false),
			get("https://h.example/?Beta=true", false),
			get("https://h.example/", false),
			get("https://h.example/?beta=true&x=%zz", false), // malformed: fail closed
		}},
		{"query key only, startsWith", `{"host":"h.example","queryString":[{"key":{"startsWith":"api_"}}]}`, []req{
			get("https://h.example/?api_version=1", true),
			get("https://h.example/?version=1", false),
		}},
		{"query value only", `{"host":"h.example","queryString":[{"value":{"exact":"a b"}}]}`, []req{
			get("https://h.example/?x=a+b", true),
			get("https://h.example/?x=a%20b", true),
			get("https://h.example/?x=ab", false),
		}},
		{"query every matcher must match", `{"host":"h.example","queryString":[{"key":{"exact":"a"}},{"key":{"exact":"b"}}]}`, []req{
			get("https://h.example/?a=1&b=2", true),
			get("https://h.example/?a=1", false),
		}},
		{"header key case-insensitive exact", `{"host":"h.example","headers":[{"key":{"exact":"Anthropic-Version"},"value":{"exact":"2023-06-01"}}]}`, []req{
			get("https://h.example/", true, "anthropic-version", "2023-06-01"),
			get("https://h.example/", true, "ANTHROPIC-VERSION", "2023-06-01"),
			get("https://h.example/", false, "anthropic-version", "2023-06-02"),
			get("https://h.example/", false),
		}},
		{"header key startsWith folds case", `{"host":"h.example","headers":[{"key":{"startsWith":"X-STAINLESS-"}}]}`, []req{
			get("https://h.example/", true, "x-stainless-lang", "js"),
			get("https://h.example/", false, "x-other", "js"),
		}},
		{"header key regex folds case", `{"host":"h.example","headers":[{"key":{"regex":"^x-trace-[0-9]+$"}}]}`, []req{
			get("https://h.example/", true, "X-Trace-42", "1"),
			get("https://h.example/", false, "X-Trace-a", "1"),
		}},
		{"header value is case-sensitive", `{"host":"h.example","headers":[{"value":{"startsWith":"Bearer "}}]}`, []req{
			get("https://h.example/", true, "Authorization", "Bearer x"),
			get("https://h.example/", false, "Authorization", "bearer x"),
		}},
		// Regression (review): a repeated key must not satisfy the rule with
		// one value while the upstream acts on another.
		{"header: every value of a matched key must match", `{"host":"h.example","headers":[{"key":{"exact":"accept"},"value":{"exact":"b"}}]}`, []req{
			get("https://h.example/", false, "Accept", "a", "Accept", "b"),
			get("https://h.example/", true, "Accept", "b", "Accept", "b"),
		}},
		{"query: every value of a matched key must match", `{"host":"h.example","queryString":[{"key":{"exact":"org"},"value":{"exact":"mine"}}]}`, []req{
			get("https://h.example/x?org=mine", true),
			get("https://h.example/x?org=victim&org=mine", false),
			get("https://h.example/x?org=mine&org=victim", false),
		}},
		{"all matchers together", `{"host":"h.example","path":{"startsWith":"/v1"},"method":["POST"],"queryString":[{"key":{"exact":"k"}}],"headers":[{"key":{"exact":"x"}}]}`, []req{
			{"POST", "https://h.example/v1?k=1", []string{"X", "1"}, true},
			{"GET", "https://h.example/v1?k=1", []string{"X", "1"}, false},
			{"POST", "https://h.example/v2?k=1", []string{"X", "1"}, false},
			{"POST", "https://h.example/v1?j=1", []string{"X", "1"}, false},
			{"POST", "https://h.example/v1?k=1", nil, false},
			{"POST", "https://other.example/v1?k=1", []string{"X", "1"}, false},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rules, err := ParseRules([]byte(ruleJSON(tc.match)), noEnv)
			if err != nil {
				t.Fatal(err)
			}
			set := NewRuleSet(rules...)
			for _, r := range tc.reqs {
				req := newReq(t, r.method, r.url, r.hdr...)
				a := set.Apply(req)
				got := req.Header.Get("X-Set") == "yes"
				if got != r.want || (len(a.Rules) == 1) != r.want {
					t.Errorf("%s %s %q: got match %v (applied %q), want %v", r.method, r.url, r.hdr, got, a.Rules, r.want)
				}
			}
		})
	}
}

func TestParseRulesErrors(t *testing.T) {
	okT := `"transform":{"headers":{"x":"y"}}`
	for _, tc := range []struct {
		name, doc string
		index     int
		field     string
		want      string
	}{
		{"not json", `[{`, 0, "", "invalid JSON"},
		{"not a list", `{"match":{}}`, -1, "", "want a JSON list"},
		{"null", `null`, -1, "", "want a JSON list"},
		{"trailing data", `[] []`, -1, "", "unexpected data after"},
		{"rule not object", `[1]`, 0, "", "want a JSON object"},
		{"unknown top key", `[{"match":{"host":"h.example"},` + okT + `,"name":"x"}]`, 0, "name", `unknown key "name"`},
		{"key case matters", `[{"Match":{"host":"h.example"},` + okT + `}]`, 0, "Match", `unknown key "Match"`},
		{"duplicate key", `[{"match":{"host":"h.example"},"match":{"host":"h.example"},` + okT + `}]`, 0, "match", "given twice"},
		{"missing match", `[{` + okT + `}]`, 0, "match", "is required"},
		{"missing transform", `[{"match":{"host":"h.example"}}]`, 0, "transform", "is required"},
		{"missing host", `[{"match":{"path":{"exact":"/"}},` + okT + `}]`, 0, "match.host", "is required"},
		{"unknown match key", `[{"match":{"host":"h.example","hots":"x"},` + okT + `}]`, 0, "match.hots", `unknown key "hots"`},
		{"host not string", `[{"match":{"host":3},` + okT + `}]`, 0, "match.host", "want a string, got a number"},
		{"host empty", `[{"match":{"host":""},` + okT + `}]`, 0, "match.host", "is empty"},
		{"host star", `[{"match":{"host":"*"},` + okT + `}]`, 0, "match.host", "wildcard is allowed only"},
		{"host inner star", `[{"match":{"host":"*.*.example.com"},` + okT + `}]`, 0, "match.host", "wildcard is allowed only"},
		{"host with port", `[{"match":{"host":"h.example:443"},` + okT + `}]`, 0, "match.host", "without scheme, port"},
		{"host url", `[{"match":{"host":"https://h.example"},` + okT + `}]`, 0, "match.host", "without scheme"},
		{"host unicode", `[{"match":{"host":"*.exämple.com"},` + okT + `}]`, 0, "match.host", `use "*.xn--exmple-cua.com"`},
		{"host empty label", `[{"match":{"host":"a..b"},` + okT + `}]`, 0, "match.host", "empty label"},
		{"path two kinds", `[{"match":{"host":"h.example","path":{"exact":"/","regex":"/"}},` + okT + `}]`, 0, "match.path", "exactly one"},
		{"path none", `[{"match":{"host":"h.example","path":{}},` + okT + `}]`, 0, "match.path", "exactly one"},
		{"path unknown kind", `[{"match":{"host":"h.example","path":{"prefix":"/"}},` + okT + `}]`, 0, "match.path.prefix", `unknown key "prefix"`},
		{"path not object", `[{"match":{"host":"h.example","path":"/v1"},` + okT + `}]`, 0, "match.path", "want a JSON object"},
		{"bad regex", `[{"match":{"host":"h.example","path":{"regex":"(a"}},` + okT + `}]`, 0, "match.path.regex", "not a valid RE2"},
		{"perl regex", `[{"match":{"host":"h.example","path":{"regex":"(?=a)"}},` + okT + `}]`, 0, "match.path.regex", "not a valid RE2"},
		{"method string", `[{"match":{"host":"h.example","method":"POST"},` + okT + `}]`, 0, "match.method", "want a list"},
		{"method empty", `[{"match":{"host":"h.example","method":[]},` + okT + `}]`, 0, "match.method", "is empty"},
		{"method bad", `[{"match":{"host":"h.example","method":["PO ST"]},` + okT + `}]`, 0, "match.method[0]", "not an HTTP method"},
		{"query not list", `[{"match":{"host":"h.example","queryString":{"key":{"exact":"a"}}},` + okT + `}]`, 0, "match.queryString", "want a list"},
		{"query empty pair", `[{"match":{"host":"h.example","queryString":[{}]},` + okT + `}]`, 0, "match.queryString[0]", "needs a"},
		{"query unknown", `[{"match":{"host":"h.example","queryString":[{"name":{"exact":"a"}}]},` + okT + `}]`, 0, "match.queryString[0].name", "unknown key"},
		{"header bad regex", `[{"match":{"host":"h.example","headers":[{"key":{"exact":"a"}},{"value":{"regex":"["}}]},` + okT + `}]`, 0, "match.headers[1].value.regex", "not a valid RE2"},
		{"transform unknown", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":"y"},"body":"z"}}]`, 0, "transform.body", "unknown key"},
		{"transform no headers", `[{"match":{"host":"h.example"},"transform":{}}]`, 0, "transform.headers", "is required"},
		{"transform empty headers", `[{"match":{"host":"h.example"},"transform":{"headers":{}}}]`, 0, "transform.headers", "is empty"},
		{"header bad name", `[{"match":{"host":"h.example"},"transform":{"headers":{"a b":"y"}}}]`, 0, `transform.headers["a b"]`, "not a valid HTTP header name"},
		{"header hop", `[{"match":{"host":"h.example"},"transform":{"headers":{"host":"y"}}}]`, 0, "transform.headers.host", "cannot be set by a rule"},
		{"header content-length", `[{"match":{"host":"h.example"},"transform":{"headers":{"Content-Length":"1"}}}]`, 0, `transform.headers["Content-Length"]`, "cannot be set"},
		{"header dup case", `[{"match":{"host":"h.example"},"transform":{"headers":{"X-A":"1","x-a":"2"}}}]`, 0, `transform.headers["x-a"]`, "same header"},
		{"header bad value", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":"a\r\nb: c"}}}]`, 0, "transform.headers.x", "not allowed in an HTTP header"},
		{"header value number", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":1}}}]`, 0, "transform.headers.x", `{"env": "NAME"}`},
		{"env unknown key", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":{"env":"K","Prefix":"a"}}}}]`, 0, "transform.headers.x.Prefix", "unknown key"},
		{"env missing key", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":{"prefix":"a"}}}}]`, 0, "transform.headers.x.env", "is required"},
		{"env empty name", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":{"env":""}}}}]`, 0, "transform.headers.x.env", "not an environment variable name"},
		{"env not set", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":{"env":"NOPE_KEY"}}}}]`, 0, "transform.headers.x.env", "NOPE_KEY is not set"},
		{"env too short", `[{"match":{"host":"h.example"},"transform":{"headers":{"x":{"env":"SHORT"}}}}]`, 0, "transform.headers.x", "shorter than 8"},
		{"second rule indexed", `[{"match":{"host":"h.example"},` + okT + `},{"match":{"host":"h.example","method":["GET"],"path":{"regex":"*"}},` + okT + `}]`, 1, "match.path.regex", "not a valid RE2"},
		{"second rule bad json", `[{"match":{"host":"h.example"},` + okT + `},{"match":}]`, 1, "", "invalid JSON at byte 74"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := func(n string) (string, bool) {
				if n == "SHORT" {
					return "abc", true
				}
				return noEnv(n)
			}
			rules, err := ParseRules([]byte(tc.doc), env)
			if err == nil {
				t.Fatalf("got %d rules and no error, want error containing %q", len(rules), tc.want)
			}
			if rules != nil {
				t.Errorf("got %d rules with the error, want none", len(rules))
			}
			var re *RuleError
			if !errors.As(err, &re) {
				t.Fatalf("got %T %v, want *RuleError", err, err)
			}
			if re.Index != tc.index || re.Field != tc.field {
				t.Errorf("got rule %d field %q, want rule %d field %q (%v)", re.Index, re.Field, tc.index, tc.field, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %q, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestParseRulesMissingEnvIs(t *testing.T) {
	_, err := ParseRules([]byte(`[{"match":{"host":"h.example"},"transform":{"headers":{"x":{"env":"NOPE_KEY"}}}}]`), nil)
	if !errors.Is(err, ErrMissingEnv) {
		t.Fatalf("got %v, want ErrMissingEnv", err)
	}
	const want = `transforms: rule[0] transform.headers.x.env: environment variable NOPE_KEY is not set`
	if err.Error() != want {
		t.Errorf("got %q, want %q", err, want)
	}
	_, err = ParseRules([]byte(`[{"match":{"host":"h.example","path":{"regex":"(a"}},"transform":{"headers":{"x":"y"}}}]`), nil)
	var re *syntax.Error
	if !errors.As(err, &re) {
		t.Errorf("got %v, want it to wrap *syntax.Error", err)
	}
}

func TestParseRulesEmptyAndShape(t *testing.T) {
	rules, err := ParseRules([]byte(" [ ] \n"), nil)
	if err != nil || len(rules) != 0 {
		t.Fatalf("got %v, %v; want no rules, no error", rules, err)
	}
	rules, err = ParseRules([]byte(`[{"match":{"host":"*.Example.com."},"transform":{"headers":{"x-b":"1","X-A":{"env":"CANARY","prefix":"Bearer "}}}}]`), canaryEnv)
	if err != nil {
		t.Fatal(err)
	}
	r := rules[0]
	if got, want := r.String(), "rule[0] *.example.com sets X-B,X-A"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if got := r.Host(); got != "*.example.com" {
		t.Errorf("got %q, want %q", got, "*.example.com")
	}
	if s := r.Secrets(); len(s) != 1 || s[0].Name() != "CANARY" {
		t.Errorf("got secrets %v, want one named CANARY", s)
	}
}

func TestParseRulesSharesSecretAndRefusesPlaceholderClash(t *testing.T) {
	rules, err := ParseRules([]byte(`[
	 {"match":{"host":"a.example"},"transform":{"headers":{"x":{"env":"CANARY"}}}},
	 {"match":{"host":"b.example"},"transform":{"headers":{"y":{"env":"CANARY","prefix":"Bearer "}}}}]`), canaryEnv)
	if err != nil {
		t.Fatal(err)
	}
	if rules[0].secrets[0] != rules[1].secrets[0] {
		t.Error("got two secrets for one variable and placeholder, want one shared")
	}
	_, err = ParseRules([]byte(`[{"match":{"host":"a.example"},"transform":{"headers":{
	 "x":{"env":"A_KEY","placeholder":"same-placeholder"},"y":{"env":"B_KEY","placeholder":"same-placeholder"}}}}]`),
		func(n string) (string, bool) { return n + "-value-123", true })
	if err == nil || !strings.Contains(err.Error(), "same placeholder") {
		t.Errorf("got %v, want the placeholder clash refused", err)
	}
}

func TestLoadRulesFile(t *testing.T) {
	env := func(n string) (string, bool) {
		switch n {
		case "ANTHROPIC_API_KEY":
			return "sk-ant-test-0123456789", true
		case "OPENAI_API_KEY":
			return "sk-openai-test-0123456789", true
		}
		return "", false
	}
	rules, err := LoadRulesFile(filepath.Join("testdata", "rules.json"), env)
	if err != nil {
		t.Fatal(err)
	}
	if len(rules) != 3 {
		t.Fatalf("got %d rules, want 3", len(rules))
	}
	set := NewRuleSet(rules...)
	req := newReq(t, "POST", "https://api.anthropic.com/v1/messages", "Anthropic-Version", "2023-06-01")
	a := set.Apply(req)
	if got, want := req.Header.Get("X-Api-Key"), "sk-ant-test-0123456789"; got != want {
		t.Errorf("x-api-key: got %q, want %q", got, want)
	}
	if got, want := strings.Join(a.Rules, "; "), "rule[0] api.anthropic.com"; got != want {
		t.Errorf("applied: got %q, want %q", got, want)
	}
	req = newReq(t, "GET", "https://api.openai.com/v1/models", "Authorization", "Bearer sandgate-placeholder-OPENAI_API_KEY")
	set.Apply(req)
	if got, want := req.Header.Get("Authorization"), "Bearer sk-openai-test-0123456789"; got != want {
		t.Errorf("authorization: got %q, want %q", got, want)
	}

	_, err = LoadRulesFile(filepath.Join("testdata", "rules.json"), noEnv)
	if !errors.Is(err, ErrMissingEnv) || !strings.Contains(err.Error(), "rules.json") {
		t.Errorf("got %v, want ErrMissingEnv naming the file", err)
	}
	_, err = LoadRulesFile(filepath.Join(t.TempDir(), "none.json"), noEnv)
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("got %v, want os.ErrNotExist", err)
	}
}
