package wasm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

// notesHave fails unless every want is one of the notes (without the
// "probe: " prefix).
func notesHave(t *testing.T, notes []string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !slices.Contains(notes, "probe: "+w) {
			t.Errorf("no note %q in:\n  %s", w, strings.Join(notes, "\n  "))
		}
	}
}

func TestBufLimitConvention(t *testing.T) {
	r := newRuntime(t, Config{})
	// get_config returns the whole script, so its length is known.
	script := []string{"req get config 0", "req get config 10", "req get config 4096"}
	full := strings.Join(script, "\n")
	m := probe(t, r, script...)
	notes := mustRun(t, outbound(t, "GET", "/", ""), m)
	notesHave(t, notes,
		fmt.Sprintf("config len=%d untouched=true buf=\"\"", len(full)),
		fmt.Sprintf("config len=%d untouched=true buf=\"\"", len(full)),
		fmt.Sprintf("config len=%d untouched=false buf=%q", len(full), full))
}

func TestRequestGetters(t *testing.T) {
	r := newRuntime(t, Config{})
	m := probe(t, r,
		"req get method 3", "req get method 2",
		"req get uri 64", "req get uri 5",
		"req get proto 8", "req get proto 7",
		"req get source 64", "req get sandbox 4", "req get sandbox 3")
	notes := mustRun(t, outbound(t, "POST", "/v1/a%2Fb?x=1&y=%20", "hi"), m)
	// When the value does not fit, nothing is written and the length is
	// returned (the probe shows its untouched 0xAA-filled buffer).
	notesHave(t, notes,
		`method len=4 untouched=true buf="\xaa\xaa\xaa"`,
		`method len=4 untouched=true buf="\xaa\xaa"`,
		`uri len=19 untouched=false buf="/v1/a%2Fb?x=1&y=%20"`,
		`uri len=19 untouched=true buf="\xaa\xaa\xaa\xaa\xaa"`,
		`proto len=8 untouched=false buf="HTTP/1.1"`,
		`proto len=8 untouched=true buf="\xaa\xaa\xaa\xaa\xaa\xaa\xaa"`,
		`source len=14 untouched=false buf="127.0.0.1:5555"`,
		`sandbox len=4 untouched=false buf="sb-1"`,
		`sandbox len=4 untouched=true buf="\xaa\xaa\xaa"`)
}

func TestHeaderNamesAndValues(t *testing.T) {
	r := newRuntime(t, Config{})
	m := probe(t, r,
		"req names 0 256", "req names 0 10", "req names 0 0",
		"req values 0 512 x-multi", "req values 0 4 X-MULTI", "req values 0 64 host", "req values 0 64 absent",
		"req names 2 64", "req values 3 64 x-multi")
	req := outbound(t, "GET", "/", "", "X-Multi", "a=b", "X-Multi", "c=d", "Accept", "*/*")
	notes := mustRun(t, req, m)
	// Names are lowercase, sorted, NUL-terminated; count<<32|len; Host is
	// the decided destination.
	notesHave(t, notes,
		`names count=3 len=20 untouched=false buf="accept\x00host\x00x-multi\x00"`,
		`names count=3 len=20 untouched=true buf="\xaa\xaa\xaa\xaa\xaa\xaa\xaa\xaa\xaa\xaa"`,
		`names count=3 len=20 untouched=true buf=""`,
		`values count=2 len=8 untouched=false buf="a=b\x00c=d\x00"`,
		`values count=2 len=8 untouched=true buf="\xaa\xaa\xaa\xaa"`,
		`values count=1 len=16 untouched=false buf="api.example.com\x00"`,
		`values count=0 len=0 untouched=true buf=""`,
		// Trailers are not supported: always empty.
		`names count=0 len=0 untouched=true buf=""`,
		`values count=0 len=0 untouched=true buf=""`)
}

func TestHeaderWrites(t *testing.T) {
	r := newRuntime(t, Config{})
	m := probe(t, r,
		"req set 0 X-Set one", "req set 0 x-multi replaced", "req add 0 X-Add 1", "req add 0 x-add 2",
		"req remove 0 ACCEPT", "req set 1 X-Resp-Early yes")
	req := outbound(t, "GET", "/", "", "X-Multi", "a", "X-Multi", "b", "Accept", "*/*")
	sent := req.Header.Clone()
	x, err := run(t, req, m)
	if err != nil {
		t.Fatal(err)
	}
	h := req.Header
	if got := h.Values("X-Set"); !slices.Equal(got, []string{"one"}) {
		t.Errorf("X-Set = %q", got)
	}
	if got := h.Values("X-Multi"); !slices.Equal(got, []string{"replaced"}) {
		t.Errorf("X-Multi = %q", got)
	}
	if got := h.Values("X-Add"); !slices.Equal(got, []string{"1", "2"}) {
		t.Errorf("X-Add = %q", got)
	}
	if _, ok := h["Accept"]; ok {
		t.Errorf("Accept not removed: %v", h)
	}
	if !slices.Equal(sent.Values("X-Multi"), []string{"a", "b"}) {
		t.Errorf("the caller's copy of the header changed: %v", sent)
	}
	// A response header set in handle_request lands on the response.
	resp := &http.Response{StatusCode: 200, Header: http.Header{}, Body: http.NoBody}
	if err := x.HandleResponse(context.Background(), resp); err != nil {
		t.Fatal(err)
	}
	if resp.Header.Get("X-Resp-Early") != "yes" {
		t.Errorf("response header set in handle_request lost: %v", resp.Header)
	}
}

