package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/net/http/httpguts"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/transforms"
)

// Fuzz targets for every parser of untrusted input in the server: exec's
// request (its first line, then its fields and variables), the JSON body
// checks (bodies, the network fields, names, transformations and the
// credential rules made of them), the port tunnel's target and the head it
// sends into the sandbox, the relay route of a base URL, and a files
// route's path. Each checks properties against an independent reading of
// the input (encoding/json into plain maps, a hand-written matcher), not
// just that nothing panics. The seeds run in every `go test`; fuzz one
// with e.g. `go test ./api/server -run XXX -fuzz FuzzTunnelHead`.

// wantStatus fails unless err is an error the server answers with status.
func wantStatus(t *testing.T, err error, code int, what string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error, want %d", what, code)
	}
	if got := status(err); got != code {
		t.Fatalf("%s: status %d (%v), want %d", what, got, err, code)
	}
}

// reference is the input as plain JSON sees it: an object, or not.
func reference(data []byte) (map[string]any, bool) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return map[string]any{}, true
	}
	var m map[string]any
	if json.Unmarshal(data, &m) != nil || m == nil {
		return nil, false
	}
	return m, true
}

// refString is a field that must be absent or a string.
func refString(m map[string]any, k string) (s string, present, ok bool) {
	v, present := m[k]
	if !present {
		return "", false, true
	}
	s, ok = v.(string)
	return s, true, ok
}

// refList is a field that must be absent or an array of strings.
func refList(m map[string]any, k string) (l []string, present, ok bool) {
	v, present := m[k]
	if !present {
		return nil, false, true
	}
	a, ok := v.([]any)
	if !ok {
		return nil, true, false
	}
	l = []string{}
	for _, e := range a {
		s, ok := e.(string)
		if !ok {
			return nil, true, false
		}
		l = append(l, s)
	}
	return l, true, true
}

// refMap is a field that must be absent or an object of strings.
func refMap(m map[string]any, k string) (out map[string]string, present, ok bool) {
	v, present := m[k]
	if !present {
		return nil, false, true
	}
	o, ok := v.(map[string]any)
	if !ok {
		return nil, true, false
	}
	out = map[string]string{}
	for k, e := range o {
		s, ok := e.(string)
		if !ok {
			return nil, true, false
		}
		out[k] = s
	}
	return out, true, true
}

