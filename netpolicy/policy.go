package netpolicy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"

	"golang.org/x/net/idna"
)

// Mode is a network policy's mode.
type Mode string

// The modes of the AI SDK harness network policy.
const (
	AllowAll Mode = "allow-all"
	DenyAll  Mode = "deny-all"
	Custom   Mode = "custom"
)

// Policy is a sandbox's network policy. The zero value is a custom policy
// with no rules: it allows only what the service-wide host list allows.
// A Policy is immutable once parsed; build a new one to change it.
type Policy struct {
	Mode         Mode
	AllowedHosts []HostRule
	AllowedCIDRs []netip.Prefix
	DeniedCIDRs  []netip.Prefix
	// RouteHosts are hosts that base-URL routes may reach besides
	// AllowedHosts (a custom policy only), and CONNECT tunnels may not:
	// the hosts of a sandbox's base URLs and of its credential rules.
	// The service derives them; they are not part of the JSON shape.
	RouteHosts []HostRule
	// RouteOrigins are the sandbox's base URLs' own origins: a route may
	// reach one on its own port (https://host:8443/v1), in its own scheme
	// (an http base URL, forwarded only to addresses the operator opened),
	// at its own address (an IP literal). The service derives them.
	RouteOrigins []Origin
	// Intercept names the hosts whose HTTPS the proxy terminates (with a
	// certificate of the service's own CA) to run the chain of a base-URL
	// route — modules, credential swap, scrub — on tunnels and captured
	// connections too. It allows nothing: a host must still be allowed.
	// The JSON key is "intercept".
	Intercept []HostRule
}

// Intercepts returns the intercept rule that names host (canonical), if
// any.
func (p Policy) Intercepts(host Host) (HostRule, bool) {
	if host.IsIP() {
		return HostRule{}, false
	}
	for _, r := range p.Intercept {
		if r.Match(host.Name) {
			return r, true
		}
	}
	return HostRule{}, false
}

// Origin is a base URL's scheme, host and port.
type Origin struct {
	Plain bool   // http, not https
	Host  string // canonical (Host.String)
	Port  int
}

// OriginOf returns the origin of a base URL, or false when it is not an
// http or https URL with a valid host.
func OriginOf(rawURL string) (Origin, bool) {
	scheme, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return Origin{}, false
	}
	var o Origin
	switch strings.ToLower(scheme) {
	case "https":
		o.Port = HTTPSPort
	case "http":
		o.Plain, o.Port = true, 80
	default:
		return Origin{}, false
	}
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	if i := strings.LastIndexByte(rest, '@'); i >= 0 {
		rest = rest[i+1:]
	}
	host, port, err := SplitHostPort(rest)
	if err != nil {
		return Origin{}, false
	}
	h, err := CanonicalHost(strings.Trim(host, "[]"))
	if err != nil {
		return Origin{}, false
	}
	o.Host = h.String()
	if port != 0 {
		o.Port = port
	}
	return o, true
}

// hasOrigin reports whether a route in that scheme to host:port is one of
// the policy's RouteOrigins.
func (p Policy) hasOrigin(plain bool, host Host, port int) bool {
	for _, o := range p.RouteOrigins {
		if o.Plain == plain && o.Port == port && o.Host == host.String() {
			return true
		}
	}
	return false
}

// HostRule is one allowed host: an exact name, or "*.suffix" for every name
// under suffix (not suffix itself).
type HostRule struct {
	pattern string // as written, canonical
	suffix  string // ".example.com" for a wildcard, "" for exact
}

// String returns the rule as written.
func (r HostRule) String() string { return r.pattern }

// Match reports whether the canonical name is covered by the rule.
func (r HostRule) Match(name string) bool {
	if r.suffix != "" {
		return len(name) > len(r.suffix) && strings.HasSuffix(name, r.suffix)
	}
	return name == r.pattern
}

