package transforms

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

const chainSecret = "sk-chain-0123456789abcdef"

// recordingModules is a module chain that records what it was shown: the
// request headers in its request pass and the response body in its
// response pass. It answers instead of continuing when answer is set.
type recordingModules struct {
	answer     *Answer
	fail       error
	sawAuth    string
	sawBody    string
	responded  bool
	closed     bool
	notes      []string
	notesAfter []string // added by Close (the error pass)
}

func (m *recordingModules) Len() int { return 1 }

func (m *recordingModules) HandleRequest(_ context.Context, req *http.Request, _ RequestInfo) (ModuleExchange, error) {
	m.sawAuth = req.Header.Get("Authorization")
	return m, m.fail
}

func (m *recordingModules) Answer() *Answer { return m.answer }

func (m *recordingModules) HandleResponse(_ context.Context, resp *http.Response) error {
	b, _ := io.ReadAll(resp.Body)
	m.sawBody, m.responded = string(b), true
	resp.Body = io.NopCloser(strings.NewReader(string(b)))
	return nil
}

func (m *recordingModules) Notes() []string   { return m.notes }
func (m *recordingModules) NotesDropped() int { return 0 }
func (m *recordingModules) Close() {
	m.closed = true
	m.notes = append(m.notes, m.notesAfter...)
}

type moduleErr struct{ name string }

func (e *moduleErr) Error() string      { return "module " + e.name + " failed" }
func (e *moduleErr) ModuleName() string { return e.name }

func chainRules(t *testing.T) *RuleSet {
	t.Helper()
	rules, err := ParseRules([]byte(`[{"match":{"host":"api.example.com"},"transform":{"headers":{"authorization":{"env":"KEY","prefix":"Bearer "}}}}]`),
		func(string) (string, bool) { return chainSecret, true })
	if err != nil {
		t.Fatal(err)
	}
	return NewRuleSet(rules...)
}

// The chain runs the modules before the swap and the scrub before the
// modules' response pass: a module never sees the secret either way.
func TestChainModulesNeverSeeTheSecret(t *testing.T) {
	mods := &recordingModules{notesAfter: []string{"m: upstream said " + chainSecret}}
	req, _ := http.NewRequest("POST", "https://api.example.com/v1/x", nil)
	req.Header.Set("Authorization", "Bearer sandgate-placeholder-KEY")
	x, err := Chain{Modules: mods, Rules: chainRules(t)}.Request(context.Background(), req, RequestInfo{})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(mods.sawAuth, chainSecret) {
		t.Fatalf("the module saw the secret in the request: %q", mods.sawAuth)
	}
	if got := req.Header.Get("Authorization"); got != "Bearer "+chainSecret {
		t.Fatalf("outbound Authorization = %q, want the secret swapped in after the modules", got)
	}
	if !x.Swapped() {
		t.Fatal("Swapped() = false after a secret went in")
	}
	body := "echo: " + chainSecret
	resp := &http.Response{StatusCode: 200, Header: http.Header{}, ContentLength: int64(len(body)), Body: io.NopCloser(strings.NewReader(body)), Request: req}
	if err := x.Response(context.Background(), resp); err != nil {
		t.Fatal(err)
	}
	if !mods.responded || strings.Contains(mods.sawBody, chainSecret) || !strings.Contains(mods.sawBody, "sandgate-placeholder-KEY") {
		t.Fatalf("the module's response pass saw %q: want it scrubbed first", mods.sawBody)
	}
	x.Close()
	if !mods.closed {
		t.Error("Close did not close the modules' exchange")
	}
	a := x.Audit()
	if len(a.Transforms) != 1 || len(a.Notes) != 1 || strings.Contains(a.Notes[0], chainSecret) {
		t.Errorf("audit = %+v: want the rule named and the note (added by Close) scrubbed", a)
	}
	if got := x.ScrubString("error quoting " + chainSecret); strings.Contains(got, chainSecret) {
		t.Errorf("ScrubString left the secret: %q", got)
	}
}

