package wasm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// sendable checks that req can be written on the wire and read back as
// the same request to the same host: what the proxy accepted from a module
// it can send.
func sendable(t *testing.T, req *http.Request) {
	t.Helper()
	var buf bytes.Buffer
	if err := req.Write(&buf); err != nil {
		t.Fatalf("accepted request cannot be written: %v", err)
	}
	back, err := http.ReadRequest(bufio.NewReader(&buf))
	if err != nil {
		t.Fatalf("accepted request does not parse back: %v\n%q", err, buf.String())
	}
	if back.Host != "api.example.com" || back.Method != req.Method || back.RequestURI != req.URL.RequestURI() {
		t.Fatalf("sent %s %s to %s, read back %s %s to %s", req.Method, req.URL.RequestURI(), req.URL.Host, back.Method, back.RequestURI, back.Host)
	}
	for k, vs := range req.Header {
		if k == "Content-Length" || k == "User-Agent" {
			continue
		}
		got := back.Header.Values(k)
		if len(got) != len(vs) {
			t.Fatalf("header %q: sent %q, read back %q", k, vs, got)
		}
	}
}

// FuzzValidate feeds arbitrary bytes to the checks applied to what a module
// writes: what they accept must be sendable, and nothing panics.
func FuzzValidate(f *testing.F) {
	for _, s := range [][4]string{
		{"GET", "/v1/x?y=1", "X-Api", "v"}, {"G ET", "//evil/x", "Host", "a\r\nb"}, {"", "", "", ""},
		{"CONNECT", "http://x/", "Transfer-Encoding", "chunked"}, {"PATCH", "/a#b", "X", "\x00"}, {"POST", "/%zz", "Bad Name", "ok"},
	} {
		f.Add(s[0], s[1], s[2], s[3])
	}
	f.Fuzz(func(t *testing.T, method, uri, name, value string) {
		req, _ := http.NewRequest("GET", "https://api.example.com/", nil)
		if checkMethod(method) == "" {
			req.Method = method
		}
		if u, v := parseURI(uri); v == "" {
			if u.Host != "" || u.Scheme != "" {
				t.Fatalf("parseURI(%q) accepted a URI with a host", uri)
			}
			req.URL.Path, req.URL.RawPath, req.URL.RawQuery, req.URL.ForceQuery = u.Path, u.RawPath, u.RawQuery, u.ForceQuery
		}
		if checkHeaderName(name) == "" && checkHeaderValue(name, value) == "" {
			if strings.EqualFold(name, "host") {
				t.Fatalf("Host accepted")
			}
			req.Header.Add(name, value)
		}
		sendable(t, req)
	})
}

var fuzzModule struct {
	once sync.Once
	r    *Runtime
	m    *Module
	err  error
}

// FuzzChain runs a real guest that writes the fuzzer's bytes as method,
// URI, header and body (NUL-separated in the request body): the host
// either refuses them (a 502 naming the module) or yields a request it can
// send to the same host; it never panics, and the instance stays usable.
func FuzzChain(f *testing.F) {
	for _, s := range []string{
		"PUT\x00/v2/x?y=1\x00X-Fuzz\x00value\x00body",
		"GET\x00//evil.example/\x00Host\x00evil\x00",
		"\x00/a b\x00X\x00a\r\nb\x00",
		"CONNECT\x00*\x00Transfer-Encoding\x00chunked\x00x",
		"\x00\x00\x00\x00",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		fuzzModule.once.Do(func() {
			fuzzModule.r, fuzzModule.err = NewRuntime(context.Background(), Config{CacheDir: gobuild.WasmCache(t), CallTimeout: normalCallTimeout, MaxBodyBytes: 1 << 16})
			if fuzzModule.err == nil {
				fuzzModule.m, fuzzModule.err = fuzzModule.r.Load(context.Background(), "fuzz", guest(t, "probe"), []byte("init enable 1\nreq fuzz"))
			}
		})
		if fuzzModule.err != nil {
			t.Fatal(fuzzModule.err)
		}
		req, _ := http.NewRequest("POST", "https://api.example.com/start", bytes.NewReader(in))
		x, err := HandleRequest(context.Background(), req, info, NewChain(fuzzModule.m))
		x.Close()
		if len(fuzzModule.m.slots) != 0 {
			t.Fatalf("an instance was not returned to the pool after input %q", in)
		}
		if err != nil {
			var we *Error
			if !errors.As(err, &we) || we.Module != "fuzz" || we.Status == 0 {
				t.Fatalf("error %v does not name the module with a status", err)
			}
			if strings.Contains(we.Reason, "trapped") || strings.Contains(we.Reason, "exited") {
				t.Fatalf("the guest died on input %q: %v", in, err)
			}
			return
		}
		sendable(t, req)
	})
}
