package bridge

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"testing"
	"time"
)

// Paths a caller may spell to reach outside /workspace, and what each
// resolves to (refused: "").
func TestResolveWorkspaceBypasses(t *testing.T) {
	for in, want := range map[string]string{
		"/workspace":                  "/workspace",
		"/workspace/":                 "/workspace",
		"":                            "/workspace",
		".":                           "/workspace",
		"a/b":                         "/workspace/a/b",
		"sub/dir/":                    "/workspace/sub/dir",
		"//workspace//x":              "/workspace/x",
		"/workspace/./x/../y":         "/workspace/y",
		"/workspace/../workspace/x":   "/workspace/x",
		"/workspace/..":               "",
		"/workspace/../etc/passwd":    "",
		"../etc":                      "",
		"a/../../etc":                 "",
		"/workspaces/x":               "",
		"/workspace2":                 "",
		"/workspace..":                "",
		"/tmp":                        "",
		"/":                           "",
		"/workspace/x\x00":            "",
		"/../../workspace/x":          "/workspace/x",
		"/workspace/a/b/../../../etc": "",
		`/workspace/..\..\etc`:        `/workspace/..\..\etc`,  // a backslash is a name byte, not a separator
		"/workspace/%2e%2e/etc":       "/workspace/%2e%2e/etc", // percent-decoding happened before
	} {
		got, ok := resolveWorkspace(in)
		if !ok {
			got = ""
		}
		if got != want {
			t.Errorf("resolveWorkspace(%q) = %q, want %q", in, got, want)
		}
	}
}

func FuzzResolveWorkspace(f *testing.F) {
	for _, s := range []string{"", "a", "/workspace/../etc", "a/../../b", "//workspace/./x", "/workspaces", "x\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		got, ok := resolveWorkspace(p)
		if !ok {
			return
		}
		if got != "/workspace" && !strings.HasPrefix(got, "/workspace/") {
			t.Fatalf("%q resolved outside: %q", p, got)
		}
		if path.Clean(got) != got || strings.Contains(got, "\x00") {
			t.Fatalf("%q resolved to an unclean path %q", p, got)
		}
		for _, seg := range strings.Split(got, "/") {
			if seg == ".." || seg == "." {
				t.Fatalf("%q resolved to %q", p, got)
			}
		}
	})
}

func TestParseExecBody(t *testing.T) {
	for _, tc := range []struct {
		body   string
		status int // 0: accepted
		argv   []string
		cwd    string
		ms     int64
	}{
		{`{"argv":["ls","-l"]}`, 0, []string{"ls", "-l"}, "", 0},
		{`{"argv":["echo",42,-1.5],"timeout_ms":1500,"cwd":"sub"}`, 0, []string{"echo", "42", "-1.5"}, "/workspace/sub", 1500},
		{`{"argv":["x"],"timeout_ms":"5000","cwd":7}`, 0, []string{"x"}, "", 0}, // wrong types ignored, as the contract does
		{`{"argv":["x"],"timeout_ms":0}`, 0, []string{"x"}, "", 0},
		{`{"argv":["x"],"timeout_ms":-5}`, 0, []string{"x"}, "", 0},
		{`{"argv":["x"],"extra":{"y":1}}`, 0, []string{"x"}, "", 0},
		{`{"argv":["x"],"cwd":"/etc"}`, 403, nil, "", 0},
		{`{"argv":["x"],"cwd":"a/../../.."}`, 403, nil, "", 0},
		{`{"argv":[]}`, 400, nil, "", 0},
		{`{"argv":null}`, 400, nil, "", 0},
		{`{"argv":[null]}`, 400, nil, "", 0},
		{`{"argv":[true]}`, 400, nil, "", 0},
		{`{"argv":[["a"]]}`, 400, nil, "", 0},
		{`{"argv":"ls"}`, 400, nil, "", 0},
		{`{}`, 400, nil, "", 0},
		{`[]`, 400, nil, "", 0},
		{`null`, 400, nil, "", 0},
		{``, 400, nil, "", 0},
		{`{"argv":["a\u0000"]}`, 400, nil, "", 0},
	} {
		e, err := parseExecBody([]byte(tc.body))
		if tc.status != 0 {
			var ae *apiError
			if !errors.As(err, &ae) || ae.status != tc.status {
				t.Errorf("%s: %v, want %d", tc.body, err, tc.status)
			}
			continue
		}
		if err != nil || strings.Join(e.argv, "|") != strings.Join(tc.argv, "|") || e.cwd != tc.cwd || e.timeout != time.Duration(tc.ms)*time.Millisecond {
			t.Errorf("%s: %+v %v", tc.body, e, err)
		}
	}
}

