package netpolicy

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestParseHostRule(t *testing.T) {
	good := []struct{ in, want string }{
		{"example.com", "example.com"},
		{"Example.COM.", "example.com"},
		{"*.example.com", "*.example.com"},
		{"*.Example.com", "*.example.com"},
		{"xn--bcher-kva.example", "xn--bcher-kva.example"},
		{"*.com", "*.com"},
	}
	for _, tt := range good {
		r, err := ParseHostRule(tt.in)
		if err != nil || r.String() != tt.want {
			t.Errorf("ParseHostRule(%q) = %q, %v; want %q", tt.in, r, err, tt.want)
		}
	}
	bad := []struct{ in, wantMsg string }{
		{"", "empty"},
		{"*", "allow-all"},
		{"*.", "allow-all"},
		{"*.*", "allow-all"},
		{"*.*.example.com", `one leading "*."`},
		{"a.*.example.com", `one leading "*."`},
		{"ex*mple.com", `one leading "*."`},
		{"1.2.3.4", "add 1.2.3.4/32 to allowedCIDRs"},
		{"2130706433", "add 127.0.0.1/32 to allowedCIDRs"},
		{"::1", "add ::1/128 to allowedCIDRs"},
		{"[::1]", "add ::1/128 to allowedCIDRs"},
		{"éxample.com", `use "xn--xample-9ua.com"`},
		{"*.bücher.example", `use "*.xn--bcher-kva.example"`},
		{"example.com:443", "ports are not part"},
		{"https://example.com", "without scheme"},
		{"a..b", "empty label"},
	}
	for _, tt := range bad {
		r, err := ParseHostRule(tt.in)
		if err == nil {
			t.Errorf("ParseHostRule(%q) = %q, want error", tt.in, r)
			continue
		}
		if !strings.Contains(err.Error(), tt.wantMsg) {
			t.Errorf("ParseHostRule(%q) error %q, want it to contain %q", tt.in, err, tt.wantMsg)
		}
	}
}

func TestHostRuleMatch(t *testing.T) {
	tests := []struct {
		rule, name string
		want       bool
	}{
		{"example.com", "example.com", true},
		{"example.com", "api.example.com", false},
		{"*.example.com", "api.example.com", true},
		{"*.example.com", "a.b.example.com", true},
		{"*.example.com", "example.com", false},
		{"*.example.com", "badexample.com", false},
		{"*.example.com", "example.com.evil.com", false},
		{"example.com", "example.com.evil.com", false},
	}
	for _, tt := range tests {
		r, err := ParseHostRule(tt.rule)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.Match(tt.name); got != tt.want {
			t.Errorf("%q.Match(%q) = %v, want %v", tt.rule, tt.name, got, tt.want)
		}
	}
}

func TestParsePolicy(t *testing.T) {
	good := []string{
		`{"mode":"allow-all"}`,
		`{"mode":"deny-all"}`,
		`{"mode":"custom"}`,
		`{"mode":"custom","allowedHosts":["api.anthropic.com","*.example.com"],"allowedCIDRs":["203.0.113.0/24"],"deniedCIDRs":["2001:db8::/32"]}`,
		`{"mode":"custom","allowedHosts":["api.github.com"],"intercept":["api.github.com","*.example.com"]}`,
		`{"mode":"allow-all","intercept":["api.github.com"]}`,
	}
	for _, in := range good {
		p, err := ParsePolicy([]byte(in))
		if err != nil {
			t.Errorf("ParsePolicy(%s): %v", in, err)
			continue
		}
		out, err := json.Marshal(p)
		if err != nil || string(out) != in {
			t.Errorf("ParsePolicy(%s) marshals back as %s (%v)", in, out, err)
		}
	}
	bad := []struct{ in, wantMsg string }{
		{`{}`, `"mode" is required`},
		{`{"mode":"allow"}`, `unknown mode "allow"`},
		{`{"mode":"custom","allowedHost":["a.com"]}`, `unknown key "allowedHost"`},
		{`{"mode":"allow-all","allowedHosts":["a.com"]}`, `takes no rules`},
		{`{"mode":"custom","allowedHosts":["*"]}`, `allow-all`},
		{`{"mode":"custom","allowedCIDRs":["10.0.0.1/8"]}`, `use 10.0.0.0/8`},
		{`{"mode":"custom","allowedCIDRs":["10.0.0.1"]}`, `10.0.0.1/32`},
		{`{"mode":"custom","deniedCIDRs":["ten"]}`, `deniedCIDRs entry "ten"`},
		{`{"mode":"custom","allowedHosts":"a.com"}`, `"allowedHosts" must be []string`},
		{`{"mode":"custom"} {}`, `trailing data`},
		{`[`, `unexpected EOF`},
		{`{"mode":"deny-all","intercept":["a.com"]}`, `intercepts none`},
		{`{"mode":"custom","intercept":["*"]}`, `intercept: host rule "*"`},
		{`{"mode":"custom","intercept":["10.0.0.1"]}`, `allowedCIDRs`},
		{`{"mode":"custom","intercept":["a.com:443"]}`, `ports are not part`},
	}
	for _, tt := range bad {
		_, err := ParsePolicy([]byte(tt.in))
		if err == nil {
			t.Errorf("ParsePolicy(%s) succeeded, want error", tt.in)
			continue
		}
		if !errors.Is(err, ErrInvalidPolicy) {
			t.Errorf("ParsePolicy(%s) error %v is not ErrInvalidPolicy", tt.in, err)
		}
		if !strings.Contains(err.Error(), tt.wantMsg) {
			t.Errorf("ParsePolicy(%s) error %q, want it to contain %q", tt.in, err, tt.wantMsg)
		}
	}
}

func TestInterceptsMatchesNamesNotAddresses(t *testing.T) {
	p, err := ParsePolicy([]byte(`{"mode":"custom","intercept":["api.github.com","*.example.com"]}`))
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]string{
		"api.github.com": "api.github.com", "API.GitHub.com.": "api.github.com", "a.example.com": "*.example.com",
		"example.com": "", "github.com": "", "198.18.0.2": "", "api.github.com.evil.test": "",
	} {
		h, err := CanonicalHost(host)
		if err != nil {
			t.Fatal(err)
		}
		r, ok := p.Intercepts(h)
		if got := r.String(); ok != (want != "") || got != want {
			t.Errorf("Intercepts(%s) = %q, %v; want %q", host, got, ok, want)
		}
	}
}

func FuzzParsePolicy(f *testing.F) {
	for _, s := range []string{`{"mode":"allow-all"}`, `{"mode":"custom","allowedHosts":["*.example.com"],"allowedCIDRs":["1.2.3.0/24"],"deniedCIDRs":["::/0"]}`, `{"mode":"custom","allowedHosts":["bücher.de"]}`, `{"mode":"custom","intercept":["*.example.com"]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := ParsePolicy(data)
		if err != nil {
			if !errors.Is(err, ErrInvalidPolicy) {
				t.Fatalf("error %v is not ErrInvalidPolicy", err)
			}
			return
		}
		out, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		p2, err := ParsePolicy(out)
		if err != nil {
			t.Fatalf("policy %s does not parse again: %v", out, err)
		}
		out2, _ := json.Marshal(p2)
		if string(out) != string(out2) {
			t.Fatalf("round trip changed the policy: %s then %s", out, out2)
		}
		for _, r := range p.AllowedHosts {
			if strings.Count(r.String(), "*") > 1 || (strings.Contains(r.String(), "*") && !strings.HasPrefix(r.String(), "*.")) {
				t.Fatalf("accepted wildcard rule %q", r)
			}
		}
	})
}
