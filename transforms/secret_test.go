package transforms

import (
	"bytes"
	"encoding/gob"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
)

// canary is the secret every leak test looks for.
const canary = "sk-canary-7f3e9b1c2d4a5e6f"

func canaryEnv(name string) (string, bool) {
	switch name {
	case "CANARY", "ANTHROPIC_API_KEY":
		return canary, true
	}
	return "", false
}

func mustSecret(t testing.TB, name, value, placeholder string) *Secret {
	t.Helper()
	s, err := NewSecret(name, value, placeholder)
	if err != nil {
		t.Fatalf("NewSecret: %v", err)
	}
	return s
}

// printAll renders v every way a careless caller might.
func printAll(t *testing.T, v any) string {
	t.Helper()
	var b strings.Builder
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%X", "%d", "%T", "%10.3s", "%-20v"} {
		fmt.Fprintf(&b, verb+"\n", v)
	}
	fmt.Fprintln(&b, v)
	fmt.Fprint(&b, v)
	if j, err := json.Marshal(v); err == nil {
		b.Write(j)
	}
	var gb bytes.Buffer
	_ = gob.NewEncoder(&gb).Encode(v)
	b.Write(gb.Bytes())
	for _, h := range []slog.Handler{slog.NewJSONHandler(&b, nil), slog.NewTextHandler(&b, nil)} {
		slog.New(h).Info("msg", "v", v, slog.Any("any", v), slog.Group("g", "v", v))
	}
	return b.String()
}

func TestSecretNeverPrints(t *testing.T) {
	s := mustSecret(t, "CANARY", canary, "")
	rules, err := ParseRules([]byte(`[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY"},"authorization":{"env":"CANARY","prefix":"Bearer "}}}}]`), canaryEnv)
	if err != nil {
		t.Fatal(err)
	}
	set := NewRuleSet(rules...)
	req, _ := http.NewRequest("POST", "https://api.example.com/v1", nil)
	applied := set.Apply(req)
	if len(applied.Secrets) != 1 {
		t.Fatalf("got %d secrets, want 1", len(applied.Secrets))
	}
	values := map[string]any{
		"Secret":      *s,
		"*Secret":     s,
		"[]*Secret":   []*Secret{s},
		"[]Secret":    []Secret{*s},
		"map":         map[string]*Secret{"k": s},
		"Rule":        rules[0],
		"*Rule":       &rules[0],
		"[]Rule":      rules,
		"RuleSet":     set,
		"Applied":     applied,
		"*Applied":    &applied,
		"struct":      struct{ S *Secret }{s},
		"anonymous":   struct{ A Applied }{applied},
		"secretError": fmt.Errorf("wrapped: %v", s),
	}
	for name, v := range values {
		t.Run(name, func(t *testing.T) {
			if out := printAll(t, v); strings.Contains(out, canary) {
				t.Errorf("canary printed:\n%s", out)
			}
		})
	}
	if got := fmt.Sprintf("%v|%s|%#v|%q|%x", s, s, s, s, s); got != strings.Repeat(Redacted+"|", 4)+Redacted {
		t.Errorf("got %q, want every verb to print %q", got, Redacted)
	}
	if got, _ := json.Marshal(s); string(got) != `"[REDACTED]"` {
		t.Errorf("json: got %q, want %q", got, `"[REDACTED]"`)
	}
	if got, _ := s.MarshalText(); string(got) != Redacted {
		t.Errorf("text: got %q, want %q", got, Redacted)
	}
	if _, err := s.GobEncode(); err == nil {
		t.Error("GobEncode: got nil error, want a refusal")
	}
	if got := s.Placeholder(); got != "sandgate-placeholder-CANARY" {
		t.Errorf("placeholder: got %q, want %q", got, "sandgate-placeholder-CANARY")
	}
}

func TestNewSecretErrors(t *testing.T) {
	for _, tc := range []struct {
		name, value, placeholder, want string
	}{
		{"K", "", "", "is empty"},
		{"K", "abc1", "", "shorter than 8 bytes"},
		{"K", "abcdefgh\r\nX: y", "", "not allowed in an HTTP header"},
		{"K", " abcdefgh", "", "not allowed in an HTTP header"},
		{"K", "abcdefgh", "x\ny", "placeholder of secret K"},
		{"K", "abcdefgh", "PH-abcdefgh-PH", "contains the secret's value"},
	} {
		_, err := NewSecret(tc.name, tc.value, tc.placeholder)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewSecret(%q, %q, %q): got %v, want error containing %q", tc.name, tc.value, tc.placeholder, err, tc.want)
			continue
		}
		if tc.value != "" && strings.Contains(err.Error(), tc.value) {
			t.Errorf("error %q contains the value", err)
		}
	}
}

// TestErrorsNeverCarrySecret checks every error the package makes with a
// canary in play.
func TestErrorsNeverCarrySecret(t *testing.T) {
	s := mustSecret(t, "CANARY", canary, "")
	var errs []error
	for _, doc := range []string{
		`[{"match":{"host":"a.example"},"transform":{"headers":{"x":{"env":"CANARY","placeholder":"a-` + "sk-canary-7f3e9b1c2d4a5e6f" + `-b"}}}}]`,
		`[{"match":{"host":"a.example"},"transform":{"headers":{"x":{"env":"CANARY"},"y":{"env":"ANTHROPIC_API_KEY","placeholder":"sandgate-placeholder-CANARY"}}}}]`,
		`[{"match":{"host":"a.example"},"transform":{"headers":{"x":{"env":"MISSING"}}}}]`,
	} {
		_, err := ParseRules([]byte(doc), func(n string) (string, bool) {
			if n == "ANTHROPIC_API_KEY" {
				return canary + "-other", true
			}
			return canaryEnv(n)
		})
		if err == nil {
			t.Fatalf("ParseRules(%s): got nil error", doc)
		}
		errs = append(errs, err)
	}
	resp := &http.Response{Header: http.Header{"Content-Encoding": {"br;" + canary}}, Body: http.NoBody}
	resp.Body = nopCloser{strings.NewReader("x")}
	errs = append(errs, ScrubResponse(resp, []*Secret{s}))
	for _, err := range errs {
		if err == nil {
			t.Fatal("got nil error")
		}
		var re *RuleError
		if errors.As(err, &re) && re.Reason == "" {
			t.Errorf("RuleError without reason: %#v", re)
		}
		if out := fmt.Sprintf("%v %+v %#v %s", err, err, err, err); strings.Contains(out, canary) {
			t.Errorf("error carries the canary: %s", out)
		}
	}
}
