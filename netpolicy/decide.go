package netpolicy

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"
)

// HTTPSPort is the only destination port a sandbox may reach.
const HTTPSPort = 443

// Code is a short, stable name for why a decision came out as it did. It is
// what metrics are labelled with; Reason is the sentence for people. A
// failed lookup is not a decision and has no Code: Decide returns it as an
// error beside the rules' decision.
type Code string

// Decision codes.
const (
	CodeAllowAll     Code = "allow_all"
	CodeAllowedHost  Code = "allowed_host"
	CodeRouteHost    Code = "route_host"
	CodeAllowedCIDR  Code = "allowed_cidr"
	CodeDenyAll      Code = "deny_all"
	CodeNoRule       Code = "no_rule"
	CodePort         Code = "port"
	CodeInvalidHost  Code = "invalid_host"
	CodeLocalName    Code = "local_name"
	CodeAddressClass Code = "address_class"
	CodeDeniedCIDR   Code = "denied_cidr"
	// CodePlainHTTP: an http route to an address the operator did not
	// open (cleartext goes only to a private network the operator chose).
	CodePlainHTTP Code = "plain_http"
)

// Decision is the outcome of judging one destination: whether it is
// allowed, a sentence saying why, the rule that decided, and the addresses
// that were checked and may be dialed.
type Decision struct {
	Allow  bool
	Code   Code
	Reason string
	// Rule is the rule that decided, e.g. "allowedHosts:*.example.com",
	// "deniedCIDRs:10.0.0.0/8", "mode:deny-all" or "class:loopback".
	Rule string
	// Host is the canonical target; zero when the host was invalid.
	Host Host
	Port int
	// Addrs are the addresses that passed every check, in the order to try.
	// Only these may be dialed. Empty when not allowed, and when the rules
	// allowed a name whose lookup failed.
	Addrs []netip.Addr
	// Addr is the address actually connected to, set by Dial.
	Addr netip.Addr
	// DNSTime is how long name resolution took (zero for IP literals).
	DNSTime time.Duration
}

// Decider judges destinations for sandboxes. Its fields are configuration:
// set them before first use and do not change them afterwards. A Decider is
// safe for concurrent use.
type Decider struct {
	// Resolver looks names up. It must not be the system resolver: the
	// DNSResolver in this package is the one meant for production.
	Resolver Resolver
	// ServiceHosts are added to every custom policy (SANDBOX_ALLOWED_HOSTS).
	ServiceHosts []HostRule
	// AllowPrivate exempts addresses from the address-class refusal. Empty
	// in production; tests use it to reach loopback upstreams.
	AllowPrivate []netip.Prefix
	// DialTimeout bounds each connection attempt; zero means 10s.
	DialTimeout time.Duration
}

// DecideArgs is what Decide judges. New fields may be added; the zero value
// of each keeps the old behaviour.
type DecideArgs struct {
	// Policy is the sandbox's network policy.
	Policy Policy
	// Host is the destination host as the sandbox spelled it, without port.
	Host string
	// Port is the destination port; zero means 443.
	Port int
	// Route says the destination is a base-URL route's, which the
	// policy's RouteHosts admit too.
	Route bool
	// Plain says the route is an http one (cleartext): forwarded only to
	// addresses the operator exempted from the address-class refusal
	// (AllowPrivate), and only for a route.
	Plain bool
}