func TestMethodAndURIWrites(t *testing.T) {
	r := newRuntime(t, Config{})
	m := probe(t, r, "req setmethod PATCH", "req seturi /v2/new%2520path?a=b", "req get uri 64")
	req := outbound(t, "GET", "/v1/old?q=1", "")
	notes := mustRun(t, req, m)
	if req.Method != "PATCH" || req.URL.RequestURI() != "/v2/new%20path?a=b" || req.URL.Host != "api.example.com" {
		t.Errorf("request = %s %s (host %s)", req.Method, req.URL.RequestURI(), req.URL.Host)
	}
	notesHave(t, notes, `uri len=18 untouched=false buf="/v2/new%20path?a=b"`)
}

// The proxy refuses what it cannot send, naming the module, and keeps the
// (healthy) instance.
func TestUnsendableWritesFailClosed(t *testing.T) {
	r := newRuntime(t, Config{})
	tests := []struct {
		cmd, want string
	}{
		{"req setmethod GE%20T", "not an HTTP token"},
		{"req setmethod CONNECT", "CONNECT"},
		{"req seturi http://evil.example/x", "not origin-form"},
		{"req seturi //evil.example/x", "cannot change the destination host"},
		{"req seturi /a%250Db", ""}, // percent-encoded CR is fine
		{"req seturi /a%2520b?c=%250A", ""},
		{"req seturi /a%20b", "percent-encoded ASCII"},
		{"req seturi /a%0D%0AHost:x", "percent-encoded ASCII"},
		{"req seturi /a#frag", "fragment"},
		{"req set 0 Host evil.example", "cannot change the destination host"},
		{"req remove 0 host", "cannot change the destination host"},
		{"req set 0 Transfer-Encoding chunked", "hop-by-hop"},
		{"req add 0 Proxy-Authorization x", "hop-by-hop"},
		{"req set 0 X-Bad a%0D%0AInjected:%201", "control character"},
		{"req set 0 X-Bad a%00b", "control character"},
		{"req set 0 Bad%20Name v", "not an HTTP token"},
		{"req set 1 Connection close", "hop-by-hop"},
	}
	for _, tt := range tests {
		t.Run(tt.cmd, func(t *testing.T) {
			m := probe(t, r, tt.cmd)
			x, err := run(t, outbound(t, "GET", "/", ""), m)
			x.Close()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("got %v, want success", err)
				}
				return
			}
			var we *Error
			if err == nil || !strings.Contains(err.Error(), tt.want) || !asError(err, &we) || we.Module != "probe" || we.Status != http.StatusBadGateway {
				t.Fatalf("got %v, want a 502 from module probe containing %q", err, tt.want)
			}
			if m.Idle() != 1 {
				t.Errorf("idle instances = %d, want the healthy instance back in the pool", m.Idle())
			}
		})
	}
}

