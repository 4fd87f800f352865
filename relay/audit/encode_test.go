package audit

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

// goldenEvents are the events of testdata/events-v1.golden: every key
// set, and the fewest.
func goldenEvents() []Event {
	at := time.Date(2025, 6, 1, 14, 2, 11, 123456789, time.UTC)
	return []Event{
		{Time: at, Sandbox: "agent-1", Kind: Route, Allow: true, Code: "allowed_host", Reason: "api.example.com matched allowed host rule api.example.com",
			Host: "api.example.com", Port: 443, PID: 4242, Cmd: "npm install left-pad", Method: "POST", Path: "/v1/messages",
			Rule: "allowedHosts:api.example.com", Module: "tagger", Addr: "93.184.216.34:443", Status: 200, BytesIn: 10, BytesOut: 20,
			Duration: 3*time.Millisecond + 7*time.Microsecond + 300, DNSTime: 120 * time.Microsecond,
			Transforms: []string{"rule[0] api.example.com"}, Notes: []string{"tagger: task=42"}, NotesDropped: 1, Error: "reading upstream body: EOF"},
		{Time: at.Add(time.Second), Sandbox: "agent-1", Kind: Connect, Code: "no_rule", Reason: "no allowedHosts rule matches evil.example.com",
			Host: "evil.example.com", Port: 443, Status: 403},
	}
}

// The line is the schema: its bytes are pinned by a golden file, so a
// change of a key, its order or its format is a deliberate one (and a new
// Version when it renames, removes or retypes a key).
func TestEventGolden(t *testing.T) {
	var got []byte
	for _, e := range goldenEvents() {
		got = AppendJSON(got, &e)
	}
	path := filepath.Join("testdata", "events-v1.golden")
	if *update {
		os.MkdirAll("testdata", 0o755)
		os.WriteFile(path, got, 0o644)
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("event lines changed:\n got %s\nwant %s", got, want)
	}
	// Each line reads back as the event it came from (durations to the
	// microsecond, as they are written).
	for i, line := range bytes.SplitAfter(got, []byte("\n"))[:2] {
		var e Event
		if err := json.Unmarshal(line, &e); err != nil {
			t.Fatal(err)
		}
		w := goldenEvents()[i]
		w.Duration = w.Duration.Round(time.Microsecond)
		if !reflect.DeepEqual(e, w) {
			t.Errorf("line %d reads back as\n%+v\nwant\n%+v", i, e, w)
		}
		if m, _ := e.MarshalJSON(); !bytes.Equal(append(m, '\n'), line) {
			t.Errorf("MarshalJSON of line %d is %s", i, m)
		}
	}
}

// Every awkward string is written as encoding/json would write it, and
// reads back as it was (invalid UTF-8 as U+FFFD, long strings cut).
func TestAppendJSONStrings(t *testing.T) {
	for _, s := range []string{"", "plain", "sb\x01\"2\\", "bad \xff byte \u2028 line \u2029 é <&>", "tab\there\r\n", strings.Repeat("é", 2000)} {
		e := Event{Time: time.Unix(1, 0), Sandbox: s, Kind: Refused, Reason: s, Cmd: s, Path: s, Notes: []string{s}}
		line := AppendJSON(nil, &e)
		if n := bytes.Count(line, []byte("\n")); n != 1 || !bytes.HasSuffix(line, []byte("\n")) {
			t.Fatalf("%q: %d newlines, want one line", s, n)
		}
		var m map[string]any
		if err := json.Unmarshal(line, &m); err != nil {
			t.Fatalf("%q: %v in %s", s, err, line)
		}
		want := strings.ToValidUTF8(Truncate(s, maxField), "\uFFFD")
		if s == "" {
			if m["cmd"] != Unknown {
				t.Errorf("an empty cmd is written %v, want %q", m["cmd"], Unknown)
			}
			continue
		}
		for _, k := range []string{"sandbox", "reason", "cmd", "path"} {
			if m[k] != want {
				t.Errorf("%s of %q reads back as %q", k, s, m[k])
			}
		}
		if len(want) > maxField {
			t.Errorf("%q was not cut to %d bytes", s, maxField)
		}
	}
}

func TestTruncate(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{{"abc", 3, "abc"}, {"abcd", 3, "…"}, {"abcdef", 5, "ab…"}, {"éééé", 6, "é…"}} {
		if got := Truncate(c.in, c.n); got != c.want || len(got) > c.n || !utf8.ValidString(got) {
			t.Errorf("Truncate(%q, %d) = %q, want %q", c.in, c.n, got, c.want)
		}
	}
}

func TestUnmarshalRefusesOtherVersions(t *testing.T) {
	var e Event
	for _, bad := range []string{`{"v":2,"time":"2025-01-01T00:00:00Z","decision":"allow"}`, `{"time":"2025-01-01T00:00:00Z","decision":"allow"}`,
		`{"v":1,"time":"yesterday","decision":"allow"}`, `{"v":1,"time":"2025-01-01T00:00:00Z","decision":"maybe"}`} {
		if err := json.Unmarshal([]byte(bad), &e); err == nil {
			t.Errorf("%s read as an event", bad)
		}
	}
}

// FuzzEventLine: whatever strings an event holds, its line is one JSON
// object that reads back.
func FuzzEventLine(f *testing.F) {
	f.Add("sb", "api.example.com", "/v1/x", "curl -v https://x", "why", "err")
	f.Add("\xff\x00", "\u2028", "\"\\", "\n", "\t", "é")
	f.Fuzz(func(t *testing.T, sandbox, host, path, cmd, reason, errs string) {
		e := Event{Time: time.Unix(0, 1), Sandbox: sandbox, Kind: Route, Host: host, Path: path, Cmd: cmd, Reason: reason, Error: errs, Notes: []string{reason}}
		line := AppendJSON(nil, &e)
		if bytes.Count(line, []byte("\n")) != 1 {
			t.Fatalf("not one line: %q", line)
		}
		var back Event
		if err := json.Unmarshal(line, &back); err != nil {
			t.Fatalf("%v: %q", err, line)
		}
		if back.Host != strings.ToValidUTF8(Truncate(host, maxField), "\uFFFD") {
			t.Errorf("host %q read back as %q", host, back.Host)
		}
	})
}