func FuzzExecBody(f *testing.F) {
	for _, s := range []string{`{"argv":["a"]}`, `{"argv":[1,"b"],"cwd":"../x","timeout_ms":1e300}`, `[]`, `{"argv":["\u0000"]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		e, err := parseExecBody(data)
		if err != nil {
			var ae *apiError
			if !errors.As(err, &ae) || (ae.status != 400 && ae.status != 403) || ae.code != codeInvalid {
				t.Fatalf("refusal %v is not the contract's", err)
			}
			return
		}
		if len(e.argv) == 0 || e.timeout < 0 {
			t.Fatalf("accepted %+v", e)
		}
		for _, a := range e.argv {
			if strings.IndexByte(a, 0) >= 0 {
				t.Fatal("a NUL byte in argv")
			}
		}
		if e.cwd != "" && e.cwd != Workspace && !strings.HasPrefix(e.cwd, Workspace+"/") {
			t.Fatalf("cwd %q", e.cwd)
		}
	})
}

func TestSessionHeaderAndIDs(t *testing.T) {
	for v, ok := range map[string]bool{
		"s1": true, "a.b-c_D": true, strings.Repeat("a", 128): true,
		"": false, "..": false, "a..b": false, "a/b": false, "a b": false, strings.Repeat("a", 129): false, "é": false,
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Header.Set("Session-Id", v)
		got, err := sessionHeader(r)
		if (err == nil) != ok || (ok && got != v) {
			t.Errorf("Session-Id %q: %q %v", v, got, err)
		}
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Add("Session-Id", "a")
	r.Header.Add("Session-Id", "b")
	if _, err := sessionHeader(r); err == nil {
		t.Error("Session-Id sent twice was taken")
	}
	for id, ok := range map[string]bool{
		"abc": true, "rvs6w2hq4rbako5uys4bofngry": true, strings.Repeat("a", 63): true,
		strings.Repeat("a", 64): false, "ABC": false, "a-b": false, "a1": false, "": false, "a/b": false,
	} {
		if err := checkSandboxID(id); (err == nil) != ok {
			t.Errorf("sandbox id %q: %v", id, err)
		}
	}
	for i := 0; i < 100; i++ {
		if id := newSandboxID(); !sandboxIDPattern.MatchString(id) || len(id) != 26 {
			t.Fatalf("minted id %q", id)
		}
	}
}

func TestParseExcludes(t *testing.T) {
	got, err := parseExcludes(" ./.venv ,,__pycache__/,a b,./,.,x/./y")
	if err != nil || strings.Join(got, "|") != ".venv|__pycache__|a b|x/./y" {
		t.Errorf("excludes: %q %v", got, err)
	}
	for _, bad := range []string{"..", "a/../b", "x,..y", "a\x00"} {
		if _, err := parseExcludes(bad); err == nil {
			t.Errorf("excludes %q taken", bad)
		}
	}
}

func FuzzSessionBody(f *testing.F) {
	for _, s := range []string{`{"id":"s","cwd":"x","env":{"A":"b"}}`, `{"env":{"A":null}}`, `not json`, `{"cwd":"/etc"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		name, s, err := parseSessionBody(data)
		if err != nil {
			var ae *apiError
			if !errors.As(err, &ae) || ae.code != codeSession {
				t.Fatalf("refusal %v", err)
			}
			return
		}
		if name != "" && checkSessionID(name) != nil {
			t.Fatalf("session id %q", name)
		}
		if s.Dir != "" && s.Dir != Workspace && !strings.HasPrefix(s.Dir, Workspace+"/") {
			t.Fatalf("cwd %q", s.Dir)
		}
		for k, v := range s.Env {
			if strings.IndexByte(k+v, 0) >= 0 {
				t.Fatal("a NUL byte in env")
			}
		}
	})
}

// hdr is a tar entry for the repack tests.
type hdr struct {
	name, link, content string
	typ                 byte
	mode                int64
	pax                 map[string]string
}

func tarFrom(t testing.TB, hs ...hdr) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range hs {
		th := &tar.Header{Name: h.name, Linkname: h.link, Typeflag: h.typ, Mode: h.mode, Size: int64(len(h.content)), PAXRecords: h.pax, Format: tar.FormatPAX}
		if th.Mode == 0 {
			th.Mode = 0o644
		}
		if h.typ == tar.TypeXGlobalHeader {
			th = &tar.Header{Typeflag: h.typ, PAXRecords: h.pax, Format: tar.FormatPAX}
		}
		if err := tw.WriteHeader(th); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(h.content))
	}
	tw.Close()
	return buf.Bytes()
}