// Decide judges a destination. A name is checked against the host rules
// before any lookup, then resolved, and every answer classified; only
// answers that pass are returned in Decision.Addrs. A denial by policy is a
// Decision with Allow false and a nil error. The error is non-nil only when
// the rules allowed a name and its lookup then failed (a *DNSError): that is
// not a policy decision, so the Decision still says what the rules decided
// (Allow true, with their Code, Rule and Reason) but holds no address, and
// Dial refuses it.
func (d *Decider) Decide(ctx context.Context, args DecideArgs) (Decision, error) {
	dec := Decision{Port: args.Port}
	if dec.Port == 0 {
		dec.Port = defaultPort(args.Plain)
	}
	hm := canonicalHostMemo(args.Host)
	h, err := hm.host, hm.err
	if err != nil {
		return deny(dec, CodeInvalidHost, "", err.Error()), nil
	}
	dec.Host = h
	p := args.Policy
	if args.Plain && !args.Route {
		return deny(dec, CodePlainHTTP, "plain", "plain http is refused: only a base-URL route may be http, and only to an address the operator opened"), nil
	}
	if port := defaultPort(args.Plain); dec.Port != port {
		switch {
		case !args.Route:
			return deny(dec, CodePort, "port", fmt.Sprintf("port %d is not allowed: HTTPS (443) only", dec.Port)), nil
		case !p.hasOrigin(args.Plain, h, dec.Port):
			return deny(dec, CodePort, "port", fmt.Sprintf("port %d is not allowed: a route reaches port %d, or the port of one of the sandbox's own base URLs (%s:%d is none)", dec.Port, port, h, dec.Port)), nil
		}
	}
	if h.IsIP() {
		dec = d.decideAddr(dec, p, args)
		if dec.Allow && args.Plain {
			dec, _ = d.plainRefused(dec)
		}
		return dec, nil
	}
	if p.mode() == DenyAll {
		return denyAll(dec), nil
	}
	if why := hm.local; why != "" {
		return deny(dec, CodeLocalName, "name:"+h.Name, fmt.Sprintf("%s is refused before any lookup: %s", h.Name, why)), nil
	}
	rule, code, reason := d.matchName(p, h.Name, args.Route)
	if rule == "" {
		return deny(dec, CodeNoRule, "", reason), nil
	}
	start := time.Now()
	addrs, err := d.Resolver.LookupIP(ctx, h.Name)
	dec.DNSTime = time.Since(start)
	if err != nil {
		var de *DNSError
		if !errors.As(err, &de) {
			err = &DNSError{Host: h.Name, Err: err}
		}
		return allowed(dec, code, rule, reason), err
	}
	if len(addrs) == 0 {
		return allowed(dec, code, rule, reason), &DNSError{Host: h.Name, Err: errors.New("no addresses"), NotFound: true}
	}
	var refusals []refusal
	for _, a := range addrs {
		if r, bad := d.refuse(p, a); bad {
			refusals = append(refusals, r)
			continue
		}
		dec.Addrs = append(dec.Addrs, a.Unmap())
	}
	if len(dec.Addrs) == 0 {
		return denyRefusals(dec, h.Name, refusals), nil
	}
	if args.Plain {
		if d, bad := d.plainRefused(dec); bad {
			return d, nil
		}
	}
	dec.Allow, dec.Code, dec.Rule, dec.Reason = true, code, rule, reason
	return dec, nil
}

// defaultPort is the port a route or tunnel reaches without saying.
func defaultPort(plain bool) int {
	if plain {
		return 80
	}
	return HTTPSPort
}

// plainRefused refuses an http route unless every address it may dial is
// one the operator exempted from the address classes: cleartext, and
// credentials swapped into it, go only to a private network the operator
// chose, never across the internet.
func (d *Decider) plainRefused(dec Decision) (Decision, bool) {
	for _, a := range dec.Addrs {
		if !d.exempt(a) {
			return deny(dec, CodePlainHTTP, "plain", fmt.Sprintf("an http route to %s is refused: %s is not an address the operator opened (SANDBOX_ALLOW_PRIVATE_NETWORK, SANDBOX_ALLOW_PRIVATE), and cleartext never crosses the internet; use https", dec.Host, a)), true
		}
	}
	return dec, false
}

// matchName finds the rule allowing a name. It returns an empty rule and
// the reason for the denial when none does.
func (d *Decider) matchName(p Policy, name string, route bool) (rule string, code Code, reason string) {
	if p.mode() == AllowAll {
		return "mode:allow-all", CodeAllowAll, "the allow-all policy allows every public host"
	}
	for _, list := range [][]HostRule{p.AllowedHosts, d.ServiceHosts} {
		for _, r := range list {
			if r.Match(name) {
				return "allowedHosts:" + r.String(), CodeAllowedHost, fmt.Sprintf("%s matched allowed host rule %s", name, r)
			}
		}
	}
	if route {
		for _, r := range p.RouteHosts {
			if r.Match(name) {
				return "routeHosts:" + r.String(), CodeRouteHost, fmt.Sprintf("%s is the host of one of the sandbox's base URLs or credential rules (%s), which routes may reach", name, r)
			}
		}
	}
	return "", CodeNoRule, fmt.Sprintf("no allowedHosts rule matches %s", name)
}

