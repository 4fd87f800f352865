package main

import (
	"fmt"
	"log/slog"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/netpolicy"
)

// Flags shared by the verbs that judge egress (proxy, policy check).
func egressFlags() []cli.Flag {
	return append([]cli.Flag{
		&cli.StringSliceFlag{Name: "allow", Usage: "allow `HOST` (exact, or *.example.com for its subdomains) in every custom policy; repeatable or comma-separated", EnvVars: []string{"SANDBOX_ALLOWED_HOSTS"}},
		&cli.StringFlag{Name: "policy", Usage: "network policy `FILE` (JSON: {\"mode\":\"allow-all\"|\"deny-all\"|\"custom\",\"allowedHosts\":[…],\"allowedCIDRs\":[…],\"deniedCIDRs\":[…]}); default: custom with no rules of its own", EnvVars: []string{"SANDBOX_POLICY_FILE"}},
	}, dnsFlags()...)
}

// dnsFlags are how every verb that dials resolves, and which special
// addresses it may dial anyway.
func dnsFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{Name: "dns", Usage: "DNS server `ADDR` (IP or IP:port) to resolve with; default: the nameservers of /etc/resolv.conf", EnvVars: []string{"SANDBOX_DNS"}},
		&cli.StringSliceFlag{Name: "allow-private", Usage: "exempt `CIDR` from the refusal of private, loopback and other special addresses (for tests; never in production)", EnvVars: []string{"SANDBOX_ALLOW_PRIVATE"}},
	}
}

// egress is what the egress flags configure.
type egress struct {
	decider  *netpolicy.Decider
	resolver *netpolicy.DNSResolver
	policy   netpolicy.Policy
}

func (e *egress) Close() {
	if e.resolver != nil {
		e.resolver.Close()
	}
}

// newEgress builds the decider and policy from the egress flags. Bad values
// are the caller's mistake (exit 2), named by flag.
func newEgress(c *cli.Context, logger *slog.Logger) (*egress, error) {
	hosts, err := netpolicy.ParseHostRules(splitAll(c.StringSlice("allow")))
	if err != nil {
		return nil, badInput("--allow: %v", err)
	}
	private, err := netpolicy.ParseCIDRs("--allow-private", splitAll(c.StringSlice("allow-private")))
	if err != nil {
		return nil, badInput("%v", err)
	}
	var policy netpolicy.Policy
	if f := c.String("policy"); f != "" {
		if policy, err = netpolicy.LoadPolicyFile(f); err != nil {
			return nil, badInput("--policy: %v", err)
		}
	}
	servers := splitAll(c.StringSlice("dns"))
	if len(servers) == 0 {
		if servers, err = netpolicy.ServersFromResolvConf("/etc/resolv.conf"); err != nil {
			return nil, fmt.Errorf("no --dns given and /etc/resolv.conf is unusable: %w", err)
		}
	}
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: servers})
	if err != nil {
		return nil, badInput("--dns: %v", err)
	}
	for _, p := range private {
		logger.Warn("address-class refusal disabled for a range: sandboxes may reach it", "cidr", p.String(), "flag", "--allow-private")
	}
	return &egress{
		decider:  &netpolicy.Decider{Resolver: res, ServiceHosts: hosts, AllowPrivate: private},
		resolver: res,
		policy:   policy,
	}, nil
}

// splitAll flattens repeated and comma-separated flag values.
func splitAll(vals []string) []string {
	var out []string
	for _, v := range vals {
		out = append(out, netpolicy.SplitList(v)...)
	}
	return out
}