// A workspace tar as the agent packs it comes out as GNU tar's: ./ names,
// excludes applied, links as links, and what could harm whoever unpacks
// it either refused or left out.
func TestRepack(t *testing.T) {
	in := tarFrom(t,
		hdr{name: "./", typ: tar.TypeDir, mode: 0o755},
		hdr{name: "a.txt", typ: tar.TypeReg, content: "alpha"},
		hdr{name: "suid", typ: tar.TypeReg, content: "x", mode: 0o4755},
		hdr{name: "caps", typ: tar.TypeReg, content: "x", pax: map[string]string{"SCHILY.xattr.security.capability": "\x01"}},
		hdr{name: "hard", typ: tar.TypeLink, link: "a.txt"},
		hdr{name: "dev", typ: tar.TypeChar},
		hdr{name: "out", typ: tar.TypeSymlink, link: "/etc/passwd"},
		hdr{name: ".venv/", typ: tar.TypeDir},
		hdr{name: ".venv/lib", typ: tar.TypeReg, content: "big"},
		hdr{name: "d/", typ: tar.TypeDir},
		hdr{name: "d/x.pyc", typ: tar.TypeReg, content: "pyc"},
		hdr{name: "d/keep.py", typ: tar.TypeReg, content: "py"},
	)
	var out bytes.Buffer
	if err := repack(&out, bytes.NewReader(in), []string{".venv", "d/*.pyc"}); err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(&out)
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		if h.Mode&0o6000 != 0 {
			t.Errorf("%s keeps mode %o", h.Name, h.Mode)
		}
		for k := range h.PAXRecords {
			if strings.HasPrefix(k, "SCHILY.xattr.") {
				t.Errorf("%s keeps %s", h.Name, k)
			}
		}
		if h.Name == "./hard" && h.Linkname != "./a.txt" {
			t.Errorf("hard link to %q", h.Linkname)
		}
		if h.Name == "./out" && (h.Typeflag != tar.TypeSymlink || h.Linkname != "/etc/passwd") {
			t.Errorf("the link out: %+v", h)
		}
	}
	if got := strings.Join(names, " "); got != "./ ./a.txt ./suid ./caps ./hard ./out ./d/ ./d/keep.py" {
		t.Errorf("entries: %s", got)
	}

	// What a hostile sandbox's agent could send instead.
	for what, hs := range map[string][]hdr{
		"an absolute name":               {{name: "/etc/passwd", typ: tar.TypeReg}},
		"a .. name":                      {{name: "a/../../x", typ: tar.TypeReg}},
		"an entry below a link":          {{name: "l", typ: tar.TypeSymlink, link: "/etc"}, {name: "l/passwd", typ: tar.TypeReg, content: "x"}},
		"a link over a directory before": {{name: "d/", typ: tar.TypeDir}, {name: "d/f", typ: tar.TypeReg}, {name: "d", typ: tar.TypeSymlink, link: "/"}},
		"a file over a link":             {{name: "l", typ: tar.TypeSymlink, link: "/etc/passwd"}, {name: "l", typ: tar.TypeReg, content: "x"}},
		"a hard link out":                {{name: "h", typ: tar.TypeLink, link: "/etc/shadow"}},
		"a hard link to nothing before":  {{name: "h", typ: tar.TypeLink, link: "later"}, {name: "later", typ: tar.TypeReg}},
		"a hard link to a link":          {{name: "l", typ: tar.TypeSymlink, link: "/etc/shadow"}, {name: "h", typ: tar.TypeLink, link: "l"}},
		"a global header":                {{name: "g", typ: tar.TypeXGlobalHeader, pax: map[string]string{"path": "x"}}},
	} {
		err := repack(io.Discard, bytes.NewReader(tarFrom(t, hs...)), nil)
		if !errors.Is(err, errUnsafeTar) {
			t.Errorf("%s: %v, want refused", what, err)
		}
	}
	if err := repack(io.Discard, strings.NewReader("not a tar"), nil); err == nil {
		t.Error("a stream that is no tar passed")
	}
}

