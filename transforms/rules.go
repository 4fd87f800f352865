package transforms

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/idna"
)

// MaxRulesFileSize bounds what [LoadRulesFile] reads.
const MaxRulesFileSize = 4 << 20

// ErrMissingEnv is wrapped by the [RuleError] for a header value that names
// an environment variable that is not set.
var ErrMissingEnv = errors.New("environment variable is not set")

// RuleError reports why a list of rules cannot be loaded. Its message names
// the rule and the field and says what to write instead; it never contains a
// secret's value. Branch on it with errors.As.
type RuleError struct {
	Index  int    // position of the rule in the list; -1 when the list itself is malformed
	Field  string // JSON path inside the rule, e.g. `match.path.regex`; "" for the whole rule
	Reason string // what is wrong and how to fix it
	Err    error  // underlying cause, if any (e.g. ErrMissingEnv, *regexp.Error)
}

// Error implements error.
func (e *RuleError) Error() string {
	var b strings.Builder
	b.WriteString("transforms: ")
	if e.Index >= 0 {
		fmt.Fprintf(&b, "rule[%d]", e.Index)
		if e.Field != "" {
			b.WriteString(" ")
		}
	} else {
		b.WriteString("rules")
	}
	b.WriteString(e.Field)
	b.WriteString(": ")
	b.WriteString(e.Reason)
	return b.String()
}

// Unwrap returns the underlying cause.
func (e *RuleError) Unwrap() error { return e.Err }

// Rule is one compiled request-transformation rule: when every matcher in
// its match part matches an outbound request, its headers are written onto
// it. A Rule is immutable once parsed and safe to share; the zero Rule matches
// nothing. Build rules with [ParseRules] or [LoadRulesFile].
type Rule struct {
	index   int // position in the list it was parsed from
	host    hostMatcher
	path    *strMatcher
	methods []string // upper case; nil = any
	query   []pairMatcher
	headers []pairMatcher
	set     []headerSet // in file order, names canonical
	secrets []*Secret   // distinct secrets used by set
}

// headerSet is one entry of transform.headers. The value sent is literal,
// or prefix+secret when secret is non-nil.
type headerSet struct {
	name    string // canonical MIME header key
	literal string
	prefix  string
	secret  *Secret
}

// value returns what the header is set to; it holds the secret in clear.
func (h headerSet) value() string {
	if h.secret == nil {
		return h.literal
	}
	return h.prefix + h.secret.reveal()
}

// Host returns the rule's host pattern ("api.example.com" or "*.example.com").
func (r Rule) Host() string { return r.host.pattern }

// HeaderNames returns the names of the headers the rule writes, canonical.
func (r Rule) HeaderNames() []string {
	names := make([]string, len(r.set))
	for i, h := range r.set {
		names[i] = h.name
	}
	return names
}

// Secrets returns the distinct secrets the rule swaps in (redacted when
// printed).
func (r Rule) Secrets() []*Secret { return slices.Clone(r.secrets) }

// String describes the rule without any value: `rule[0] api.example.com
// sets X-Api-Key`. The index is its position in the list it was parsed from.
func (r Rule) String() string {
	return fmt.Sprintf("rule[%d] %s sets %s", r.index, r.host.pattern, strings.Join(r.HeaderNames(), ","))
}

// GoString is String: a rule never prints its fields.
func (r Rule) GoString() string { return r.String() }

// Format prints String whatever the verb, so no verb can reach a field.
func (r Rule) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, r.String()) }

// LogValue makes log/slog print String.
func (r Rule) LogValue() slog.Value { return slog.StringValue(r.String()) }

// MarshalJSON encodes the rule as its String, never its values.
func (r Rule) MarshalJSON() ([]byte, error) { return json.Marshal(r.String()) }

// LoadRulesFile reads a JSON list of rules from path and parses it with
// [ParseRules]. env resolves {"env":NAME} header values; pass os.LookupEnv
// to read the process environment.
func LoadRulesFile(path string, env func(string) (string, bool)) ([]Rule, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("transforms: read rules: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxRulesFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("transforms: read rules %s: %w", path, err)
	}
	if len(data) > MaxRulesFileSize {
		return nil, fmt.Errorf("transforms: rules file %s is larger than %d bytes", path, MaxRulesFileSize)
	}
	rules, err := ParseRules(data, env)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return rules, nil
}

