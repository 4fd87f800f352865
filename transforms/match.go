package transforms

import (
	"net/http"
	"net/netip"
	"net/url"
	"regexp"
	"slices"
	"strings"
)

type matchKind uint8

const (
	matchExact matchKind = iota
	matchPrefix
	matchRegex
)

// strMatcher is {"exact"|"startsWith"|"regex": s}. Regexes are RE2 and
// unanchored (write ^ and $ to anchor). With fold the input is compared in
// lower case (s is stored lower case and the regex compiled with (?i)).
type strMatcher struct {
	kind matchKind
	s    string
	re   *regexp.Regexp
	fold bool
}

func (m *strMatcher) match(v string) bool {
	if m.fold && m.kind != matchRegex {
		v = strings.ToLower(v)
	}
	switch m.kind {
	case matchExact:
		return v == m.s
	case matchPrefix:
		return strings.HasPrefix(v, m.s)
	default:
		return m.re.MatchString(v)
	}
}

// pairMatcher is one queryString or headers entry. With a key matcher it
// matches when at least one key matches and every value of every matching
// key satisfies the value matcher: a request that repeats a key
// ("?org=victim&org=mine") cannot satisfy the rule with one value while the
// upstream acts on another. Without a key matcher, one pair whose value
// matches is enough. A missing matcher matches anything.
type pairMatcher struct {
	key, value *strMatcher
}

func (m *pairMatcher) matchAny(pairs map[string][]string) bool {
	if m.key == nil {
		for _, vs := range pairs {
			for _, v := range vs {
				if m.value == nil || m.value.match(v) {
					return true
				}
			}
		}
		return false
	}
	seen := false
	for k, vs := range pairs {
		if !m.key.match(k) {
			continue
		}
		for _, v := range vs {
			if m.value != nil && !m.value.match(v) {
				return false
			}
			seen = true
		}
	}
	return seen
}

// requestView is what the matchers see of an outbound request, computed
// once per Apply so that rules are matched against the request as the
// sandbox sent it, not as earlier rules rewrote it.
type requestView struct {
	host    string
	path    string // as sent on the wire (escaped)
	pathOK  bool   // false when the path has dot segments: path matchers fail closed
	method  string
	header  http.Header
	rawQ    string
	query   url.Values
	queryOK bool
	parsedQ bool
}

func newRequestView(r *http.Request) *requestView {
	v := &requestView{method: strings.ToUpper(r.Method), header: r.Header}
	if v.method == "" {
		v.method = http.MethodGet
	}
	host := r.Host
	if r.URL != nil {
		if r.URL.Host != "" {
			host = r.URL.Host
		}
		v.path = r.URL.EscapedPath()
		v.rawQ = r.URL.RawQuery
	}
	v.host = canonicalHost(host)
	if v.path == "" {
		v.path = "/"
	}
	v.pathOK = !hasDotSegment(v.path)
	return v
}

// canonicalHost strips a port and brackets, lowercases, removes one
// trailing dot and writes IP addresses in their canonical form.
func canonicalHost(h string) string {
	if strings.HasPrefix(h, "[") {
		if i := strings.LastIndexByte(h, ']'); i > 0 {
			h = h[1:i]
		}
	} else if i := strings.LastIndexByte(h, ':'); i >= 0 && strings.Count(h, ":") == 1 {
		h = h[:i]
	}
	h = strings.TrimSuffix(strings.ToLower(h), ".")
	if a, err := netip.ParseAddr(h); err == nil && a.Zone() == "" {
		return a.Unmap().String()
	}
	return h
}

// hasDotSegment reports a path an upstream could read as another path: a
// "." or ".." segment, also percent-encoded (once or twice), an encoded
// slash or backslash, a backslash or a ";" (servers that take "..;" for
// ".."). A path matcher could be steered around with such a path, so it
// matches no path matcher.
func hasDotSegment(p string) bool {
	s := p
	for range 3 {
		if strings.ContainsAny(s, "\\;") {
			return true
		}
		for seg := range strings.SplitSeq(s, "/") {
			if seg == "." || seg == ".." {
				return true
			}
		}
		d, err := url.PathUnescape(s)
		if err != nil {
			return true
		}
		if d == s {
			return false
		}
		if strings.Count(d, "/") != strings.Count(s, "/") {
			return true // an encoded slash
		}
		s = d
	}
	return true // still encoded after three rounds
}

func (v *requestView) queryValues() (url.Values, bool) {
	if !v.parsedQ {
		v.parsedQ = true
		q, err := url.ParseQuery(v.rawQ)
		v.query, v.queryOK = q, err == nil
	}
	return v.query, v.queryOK
}

// matches reports whether every matcher the rule gives matches v.
func (r *Rule) matches(v *requestView) bool {
	if !r.host.match(v.host) {
		return false
	}
	if r.path != nil && (!v.pathOK || !r.path.match(v.path)) {
		return false
	}
	if r.methods != nil && !slices.Contains(r.methods, v.method) {
		return false
	}
	if len(r.query) > 0 {
		q, ok := v.queryValues()
		if !ok { // a malformed query string matches no query matcher
			return false
		}
		for i := range r.query {
			if !r.query[i].matchAny(q) {
				return false
			}
		}
	}
	for i := range r.headers {
		if !r.headers[i].matchAny(v.header) {
			return false
		}
	}
	return true
}

// targets reports whether a secret of a rule with this host matcher may
// be sent to host, so that host's responses must be scrubbed of it: when
// the matcher matches it, and, for a matcher that names no host (the zero
// Rule's), always.
func (m hostMatcher) targets(host string) bool {
	if m.exact == "" && m.suffix == "" {
		return true
	}
	return m.match(host)
}

func (m hostMatcher) match(host string) bool {
	if host == "" {
		return false
	}
	if m.suffix != "" {
		return len(host) > len(m.suffix) && strings.HasSuffix(host, m.suffix)
	}
	return m.exact != "" && host == m.exact
}