// A module that answers or fails keeps the secret out of the request:
// nothing goes upstream, so nothing is swapped in.
func TestChainNoSwapWhenAModuleAnswersOrFails(t *testing.T) {
	for name, mods := range map[string]*recordingModules{
		"answer": {answer: &Answer{Module: "m", Status: 200, Header: http.Header{}}},
		"refuse": {answer: &Answer{Module: "m", Refused: true, Reason: "no", Status: 403}},
		"fail":   {fail: &moduleErr{"m"}},
	} {
		t.Run(name, func(t *testing.T) {
			req, _ := http.NewRequest("GET", "https://api.example.com/v1/x", nil)
			req.Header.Set("Authorization", "Bearer sandgate-placeholder-KEY")
			x, err := Chain{Modules: mods, Rules: chainRules(t)}.Request(context.Background(), req, RequestInfo{})
			defer x.Close()
			if mods.fail != nil {
				var mf ModuleFailure
				if !errors.As(err, &mf) {
					t.Fatalf("got %v, want the module's failure", err)
				}
			} else if err != nil || x.Answer() != mods.answer {
				t.Fatalf("got %v, %v: want the module's answer", x.Answer(), err)
			}
			if x.Swapped() || strings.Contains(req.Header.Get("Authorization"), chainSecret) {
				t.Fatal("a secret was swapped into a request that does not go upstream")
			}
			if got := x.Audit().Module; got != "m" {
				t.Errorf("audit module = %q, want m", got)
			}
		})
	}
}

// A response that cannot be scrubbed (an encoding the chain cannot
// decode) is refused with ErrScrub, before any module sees it.
func TestChainUnscrubbableResponse(t *testing.T) {
	mods := &recordingModules{}
	req, _ := http.NewRequest("GET", "https://api.example.com/v1/x", nil)
	x, err := Chain{Modules: mods, Rules: chainRules(t)}.Request(context.Background(), req, RequestInfo{})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Encoding": {"br"}}, ContentLength: -1, Body: io.NopCloser(strings.NewReader("x"))}
	if err := x.Response(context.Background(), resp); !errors.Is(err, ErrScrub) || !errors.Is(err, ErrUnsupportedEncoding) {
		t.Fatalf("got %v, want ErrScrub wrapping ErrUnsupportedEncoding", err)
	}
	if mods.responded {
		t.Error("a module saw a response that could not be scrubbed")
	}
}

// A response from a host a rule's secret goes to is scrubbed even when the
// request carried no secret: the upstream may echo an earlier request.
func TestChainScrubsResponseOfTargetedHostWithoutSwap(t *testing.T) {
	rules, err := ParseRules([]byte(`[{"match":{"host":"api.example.com","path":{"startsWith":"/v1/"}},"transform":{"headers":{"authorization":{"env":"KEY","prefix":"Bearer "}}}}]`),
		func(string) (string, bool) { return chainSecret, true })
	if err != nil {
		t.Fatal(err)
	}
	set := NewRuleSet(rules...)
	for _, tc := range []struct {
		url  string
		want string
	}{
		{"https://api.example.com/other", "echo sandgate-placeholder-KEY"},
		{"https://elsewhere.example/v1/x", "echo " + chainSecret}, // never sent the secret: untouched
	} {
		mods := &recordingModules{notesAfter: []string{"m: saw " + chainSecret}}
		req, _ := http.NewRequest("GET", tc.url, nil)
		x, err := Chain{Modules: mods, Rules: set}.Request(context.Background(), req, RequestInfo{})
		if err != nil {
			t.Fatal(err)
		}
		if x.Swapped() {
			t.Fatalf("%s: a secret went into a request no rule matched", tc.url)
		}
		resp := &http.Response{StatusCode: 200, Header: http.Header{"X-Echo": {chainSecret}}, ContentLength: -1,
			Body: io.NopCloser(strings.NewReader("echo " + chainSecret))}
		if err := x.Response(context.Background(), resp); err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		if string(b) != tc.want || mods.sawBody != tc.want {
			t.Errorf("%s: body %q (module saw %q), want %q", tc.url, b, mods.sawBody, tc.want)
		}
		x.Close()
		notes := strings.Join(x.Audit().Notes, " ")
		if x.Scrubs() && (strings.Contains(notes, chainSecret) || strings.Contains(resp.Header.Get("X-Echo"), chainSecret)) {
			t.Errorf("%s: the secret is left in a note %q or a header %q", tc.url, notes, resp.Header.Get("X-Echo"))
		}
	}
}