// ParseRules parses a JSON list of rules in the AI SDK harness shape:
//
//	[{"match": {"host": "api.anthropic.com",
//	            "path": {"startsWith": "/v1/"},
//	            "method": ["POST"],
//	            "queryString": [{"key": {"exact": "beta"}, "value": {"regex": "^true$"}}],
//	            "headers": [{"key": {"exact": "anthropic-version"}}]},
//	  "transform": {"headers": {"x-api-key": {"env": "ANTHROPIC_API_KEY"}}}}]
//
// A header value is a JSON string (sent as is) or {"env": NAME, "prefix": P,
// "placeholder": PH}: the secret read through env (at load time, here), sent
// as P+secret; PH (default "sandgate-placeholder-NAME") stands for it in the
// sandbox. env nil means no variable is set. Unknown and duplicate keys are
// refused by name; regexes are RE2, compiled here. On error no rule is
// returned and the error is a *[RuleError] naming the rule and the field,
// never a secret value.
func ParseRules(data []byte, env func(string) (string, bool)) ([]Rule, error) {
	if env == nil {
		env = func(string) (string, bool) { return "", false }
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, listError(err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return nil, &RuleError{Index: -1, Reason: "want a JSON list of rules: [{\"match\":{...},\"transform\":{...}}, ...]"}
	}
	p := &parser{env: env, secrets: map[[2]string]*Secret{}, byPlaceholder: map[string]*Secret{}}
	var rules []Rule
	for i := 0; dec.More(); i++ {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			e := listError(err)
			e.Index = i
			return nil, e
		}
		r, err := p.rule(i, raw)
		if err != nil {
			return nil, err
		}
		rules = append(rules, r)
	}
	if _, err := dec.Token(); err != nil { // the closing ]
		return nil, listError(err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, &RuleError{Index: -1, Reason: "unexpected data after the list of rules"}
	}
	return rules, nil
}

func listError(err error) *RuleError {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return &RuleError{Index: -1, Reason: fmt.Sprintf("invalid JSON at byte %d: %v", se.Offset, se), Err: err}
	}
	if err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF) {
		return &RuleError{Index: -1, Reason: "invalid JSON: unexpected end of input", Err: err}
	}
	return &RuleError{Index: -1, Reason: "invalid JSON: " + err.Error(), Err: err}
}

// parser carries what spans rules: secrets are shared by (variable,
// placeholder), and a placeholder may stand for one value only.
type parser struct {
	env           func(string) (string, bool)
	secrets       map[[2]string]*Secret
	byPlaceholder map[string]*Secret
}

// ruleCtx builds errors for one rule.
type ruleCtx struct{ index int }

func (c ruleCtx) errf(field, format string, args ...any) *RuleError {
	return &RuleError{Index: c.index, Field: field, Reason: fmt.Sprintf(format, args...)}
}

// object splits a JSON object into its fields, refusing keys not in known
// (exact case) and duplicate keys.
func (c ruleCtx) object(raw json.RawMessage, field string, known ...string) (map[string]json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	tok, err := dec.Token()
	if err != nil {
		return nil, c.errf(field, "invalid JSON: %v", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		if known == nil {
			return nil, c.errf(field, "want a JSON object, got %s", jsonKind(raw))
		}
		return nil, c.errf(field, "want a JSON object with keys %s, got %s", strings.Join(known, ", "), jsonKind(raw))
	}
	out := make(map[string]json.RawMessage)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, c.errf(field, "invalid JSON: %v", err)
		}
		key, _ := tok.(string)
		sub := joinField(field, key)
		if known != nil && !slices.Contains(known, key) {
			return nil, c.errf(sub, "unknown key %q (known keys: %s)", key, strings.Join(known, ", "))
		}
		if _, dup := out[key]; dup {
			return nil, c.errf(sub, "key %q is given twice", key)
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, c.errf(sub, "invalid JSON: %v", err)
		}
		out[key] = v
	}
	return out, nil
}

func joinField(field, key string) string {
	if field == "" {
		return key
	}
	if isIdent(key) {
		return field + "." + key
	}
	return fmt.Sprintf("%s[%q]", field, key)
}

func isIdent(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

func jsonKind(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '{':
		return "an object"
	case '[':
		return "a list"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	default:
		return "a number"
	}
}