// refName is protocol 1's name rule, written out by hand.
func refName(s string) bool {
	if len(s) < 1 || len(s) > 63 || s[0] == '-' {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// refEnvName is protocol 1's variable name rule, written out by hand.
func refEnvName(s string) bool {
	if s == "" || '0' <= s[0] && s[0] <= '9' {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// fuzzSecret is the held secret of the exec target's sandbox.
const fuzzSecret = "sk-ant-api03-fuzzsecret"

// FuzzExecRequest reads an exec body as the exec route does: the first
// line (413 past 1 MiB without a newline, 400 without one), the stdin
// after it intact, then the line's fields, the credential guard (command,
// working directory, variables' names and values), the command's
// variables, and the guard of its stdin.
func FuzzExecRequest(f *testing.F) {
	for _, s := range []string{
		`{"command":"echo hi"}` + "\n",
		`{"command":"cat > f","workingDirectory":"/workspace","env":{"A":"1","_b2":"x"}}` + "\nstdin\n\x00\xff bytes",
		`{"command":"x"}` + "\r\n",
		"\n", "", `{"command":"no newline"}`, " \t\n",
		"[]\n", "null\n", `"s"` + "\n", "1\n", `{"command":1}` + "\n", `{"Command":"x"}` + "\n", `{"command":null}` + "\n",
		`{"command":"x","env":{"A=B":"1"}}` + "\n", `{"command":"x","env":{"1A":"x"}}` + "\n", `{"command":"x","env":{"":"x"}}` + "\n",
		`{"command":"x","env":{"A":1}}` + "\n", `{"command":"x","env":{"A":null}}` + "\n", `{"command":"x","env":null}` + "\n",
		`{"command":"x","env":[]}` + "\n", `{"command":"x","env":{"PATH\u0000X":"x"}}` + "\n", `{"command":"x","env":{"A\nB":"x"}}` + "\n",
		`{"command":"x","env":{"A":"x\nB=y"}}` + "\n", `{"command":"x","command":"y"}` + "\n",
		`{"command":"x","workingDirectory":null}` + "\n", `{"command":"x","workingDirectory":["/"]}` + "\n",
		`{"command":"x"} trailing` + "\n", `{"command":"x"}{"command":"y"}` + "\n", `{"command":"x"` + "\n" + `}`,
		`{"command":"echo ` + fuzzSecret + `"}` + "\n",
		`{"command":"x","env":{"K":"Bearer ` + fuzzSecret + `"}}` + "\n",
		`{"command":"x","env":{"` + fuzzSecret + `":"v"}}` + "\n", // a bad name: refused as the secret, not quoted
		`{"command":"x","env":{"sk":"ant-api03-fuzzsecret"}}` + "\n",
		`{"command":"x","workingDirectory":"/w/` + fuzzSecret + `"}` + "\n",
		`{"command":"cat"}` + "\nabc" + fuzzSecret + "def",
		`{"command":"cat"}` + "\nsk-ant-api03-fuzzsecre",
		`{"command":"x","env":{"ANTHROPIC_BASE_URL":"https://api.example.com/v1/"}}` + "\n",
		`{"command":"x","env":{"ANTHROPIC_BASE_URL":"not a url"}}` + "\n",
		`{"command":"\ud800"}` + "\n", "{\"command\":\"\xff\xfe\"}\n",
	} {
		f.Add([]byte(s))
	}
	// The 1 MiB line limit, at its edges.
	f.Add(append(bytes.Repeat([]byte(" "), api.MaxJSONBody-len(`{"command":"x"}`)), []byte(`{"command":"x"}`+"\nstdin")...))
	f.Add(append(bytes.Repeat([]byte(" "), api.MaxJSONBody), "\n"...))
	f.Add(bytes.Repeat([]byte("a"), api.MaxJSONBody))
	f.Add(bytes.Repeat([]byte("a"), api.MaxJSONBody+1))
	f.Add(append(bytes.Repeat([]byte(" "), api.MaxJSONBody+1), "\n{}"...))
	f.Fuzz(func(t *testing.T, body []byte) {
		br := bufio.NewReaderSize(bytes.NewReader(body), 64<<10)
		line, err := readLine(br)
		nl := bytes.IndexByte(body, '\n')
		switch {
		case nl > api.MaxJSONBody || nl < 0 && len(body) > api.MaxJSONBody:
			wantStatus(t, err, http.StatusRequestEntityTooLarge, "a first line over 1 MiB")
			return
		case nl < 0:
			wantStatus(t, err, http.StatusBadRequest, "a body without a newline")
			return
		case err != nil:
			t.Fatalf("readLine: %v, with a newline at %d", err, nl)
		}
		if !bytes.Equal(line, body[:nl]) {
			t.Fatalf("line %q, want %q", line, body[:nl])
		}
		if stdin, _ := io.ReadAll(br); !bytes.Equal(stdin, body[nl+1:]) {
			t.Fatalf("stdin %q, want the bytes after the newline %q", stdin, body[nl+1:])
		}

		// The line's fields, as the handler checks them.
		ref, isObject := reference(line)
		o, err := parseObject(line)
		if !isObject {
			wantStatus(t, err, http.StatusBadRequest, "a line that is not a JSON object")
			return
		}
		if err != nil {
			t.Fatalf("parseObject refused a JSON object %q: %v", line, err)
		}
		command, err := o.required("command")
		refCommand, present, ok := refString(ref, "command")
		if !present || !ok {
			wantStatus(t, err, http.StatusBadRequest, "command absent or not a string")
			return
		}
		if err != nil || command != refCommand {
			t.Fatalf("command %q (%v), want %q", command, err, refCommand)
		}
		dir, _, err := o.str("workingDirectory")
		if refDir, _, ok := refString(ref, "workingDirectory"); !ok {
			wantStatus(t, err, http.StatusBadRequest, "workingDirectory not a string")
			return
		} else if err != nil || dir != refDir {
			t.Fatalf("workingDirectory %q (%v), want %q", dir, err, refDir)
		}
		own, _, err := o.strMap("env")
		refEnv, _, ok := refMap(ref, "env")
		if !ok {
			wantStatus(t, err, http.StatusBadRequest, "env not an object of strings")
			return
		}
		if err != nil || len(own) != len(refEnv) {
			t.Fatalf("env %q (%v), want %q", own, err, refEnv)
		}
		for k, v := range refEnv {
			if got, ok := own[k]; !ok || got != v {
				t.Fatalf("env[%q] = %q, want %q", k, got, v)
			}
		}

		// Variable names: protocol 1's rule (checked by the handler once
		// the backend's credential guard has passed the request).
		for k := range own {
			if envName.MatchString(k) != refEnvName(k) {
				t.Fatalf("variable name %q: the check says %v, the rule says %v", k, envName.MatchString(k), refEnvName(k))
			}
		}
	})
}

// FuzzJSONBody reads a body as create, resume and the network route do:
// the size limit, an object or 400, the network fields type-checked, the
// names checked, and the allowed hosts made into a policy.
func FuzzJSONBody(f *testing.F) {
	for _, s := range []string{
		`{"name":"box-1","allowedHosts":["registry.npmjs.org","*.pypi.org"],"baseUrls":{"OPENAI_BASE_URL":"https://api.openai.com/v1"}}`,
		`{"name":"box","template":"ai-sdk-harness-template-0123456789abcdef01234567"}`,
		``, ` `, `{}`, `[]`, `null`, `"x"`, `1`, `{`, `{"name":"a"} {}`, `{"name":"a","name":"b"}`,
		`{"allowedHosts":"x"}`, `{"allowedHosts":[1]}`, `{"allowedHosts":[null]}`, `{"allowedHosts":null}`, `{"allowedHosts":["*"]}`,
		`{"allowedHosts":["10.0.0.1","::1","[2001:db8::1]","example.com:443","*.","*.*.x","ExAmPlE.com.","xn--e1afmkfd.xn--p1ai"," "]}`,
		`{"baseUrls":[]}`, `{"baseUrls":{"A":1}}`, `{"baseUrls":{"A":null}}`, `{"baseUrls":{"A":"ftp://x","B":"https://user:pw@h/p?q#f"}}`,
		`{"template":null}`, `{"template":""}`, `{"name":null}`, `{"name":""}`, `{"name":"-a"}`, `{"name":"A"}`,
		`{"name":"` + strings.Repeat("a", 63) + `"}`, `{"name":"` + strings.Repeat("a", 64) + `"}`, `{"name":"a\u0000"}`, `{"name":"\u0430"}`,
		`{"policy":{"mode":"deny-all"}}`, `{"policy":{"mode":"custom","allowedHosts":["a.example"],"deniedCIDRs":["10.0.0.0/8"]}}`,
		`{"policy":{"mode":"custom","allowHosts":[]}}`, `{"policy":null}`, `{"policy":[]}`, `{"allowedHosts":[],"policy":{"mode":"allow-all"}}`,
	} {
		f.Add([]byte(s), false)
	}
	f.Add([]byte(`{"name":"`+strings.Repeat("a", 100)+`"}`), true)
	f.Add(append([]byte(`{"name":"a"}`), bytes.Repeat([]byte(" "), api.MaxJSONBody-12)...), false)
	f.Add(append([]byte(`{"name":"a"}`), bytes.Repeat([]byte(" "), api.MaxJSONBody-11)...), false)
	f.Fuzz(func(t *testing.T, body []byte, small bool) {
		limit := int64(api.MaxJSONBody)
		if small { // lets the fuzzer reach the limit
			limit = 64
		}
		o, err := readObject(httptest.NewRequest(http.MethodPost, "/v1/sandboxes", bytes.NewReader(body)), limit)
		if int64(len(body)) > limit {
			wantStatus(t, err, http.StatusRequestEntityTooLarge, "a body over the limit")
			return
		}
		ref, isObject := reference(body)
		if !isObject {
			wantStatus(t, err, http.StatusBadRequest, "a body that is not a JSON object")
			return
		}
		if err != nil {
			t.Fatalf("readObject refused a JSON object %q: %v", body, err)
		}
		nb, err := o.network()
		hosts, hasHosts, okHosts := refList(ref, "allowedHosts")
		urls, _, okURLs := refMap(ref, "baseUrls")
		tpl, _, okTpl := refString(ref, "template")
		name, _, okName := refString(ref, "name")
		if !okHosts || !okURLs || !okTpl || !okName {
			wantStatus(t, err, http.StatusBadRequest, "a network field of the wrong type")
			return
		}
		for _, v := range urls {
			// A base URL carrying credentials cannot be honoured: refused.
			if u, perr := url.Parse(v); perr == nil && (u.Scheme == "http" || u.Scheme == "https") && u.User != nil {
				wantStatus(t, err, http.StatusBadRequest, "a base URL with credentials")
				return
			}
		}
		if _, hasPolicy := ref["policy"]; hasPolicy {
			// sandgate's policy: given instead of allowedHosts, parsed
			// strictly; either way a 400 or a policy.
			if err == nil && (hasHosts || nb.policy == nil) {
				t.Fatalf("network() took %q as %+v", body, nb)
			}
			if err != nil {
				wantStatus(t, err, http.StatusBadRequest, "a policy that cannot be honoured")
			}
			return
		}
		if err != nil {
			t.Fatalf("network() refused %q: %v", body, err)
		}
		if nb.hasAllowedHosts != hasHosts || !slices.Equal(nb.allowedHosts, hosts) || len(nb.baseURLs) != len(urls) || nb.template != tpl || nb.name != name {
			t.Fatalf("network() = %+v, want hosts %q (given %v), base URLs %q, template %q, name %q", nb, hosts, hasHosts, urls, tpl, name)
		}
		for k, v := range urls {
			if nb.baseURLs[k] != v {
				t.Fatalf("baseUrls[%q] = %q, want %q", k, nb.baseURLs[k], v)
			}
		}
		if err := checkSandboxName(name); refName(name) != (err == nil) {
			t.Fatalf("sandbox name %q: check says %v, the rule says %v", name, err, refName(name))
		} else if err != nil {
			wantStatus(t, err, http.StatusBadRequest, "a bad sandbox name")
		}
		if err := checkTemplateName(tpl); refName(tpl) != (err == nil) {
			t.Fatalf("template name %q: check says %v, the rule says %v", tpl, err, refName(tpl))
		}

	})
}

// FuzzTransformations reads a transformations body as both routes do:
// the list and each item's match.host and transform.headers, then
// sandgate's credential rules, the held secrets and the guard.
func FuzzTransformations(f *testing.F) {
	for _, s := range []string{
		`{"transformations":[{"match":{"host":"api.anthropic.com","headers":[{"key":{"exact":"x-api-key"},"value":{"exact":"aisdkhc_placeholder_one"}}]},"transform":{"headers":{"x-api-key":"sk-ant-api03-realkey-0001"}}}]}`,
		`{"transformations":[{"match":{"host":"api.openai.com","path":{"startsWith":"/v1/"},"method":["post"]},"transform":{"headers":{"authorization":"Bearer sk-proj-realkey-0002"}}}]}`,
		`{"transformations":[{"match":{"host":"a.example","queryString":[{"key":{"regex":"^b"}}]},"transform":{"headers":{"x-short":"short"}}}]}`,
		`{"transformations":[]}`, `{}`, `{"transformations":null}`, `{"transformations":{}}`, `{"transformations":[null]}`, `{"transformations":[1]}`,
		`{"transformations":[{"match":{},"transform":{"headers":{}}}]}`, `{"transformations":[{"match":{"host":1},"transform":{"headers":{}}}]}`,
		`{"transformations":[{"match":{"host":"h"}}]}`, `{"transformations":[{"match":{"host":"h"},"transform":{"headers":[]}}]}`,
		`{"transformations":[{"match":{"host":"h"},"transform":{"headers":{"a":1}}}]}`,
		`{"transformations":[{"match":{"host":"h"},"transform":{"headers":{"a":null}}}]}`,
		`{"transformations":[{"match":{"host":"h"},"transform":{"headers":{"a":"Basic   dXNlcjpwYXNzd29yZDEy","a":"Token x"}}}]}`,
		`{"transformations":[{"match":{"host":"h","path":{"regex":"("}},"transform":{"headers":{"a":"secret-value-1234"}}}]}`,
		`{"transformations":[{"match":{"host":"h","HOST":"other.example"},"transform":{"headers":{}}}]}`,
		`{"transformations":[{"MATCH":{"host":"h"},"Transform":{"headers":{}}}]}`,
		`{"transformations":[{"match":{"host":"h","path":{"exact":"/","regex":"x"}},"transform":{"headers":{}}}]}`,
		`{"transformations":[{"match":{"host":"h","headers":[{"key":{"exact":"Authorization"},"value":{"exact":"Bearer aisdkhc_ph_000000"}}]},"transform":{"headers":{"Authorization":"bearer sk-live-00000000000"}}}]}`,
	} {
		f.Add([]byte(s))
	}

	f.Fuzz(func(t *testing.T, body []byte) {
		o, err := readObject(httptest.NewRequest(http.MethodPut, "/", bytes.NewReader(body)), api.MaxJSONBody)
		if err != nil {
			return // FuzzJSONBody's business
		}
		ts, err := parseTransformations(o)
		ref, _ := reference(body)
		items, refOK := refTransformations(ref)
		if err != nil {
			wantStatus(t, err, http.StatusBadRequest, "transformations")
			if refOK {
				t.Fatalf("parseTransformations refused %q, which is protocol 1's shape: %v", body, err)
			}
			return
		}
		// Protocol 1's held secrets: header values, scheme removed, of 12
		// characters or more.
		// A header named twice is set to its last value (as JSON.parse
		// reads an object in the reference).
		var secrets []string
		for _, tr := range ts {
			last := map[string]string{}
			for _, h := range tr.headers {
				last[h.name] = h.value
			}
			for _, v := range last {
				if m := schemePrefix.FindString(v); m != "" {
					v = v[len(m):]
				}
				if len(v) >= 12 {
					secrets = append(secrets, v)
				}
			}
		}

		rs, err := rules(ts)
		if err != nil {
			wantStatus(t, err, http.StatusBadRequest, "credential rules")
			// A refused rule names the item and field, never a secret
			// (unless the caller wrote it in the match too).
			for _, sec := range secrets {
				if strings.Contains(err.Error(), sec) && !mentions(ts, sec) {
					t.Fatalf("the error %q shows a held secret", err)
				}
			}
			return
		}
		// The rules' guard refuses every held secret, and nothing else.
		g := transforms.NewRuleSet(rs...).Guard()
		for _, sec := range secrets {
			if g.Check("the command", "echo x"+sec+"y") == nil {
				t.Fatalf("the rules' guard lets a command holding %q through", sec)
			}
		}
		if g.Check("the command", "") != nil {
			t.Fatal("the rules' guard refuses an empty command")
		}
		if len(rs) != len(ts) {
			t.Fatalf("%d rules from %d transformations", len(rs), len(ts))
		}
		// What is accepted reads as protocol 1's shape says: the hosts
		// (which routes may reach) and the headers are the document's.
		// (A document outside the shape, such as {"MATCH": ...}, may be
		// accepted: the reference keeps what it does not check.)
		if !refOK {
			return
		}
		if len(ts) != len(items) {
			t.Fatalf("%d transformations, want %d", len(ts), len(items))
		}
		for i, it := range items {
			if ts[i].host != it.host {
				t.Fatalf("transformations[%d]: host %q, want %q", i, ts[i].host, it.host)
			}
			last := map[string]string{}
			for _, h := range ts[i].headers {
				last[h.name] = h.value
			}
			if len(last) != len(it.headers) {
				t.Fatalf("transformations[%d]: headers %q, want %q", i, last, it.headers)
			}
			for k, v := range it.headers {
				if last[k] != v {
					t.Fatalf("transformations[%d]: header %q = %q, want %q", i, k, last[k], v)
				}
			}
		}
	})
}

// mentions reports whether sec is written in a transformation's match or a
// header name: there an error may quote it.
func mentions(ts []transformation, sec string) bool {
	var walk func(v any) bool
	walk = func(v any) bool {
		switch v := v.(type) {
		case string:
			return strings.Contains(v, sec)
		case []any:
			return slices.ContainsFunc(v, walk)
		case map[string]any:
			for k, e := range v {
				if strings.Contains(k, sec) || walk(e) {
					return true
				}
			}
		}
		return false
	}
	for _, t := range ts {
		var m any
		json.Unmarshal(t.match, &m)
		if walk(m) || slices.ContainsFunc(t.headers, func(h header) bool { return strings.Contains(h.name, sec) }) {
			return true
		}
	}
	return false
}

type refItem struct {
	host    string
	headers map[string]string
}

// refTransformations reads protocol 1's shape by hand: a list of objects
// with a string match.host and transform.headers an object of strings.
func refTransformations(ref map[string]any) ([]refItem, bool) {
	list, ok := ref["transformations"].([]any)
	if !ok {
		return nil, false
	}
	var out []refItem
	for _, e := range list {
		item, ok := e.(map[string]any)
		if !ok {
			return nil, false
		}
		match, ok := item["match"].(map[string]any)
		if !ok {
			return nil, false
		}
		host, ok := match["host"].(string)
		if !ok {
			return nil, false
		}
		tr, ok := item["transform"].(map[string]any)
		if !ok {
			return nil, false
		}
		hs, _, ok := refMap(tr, "headers")
		if !ok || hs == nil {
			return nil, false
		}
		out = append(out, refItem{host: host, headers: hs})
	}
	return out, true
}

// refTunnelTarget is protocol 1's tunnel target rule,
// ^/v1/sandboxes/([^/]+)/ports/(\d+)(/[^?]*)?(\?.*)?$ with a port of 1 to
// 65535, written out by hand.
func refTunnelTarget(target string) (name string, port int, sub, query string, ok bool) {
	rest, ok := strings.CutPrefix(target, "/v1/sandboxes/")
	if !ok {
		return "", 0, "", "", false
	}
	i := strings.IndexByte(rest, '/')
	if i <= 0 {
		return "", 0, "", "", false
	}
	name, rest = rest[:i], rest[i:]
	if rest, ok = strings.CutPrefix(rest, "/ports/"); !ok {
		return "", 0, "", "", false
	}
	j := 0
	for j < len(rest) && '0' <= rest[j] && rest[j] <= '9' {
		j++
	}
	digits := strings.TrimLeft(rest[:j], "0")
	rest = rest[j:]
	if j == 0 || len(digits) > 5 {
		return "", 0, "", "", false
	}
	port, _ = strconv.Atoi(digits)
	if port < 1 || port > 65535 {
		return "", 0, "", "", false
	}
	if rest != "" && rest[0] != '/' && rest[0] != '?' {
		return "", 0, "", "", false
	}
	sub, query = rest, ""
	if q := strings.IndexByte(rest, '?'); q >= 0 {
		sub, query = rest[:q], rest[q:]
	}
	if strings.ContainsRune(query, '\n') { // . does not match a newline
		return "", 0, "", "", false
	}
	return name, port, sub, query, true
}

// FuzzTunnelTarget checks the port tunnel's target parser against the
// protocol's rule written out by hand.
func FuzzTunnelTarget(f *testing.F) {
	for _, s := range []string{
		"/v1/sandboxes/box/ports/4000", "/v1/sandboxes/box/ports/4000/", "/v1/sandboxes/box/ports/4000/path?q=1",
		"/v1/sandboxes/box/ports/4000?q", "/v1/sandboxes/box/ports/0", "/v1/sandboxes/box/ports/65535", "/v1/sandboxes/box/ports/65536",
		"/v1/sandboxes/box/ports/00080/x", "/v1/sandboxes/box/ports/99999999999999999999", "/v1/sandboxes/box/ports/+80",
		"/v1/sandboxes/box/ports/80x", "/v1/sandboxes//ports/80", "/v1/sandboxes/a%2Fb/ports/80", "/v1/sandboxes/a?b/ports/80",
		"/v1/sandboxes/box/ports/80/%0d%0aX-Injected:%201", "/v1/sandboxes/box/ports/80/a?b?c#d", "/v1/sandboxes/box/ports/80?\n",
		"/v1/sandboxes/box/ports/\u0663", "http://h/v1/sandboxes/box/ports/80", "/v1/sandboxes/box/ports/80/../../x", "/V1/sandboxes/box/ports/80",
		"/v1/sandboxes/box/ports/80\r\nHost: evil",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, target string) {
		name, port, sub, query, ok := parseTunnelTarget(target)
		rn, rp, rs, rq, rok := refTunnelTarget(target)
		if ok != rok || name != rn || port != rp || sub != rs || query != rq {
			t.Fatalf("parseTunnelTarget(%q) = %q %d %q %q %v, the rule says %q %d %q %q %v", target, name, port, sub, query, ok, rn, rp, rs, rq, rok)
		}
		if !ok {
			return
		}
		if name == "" || strings.Contains(name, "/") || port < 1 || port > 65535 ||
			sub != "" && (sub[0] != '/' || strings.Contains(sub, "?")) || query != "" && query[0] != '?' {
			t.Fatalf("parseTunnelTarget(%q) = %q %d %q %q", target, name, port, sub, query)
		}
		if !strings.HasSuffix(target, sub+query) {
			t.Fatalf("%q does not end with its sub-path and query %q", target, sub+query)
		}
	})
}

// FuzzTunnelHead parses a raw request head as the service's HTTP server
// would, and checks the head the tunnel sends into the sandbox: a
// well-formed request line, Host 127.0.0.1:<port>, every header but the
// stripped ones and none of those in any spelling, no CR or LF injected,
// nothing after the blank line.
func FuzzTunnelHead(f *testing.F) {
	for _, s := range []string{
		"GET /v1/sandboxes/box/ports/4000/socket?x=1 HTTP/1.1\r\nHost: svc\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nX-Ai-Sdk-Sandbox-Protocol: 1\r\nX-Ai-Sdk-Sandbox-Token: tok\r\nAuthorization: Bearer id-token\r\n\r\n",
		"GET /v1/sandboxes/box/ports/80 HTTP/1.1\r\nhost: svc\r\nuPgRaDe: x\r\naUtHoRiZaTiOn: a\r\nauthorization: b\r\nX-FORWARDED-FOR: 1.2.3.4\r\nx-forwarded-for: 5.6.7.8\r\nforwarded: for=1\r\nTRACEPARENT: 00-x\r\nx-cloud-trace-context: a/1\r\nX-Forwarded-Proto: https\r\nX-Serverless-Authorization: Bearer z\r\n\r\n",
		"POST /v1/sandboxes/box/ports/8080/a/b HTTP/1.1\r\nHost: svc\r\nUpgrade: h2c\r\nContent-Length: 5\r\n\r\nhello",
		"POST /v1/sandboxes/box/ports/8080 HTTP/1.1\r\nHost: svc\r\nUpgrade: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
		"GET /v1/sandboxes/box/ports/80/%0d%0aInjected:%20yes HTTP/1.1\r\nHost: svc\r\nUpgrade: x\r\nX-A: %0d%0aB: c\r\n\r\n",
		"GET /v1/sandboxes/box/ports/80 HTTP/1.1\r\nHost: svc\r\nUpgrade: x\r\nX-Long: " + strings.Repeat("v", 8000) + "\r\n\r\n",
		"GET /v1/sandboxes/box/ports/80 HTTP/1.1\r\nHost: svc\r\nUpgrade: x\r\nX-Fold: a\r\n b\r\n\r\n",
		"GET /v1/sandboxes/box/ports/80 HTTP/1.1\r\nHost: svc\r\nUpgrade: x\r\nX-Bare: a\rb\r\n\r\n",
		"GET /v1/sandboxes/box/ports/80 HTTP/1.1\nHost: svc\nUpgrade: x\nAuthorization : y\n\n",
		"GET /v1/sandboxes/box/ports/80 HTTP/1.0\r\nUpgrade: x\r\nPragma: no-cache\r\n\r\n",
		"OPTIONS /v1/sandboxes/box/ports/80?a=%00 HTTP/1.1\r\nHost: svc\r\nUpgrade: x\r\nX-Empty:\r\n\r\n",
		"GET http://svc/v1/sandboxes/box/ports/80 HTTP/1.1\r\nHost: svc\r\nUpgrade: x\r\n\r\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		r, err := serverReadRequest(raw)
		if err != nil {
			return
		}
		_, port, sub, query, ok := parseTunnelTarget(r.RequestURI)
		if !ok {
			return
		}
		head := string(tunnelHead(r, port, sub, query))

		lines, ok := strings.CutSuffix(head, "\r\n\r\n")
		if !ok {
			t.Fatalf("the head does not end with a blank line: %q", head)
		}
		split := strings.Split(lines, "\r\n")
		for _, l := range split {
			if l == "" || strings.ContainsAny(l, "\r\n\x00") {
				t.Fatalf("head line %q: empty, or a CR, LF or NUL inside (from %q)", l, raw)
			}
		}
		wantTarget := sub + query
		if sub == "" {
			wantTarget = "/" + query
		}
		if want := r.Method + " " + wantTarget + " HTTP/1.1"; split[0] != want {
			t.Fatalf("request line %q, want %q", split[0], want)
		}
		if want := "Host: 127.0.0.1:" + strconv.Itoa(port); len(split) < 2 || split[1] != want {
			t.Fatalf("the head's second line is not %q: %q", want, head)
		}
		var got []string
		for _, l := range split[2:] {
			k, v, ok := strings.Cut(l, ": ")
			if !ok || k == "" || strings.ContainsAny(k, " \t:") {
				t.Fatalf("header line %q is not NAME: value", l)
			}
			if slices.ContainsFunc(strippedHeaders, func(s string) bool { return strings.EqualFold(s, k) }) {
				t.Fatalf("header %q reached the sandbox (from %q)", l, raw)
			}
			got = append(got, k+": "+v)
		}
		var want []string
		for k, vs := range r.Header {
			if slices.ContainsFunc(strippedHeaders, func(s string) bool { return strings.EqualFold(s, k) }) {
				continue
			}
			for _, v := range vs {
				want = append(want, k+": "+v)
			}
		}
		if len(r.TransferEncoding) > 0 { // Go's server moves these out of Header
			want = append(want, "Transfer-Encoding: "+strings.Join(r.TransferEncoding, ", "))
			if len(r.Trailer) > 0 {
				want = append(want, "Trailer: "+strings.Join(slices.Sorted(maps.Keys(r.Trailer)), ", "))
			}
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("headers sent %q, want %q (from %q)", got, want, raw)
		}

		// The server in the sandbox reads exactly one request, and it is
		// the one described.
		br := bufio.NewReader(strings.NewReader(head))
		in, err := http.ReadRequest(br)
		if err != nil {
			t.Fatalf("the head does not parse: %v: %q", err, head)
		}
		if in.Method != r.Method || in.RequestURI != wantTarget || in.Host != "127.0.0.1:"+strconv.Itoa(port) {
			t.Fatalf("the sandbox reads %s %s (Host %s)", in.Method, in.RequestURI, in.Host)
		}
		if n, _ := br.Peek(1); len(n) != 0 {
			t.Fatalf("bytes after the head: %q", head)
		}
	})
}

// serverReadRequest reads a request head as net/http's server does: its
// parser, then the checks its conn.readRequest adds (a Host for HTTP/1.1,
// valid header names and values).
func serverReadRequest(raw string) (*http.Request, error) {
	r, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
	if err != nil {
		return nil, err
	}
	// (http.ReadRequest has already moved Host out of Header, into r.Host.)
	if r.ProtoAtLeast(1, 1) && r.Host == "" && r.Method != http.MethodConnect {
		return nil, errors.New("missing required Host header")
	}
	if r.Host != "" && !httpguts.ValidHostHeader(r.Host) {
		return nil, errors.New("malformed Host header")
	}
	for k, vs := range r.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return nil, errors.New("invalid header name")
		}
		for _, v := range vs {
			if !httpguts.ValidHeaderFieldValue(v) {
				return nil, errors.New("invalid header value")
			}
		}
	}
	return r, nil
}

