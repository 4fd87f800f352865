package transforms

import (
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// RuleSet is the live list of rules the proxy applies. It is safe for
// concurrent use: Set and Add swap in a new immutable list atomically, so an
// Apply sees the old list or the new one, never a mix. The zero RuleSet is
// empty and ready to use; a nil *RuleSet is not.
type RuleSet struct {
	mu  sync.Mutex // serialises writers; readers never take it
	cur atomic.Pointer[ruleList]
}

// ruleList is one immutable generation of a RuleSet.
type ruleList struct {
	rules []Rule
	names []string // audit names, by position in the set
	// held is every secret the set holds or has held (see held.go), the
	// rules' own among them, in the order they were first held.
	held []*heldSecret
	// sealed says whether a held secret could not be unsealed (see
	// Unscrubbable): most lists have none, and skip the search.
	sealed bool
	// scrubs caches, by the set of rules and held secrets whose host
	// matchers match a host (a bit each, rules first; lists of more than
	// 64 are not cached), the secrets that responses of such a host are
	// scrubbed of, with their scrubber: copy on write, at most
	// maxScrubCache entries.
	scrubs atomic.Pointer[map[uint64]*scrubTarget]
	smu    sync.Mutex // serialises writers of scrubs

	guard     *Guard // of the list's secrets, made when first asked
	guardOnce sync.Once
}

// scrubTarget is what the responses of a host are scrubbed of.
type scrubTarget struct {
	secrets []*Secret
	m       *scrubber
}

// maxScrubCache bounds the cache of a ruleList: wildcard rules match
// unbounded sets of hosts, but the cache is keyed by the rules that
// matched, so a handful of entries is the rule.
const maxScrubCache = 64

func newRuleList(rules []Rule, held []*heldSecret) *ruleList {
	l := &ruleList{rules: rules, names: make([]string, len(rules)), held: addHeld(held, rules)}
	l.sealed = slices.ContainsFunc(l.held, func(h *heldSecret) bool { return h.sealed != nil })
	for i, r := range rules {
		l.names[i] = fmt.Sprintf("rule[%d] %s", i, r.host.pattern)
	}
	return l
}

// NewRuleSet returns a set holding rules, in order.
func NewRuleSet(rules ...Rule) *RuleSet {
	s := &RuleSet{}
	s.cur.Store(newRuleList(slices.Clone(rules), nil))
	return s
}

// Set replaces every rule with rules (none empties the set). The secrets
// of the rules replaced are retired, not forgotten: the responses of the
// hosts they targeted go on being scrubbed of them (see held.go).
func (s *RuleSet) Set(rules ...Rule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var held []*heldSecret
	if l := s.cur.Load(); l != nil {
		held = l.held
	}
	s.cur.Store(newRuleList(slices.Clone(rules), held))
}

// Add appends rules after the current ones.
func (s *RuleSet) Add(rules ...Rule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var old []Rule
	var held []*heldSecret
	if l := s.cur.Load(); l != nil {
		old, held = l.rules, l.held
	}
	s.cur.Store(newRuleList(slices.Concat(old, rules), held))
}

// Rules returns a copy of the current rules, in order.
func (s *RuleSet) Rules() []Rule {
	if l := s.cur.Load(); l != nil {
		return slices.Clone(l.rules)
	}
	return nil
}

// GuardMinLength is the shortest secret the credential guard looks for
// (protocol 1's "held secrets": 12 characters or more); a shorter one
// would be found by chance in what a sandbox is given.
const GuardMinLength = 12

// Guard returns the credential guard of the secrets the set holds and has
// held (those of GuardMinLength or more; retired ones too): what the
// service puts into a sandbox is searched with it, so no secret of the
// sandbox's rules, now or before, goes in. It is the guard of the current
// rules; a change of the rules makes another.
func (s *RuleSet) Guard() *Guard {
	l := s.cur.Load()
	if l == nil {
		return nil
	}
	l.guardOnce.Do(func() {
		var vals []string
		for _, h := range l.held {
			if len(h.value) >= GuardMinLength {
				vals = append(vals, h.value)
			}
		}
		l.guard = NewGuard(vals...)
	})
	return l.guard
}

// Targets reports whether a rule with a secret targets host (see
// [Applied.Scrub]: its match.host matches it), and names the first such
// rule ("rule[0] api.example.com"). host is spelled as a request or a
// CONNECT line may spell it: a port, letter case, one trailing dot and
// the spellings of an IP address are canonicalised first; a name is
// expected in punycode (netpolicy's canonical form). A host reached
// whose responses could carry a secret unscrubbed (a tunnel) must not be
// reached where it targets one: see relay.
func (s *RuleSet) Targets(host string) (string, bool) {
	l := s.cur.Load()
	if l == nil {
		return "", false
	}
	host = canonicalHost(host)
	for i := range l.rules {
		if r := &l.rules[i]; len(r.secrets) > 0 && r.host.targets(host) {
			return l.names[i], true
		}
	}
	for _, h := range l.held {
		if h.targets(host) {
			return fmt.Sprintf("held credential %s (%s)", h.name, strings.Join(h.hostPatterns(), ", ")), true
		}
	}
	return "", false
}

// Len returns the number of rules.
func (s *RuleSet) Len() int {
	if l := s.cur.Load(); l != nil {
		return len(l.rules)
	}
	return 0
}

// Applied says what [RuleSet.Apply] did to a request. It holds no secret
// value: Rules are names for the audit event and secrets print as
// [Redacted].
type Applied struct {
	// Rules names the rules that matched, in order, as "rule[i] host" where
	// i is the rule's position in the set.
	Rules []string
	// Secrets are the distinct secrets swapped into the request.
	Secrets []*Secret
	// Scrub are the secrets the response must be scrubbed of before it
	// reaches the sandbox: those of every rule whose match.host matches
	// the request's host, whether or not the rest of the rule matched this
	// request (so Secrets are among them). When it is non-empty the
	// response goes through [Applied.ScrubResponse].
	Scrub []*Secret
	scrub *scrubber // for Scrub, built once per rule list
}

// ScrubResponse scrubs resp of a.Scrub; see [ScrubResponse].
func (a Applied) ScrubResponse(resp *http.Response) error {
	return scrubResponse(resp, a.scrubber())
}

// scrubber returns the scrubber of a.Scrub (nil when there is nothing to
// scrub).
func (a Applied) scrubber() *scrubber {
	if a.scrub == nil && len(a.Scrub) > 0 {
		return newScrubber(a.Scrub)
	}
	return a.scrub
}

// Apply matches out against every rule and, for each rule that matches, in
// order, sets the headers of its transform (a later rule overwrites an
// earlier one). out is the outbound request the proxy is about to send,
// after hop-by-hop headers were stripped; its host is taken from out.URL
// (or out.Host), its path as sent on the wire. Every rule is matched against
// the request as it came in, before any rule rewrote it.
//
// Then, for the matching rules' secrets, each value of the credential
// headers (Authorization, X-Api-Key, Api-Key) that contains a secret's
// placeholder has it replaced by the secret (so "Authorization: Bearer
// sandgate-placeholder-KEY" works). The body and URL are never rewritten.
// Header value slices are replaced, never written in place, so a request
// cloned from the sandbox's keeps its values.
//
// Applied.Scrub lists the secrets the response must be scrubbed of: every
// secret of a rule whose host matcher matches out's host, even when no
// rule matched the request (see [Applied]). Whenever it is non-empty,
// Accept-Encoding is restricted to codings the scrubber can decode (see
// [RestrictAcceptEncoding]).
func (s *RuleSet) Apply(out *http.Request) Applied {
	l := s.cur.Load()
	if l == nil || len(l.rules) == 0 && len(l.held) == 0 || out == nil {
		return Applied{}
	}
	v := newRequestView(out)
	var a Applied
	if t := l.targets(v.host); t != nil {
		a.Scrub, a.scrub = t.secrets, t.m
		if out.Header == nil {
			out.Header = make(http.Header)
		}
		RestrictAcceptEncoding(out.Header)
	}
	var matched []int
	for i := range l.rules {
		if l.rules[i].matches(v) {
			matched = append(matched, i)
		}
	}
	if len(matched) == 0 {
		return a
	}
	if out.Header == nil {
		out.Header = make(http.Header)
	}
	for _, i := range matched {
		r := &l.rules[i]
		a.Rules = append(a.Rules, l.names[i])
		for _, h := range r.set {
			out.Header[h.name] = []string{h.value()}
		}
		for _, sec := range r.secrets {
			if !slices.Contains(a.Secrets, sec) {
				a.Secrets = append(a.Secrets, sec)
			}
		}
	}
	if len(a.Secrets) > 0 {
		swapPlaceholders(out.Header, a.Secrets)
	}
	return a
}

// targets returns what the responses of host must be scrubbed of, or nil
// when no rule with a secret, and no secret held before, targets it.
//
// A rule targets the hosts its match.host matches — exactly the hosts the
// proxy may send its secret to — whatever the rest of its match says: a
// response on a route to such a host may carry the secret even when the
// request did not (an upstream that echoes an earlier request, a response
// read from a connection that had carried one, an upstream that keeps
// what it was sent), so every such response is scrubbed. Hosts no rule
// targets never received a secret from the proxy (upstream connections are
// pooled per host), so their responses go through untouched. A rule with
// no host matcher (the zero Rule; ParseRules requires a host) targets
// every host: a secret with no known destination is scrubbed everywhere.
// A secret the set held before (retired, see held.go) targets the hosts
// its rules targeted, for as long as the set lives.
func (l *ruleList) targets(host string) *scrubTarget {
	var key uint64
	cacheable := len(l.rules)+len(l.held) <= 64
	found := false
	for i := range l.rules {
		r := &l.rules[i]
		if len(r.secrets) == 0 || !r.host.targets(host) {
			continue
		}
		found = true
		if cacheable {
			key |= 1 << i
		}
	}
	for j, h := range l.held {
		if h.sealed != nil || !h.targets(host) {
			continue
		}
		found = true
		if cacheable {
			key |= 1 << (len(l.rules) + j)
		}
	}
	if !found {
		return nil
	}
	if cacheable {
		if m := l.scrubs.Load(); m != nil {
			if t := (*m)[key]; t != nil {
				return t
			}
		}
	}
	t := &scrubTarget{}
	for i := range l.rules {
		r := &l.rules[i]
		if len(r.secrets) == 0 || !r.host.targets(host) {
			continue
		}
		for _, sec := range r.secrets {
			if !slices.Contains(t.secrets, sec) {
				t.secrets = append(t.secrets, sec)
			}
		}
	}
	// Then the secrets held for this host and retired from its rules (or
	// held for another host now): a mask each, where the secret is not
	// replaced by a rule's placeholder already.
	for _, h := range l.held {
		if h.sealed != nil || !h.targets(host) {
			continue
		}
		if !slices.ContainsFunc(t.secrets, func(sec *Secret) bool { return sec.value == h.value }) {
			t.secrets = append(t.secrets, h.masked)
		}
	}
	t.m = newScrubber(t.secrets)
	if cacheable {
		l.smu.Lock()
		old := l.scrubs.Load()
		if old != nil && (*old)[key] != nil {
			t = (*old)[key] // built meanwhile by another request
		} else if old == nil || len(*old) < maxScrubCache {
			m := make(map[uint64]*scrubTarget, 1)
			if old != nil {
				maps.Copy(m, *old)
			}
			m[key] = t
			l.scrubs.Store(&m)
		}
		l.smu.Unlock()
	}
	return t
}

// swapHeaders are the headers in which a placeholder is replaced by its
// secret. Only credential headers: a header an upstream might echo back
// truncated at a point the sandbox chooses (Content-Type in an error
// message, say) would let the sandbox read the secret in pieces shorter
// than the scrubber's MinPartialRun. Headers a rule writes are set whole
// and need no swap.
var swapHeaders = []string{"Authorization", "X-Api-Key", "Api-Key"}

// swapPlaceholders replaces each secret's placeholder by its value in the
// values of the swapHeaders.
func swapPlaceholders(h http.Header, secrets []*Secret) {
	for _, k := range swapHeaders {
		vs := h[k]
		var nv []string
		for i, v := range vs {
			w := v
			for _, s := range secrets {
				if strings.Contains(w, s.placeholder) {
					w = strings.ReplaceAll(w, s.placeholder, s.reveal())
				}
			}
			if w != v {
				if nv == nil {
					nv = slices.Clone(vs)
				}
				nv[i] = w
			}
		}
		if nv != nil {
			h[k] = nv
		}
	}
}

// RestrictAcceptEncoding rewrites h's Accept-Encoding to keep only the
// codings [ScrubResponse] can decode (gzip, x-gzip, zstd, identity), with
// their q-values; "*" and anything else is dropped. When nothing is left it
// sets "identity", because a request without Accept-Encoding accepts any
// coding. Apply calls it whenever it swaps in a secret, so that an agent
// asking for "br" gets a scrubbable response instead of a 502.
func RestrictAcceptEncoding(h http.Header) {
	vs := h.Values("Accept-Encoding")
	if len(vs) == 0 {
		h.Set("Accept-Encoding", "identity")
		return
	}
	var keep []string
	for _, v := range vs {
		for part := range strings.SplitSeq(v, ",") {
			part = strings.TrimSpace(part)
			coding, _, _ := strings.Cut(part, ";")
			switch strings.ToLower(strings.TrimSpace(coding)) {
			case "gzip", "x-gzip", "zstd", "identity":
				keep = append(keep, part)
			}
		}
	}
	if len(keep) == 0 {
		h.Set("Accept-Encoding", "identity")
		return
	}
	h.Set("Accept-Encoding", strings.Join(keep, ", "))
}