func (c ruleCtx) str(raw json.RawMessage, field string) (string, error) {
	var s string
	if len(bytes.TrimSpace(raw)) == 0 || bytes.TrimSpace(raw)[0] != '"' {
		return "", c.errf(field, "want a string, got %s", jsonKind(raw))
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", c.errf(field, "want a string: %v", err)
	}
	return s, nil
}

func (c ruleCtx) list(raw json.RawMessage, field string) ([]json.RawMessage, error) {
	var l []json.RawMessage
	if len(bytes.TrimSpace(raw)) == 0 || bytes.TrimSpace(raw)[0] != '[' {
		return nil, c.errf(field, "want a list, got %s", jsonKind(raw))
	}
	if err := json.Unmarshal(raw, &l); err != nil {
		return nil, c.errf(field, "want a list: %v", err)
	}
	return l, nil
}

func (p *parser) rule(i int, raw json.RawMessage) (Rule, error) {
	c := ruleCtx{i}
	r := Rule{index: i}
	top, err := c.object(raw, "", "match", "transform")
	if err != nil {
		return Rule{}, err
	}
	if top["match"] == nil {
		return Rule{}, c.errf("match", "is required: say which requests the rule applies to, at least {\"host\": \"api.example.com\"}")
	}
	if top["transform"] == nil {
		return Rule{}, c.errf("transform", "is required: {\"headers\": {\"name\": \"value\"}}")
	}
	if err := p.match(c, &r, top["match"]); err != nil {
		return Rule{}, err
	}
	if err := p.transform(c, &r, top["transform"]); err != nil {
		return Rule{}, err
	}
	return r, nil
}

func (p *parser) match(c ruleCtx, r *Rule, raw json.RawMessage) error {
	m, err := c.object(raw, "match", "host", "path", "method", "queryString", "headers")
	if err != nil {
		return err
	}
	if m["host"] == nil {
		return c.errf("match.host", "is required: a rule without a host would write its headers (and secrets) to every host")
	}
	host, err := c.str(m["host"], "match.host")
	if err != nil {
		return err
	}
	if r.host, err = parseHostPattern(host); err != nil {
		return c.errf("match.host", "%v", err)
	}
	if v := m["path"]; v != nil {
		sm, err := c.strMatcher(v, "match.path", false)
		if err != nil {
			return err
		}
		r.path = &sm
	}
	if v := m["method"]; v != nil {
		l, err := c.list(v, "match.method")
		if err != nil {
			return err
		}
		if len(l) == 0 {
			return c.errf("match.method", "is empty, so nothing would match; list methods such as [\"POST\"] or leave the key out to match any")
		}
		for j, e := range l {
			f := fmt.Sprintf("match.method[%d]", j)
			s, err := c.str(e, f)
			if err != nil {
				return err
			}
			if !httpguts.ValidHeaderFieldName(s) { // a method is a token
				return c.errf(f, "%q is not an HTTP method", s)
			}
			r.methods = append(r.methods, strings.ToUpper(s))
		}
	}
	for _, kv := range []struct {
		key  string
		dst  *[]pairMatcher
		fold bool
	}{{"queryString", &r.query, false}, {"headers", &r.headers, true}} {
		v := m[kv.key]
		if v == nil {
			continue
		}
		f := "match." + kv.key
		l, err := c.list(v, f)
		if err != nil {
			return err
		}
		for j, e := range l {
			ef := fmt.Sprintf("%s[%d]", f, j)
			pm, err := c.pairMatcher(e, ef, kv.fold)
			if err != nil {
				return err
			}
			*kv.dst = append(*kv.dst, pm)
		}
	}
	return nil
}

func (c ruleCtx) pairMatcher(raw json.RawMessage, field string, foldKey bool) (pairMatcher, error) {
	o, err := c.object(raw, field, "key", "value")
	if err != nil {
		return pairMatcher{}, err
	}
	if o["key"] == nil && o["value"] == nil {
		return pairMatcher{}, c.errf(field, "needs a \"key\" matcher, a \"value\" matcher or both")
	}
	var pm pairMatcher
	if v := o["key"]; v != nil {
		sm, err := c.strMatcher(v, field+".key", foldKey)
		if err != nil {
			return pairMatcher{}, err
		}
		pm.key = &sm
	}
	if v := o["value"]; v != nil {
		sm, err := c.strMatcher(v, field+".value", false)
		if err != nil {
			return pairMatcher{}, err
		}
		pm.value = &sm
	}
	return pm, nil
}