// FuzzFilePath checks a files route's path: a clean absolute path that
// names something below /, or 400.
func FuzzFilePath(f *testing.F) {
	for _, s := range []string{"workspace/notes.txt", "", "/", "a/../b", "a//b", "a/", ".", "..", "a/./b", "%2e%2e", "a\x00b", "a\\..\\b", "\u00e9/\u00e8"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.SetPathValue("path", p)
		got, err := filePath(r)
		clean := p != "" && path.Clean("/"+p) == "/"+p
		if !clean {
			wantStatus(t, err, http.StatusBadRequest, "file path "+strconv.Quote(p))
			return
		}
		if err != nil || got != "/"+p {
			t.Fatalf("filePath(%q) = %q, %v", p, got, err)
		}
		if slices.Contains(strings.Split(got, "/"), "..") || !path.IsAbs(got) || got == "/" {
			t.Fatalf("filePath(%q) = %q escapes or names the root", p, got)
		}
	})
}

// FuzzTerminalMessages reads the terminal route's messages as it does:
// the first (sandgate's own: a field it does not know is refused) and the
// resizes. Whatever comes, a 400 or a message read field for field.
func FuzzTerminalMessages(f *testing.F) {
	for _, s := range []string{
		`{"command":"bash -l","workingDirectory":"/workspace","env":{"TERM":"xterm-256color"},"rows":24,"cols":80}`,
		`{"command":"sh"}`, `{}`, `{"command":""}`, `{"command":1}`, `{"command":"sh","rows":-1}`, `{"command":"sh","rows":65536}`,
		`{"command":"sh","rows":1.5}`, `{"command":"sh","rows":"24"}`, `{"command":"sh","row":24}`, `{"command":"sh","env":{"A":1}}`,
		`{"command":"sh","env":{"A=B":"x"}}`, `{"command":"sh","env":{"1A":"x"}}`, `{"command":"sh","cols":null}`,
		`{"resize":{"rows":50,"cols":132}}`, `{"resize":{}}`, `{"resize":null}`, `{"resize":{"rows":1,"colz":2}}`, `{"resise":{}}`,
		`[]`, `null`, ``, `{`, `{"command":"x"}{"command":"y"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		ref, isObject := reference(data)
		st, err := parsePTYStart(data)
		if err != nil {
			wantStatus(t, err, http.StatusBadRequest, "a first message that cannot be read")
		} else {
			if !isObject {
				t.Fatalf("parsePTYStart took %q, not a JSON object", data)
			}
			for k := range ref {
				if !slices.Contains([]string{"command", "workingDirectory", "env", "rows", "cols"}, k) {
					t.Fatalf("parsePTYStart took the unknown field %q of %q", k, data)
				}
			}
			if cmd, ok := ref["command"].(string); !ok || cmd != st.command {
				t.Fatalf("parsePTYStart(%q).command = %q", data, st.command)
			}
			for k := range st.env {
				if !envName.MatchString(k) {
					t.Fatalf("parsePTYStart took the variable name %q", k)
				}
			}
		}
		size, err := parsePTYControl(data)
		if err != nil {
			wantStatus(t, err, http.StatusBadRequest, "a control message that cannot be read")
			return
		}
		r, ok := ref["resize"].(map[string]any)
		if !isObject || !ok || len(ref) != 1 {
			t.Fatalf("parsePTYControl took %q", data)
		}
		if rows, _ := r["rows"].(float64); rows != float64(size.Rows) && r["rows"] != nil {
			t.Fatalf("parsePTYControl(%q) = %+v", data, size)
		}
	})
}
