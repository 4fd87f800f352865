package server

import (
	"fmt"
	"maps"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/transforms"
)

// sandboxState is what the server keeps of a running sandbox, in memory
// only: its caller's network settings, its credential rules as given (for
// append and for the credential guard), its processes and its open ports.
// It is forgotten when the sandbox is suspended or destroyed.
type sandboxState struct {
	mu sync.Mutex // serialises the routes that change the sandbox

	// allowedHosts and baseURLs are the caller's own (the service's are
	// merged in by policyFor and effectiveBaseURLs); policy, when set, is
	// a whole harness policy given to PUT network (sandgate's extension).
	allowedHosts []string
	baseURLs     map[string]string
	policy       *netpolicy.Policy
	rules        []transformation  // as given, in order
	guard        *transforms.Guard // of the held secrets (protocol 1 §8); nil: none

	pmu   sync.Mutex
	procs map[string]*process
	ports map[int]int // open tunnel and bridge connections per port
}

// state returns the server's state of sandbox name, made when first asked.
func (s *Server) state(name string) *sandboxState {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.boxes[name]
	if st == nil {
		st = &sandboxState{procs: map[string]*process{}, ports: map[int]int{}}
		s.boxes[name] = st
	}
	return st
}

// forget drops what the server kept of sandbox name (suspended or
// destroyed): its processes, its network settings and its credentials.
func (s *Server) forget(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.boxes, name)
	if s.cfg.Audit != nil {
		s.cfg.Audit.Forget(name)
	}
}

// guardOf is the credential guard of sandbox name: nil (nothing held)
// when the server keeps nothing of it. It makes no state of its own, so a
// route may ask before it knows the sandbox runs.
func (s *Server) guardOf(name string) *transforms.Guard {
	s.mu.Lock()
	st := s.boxes[name]
	s.mu.Unlock()
	if st == nil {
		return nil
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.guard
}

// effectiveBaseURLs is the service's base URLs overlaid by the caller's.
func (s *Server) effectiveBaseURLs(own map[string]string) map[string]string {
	out := maps.Clone(s.cfg.BaseURLs)
	if out == nil {
		out = map[string]string{}
	}
	maps.Copy(out, own)
	return out
}

// policyFor is a sandbox's effective egress policy: "*" among the
// allowed hosts (the service's or the caller's) is allow-all; otherwise a
// custom policy of the service's hosts plus the caller's (an IP literal is
// an allowedCIDRs entry for that address), whose routes may also reach the
// hosts of its base URLs and of its credential rules. An entry sandgate's
// host rules refuse is bad input naming the fix.
func (s *Server) policyFor(own []string, baseURLs map[string]string, rules []transformation) (netpolicy.Policy, error) {
	all := append(slices.Clone(s.cfg.AllowedHosts), own...)
	p := netpolicy.Policy{Mode: netpolicy.Custom}
	for _, v := range baseURLs {
		if o, ok := netpolicy.OriginOf(v); ok {
			p.RouteOrigins = append(p.RouteOrigins, o)
		}
	}
	if slices.Contains(all, "*") {
		return netpolicy.Policy{Mode: netpolicy.AllowAll, RouteOrigins: p.RouteOrigins}, nil
	}
	seen := map[string]bool{}
	for _, h := range all {
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
			return netpolicy.Policy{}, badRequest("allowedHosts: %v", err)
		}
		p.AllowedHosts = append(p.AllowedHosts, r)
	}
	var routeHosts []string
	for _, v := range baseURLs {
		if u, err := url.Parse(v); err == nil && u.Hostname() != "" {
			routeHosts = append(routeHosts, strings.ToLower(u.Hostname()))
		}
	}
	for _, t := range rules {
		routeHosts = append(routeHosts, strings.ToLower(t.host))
	}
	slices.Sort(routeHosts)
	for _, h := range slices.Compact(routeHosts) {
		if r, err := netpolicy.ParseHostRule(h); err == nil {
			p.RouteHosts = append(p.RouteHosts, r)
		}
	}
	return p, nil
}

// network is the appliance network of a sandbox's state.
func (s *Server) network(st *sandboxState) (appliance.Network, error) {
	urls := s.effectiveBaseURLs(st.baseURLs)
	if st.policy != nil {
		// A whole policy: the service's hosts are added to a custom one,
		// as they are to every sandbox's list.
		p := *st.policy
		pr, err := s.policyFor(nil, urls, st.rules)
		if err != nil {
			return appliance.Network{}, err
		}
		if p.Mode == netpolicy.Custom || p.Mode == "" {
			p.AllowedHosts = append(slices.Clone(p.AllowedHosts), pr.AllowedHosts...)
			p.AllowedCIDRs = append(slices.Clone(p.AllowedCIDRs), pr.AllowedCIDRs...)
		}
		p.RouteHosts, p.RouteOrigins = pr.RouteHosts, pr.RouteOrigins
		return appliance.Network{Policy: p, BaseURLs: urls}, nil
	}
	p, err := s.policyFor(st.allowedHosts, urls, st.rules)
	if err != nil {
		return appliance.Network{}, err
	}
	return appliance.Network{Policy: p, BaseURLs: urls}, nil
}

// agentConfig is what every sandbox's agent starts with: the service's
// PATH and the sandbox's home, the relay port, and no base URLs of its own
// (the server gives every command its base URLs, routed, itself).
func (s *Server) agentConfig(name string) *agent.Config {
	return &agent.Config{
		RelayAddr:    fmt.Sprintf("127.0.0.1:%d", s.cfg.EgressPort),
		Path:         s.cfg.Path,
		Home:         sandboxDir(s.cfg.Home, name),
		OnlyBaseURLs: true,
	}
}