// strMatcher parses {"exact"|"startsWith"|"regex": S}. With fold, matching
// ignores case (header names).
func (c ruleCtx) strMatcher(raw json.RawMessage, field string, fold bool) (strMatcher, error) {
	o, err := c.object(raw, field, "exact", "startsWith", "regex")
	if err != nil {
		return strMatcher{}, err
	}
	if len(o) != 1 {
		return strMatcher{}, c.errf(field, "give exactly one of \"exact\", \"startsWith\" or \"regex\" (got %d)", len(o))
	}
	for k, v := range o {
		f := field + "." + k
		s, err := c.str(v, f)
		if err != nil {
			return strMatcher{}, err
		}
		sm := strMatcher{s: s, fold: fold}
		switch k {
		case "exact":
			sm.kind = matchExact
		case "startsWith":
			sm.kind = matchPrefix
		case "regex":
			sm.kind = matchRegex
			expr := s
			if fold {
				expr = "(?i)" + s
			}
			re, err := regexp.Compile(expr)
			if err != nil {
				return strMatcher{}, &RuleError{Index: c.index, Field: f, Reason: fmt.Sprintf("not a valid RE2 regular expression: %v", err), Err: err}
			}
			sm.re = re
		}
		if fold {
			sm.s = strings.ToLower(sm.s)
		}
		return sm, nil
	}
	panic("unreachable")
}

// hopHeaders may not be set by a rule: they describe the connection or the
// message framing, which the proxy owns.
var hopHeaders = []string{
	"Connection", "Content-Length", "Host", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Proxy-Connection", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

func (p *parser) transform(c ruleCtx, r *Rule, raw json.RawMessage) error {
	t, err := c.object(raw, "transform", "headers")
	if err != nil {
		return err
	}
	if t["headers"] == nil {
		return c.errf("transform.headers", "is required: {\"name\": \"value\"}")
	}
	hs, err := c.object(t["headers"], "transform.headers")
	if err != nil {
		return err
	}
	if len(hs) == 0 {
		return c.errf("transform.headers", "is empty: a rule must set at least one header")
	}
	// Keep file order so the rule's effect and its String are deterministic.
	names := orderedKeys(t["headers"])
	seen := map[string]string{}
	for _, name := range names {
		f := joinField("transform.headers", name)
		if !httpguts.ValidHeaderFieldName(name) {
			return c.errf(f, "%q is not a valid HTTP header name", name)
		}
		canon := http.CanonicalHeaderKey(name)
		if slices.Contains(hopHeaders, canon) {
			return c.errf(f, "%s cannot be set by a rule: the proxy owns connection and framing headers", canon)
		}
		if prev, dup := seen[canon]; dup {
			return c.errf(f, "sets the same header as %q (header names are case-insensitive)", prev)
		}
		seen[canon] = name
		h, err := p.headerValue(c, f, hs[name])
		if err != nil {
			return err
		}
		h.name = canon
		r.set = append(r.set, h)
		if h.secret != nil && !slices.Contains(r.secrets, h.secret) {
			r.secrets = append(r.secrets, h.secret)
		}
	}
	return nil
}

// orderedKeys returns the keys of a JSON object in document order.
func orderedKeys(raw json.RawMessage) []string {
	dec := json.NewDecoder(bytes.NewReader(raw))
	var keys []string
	if _, err := dec.Token(); err != nil {
		return nil
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return keys
		}
		keys = append(keys, tok.(string))
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return keys
		}
	}
	return keys
}