// decideAddr judges an IP-literal target: only an allowedCIDRs rule (or the
// allow-all mode) admits one.
func (d *Decider) decideAddr(dec Decision, p Policy, args DecideArgs) Decision {
	a := dec.Host.Addr
	if r, bad := d.refuse(p, a); bad {
		// Before the deny-all policy: an address in a refused class is
		// said so (protocol 1's words) whatever the policy.
		return deny(dec, r.code, r.rule, r.why)
	}
	if p.mode() == DenyAll {
		return denyAll(dec)
	}
	ua := a.Unmap()
	if args.Route && p.hasOrigin(args.Plain, dec.Host, dec.Port) {
		dec.Allow, dec.Code, dec.Rule = true, CodeRouteHost, "routeOrigins:"+dec.Host.String()
		dec.Reason = fmt.Sprintf("%s is the address of one of the sandbox's base URLs, which routes may reach", a)
		dec.Addrs = []netip.Addr{ua}
		return dec
	}
	if p.mode() == AllowAll {
		dec.Allow, dec.Code, dec.Rule, dec.Reason = true, CodeAllowAll, "mode:allow-all", "the allow-all policy allows every public address"
		dec.Addrs = []netip.Addr{ua}
		return dec
	}
	for _, c := range p.AllowedCIDRs {
		if c.Contains(a) || c.Contains(ua) {
			dec.Allow, dec.Code, dec.Rule = true, CodeAllowedCIDR, "allowedCIDRs:"+c.String()
			dec.Reason = fmt.Sprintf("%s is in allowed CIDR %s", a, c)
			dec.Addrs = []netip.Addr{ua}
			return dec
		}
	}
	return deny(dec, CodeNoRule, "", fmt.Sprintf("IP-literal targets are allowed only by an allowedCIDRs rule, and none contains %s", a))
}

// denyAll is the deny-all policy's refusal.
func denyAll(dec Decision) Decision {
	return deny(dec, CodeDenyAll, "mode:deny-all", "the deny-all policy refuses every host")
}

type refusal struct {
	addr  netip.Addr
	code  Code
	class Class
	rule  string
	why   string
}

// refuse says whether an address may not be dialed under p: a refused
// class (unless exempted by the operator) or a deniedCIDRs entry.
func (d *Decider) refuse(p Policy, a netip.Addr) (refusal, bool) {
	// An IPv6 form that carries an IPv4 address (NAT64, 6to4, mapped, …)
	// is denied when the address it carries is.
	forms := []netip.Addr{a}
	if v4s, _, ok := embeddedV4(a); ok {
		forms = append(forms, v4s...)
	}
	for _, c := range p.DeniedCIDRs {
		for _, f := range forms {
			if c.Contains(f) {
				return refusal{addr: a, code: CodeDeniedCIDR, rule: "deniedCIDRs:" + c.String(),
					why: fmt.Sprintf("%s is in denied CIDR %s", a, c)}, true
			}
		}
	}
	if d.exempt(a) {
		return refusal{}, false
	}
	class, why := Classify(a)
	if class == Public {
		return refusal{}, false
	}
	// Protocol 1's wording, which its clients' tests match: "<address> is
	// not reachable from the sandbox", then why.
	why = fmt.Sprintf("%s is not reachable from the sandbox (%s)", a, strings.TrimPrefix(why, a.String()+" is "))
	return refusal{addr: a, code: CodeAddressClass, class: class, rule: "class:" + string(class), why: why}, true
}

func (d *Decider) exempt(a netip.Addr) bool {
	for _, p := range d.AllowPrivate {
		if p.Contains(a) || p.Contains(a.Unmap()) {
			return true
		}
	}
	return false
}

// denyRefusals builds the denial for a name whose every answer was refused,
// naming the class when they share one.
func denyRefusals(dec Decision, name string, rs []refusal) Decision {
	first := rs[0]
	same := true
	for _, r := range rs[1:] {
		if r.code != first.code || r.class != first.class || r.rule != first.rule {
			same = false
		}
	}
	addrs := make([]string, len(rs))
	for i, r := range rs {
		addrs[i] = r.addr.String()
	}
	list := strings.Join(addrs, ", ")
	switch {
	case same && first.code == CodeAddressClass:
		return deny(dec, first.code, first.rule, fmt.Sprintf("%s is not reachable from the sandbox: %s resolves only to %s addresses", list, name, first.class))
	case same && first.code == CodeDeniedCIDR:
		return deny(dec, first.code, first.rule, fmt.Sprintf("%s resolves only to addresses in denied CIDR %s (%s)", name, strings.TrimPrefix(first.rule, "deniedCIDRs:"), list))
	}
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = r.why
	}
	return deny(dec, first.code, first.rule, fmt.Sprintf("%s is not reachable from the sandbox: %s resolves only to refused addresses: %s", list, name, strings.Join(parts, "; ")))
}

// allowed is the rules' allow of a name whose lookup failed: no address.
func allowed(dec Decision, code Code, rule, reason string) Decision {
	dec.Allow, dec.Code, dec.Rule, dec.Reason, dec.Addrs = true, code, rule, reason, nil
	return dec
}

func deny(dec Decision, code Code, rule, reason string) Decision {
	dec.Allow, dec.Code, dec.Rule, dec.Reason, dec.Addrs = false, code, rule, reason, nil
	return dec
}
