package appliance

import (
	"fmt"
	"maps"
	"net/netip"
	"net/url"
	"slices"
	"strings"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/transforms"
)

// NetworkSpec is what a caller says of where a sandbox may go. The manager
// derives the sandbox's effective Network from it, from the service's own
// hosts and base URLs (ManagerConfig.AllowedHosts, BaseURLs) and from the
// hosts its credential rules target; it keeps the spec, never a copy of
// the result, so a change of either is applied anew.
type NetworkSpec struct {
	// AllowedHosts are host rules on top of the service's: "*" makes the
	// policy allow-all; an IP literal is an allowedCIDRs entry for that one
	// address; any other entry is a host rule (netpolicy.ParseHostRule).
	AllowedHosts []string
	// Policy, when set, is a whole harness policy (CIDR rules and all)
	// given instead of AllowedHosts; the service's hosts are added to a
	// custom one.
	Policy *netpolicy.Policy
	// BaseURLs overlay the service's base URLs (a name given here wins):
	// variable name → upstream URL, routed through the relay
	// (agent.RouteBaseURL).
	BaseURLs map[string]string
}

// Network is where a sandbox may go, as the egress proxy and its agent
// apply it: its effective policy and the base URLs its commands get.
type Network struct {
	Policy   netpolicy.Policy
	BaseURLs map[string]string
}

// check refuses a spec that cannot be honoured, naming the field.
func (n NetworkSpec) check() error {
	for k, v := range n.BaseURLs {
		if err := agent.CheckBaseURL("baseUrls."+k, v); err != nil {
			return fmt.Errorf("%w: %v", ErrBadInput, err)
		}
	}
	return nil
}

// effectiveNetwork is a sandbox's Network: the service's base URLs
// overlaid by the spec's; "*" among the allowed hosts (the service's or
// the spec's) makes the policy allow-all; otherwise a custom policy of the
// service's hosts plus the spec's (or the spec's whole policy with the
// service's hosts added), whose routes may also reach the hosts of its
// base URLs and of its credential rules, and each base URL's own origin.
func (m *Manager) effectiveNetwork(spec NetworkSpec, rules []transforms.Rule) (Network, error) {
	urls := maps.Clone(m.cfg.BaseURLs)
	if urls == nil {
		urls = map[string]string{}
	}
	maps.Copy(urls, spec.BaseURLs)
	routes := Network{BaseURLs: urls}
	var origins []netpolicy.Origin
	var routeHosts []string
	for _, v := range urls {
		if u, err := url.Parse(v); err == nil && u.Hostname() != "" {
			routeHosts = append(routeHosts, strings.ToLower(u.Hostname()))
		}
		if o, ok := netpolicy.OriginOf(v); ok {
			origins = append(origins, o)
		}
	}
	for _, r := range rules {
		if h := r.Host(); h != "" {
			routeHosts = append(routeHosts, strings.ToLower(h))
		}
	}
	slices.Sort(routeHosts)
	var routeRules []netpolicy.HostRule
	for _, h := range slices.Compact(routeHosts) {
		if r, err := netpolicy.ParseHostRule(h); err == nil {
			routeRules = append(routeRules, r)
		}
	}
	service, err := parseHosts(m.cfg.AllowedHosts)
	if err != nil {
		return Network{}, err
	}
	var p netpolicy.Policy
	switch {
	case spec.Policy != nil:
		p = *spec.Policy
		if p.Mode == netpolicy.Custom || p.Mode == "" {
			if service.Mode == netpolicy.AllowAll {
				p = netpolicy.Policy{Mode: netpolicy.AllowAll, Intercept: p.Intercept}
			} else {
				p.AllowedHosts = append(slices.Clone(p.AllowedHosts), service.AllowedHosts...)
				p.AllowedCIDRs = append(slices.Clone(p.AllowedCIDRs), service.AllowedCIDRs...)
			}
		}
	default:
		if p, err = parseHosts(append(slices.Clone(m.cfg.AllowedHosts), spec.AllowedHosts...)); err != nil {
			return Network{}, err
		}
	}
	if len(p.Intercept) > 0 && m.cfg.Proxy != nil && !m.cfg.Proxy.CanIntercept() {
		return Network{}, fmt.Errorf(`%w: "intercept" names hosts, but this service intercepts no TLS (it runs with SANDGATE_INTERCEPT_CA=off): remove "intercept", or run the service with an interception CA`, ErrBadInput)
	}
	p.RouteHosts, p.RouteOrigins = routeRules, origins
	routes.Policy = p
	return routes, nil
}

// parseHosts is protocol 1's list of allowed hosts as a policy: "*" is
// allow-all, an IP literal an allowedCIDRs entry for that address, every
// other entry a host rule (a bad one is ErrBadInput naming the fix).
func parseHosts(hosts []string) (netpolicy.Policy, error) {
	if slices.Contains(hosts, "*") {
		return netpolicy.Policy{Mode: netpolicy.AllowAll}, nil
	}
	p := netpolicy.Policy{Mode: netpolicy.Custom}
	seen := map[string]bool{}
	for _, h := range hosts {
		h = strings.TrimSpace(h)
		if h == "" || seen[h] {
			continue
		}
		seen[h] = true
		if a, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
			p.AllowedCIDRs = append(p.AllowedCIDRs, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
			continue
		}
		r, err := netpolicy.ParseHostRule(h)
		if err != nil {
			return netpolicy.Policy{}, fmt.Errorf("%w: allowedHosts: %v", ErrBadInput, err)
		}
		p.AllowedHosts = append(p.AllowedHosts, r)
	}
	return p, nil
}