func (p *parser) headerValue(c ruleCtx, field string, raw json.RawMessage) (headerSet, error) {
	if t := bytes.TrimSpace(raw); len(t) > 0 && t[0] == '"' {
		s, err := c.str(raw, field)
		if err != nil {
			return headerSet{}, err
		}
		if !httpguts.ValidHeaderFieldValue(s) {
			return headerSet{}, c.errf(field, "holds characters not allowed in an HTTP header value")
		}
		return headerSet{literal: s}, nil
	}
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '{' {
		return headerSet{}, c.errf(field, "want a string, or {\"env\": \"NAME\"} to read a secret from the environment (got %s)", jsonKind(raw))
	}
	o, err := c.object(raw, field, "env", "prefix", "placeholder")
	if err != nil {
		return headerSet{}, err
	}
	if o["env"] == nil {
		return headerSet{}, c.errf(field+".env", "is required: the environment variable holding the secret")
	}
	name, err := c.str(o["env"], field+".env")
	if err != nil {
		return headerSet{}, err
	}
	if name == "" || strings.ContainsAny(name, "=\x00") {
		return headerSet{}, c.errf(field+".env", "%q is not an environment variable name", name)
	}
	var h headerSet
	if v := o["prefix"]; v != nil {
		if h.prefix, err = c.str(v, field+".prefix"); err != nil {
			return headerSet{}, err
		}
		if !httpguts.ValidHeaderFieldValue(h.prefix) {
			return headerSet{}, c.errf(field+".prefix", "holds characters not allowed in an HTTP header value")
		}
	}
	placeholder := PlaceholderPrefix + name
	if v := o["placeholder"]; v != nil {
		if placeholder, err = c.str(v, field+".placeholder"); err != nil {
			return headerSet{}, err
		}
	}
	key := [2]string{name, placeholder}
	if s := p.secrets[key]; s != nil {
		h.secret = s
		return h, nil
	}
	value, ok := p.env(name)
	if !ok {
		return headerSet{}, &RuleError{Index: c.index, Field: field + ".env",
			Reason: fmt.Sprintf("environment variable %s is not set", name), Err: ErrMissingEnv}
	}
	if err := checkSecret(name, value, placeholder); err != nil {
		return headerSet{}, &RuleError{Index: c.index, Field: field, Reason: err.Error()}
	}
	if other := p.byPlaceholder[placeholder]; other != nil && other.value != value {
		return headerSet{}, c.errf(field+".placeholder", "secrets %s and %s have the same placeholder but different values; give each its own placeholder", other.name, name)
	}
	s := newSecret(name, value, placeholder)
	p.secrets[key] = s
	p.byPlaceholder[placeholder] = s
	h.secret = s
	return h, nil
}

// hostMatcher matches a canonical host exactly, or any subdomain of suffix.
type hostMatcher struct {
	pattern string // as written, canonical
	exact   string // "" for a wildcard
	suffix  string // ".example.com" for "*.example.com"
}

// parseHostPattern canonicalises a host pattern: lowercase, one trailing dot
// removed; "*.name" for subdomains; IP literals exact.
func parseHostPattern(s string) (hostMatcher, error) {
	h := strings.TrimSuffix(strings.ToLower(s), ".")
	if h == "" {
		return hostMatcher{}, errors.New("is empty: write a host such as \"api.example.com\" or \"*.example.com\"")
	}
	if a, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
		if a.Zone() != "" {
			return hostMatcher{}, fmt.Errorf("%q has a zone; write the address alone", s)
		}
		c := a.Unmap().String()
		return hostMatcher{pattern: c, exact: c}, nil
	}
	wild := strings.HasPrefix(h, "*.")
	name := strings.TrimPrefix(h, "*.")
	if strings.ContainsAny(name, ":/@?#") {
		return hostMatcher{}, fmt.Errorf("%q is not a host: write the name alone, without scheme, port, path or user", s)
	}
	if strings.Contains(name, "*") {
		return hostMatcher{}, fmt.Errorf("%q: a wildcard is allowed only as a whole first label, as in \"*.example.com\"", s)
	}
	ascii, err := idna.Lookup.ToASCII(name)
	if err != nil {
		return hostMatcher{}, fmt.Errorf("%q is not a valid host name: %v", s, err)
	}
	if ascii != name {
		if wild {
			ascii = "*." + ascii
		}
		return hostMatcher{}, fmt.Errorf("%q is not in punycode: use %q", s, ascii)
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" {
			return hostMatcher{}, fmt.Errorf("%q has an empty label", s)
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return hostMatcher{}, fmt.Errorf("%q: %q is not allowed in a host name", s, c)
			}
		}
	}
	if wild {
		return hostMatcher{pattern: h, suffix: "." + name}, nil
	}
	return hostMatcher{pattern: h, exact: h}, nil
}
