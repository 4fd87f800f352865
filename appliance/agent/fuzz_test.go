package agent

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net/url"
	"strconv"
	"strings"
	"testing"
)

// frame builds one frame for the fuzz seeds.
func frame(kind byte, p []byte) []byte {
	b := make([]byte, headerBytes+len(p))
	b[0] = kind
	binary.BigEndian.PutUint32(b[1:], uint32(len(p)))
	copy(b[headerBytes:], p)
	return b
}

// FuzzFrames feeds arbitrary bytes to everything that parses what the other
// side sends: the frame reader, request and response decoding, and the data
// reader. It must never panic, never allocate beyond the frame limits, and
// either decode a message or say why not.
//
//	go test -run '^$' -fuzz FuzzFrames -fuzztime 60s ./appliance/agent
func FuzzFrames(f *testing.F) {
	msg := func(v any) []byte { b, _ := json.Marshal(v); return frame(kindMsg, b) }
	f.Add(msg(request{Op: "hello", Version: 1, Config: &Config{RelayAddr: "127.0.0.1:3128"}}))
	f.Add(msg(request{Op: "exec", Args: []string{"sh", "-c", "true"}, Env: []string{"A=b"}, Stdin: true}))
	f.Add(append(frame(kindData, []byte("abc")), msg(response{End: true})...))
	f.Add(append(frame(kindStderr, []byte("x")), msg(response{Exit: &wireExit{Code: 1}})...))
	f.Add(msg(response{Error: &wireError{Code: "not_found", Message: "m"}}))
	f.Add([]byte{kindMsg, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{9, 0, 0, 0, 0})
	f.Add(frame(kindMsg, []byte(`{"op":"exec","bogus":1}`)))
	f.Fuzz(func(t *testing.T, in []byte) {
		var buf []byte
		r := bytes.NewReader(in)
		for {
			kind, p, err := readFrame(r, &buf)
			if err != nil {
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, errProtocol) {
					t.Fatalf("readFrame: unexpected error %v", err)
				}
				break
			}
			if (kind == kindMsg && len(p) > maxMsgBytes) || (kind != kindMsg && len(p) > maxDataBytes) {
				t.Fatalf("frame of %d bytes passed the limits", len(p))
			}
			if kind == kindMsg {
				if req, err := decodeRequest(p); err == nil {
					// What we decode, we can send again.
					b, err := json.Marshal(req)
					if err != nil {
						t.Fatalf("re-encoding %+v: %v", req, err)
					}
					if _, err := decodeRequest(b); err != nil {
						t.Fatalf("re-decoding %s: %v", b, err)
					}
					continue
				}
				var resp response
				if err := decodeMsg(p, &resp); err == nil && resp.Error != nil {
					_ = resp.Error.toError("fuzz").Error()
				}
			}
		}
		d := &dataReader{r: bytes.NewReader(in)}
		n, err := io.Copy(io.Discard, d)
		if err == nil && !d.final.End {
			t.Fatalf("data reader returned EOF after %d bytes without an End message", n)
		}
	})
}

// FuzzRouteBaseURL checks the relay route of a base URL: left alone
// unless it is an http(s) URL off the relay; otherwise a route on the
// relay that names exactly the URL's host, with its path, no query or
// fragment, no control bytes; and routing a route changes nothing.
func FuzzRouteBaseURL(f *testing.F) {
	for _, s := range []string{
		"https://api.openai.com/v1/", "https://api.anthropic.com", "http://localhost:8080/x//", "HTTPS://API.Example.COM/A%2FB?q=1#f",
		"https://user:pass@api.example.com/v1", "https://[2001:db8::1]:8443/p", "https://api.example.com:443", "https://api.example.com/../../evil.example/v1",
		"http://127.0.0.1:3128/https/api.example.com", "http://127.0.0.1:3128", "http://127.0.0.1:31280/x", "ftp://files.example.com/x", "not a url",
		"", "https://", "https:///path", "//api.example.com/v1", "https://api.example.com/%0d%0aX:1", "https://api.example.com\r\n/x",
		"https://%e4%bd%a0.example/x", "https://a.example/ /b", "https://a.example?x", "https://a.example#/x", "https://a.example/\u00e9",
	} {
		f.Add(uint16(3128), s)
	}
	f.Fuzz(func(t *testing.T, port uint16, value string) {
		relay := "127.0.0.1:" + strconv.Itoa(int(port))
		origin := "http://" + relay
		got := RouteBaseURL(relay, value)
		u, err := url.Parse(value)
		onRelay := value == origin || strings.HasPrefix(value, origin+"/")
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || onRelay {
			if got != value {
				t.Fatalf("routeBaseURL(%q) = %q, want it left as it is", value, got)
			}
			return
		}
		prefix := origin + "/" + u.Scheme + "/"
		rest, ok := strings.CutPrefix(got, prefix)
		if !ok {
			t.Fatalf("routeBaseURL(%q) = %q, not a route under %s", value, got, prefix)
		}
		// The relay reads the host up to the first / or ?: it must be the
		// URL's host, all of it.
		end := strings.IndexAny(rest, "/?")
		if end < 0 {
			end = len(rest)
		}
		if rest[:end] != u.Host {
			t.Fatalf("routeBaseURL(%q) = %q routes to host %q, want %q", value, got, rest[:end], u.Host)
		}
		// The path with its dot segments resolved (as a URL parser does),
		// less one trailing slash.
		p := rest[end:]
		if ep := u.ResolveReference(&url.URL{}).EscapedPath(); p != ep && p+"/" != ep {
			t.Fatalf("routeBaseURL(%q) = %q: path %q, want %q less one trailing /", value, got, p, ep)
		}
		if strings.ContainsAny(got, "?# ") || strings.ContainsFunc(got, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			t.Fatalf("routeBaseURL(%q) = %q holds a query, fragment, space or control byte", value, got)
		}
		if again := RouteBaseURL(relay, got); again != got {
			t.Fatalf("routing a route changes it: %q → %q", got, again)
		}
		if ru, err := url.Parse(got); err != nil || ru.Host != relay || ru.Scheme != "http" {
			t.Fatalf("the route %q is not a URL on the relay %s (%v)", got, relay, err)
		}
	})
}