// ParseHostRule validates one allowedHosts entry. A rule must already be in
// canonical form except for letter case and one trailing dot: wildcards
// other than a single leading "*." label, IP literals, ports and
// non-punycode names are refused with an error that says what to write.
// Any name is a rule, a single label ("localhost") included: where it
// leads is decided when a connection is made, by resolution and the
// address classes, which never let a private address through unless the
// operator opened it.
func ParseHostRule(s string) (HostRule, error) {
	raw := s
	bad := func(format string, args ...any) (HostRule, error) {
		return HostRule{}, fmt.Errorf("host rule %q: %s", raw, fmt.Sprintf(format, args...))
	}
	s = strings.TrimSpace(s)
	switch s {
	case "":
		return bad("empty")
	case "*", "*.", "*.*":
		return bad(`a bare wildcard is not a host rule; use {"mode":"allow-all"} to allow every host`)
	}
	wild := strings.HasPrefix(s, "*.")
	base := strings.TrimPrefix(s, "*.")
	if strings.Contains(base, "*") {
		return bad(`only one leading "*." label may be a wildcard, e.g. "*.example.com"`)
	}
	if strings.ContainsAny(base, "/@") {
		return bad("write a bare host name, without scheme, path or userinfo")
	}
	if strings.HasPrefix(base, "[") || strings.Count(base, ":") > 1 {
		if _, err := netip.ParseAddr(strings.Trim(base, "[]")); err == nil {
			return bad("IP literals are not host rules; add %s/128 to allowedCIDRs", strings.Trim(base, "[]"))
		}
	}
	if strings.Contains(base, ":") {
		return bad("ports are not part of a host rule; only port 443 is ever allowed")
	}
	for _, r := range base {
		if r > 0x7e {
			if a, err := idna.Lookup.ToASCII(base); err == nil {
				return bad("write the punycode form: use %q", strings.Replace(s, base, strings.ToLower(a), 1))
			}
			return bad("not a valid international domain name")
		}
	}
	h, err := CanonicalHost(base)
	if err != nil {
		return bad("%v", err.(*HostError).Reason)
	}
	if h.IsIP() {
		bits := 32
		if h.Addr.Is6() {
			bits = 128
		}
		return bad("IP literals are not host rules; add %s/%d to allowedCIDRs", h.Addr, bits)
	}
	if wild {
		return HostRule{pattern: "*." + h.Name, suffix: "." + h.Name}, nil
	}
	return HostRule{pattern: h.Name}, nil
}

