package audit

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// The credentials a command line commonly carries are redacted, each
// spelling of them.
func TestCommandLineRedacts(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"npm", "install", "left-pad"}, "npm install left-pad"},
		{[]string{"curl", "-H", "Authorization: Bearer sk-live-123", "https://api.example.com/v1"}, "curl -H Authorization: [REDACTED] https://api.example.com/v1"},
		{[]string{"curl", "-H", "x-api-key:sk-1"}, "curl -H x-api-key: [REDACTED]"},
		{[]string{"curl", "-H", "COOKIE : a=b"}, "curl -H COOKIE: [REDACTED]"},
		{[]string{"git", "clone", "https://x-access-token:ghp_abc@github.com/o/r.git"}, "git clone https://[REDACTED]@github.com/o/r.git"},
		{[]string{"git", "clone", "https://ghp_abc@github.com/o/r.git"}, "git clone https://[REDACTED]@github.com/o/r.git"},
		{[]string{"sh", "-c", "curl https://u:p@a.example/x && curl https://b.example/@y"}, "sh -c curl https://[REDACTED]@a.example/x && curl https://b.example/@y"},
		{[]string{"tool", "--token=abc", "--api-key", "k", "--password", "p", "--verbose"}, "tool --token=[REDACTED] --api-key [REDACTED] --password [REDACTED] --verbose"},
		{[]string{"env", "GITHUB_TOKEN=ghp_x", "AWS_SECRET_ACCESS_KEY=s", "HOME=/root", "cmd"}, "env GITHUB_TOKEN=[REDACTED] AWS_SECRET_ACCESS_KEY=[REDACTED] HOME=/root cmd"},
		{[]string{"echo", "line\nbreak\x1b[31m"}, "echo line?break?[31m"},
		{nil, ""},
	} {
		if got := CommandLine(c.args); got != c.want {
			t.Errorf("CommandLine(%q)\n got %q\nwant %q", c.args, got, c.want)
		}
	}
}

func TestCommandLineIsCut(t *testing.T) {
	long := []string{"node", strings.Repeat("é", 300)}
	for range 10000 {
		long = append(long, "x")
	}
	got := CommandLine(long)
	if len(got) > MaxCmd || !utf8.ValidString(got) || !strings.HasSuffix(got, "…") {
		t.Errorf("a long command line is %d bytes: %q", len(got), got)
	}
}

func FuzzCommandLine(f *testing.F) {
	f.Add("curl", "-H", "Authorization: Bearer x")
	f.Add("git", "clone", "https://a:b@c/d")
	f.Add("\xff", "--token", "\x00")
	f.Fuzz(func(t *testing.T, a, b, c string) {
		got := CommandLine([]string{a, b, c})
		if len(got) > MaxCmd || !utf8.ValidString(got) {
			t.Fatalf("%q: %d bytes, valid %v", got, len(got), utf8.ValidString(got))
		}
		for _, r := range got {
			if r < 0x20 || r == 0x7f {
				t.Fatalf("a control character in %q", got)
			}
		}
		if len(b) > 14 && strings.EqualFold(b[:14], "authorization:") {
			if one := CommandLine([]string{b}); one != b[:13]+": "+Redacted && utf8.ValidString(b[:13]) {
				t.Fatalf("the Authorization argument %q is rendered %q", b, one)
			}
		}
	})
}