func FuzzRepack(f *testing.F) {
	f.Add(tarFrom(f, hdr{name: "./", typ: tar.TypeDir}, hdr{name: "a", typ: tar.TypeReg, content: "x"}, hdr{name: "l", typ: tar.TypeSymlink, link: "../.."}), "a")
	f.Add(tarFrom(f, hdr{name: "l", typ: tar.TypeSymlink, link: "/"}, hdr{name: "l/x", typ: tar.TypeReg}), "")
	f.Add(tarFrom(f, hdr{name: "f", typ: tar.TypeReg, content: "abc"}, hdr{name: "h", typ: tar.TypeLink, link: "f"}), "z*")
	f.Fuzz(func(t *testing.T, data []byte, excludes string) {
		ex, err := parseExcludes(excludes)
		if err != nil {
			return
		}
		var out bytes.Buffer
		if err := repack(&out, bytes.NewReader(data), ex); err != nil {
			return
		}
		tr := tar.NewReader(&out)
		links, files := map[string]bool{}, map[string]bool{}
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("the output is no tar: %v", err)
			}
			if !strings.HasPrefix(h.Name, "./") || slicesHasDotDot(h.Name) {
				t.Fatalf("entry %q", h.Name)
			}
			rel := path.Clean(h.Name)
			for d := path.Dir(rel); d != "."; d = path.Dir(d) {
				if links[d] {
					t.Fatalf("%q below the link %q", rel, d)
				}
			}
			switch h.Typeflag {
			case tar.TypeSymlink:
				links[rel] = true
			case tar.TypeLink:
				if !files[path.Clean(h.Linkname)] {
					t.Fatalf("hard link %q to %q", rel, h.Linkname)
				}
			case tar.TypeReg:
				files[rel] = true
			case tar.TypeDir, tar.TypeFifo:
			default:
				t.Fatalf("entry %q of type %q", rel, h.Typeflag)
			}
			if h.Mode&0o6000 != 0 {
				t.Fatalf("%q has mode %o", rel, h.Mode)
			}
			if excluded(rel, ex) {
				t.Fatalf("%q is excluded", rel)
			}
		}
	})
}

func slicesHasDotDot(name string) bool {
	for _, s := range strings.Split(name, "/") {
		if s == ".." {
			return true
		}
	}
	return false
}

// The key: refused when absent, wrong, sent twice or in another scheme;
// the scheme in any case; ?token= only for the OpenAPI document; no key
// configured refuses all.
func TestAuthorize(t *testing.T) {
	const key = "0123456789abcdef-key"
	b := &Bridge{cfg: Config{Key: key}}
	b.key = sha(key)
	for _, tc := range []struct {
		target string
		auth   []string
		ok     bool
	}{
		{"/v1/sandbox", []string{"Bearer " + key}, true},
		{"/v1/sandbox", []string{"bearer " + key}, true},
		{"/v1/pool/stats", []string{"BEARER " + key}, true},
		{"/v1/sandbox", nil, false},
		{"/v1/sandbox", []string{"Bearer " + key + " "}, false},
		{"/v1/sandbox", []string{"Bearer  " + key}, false},
		{"/v1/sandbox", []string{"Bearer"}, false},
		{"/v1/sandbox", []string{"Bearer "}, false},
		{"/v1/sandbox", []string{"Basic " + key}, false},
		{"/v1/sandbox", []string{"Bearer " + key, "Bearer " + key}, false},
		{"/v1/sandbox?token=" + key, nil, false},
		{"/v1/openapi.json?token=" + key, nil, true},
		{"/v1/openapi.json?token=" + key + "&token=" + key, nil, false},
		{"/v1/openapi.json?token=x", nil, false},
	} {
		r := httptest.NewRequest("GET", tc.target, nil)
		for _, a := range tc.auth {
			r.Header.Add("Authorization", a)
		}
		if err := b.authorize(r); (err == nil) != tc.ok {
			t.Errorf("%s %q: %v, want ok=%v", tc.target, tc.auth, err, tc.ok)
		}
	}
	closed := &Bridge{}
	r := httptest.NewRequest("GET", "/v1/sandbox", nil)
	r.Header.Set("Authorization", "Bearer ")
	var ae *apiError
	if err := closed.authorize(r); !errors.As(err, &ae) || ae.status != http.StatusUnauthorized || !strings.Contains(ae.msg, "SANDBOX_API_KEY") {
		t.Errorf("no key configured: %v", err)
	}
}

// SSE framing: one data line per line of data, a blank line after.
func TestAppendEvent(t *testing.T) {
	if got := string(appendEvent(nil, "stdout", []byte("aGk="))); got != "event: stdout\ndata: aGk=\n\n" {
		t.Errorf("%q", got)
	}
	if got := string(appendEvent(nil, "x", []byte("a\nb"))); got != "event: x\ndata: a\ndata: b\n\n" {
		t.Errorf("%q", got)
	}
}

func sha(s string) [32]byte { return sha256.Sum256([]byte(s)) }