func TestRequestBody(t *testing.T) {
	r := newRuntime(t, Config{MaxBodyBytes: 64})
	t.Run("buffered read leaves the body for the upstream", func(t *testing.T) {
		m := probe(t, r, "init enable 1", "req read 0 5")
		req := outbound(t, "POST", "/", "hello, upstream")
		notes := mustRun(t, req, m)
		notesHave(t, notes, `body="hello, upstream" reads=3`)
		b, _ := io.ReadAll(req.Body)
		if string(b) != "hello, upstream" || req.ContentLength != 15 {
			t.Errorf("upstream body = %q (length %d)", b, req.ContentLength)
		}
	})
	t.Run("enabled per request", func(t *testing.T) {
		m := probe(t, r, "req enable 1", "req read1 0 100")
		notesHave(t, mustRun(t, outbound(t, "POST", "/", "abc"), m), "features=1", `read eof=1 len=3 buf="abc"`)
	})
	t.Run("read without buffer_request traps", func(t *testing.T) {
		m := probe(t, r, "req read1 0 100")
		_, err := run(t, outbound(t, "POST", "/", "abc"), m)
		if err == nil || !strings.Contains(err.Error(), "broke the http-wasm ABI") || !strings.Contains(err.Error(), "buffer_request") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("over the cap is 413, never truncated", func(t *testing.T) {
		m := probe(t, r, "init enable 1", "req read 0 5")
		_, err := run(t, outbound(t, "POST", "/", strings.Repeat("x", 65)), m)
		var we *Error
		if !asError(err, &we) || we.Status != http.StatusRequestEntityTooLarge || !strings.Contains(we.Reason, "64-byte") {
			t.Fatalf("got %v, want 413", err)
		}
	})
	t.Run("write replaces, then appends", func(t *testing.T) {
		m := probe(t, r, "req write 0 new-", "req write 0 body")
		req := outbound(t, "POST", "/", "old body", "Content-Length", "8")
		mustRun(t, req, m)
		b, _ := io.ReadAll(req.Body)
		if string(b) != "new-body" || req.ContentLength != 8 || req.Header.Get("Content-Length") != "8" {
			t.Errorf("body %q, length %d, header %q", b, req.ContentLength, req.Header.Get("Content-Length"))
		}
	})
	t.Run("a later module reads what an earlier one wrote", func(t *testing.T) {
		w := probe(t, r, "req write 0 rewritten")
		rd := probe(t, r, "init enable 1", "req read 0 64")
		notesHave(t, mustRun(t, outbound(t, "POST", "/", "original"), w, rd), `body="rewritten" reads=1`)
	})
	t.Run("writing over the cap fails closed", func(t *testing.T) {
		m := probe(t, r, "req write 0 "+strings.Repeat("y", 65))
		if _, err := run(t, outbound(t, "POST", "/", ""), m); err == nil || !strings.Contains(err.Error(), "over 64 bytes") {
			t.Fatalf("got %v", err)
		}
	})
}

func TestResponseSide(t *testing.T) {
	r := newRuntime(t, Config{})
	upstream := func() *http.Response {
		return &http.Response{StatusCode: 201, Header: http.Header{"Content-Type": {"text/plain"}, "Content-Length": {"8"}},
			Body: io.NopCloser(strings.NewReader("upstream")), ContentLength: 8}
	}
	t.Run("reqCtx travels and headers are writable", func(t *testing.T) {
		m := probe(t, r, "req ctx 42", "resp status", "resp values 1 64 content-type", "resp set 1 X-Seen yes", "resp values 0 64 host")
		x, err := run(t, outbound(t, "GET", "/", ""), m)
		if err != nil {
			t.Fatal(err)
		}
		resp := upstream()
		if err := x.HandleResponse(context.Background(), resp); err != nil {
			t.Fatal(err)
		}
		notesHave(t, x.Notes(), "reqctx=42 is_error=0", "status=201",
			`values count=1 len=11 untouched=false buf="text/plain\x00"`,
			`values count=1 len=16 untouched=false buf="api.example.com\x00"`)
		if resp.Header.Get("X-Seen") != "yes" {
			t.Errorf("header not set: %v", resp.Header)
		}
		if b, _ := io.ReadAll(resp.Body); string(b) != "upstream" {
			t.Errorf("body = %q; an unbuffered body streams through", b)
		}
	})
	t.Run("buffer_response reads and rewrites body and status", func(t *testing.T) {
		m := probe(t, r, "init enable 2", "resp read 1 3", "resp setstatus 299", "resp write 1 rewritten")
		x, err := run(t, outbound(t, "GET", "/", ""), m)
		if err != nil {
			t.Fatal(err)
		}
		resp := upstream()
		if err := x.HandleResponse(context.Background(), resp); err != nil {
			t.Fatal(err)
		}
		notesHave(t, x.Notes(), `body="upstream" reads=3`)
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 299 || string(b) != "rewritten" || resp.ContentLength != 9 || resp.Header.Get("Content-Length") != "" {
			t.Errorf("got %d %q (length %d, header %q)", resp.StatusCode, b, resp.ContentLength, resp.Header.Get("Content-Length"))
		}
		if m.Idle() != 1 {
			t.Errorf("idle = %d: the instance must be back once handle_response ran", m.Idle())
		}
	})
	t.Run("status write without buffer_response traps", func(t *testing.T) {
		m := probe(t, r, "resp setstatus 500")
		x, err := run(t, outbound(t, "GET", "/", ""), m)
		if err != nil {
			t.Fatal(err)
		}
		if err := x.HandleResponse(context.Background(), upstream()); err == nil || !strings.Contains(err.Error(), "buffer_response") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("request writes after next trap", func(t *testing.T) {
		m := probe(t, r, "resp set 0 X-Late 1")
		x, _ := run(t, outbound(t, "GET", "/", ""), m)
		if err := x.HandleResponse(context.Background(), upstream()); err == nil || !strings.Contains(err.Error(), "already sent") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("reverse order", func(t *testing.T) {
		a := probe(t, r, "resp note a")
		b := probe(t, r, "resp note b")
		x, _ := run(t, outbound(t, "GET", "/", ""), a, b)
		if err := x.HandleResponse(context.Background(), upstream()); err != nil {
			t.Fatal(err)
		}
		var order []string
		for _, n := range x.Notes() {
			if n == "probe: a" || n == "probe: b" {
				order = append(order, n)
			}
		}
		if !slices.Equal(order, []string{"probe: b", "probe: a"}) {
			t.Errorf("handle_response order = %v, want b then a", order)
		}
	})
	t.Run("is_error when the response never came", func(t *testing.T) {
		m := probe(t, r, "req ctx 7", "resp status", "resp set 1 X-Ignored 1")
		x, err := HandleRequest(context.Background(), outbound(t, "GET", "/", ""), info, NewChain(m))
		if err != nil {
			t.Fatal(err)
		}
		x.Close()
		notesHave(t, x.Notes(), "reqctx=7 is_error=1", "status=502")
		if m.Idle() != 1 {
			t.Errorf("idle = %d", m.Idle())
		}
	})
}

func TestAnswersAndRefusals(t *testing.T) {
	r := newRuntime(t, Config{})
	t.Run("own response", func(t *testing.T) {
		m := probe(t, r, "req next 0", "req setstatus 302", "req set 1 Location /elsewhere", "req write 1 moved")
		x, err := run(t, outbound(t, "GET", "/", ""), m)
		a := x.Answer()
		if err != nil || a == nil || a.Refused || a.Status != 302 || a.Header.Get("Location") != "/elsewhere" || string(a.Body) != "moved" {
			t.Fatalf("got %v, %+v", err, a)
		}
	})
	for _, tt := range []struct {
		cmd    string
		status int
	}{
		{"req refuse 451 not%20here", 451},
		{"req refuse 0 no", 403},
		{"req refuse 200 no", 403},
		{"req refuse 600 no", 403},
	} {
		t.Run(tt.cmd, func(t *testing.T) {
			// next stays 1: the refusal still stands (fail closed).
			m := probe(t, r, tt.cmd)
			later := probe(t, r, "req note must-not-run")
			x, err := run(t, outbound(t, "GET", "/", ""), m, later)
			a := x.Answer()
			if err != nil || a == nil || !a.Refused || a.Status != tt.status || a.Module != "probe" || a.Body != nil {
				t.Fatalf("got %v, %+v", err, a)
			}
			if slices.Contains(x.Notes(), "probe: must-not-run") {
				t.Error("a module after the refusal ran")
			}
		})
	}
	t.Run("refusal with a body", func(t *testing.T) {
		m := probe(t, r, "req refuse 429 slow%20down", "req write 1 {\"error\":\"budget\"}", "req next 0")
		x, _ := run(t, outbound(t, "GET", "/", ""), m)
		if a := x.Answer(); a == nil || a.Reason != "slow down" || string(a.Body) != `{"error":"budget"}` {
			t.Fatalf("got %+v", a)
		}
	})
}

func TestAuditNoteCaps(t *testing.T) {
	r := newRuntime(t, Config{MaxNotes: 3, MaxNoteBytes: 8})
	m := probe(t, r, "req notes 2 8", "req notes 1 9", "req notes 3 1")
	x, err := run(t, outbound(t, "GET", "/", ""), m)
	if err != nil {
		t.Fatal(err)
	}
	if got := x.Notes(); !slices.Equal(got, []string{"probe: 00000000", "probe: 00000001", "probe: 0"}) || x.NotesDropped() != 3 {
		t.Errorf("notes %q, dropped %d", got, x.NotesDropped())
	}
}

func TestLogAndLogEnabled(t *testing.T) {
	var logs syncbuf.Buffer
	r := newRuntime(t, Config{Logger: jsonLogger(&logs)})
	m := probe(t, r, "req logenabled -1", "req logenabled 3", "req log 1 hello%20host", "req log 3 never")
	notesHave(t, mustRun(t, outbound(t, "GET", "/", ""), m), "log_enabled(-1)=1", "log_enabled(3)=0")
	out := logs.String()
	if !strings.Contains(out, `"level":"WARN","msg":"hello host","module":"probe","sandbox":"sb-1"`) || strings.Contains(out, "never") {
		t.Errorf("logs:\n%s", out)
	}
}

func TestTrailersWriteTraps(t *testing.T) {
	r := newRuntime(t, Config{})
	m := probe(t, r, "req set 2 X-T 1")
	if _, err := run(t, outbound(t, "GET", "/", ""), m); err == nil || !strings.Contains(err.Error(), "trailers are not supported") {
		t.Fatalf("got %v", err)
	}
}

func asError(err error, target **Error) bool {
	e, ok := err.(*Error)
	if ok {
		*target = e
	}
	return ok
}