// ParseHostRules parses a list of host rules, naming the first bad entry.
func ParseHostRules(list []string) ([]HostRule, error) {
	out := make([]HostRule, 0, len(list))
	for _, s := range list {
		r, err := ParseHostRule(s)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}

// SplitList splits a comma-separated list (the form of SANDBOX_ALLOWED_HOSTS),
// dropping empty entries and surrounding spaces.
func SplitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// ParseCIDR parses an allowedCIDRs/deniedCIDRs entry. A bare address is
// refused (write /32 or /128), and so are host bits set past the prefix.
func ParseCIDR(field, s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(strings.TrimSpace(s))
	if err != nil {
		if a, aerr := netip.ParseAddr(strings.TrimSpace(s)); aerr == nil {
			return netip.Prefix{}, fmt.Errorf("%s entry %q: write a prefix length, e.g. %s/%d", field, s, a, a.BitLen())
		}
		return netip.Prefix{}, fmt.Errorf("%s entry %q: not a CIDR prefix like 203.0.113.0/24", field, s)
	}
	if p.Addr().Zone() != "" {
		return netip.Prefix{}, fmt.Errorf("%s entry %q: zones are not allowed", field, s)
	}
	if m := p.Masked(); m != p {
		return netip.Prefix{}, fmt.Errorf("%s entry %q: host bits are set; use %s", field, s, m)
	}
	return p, nil
}

// ParseCIDRs parses a list of CIDR entries, naming the first bad one.
func ParseCIDRs(field string, list []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(list))
	for _, s := range list {
		p, err := ParseCIDR(field, s)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

type policyJSON struct {
	Mode         Mode     `json:"mode"`
	AllowedHosts []string `json:"allowedHosts,omitempty"`
	AllowedCIDRs []string `json:"allowedCIDRs,omitempty"`
	DeniedCIDRs  []string `json:"deniedCIDRs,omitempty"`
	Intercept    []string `json:"intercept,omitempty"`
}

// ErrInvalidPolicy matches every error ParsePolicy returns.
var ErrInvalidPolicy = errors.New("invalid network policy")

type policyError struct{ err error }

func (e *policyError) Error() string        { return "network policy: " + e.err.Error() }
func (e *policyError) Unwrap() error        { return e.err }
func (e *policyError) Is(target error) bool { return target == ErrInvalidPolicy }

// ParsePolicy parses a policy in the JSON shape of the AI SDK harness:
// {"mode":"allow-all"}, {"mode":"deny-all"} or {"mode":"custom",
// "allowedHosts":[…],"allowedCIDRs":[…],"deniedCIDRs":[…]}, plus
// sandgate's "intercept":[…] (host rules, with allow-all or custom).
// Unknown keys, unknown modes, and rules given with a mode that ignores
// them are refused by name.
func ParsePolicy(data []byte) (Policy, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var pj policyJSON
	if err := dec.Decode(&pj); err != nil {
		return Policy{}, &policyError{fmt.Errorf("%w", jsonErr(err))}
	}
	if dec.More() {
		return Policy{}, &policyError{errors.New("trailing data after the policy object")}
	}
	p, err := pj.policy()
	if err != nil {
		return Policy{}, &policyError{err}
	}
	return p, nil
}

func jsonErr(err error) error {
	var ute *json.UnmarshalTypeError
	if errors.As(err, &ute) {
		return fmt.Errorf("field %q must be %s", ute.Field, ute.Type)
	}
	if s := err.Error(); strings.HasPrefix(s, "json: unknown field ") {
		return fmt.Errorf("unknown key %s (known: mode, allowedHosts, allowedCIDRs, deniedCIDRs, intercept)", strings.TrimPrefix(s, "json: unknown field "))
	}
	return err
}

func (pj policyJSON) policy() (Policy, error) {
	intercept, err := ParseHostRules(pj.Intercept)
	if err != nil {
		return Policy{}, fmt.Errorf("intercept: %w", err)
	}
	switch pj.Mode {
	case AllowAll, DenyAll:
		if len(pj.AllowedHosts)+len(pj.AllowedCIDRs)+len(pj.DeniedCIDRs) > 0 {
			return Policy{}, fmt.Errorf(`mode %q takes no rules; use "mode":"custom" with allowedHosts/allowedCIDRs/deniedCIDRs`, pj.Mode)
		}
		if pj.Mode == DenyAll && len(intercept) > 0 {
			return Policy{}, errors.New(`mode "deny-all" reaches no host, so it intercepts none: drop "intercept", or use "custom" with allowedHosts`)
		}
		return Policy{Mode: pj.Mode, Intercept: intercept}, nil
	case Custom:
	case "":
		return Policy{}, errors.New(`"mode" is required: "allow-all", "deny-all" or "custom"`)
	default:
		return Policy{}, fmt.Errorf(`unknown mode %q: use "allow-all", "deny-all" or "custom"`, pj.Mode)
	}
	hosts, err := ParseHostRules(pj.AllowedHosts)
	if err != nil {
		return Policy{}, fmt.Errorf("allowedHosts: %w", err)
	}
	allowed, err := ParseCIDRs("allowedCIDRs", pj.AllowedCIDRs)
	if err != nil {
		return Policy{}, err
	}
	denied, err := ParseCIDRs("deniedCIDRs", pj.DeniedCIDRs)
	if err != nil {
		return Policy{}, err
	}
	return Policy{Mode: Custom, AllowedHosts: hosts, AllowedCIDRs: allowed, DeniedCIDRs: denied, Intercept: intercept}, nil
}

// LoadPolicyFile reads and parses a policy file.
func LoadPolicyFile(path string) (Policy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Policy{}, fmt.Errorf("reading policy: %w", err)
	}
	p, err := ParsePolicy(data)
	if err != nil {
		return Policy{}, fmt.Errorf("%s: %w", path, err)
	}
	return p, nil
}

// MarshalJSON writes the policy in the shape ParsePolicy reads.
func (p Policy) MarshalJSON() ([]byte, error) {
	pj := policyJSON{Mode: p.mode()}
	for _, h := range p.AllowedHosts {
		pj.AllowedHosts = append(pj.AllowedHosts, h.String())
	}
	for _, c := range p.AllowedCIDRs {
		pj.AllowedCIDRs = append(pj.AllowedCIDRs, c.String())
	}
	for _, c := range p.DeniedCIDRs {
		pj.DeniedCIDRs = append(pj.DeniedCIDRs, c.String())
	}
	for _, h := range p.Intercept {
		pj.Intercept = append(pj.Intercept, h.String())
	}
	return json.Marshal(pj)
}

// UnmarshalJSON reads the policy with ParsePolicy's rules.
func (p *Policy) UnmarshalJSON(data []byte) error {
	np, err := ParsePolicy(data)
	if err != nil {
		return err
	}
	*p = np
	return nil
}

func (p Policy) mode() Mode {
	if p.Mode == "" {
		return Custom
	}
	return p.Mode
}
