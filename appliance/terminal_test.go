package appliance

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
)

// A terminal whose client went away keeps the newest TerminalScrollback
// bytes of its output, however much it wrote: a client that comes back
// from the start is told how many it missed and reads exactly the rest.
func TestTerminalScrollbackKeepsTheNewest(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.TerminalGrace = 10 * time.Minute })
	r.create("box", CreateOptions{})
	ctx := r.ctx()
	term, err := r.m.OpenTerminal(ctx, "box", TerminalRequest{Args: []string{"seq", "1", "100000"}})
	if err != nil {
		t.Fatal(err)
	}
	term.Detach() // gone before it read a byte: nothing holds the command back
	if code, err := term.Wait(ctx); code != 0 || err != nil {
		t.Fatalf("exit %d %v", code, err)
	}
	var want strings.Builder
	for i := 1; i <= 100000; i++ {
		fmt.Fprintf(&want, "%d\r\n", i)
	}
	back, err := r.m.AttachTerminal(ctx, "box", term.ID(), 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(back)
	if err != nil {
		t.Fatal(err)
	}
	if skipped := back.Skipped(); skipped != int64(want.Len()-TerminalScrollback) || string(got) != want.String()[skipped:] {
		t.Errorf("came back to %d bytes, skipped %d; want the last %d of %d", len(got), skipped, TerminalScrollback, want.Len())
	}
	back.Close()
	if _, err := r.m.AttachTerminal(ctx, "box", term.ID(), 0, nil); !errors.Is(err, ErrNotFound) {
		t.Errorf("attaching to a terminal hung up: %v, want ErrNotFound", err)
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
