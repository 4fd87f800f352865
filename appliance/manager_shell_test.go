package appliance

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
)

// In an image without bash, a session's commands run with sh from the
// session's directory and variables as kept (its seed), and keep nothing
// they change; with bash they carry.
func TestSessionWithoutBash(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("box", CreateOptions{})
	ctx := r.ctx()
	if err := r.m.CreateSession(ctx, "box", "s", Session{Dir: "/root", Env: map[string]string{"GIVEN": "it's kept"}}); err != nil {
		t.Fatal(err)
	}
	run := func(argv ...string) string {
		t.Helper()
		p, err := r.m.Exec(ctx, "box", ExecRequest{Args: argv, Session: "s"})
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		if _, err := p.Follow(ctx, 0, func(_ int, b []byte) error { out.Write(b); return nil }, func() {}); err != nil {
			t.Fatal(err)
		}
		return out.String()
	}
	r.m.mu.Lock()
	b := r.m.boxes["box"]
	r.m.mu.Unlock()
	b.sessions.mu.Lock()
	b.sessions.bash, b.sessions.bashLooked = "", true // as if the image had none
	b.sessions.mu.Unlock()
	if got := run("sh", "-c", `cd /tmp; export X=1; echo "$(pwd) $GIVEN"`); got != "/tmp it's kept\n" {
		t.Errorf("without bash, a session's command: %q", got)
	}
	if got := run("sh", "-c", `echo "$(pwd) ${X-none} $GIVEN"`); got != "/root none it's kept\n" {
		t.Errorf("without bash, the next command: %q, want the state kept, unchanged", got)
	}
	b.sessions.mu.Lock()
	b.sessions.bashLooked = false
	b.sessions.mu.Unlock()
	run("sh", "-c", "cd /tmp; export X=1")
	if got := run("sh", "-c", `echo "$(pwd) ${X-none} $GIVEN"`); got != "/tmp 1 it's kept\n" {
		t.Errorf("with bash, the next command: %q", got)
	}
}

// parseSessionState reads what a sandbox wrote: anything it cannot read
// is refused, never half taken.
func TestParseSessionState(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Session
		ok   bool
	}{
		{"/tmp\x00", Session{Dir: "/tmp"}, true},
		{"/w\x00X=1\x00Y=a=b\x00-HOME\x00", Session{Dir: "/w", Env: map[string]string{"X": "1", "Y": "a=b"}, Unset: []string{"HOME"}}, true},
		{"/w\x00X=line\nnext\x00", Session{Dir: "/w", Env: map[string]string{"X": "line\nnext"}}, true},
		{"", Session{}, false},
		{"/tmp", Session{}, false},
		{"relative\x00", Session{}, false},
		{"/w\x00bad name=1\x00", Session{}, false},
		{"/w\x00-1BAD\x00", Session{}, false},
		{"/w\x00NOEQUALS\x00", Session{}, false},
	} {
		got, err := parseSessionState([]byte(tc.in))
		if (err == nil) != tc.ok {
			t.Errorf("%q: %v, want ok %v", tc.in, err, tc.ok)
			continue
		}
		if tc.ok && (got.Dir != tc.want.Dir || fmt.Sprint(got.Env) != fmt.Sprint(tc.want.Env) || fmt.Sprint(got.Unset) != fmt.Sprint(tc.want.Unset)) {
			t.Errorf("%q: %+v, want %+v", tc.in, got, tc.want)
		}
	}
}

// FuzzSessionState: a sandbox writes its sessions' state; whatever it
// writes, the service's reading of it never panics, and what it accepts
// is a clean state, each value of which the seed quotes for the shell
// exactly (a value cannot break out of its quotes).
func FuzzSessionState(f *testing.F) {
	f.Add([]byte("/w\x00X=1\x00-HOME\x00"))
	f.Add([]byte("/\x00A='q'\x00B=x'\\''y\x00"))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := parseSessionState(data)
		if err != nil {
			return
		}
		if !strings.HasPrefix(s.Dir, "/") || strings.ContainsRune(s.Dir, 0) {
			t.Fatalf("accepted directory %q", s.Dir)
		}
		for k, v := range s.Env {
			if !envName.MatchString(k) || strings.ContainsRune(v, 0) {
				t.Fatalf("accepted variable %q=%q", k, v)
			}
			if got, ok := unquote(shellQuote(v)); !ok || got != v {
				t.Fatalf("%q quoted as %q reads back as %q (%v)", v, shellQuote(v), got, ok)
			}
		}
	})
}

// unquote reads one word of POSIX shell made only of single-quoted parts
// and \' (what shellQuote writes); ok is false for anything else.
func unquote(w string) (string, bool) {
	var b strings.Builder
	for len(w) > 0 {
		switch {
		case strings.HasPrefix(w, `\'`):
			b.WriteByte('\'')
			w = w[2:]
		case w[0] == '\'':
			end := strings.IndexByte(w[1:], '\'')
			if end < 0 {
				return "", false
			}
			b.WriteString(w[1 : 1+end])
			w = w[2+end:]
		default:
			return "", false
		}
	}
	return b.String(), true
}
