package netpolicy_test

import (
	"fmt"
	"net/netip"

	"github.com/sandgate/sandgate/netpolicy"
)

func ExampleCanonicalHost() {
	for _, s := range []string{"API.Example.COM.", "bücher.example", "0x7f.1", "2130706433"} {
		h, err := netpolicy.CanonicalHost(s)
		fmt.Println(h, h.IsIP(), err)
	}
	// Output:
	// api.example.com false <nil>
	// xn--bcher-kva.example false <nil>
	// 127.0.0.1 true <nil>
	// 127.0.0.1 true <nil>
}

func ExampleClassify() {
	for _, s := range []string{"8.8.8.8", "10.0.0.5", "::ffff:169.254.169.254", "2002:7f00:1::"} {
		c, why := netpolicy.Classify(netip.MustParseAddr(s))
		if why == "" {
			why = "reachable"
		}
		fmt.Printf("%s: %s\n", c, why)
	}
	// Output:
	// public: reachable
	// private: 10.0.0.5 is a private address
	// cloud metadata: ::ffff:169.254.169.254 is an IPv4-mapped address carrying 169.254.169.254, a cloud metadata address
	// loopback: 2002:7f00:1:: is a 6to4 address carrying 127.0.0.1, a loopback address
}

func ExampleParseHostRule() {
	for _, s := range []string{"*.example.com", "*", "éxample.com", "1.2.3.4"} {
		r, err := netpolicy.ParseHostRule(s)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(r, r.Match("api.example.com"), r.Match("example.com"))
	}
	// Output:
	// *.example.com true false
	// host rule "*": a bare wildcard is not a host rule; use {"mode":"allow-all"} to allow every host
	// host rule "éxample.com": write the punycode form: use "xn--xample-9ua.com"
	// host rule "1.2.3.4": IP literals are not host rules; add 1.2.3.4/32 to allowedCIDRs
}
