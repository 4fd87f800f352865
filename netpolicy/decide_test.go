package netpolicy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
)

func newTestDecider(t *testing.T, hosts ...string) (*Decider, *dnstest.Server) {
	t.Helper()
	srv := dnstest.Start(t)
	res, err := NewDNSResolver(ResolverConfig{Servers: []string{srv.Addr}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Close() })
	rules, err := ParseHostRules(hosts)
	if err != nil {
		t.Fatal(err)
	}
	return &Decider{Resolver: res, ServiceHosts: rules}, srv
}

func mustPolicy(t *testing.T, js string) Policy {
	t.Helper()
	p, err := ParsePolicy([]byte(js))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDecide(t *testing.T) {
	d, srv := newTestDecider(t, "service.example.com")
	srv.Set("api.example.com", addrs("93.184.216.34", "2606:2800:220:1::1")...)
	srv.Set("service.example.com", addrs("93.184.216.35")...)
	srv.Set("a.wild.example.com", addrs("93.184.216.36")...)
	srv.Set("private.example.com", addrs("10.0.0.5")...)
	srv.Set("mixed.example.com", addrs("10.0.0.5", "93.184.216.37")...)
	srv.Set("loopmix.example.com", addrs("127.0.0.1", "10.1.1.1")...)
	srv.Set("mapped.example.com", addrs("::ffff:127.0.0.1")...)
	srv.Set("meta.example.com", addrs("169.254.169.254")...)
	srv.Set("intranet", addrs("10.0.0.7")...)
	srv.Set("denied.example.com", addrs("93.184.216.99")...)
	srv.Set("nat64denied.example.com", addrs("64:ff9b::5db8:d863")...) // 93.184.216.99
	srv.Set("6to4denied.example.com", addrs("2002:5db8:d863::1")...)   // 93.184.216.99
	srv.Set("siitdenied.example.com", addrs("::ffff:0:5db8:d863")...)  // 93.184.216.99
	srv.Set("mappeddenied.example.com", addrs("::ffff:93.184.216.99")...)

	custom := mustPolicy(t, `{"mode":"custom","allowedHosts":["api.example.com","*.wild.example.com","private.example.com","mixed.example.com","loopmix.example.com","mapped.example.com","meta.example.com","denied.example.com","nx.example.com","x.localhost","*.example.net"],"allowedCIDRs":["93.184.216.0/24"],"deniedCIDRs":["93.184.216.99/32"]}`)
	tests := []struct {
		name   string
		policy Policy
		host   string
		port   int
		allow  bool
		code   Code
		reason string // substring
		addrs  []netip.Addr
	}{
		{"exact host", custom, "api.example.com", 443, true, CodeAllowedHost, "matched allowed host rule api.example.com", addrs("93.184.216.34", "2606:2800:220:1::1")},
		{"case and dot", custom, "API.Example.COM.", 0, true, CodeAllowedHost, "", addrs("93.184.216.34", "2606:2800:220:1::1")},
		{"service-wide host", custom, "service.example.com", 443, true, CodeAllowedHost, "service.example.com", addrs("93.184.216.35")},
		{"wildcard", custom, "a.wild.example.com", 443, true, CodeAllowedHost, "*.wild.example.com", addrs("93.184.216.36")},
		{"wildcard apex", custom, "wild.example.com", 443, false, CodeNoRule, "no allowedHosts rule matches wild.example.com", nil},
		{"no rule", custom, "other.example.com", 443, false, CodeNoRule, "no allowedHosts rule", nil},
		{"port 22", custom, "api.example.com", 22, false, CodePort, "port 22 is not allowed: HTTPS (443) only", nil},
		{"port 80", custom, "api.example.com", 80, false, CodePort, "HTTPS (443) only", nil},
		{"private only", custom, "private.example.com", 443, false, CodeAddressClass, "10.0.0.5 is not reachable from the sandbox: private.example.com resolves only to private addresses", nil},
		{"mixed keeps public", custom, "mixed.example.com", 443, true, CodeAllowedHost, "", addrs("93.184.216.37")},
		{"two classes", custom, "loopmix.example.com", 443, false, CodeAddressClass, "127.0.0.1, 10.1.1.1 is not reachable from the sandbox: loopmix.example.com resolves only to refused addresses: 127.0.0.1 is not reachable from the sandbox (a loopback address); 10.1.1.1 is not reachable from the sandbox (a private address)", nil},
		{"mapped answer", custom, "mapped.example.com", 443, false, CodeAddressClass, "loopback", nil},
		{"metadata answer", custom, "meta.example.com", 443, false, CodeAddressClass, "169.254.169.254 is not reachable from the sandbox: meta.example.com resolves only to cloud metadata addresses", nil},
		{"denied CIDR wins", custom, "denied.example.com", 443, false, CodeDeniedCIDR, "denied CIDR 93.184.216.99/32", nil},
		{"denied CIDR via NAT64", allowAllDenying(), "nat64denied.example.com", 443, false, CodeDeniedCIDR, "denied CIDR 93.184.216.99/32", nil},
		{"denied CIDR via 6to4", allowAllDenying(), "6to4denied.example.com", 443, false, CodeDeniedCIDR, "denied CIDR", nil},
		{"denied CIDR via SIIT", allowAllDenying(), "siitdenied.example.com", 443, false, CodeDeniedCIDR, "denied CIDR", nil},
		{"denied CIDR via mapped", allowAllDenying(), "mappeddenied.example.com", 443, false, CodeDeniedCIDR, "denied CIDR", nil},
		{"localhost is loopback", custom, "x.localhost", 443, false, CodeAddressClass, "127.0.0.1, ::1 is not reachable from the sandbox: x.localhost resolves only to loopback addresses", nil},
		{"metadata name", allowAll(), "metadata.google.internal", 443, false, CodeLocalName, "metadata", nil},
		{"sub.localhost", allowAll(), "x.localhost", 443, false, CodeAddressClass, "is not reachable from the sandbox", nil},
		{"single label", allowAll(), "intranet", 443, false, CodeAddressClass, "10.0.0.7 is not reachable from the sandbox", nil},
		{"IP literal in CIDR", custom, "93.184.216.1", 443, true, CodeAllowedCIDR, "93.184.216.1 is in allowed CIDR 93.184.216.0/24", addrs("93.184.216.1")},
		{"IP literal not in CIDR", custom, "8.8.8.8", 443, false, CodeNoRule, "IP-literal targets are allowed only by an allowedCIDRs rule", nil},
		{"IP literal denied", custom, "93.184.216.99", 443, false, CodeDeniedCIDR, "", nil},
		{"IP literal allow-all", allowAll(), "8.8.8.8", 443, true, CodeAllowAll, "", addrs("8.8.8.8")},
		{"decimal loopback", allowAll(), "2130706433", 443, false, CodeAddressClass, "127.0.0.1 is not reachable from the sandbox (a loopback address)", nil},
		{"hex loopback", allowAll(), "0x7f.1", 443, false, CodeAddressClass, "loopback", nil},
		{"octal loopback", allowAll(), "0177.0.0.1", 443, false, CodeAddressClass, "loopback", nil},
		{"short loopback", allowAll(), "127.1", 443, false, CodeAddressClass, "loopback", nil},
		{"zero", allowAll(), "0", 443, false, CodeAddressClass, "unspecified", nil},
		{"mapped literal", allowAll(), "::ffff:169.254.169.254", 443, false, CodeAddressClass, "169.254.169.254", nil},
		{"nat64 literal", allowAll(), "64:ff9b::10.0.0.1", 443, false, CodeAddressClass, "private", nil},
		{"mapped public literal", allowAll(), "::ffff:8.8.8.8", 443, true, CodeAllowAll, "", addrs("8.8.8.8")},
		{"deny-all", Policy{Mode: DenyAll}, "api.example.com", 443, false, CodeDenyAll, "deny-all", nil},
		{"deny-all, a public literal", Policy{Mode: DenyAll}, "8.8.8.8", 443, false, CodeDenyAll, "deny-all", nil},
		{"deny-all, a refused literal says so first", Policy{Mode: DenyAll}, "169.254.169.254", 443, false, CodeAddressClass, "169.254.169.254 is not reachable from the sandbox (a cloud metadata address)", nil},
		{"allow-all", allowAll(), "api.example.com", 443, true, CodeAllowAll, "", addrs("93.184.216.34", "2606:2800:220:1::1")},
		{"zero policy uses service hosts", Policy{}, "service.example.com", 443, true, CodeAllowedHost, "", addrs("93.184.216.35")},
		{"userinfo", allowAll(), "user@api.example.com", 443, false, CodeInvalidHost, "userinfo", nil},
		{"garbage", allowAll(), "a..b", 443, false, CodeInvalidHost, "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dec, err := d.Decide(context.Background(), DecideArgs{Policy: tt.policy, Host: tt.host, Port: tt.port})
			if err != nil {
				t.Fatalf("Decide(%q): unexpected error %v", tt.host, err)
			}
			if dec.Allow != tt.allow || dec.Code != tt.code {
				t.Fatalf("Decide(%q) = %v %s (%s), want %v %s", tt.host, dec.Allow, dec.Code, dec.Reason, tt.allow, tt.code)
			}
			if !strings.Contains(dec.Reason, tt.reason) {
				t.Errorf("reason %q, want it to contain %q", dec.Reason, tt.reason)
			}
			if !equalAddrs(dec.Addrs, tt.addrs) {
				t.Errorf("addrs %v, want %v", dec.Addrs, tt.addrs)
			}
			if dec.Allow && dec.Rule == "" {
				t.Errorf("an allow must name its rule")
			}
		})
	}
	for _, name := range []string{"x.localhost", "localhost", "metadata.google.internal", "wild.example.com", "other.example.com"} {
		if n := srv.Queries(name); n != 0 {
			t.Errorf("%s was looked up %d times; names not allowed must never be resolved", name, n)
		}
	}
}

func allowAll() Policy { return Policy{Mode: AllowAll} }

// allowAllDenying allows every public host but 93.184.216.99.
func allowAllDenying() Policy {
	return Policy{Mode: Custom, AllowedHosts: []HostRule{{pattern: "*.example.com", suffix: ".example.com"}},
		DeniedCIDRs: []netip.Prefix{netip.MustParsePrefix("93.184.216.99/32")}}
}

func equalAddrs(a, b []netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestDecideDNSFailureIsNotADenial: a lookup that fails after the rules
// allowed the name is returned as a *DNSError beside the rules' decision
// (allow, their rule and reason), with no address to dial; it used to be
// reported as a denial.
func TestDecideDNSFailureIsNotADenial(t *testing.T) {
	d, srv := newTestDecider(t, "*.example.com")
	srv.SetRcode("fail.example.com", dns.RcodeServerFailure)
	for _, host := range []string{"nx.example.com", "fail.example.com"} {
		dec, err := d.Decide(context.Background(), DecideArgs{Host: host})
		var de *DNSError
		if !errors.As(err, &de) || de.Host != host {
			t.Fatalf("Decide(%s) error = %v, want a *DNSError for it", host, err)
		}
		if !dec.Allow || dec.Code != CodeAllowedHost || dec.Rule != "allowedHosts:*.example.com" || len(dec.Addrs) != 0 {
			t.Errorf("Decide(%s) = %+v, want the rules' allow with no address", host, dec)
		}
		if c, err := d.Dial(context.Background(), &dec); err == nil {
			c.Close()
			t.Errorf("Dial of a decision whose lookup failed connected to %s", dec.Addr)
		}
	}
}

// TestDecideRebinding: a name that answers a public address first and a
// private one next is judged on each answer; the second is refused.
func TestDecideRebinding(t *testing.T) {
	d, srv := newTestDecider(t, "rebind.example.com")
	srv.SetTTL("rebind.example.com", 0)
	srv.SetSequence("rebind.example.com", addrs("93.184.216.34"), addrs("10.0.0.5"))
	dec, err := d.Decide(context.Background(), DecideArgs{Host: "rebind.example.com"})
	if err != nil || !dec.Allow || dec.Addrs[0] != netip.MustParseAddr("93.184.216.34") {
		t.Fatalf("first Decide = %+v, %v; want allow 93.184.216.34", dec, err)
	}
	dec, err = d.Decide(context.Background(), DecideArgs{Host: "rebind.example.com"})
	if err != nil || dec.Allow {
		t.Fatalf("second Decide = %+v, %v; want deny", dec, err)
	}
	if want := "10.0.0.5 is not reachable from the sandbox: rebind.example.com resolves only to private addresses"; dec.Reason != want {
		t.Errorf("reason %q, want %q", dec.Reason, want)
	}
}

func TestAllowPrivateExempts(t *testing.T) {
	d, srv := newTestDecider(t, "up.example.com")
	srv.Set("up.example.com", addrs("127.0.0.1", "127.0.0.2")...)
	d.AllowPrivate = []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
	dec, err := d.Decide(context.Background(), DecideArgs{Host: "up.example.com"})
	if err != nil || !dec.Allow || !equalAddrs(dec.Addrs, addrs("127.0.0.1")) {
		t.Fatalf("Decide = %+v, %v; want allow with only the exempted 127.0.0.1", dec, err)
	}
}

// TestDialPinned: Dial connects to the checked address and nothing else,
// and records it.
func TestDialPinned(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	d := &Decider{}
	dec := Decision{Allow: true, Port: port, Host: Host{Name: "x.example.com"}, Addrs: addrs("127.0.0.1")}
	c, err := d.Dial(context.Background(), &dec)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if dec.Addr != netip.MustParseAddr("127.0.0.1") {
		t.Errorf("Dial recorded %v, want 127.0.0.1", dec.Addr)
	}
	if _, err := d.Dial(context.Background(), &Decision{Allow: false, Addrs: addrs("127.0.0.1")}); !errors.Is(err, ErrNotAllowed) {
		t.Errorf("Dial of a denial = %v, want ErrNotAllowed", err)
	}
	if err := pinControl(netip.MustParseAddrPort("127.0.0.1:443"))("tcp4", "127.0.0.2:443", nil); err == nil {
		t.Errorf("pinControl let a connect to another address through")
	}
}

// RouteHosts admit base-URL routes only: a CONNECT to the same host is
// refused.
func TestRouteHostsAdmitRoutesOnly(t *testing.T) {
	d, srv := newTestDecider(t)
	srv.Set("api.example.com", netip.MustParseAddr("8.8.4.4"))
	h, err := ParseHostRule("api.example.com")
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Mode: Custom, RouteHosts: []HostRule{h}}
	route, err := d.Decide(t.Context(), DecideArgs{Policy: p, Host: "api.example.com", Route: true})
	if err != nil || !route.Allow || route.Code != CodeRouteHost {
		t.Errorf("route: %+v %v, want allowed by the route host", route, err)
	}
	tunnel, err := d.Decide(t.Context(), DecideArgs{Policy: p, Host: "api.example.com"})
	if err != nil || tunnel.Allow || tunnel.Code != CodeNoRule {
		t.Errorf("CONNECT: %+v %v, want refused (no rule)", tunnel, err)
	}
}

// TestDecideRoutes covers what a base-URL route may reach beyond a
// CONNECT tunnel: a base URL's own port, an http base URL (only at an
// address the operator opened), a base URL's IP literal.
func TestDecideRoutes(t *testing.T) {
	d, srv := newTestDecider(t)
	d.AllowPrivate = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	srv.Set("api.example.com", addrs("93.184.216.34")...)
	srv.Set("model.example.com", addrs("127.0.0.9")...)
	origins := func(urls ...string) []Origin {
		var out []Origin
		for _, u := range urls {
			o, ok := OriginOf(u)
			if !ok {
				t.Fatalf("OriginOf(%q) failed", u)
			}
			out = append(out, o)
		}
		return out
	}
	p := Policy{Mode: Custom,
		RouteHosts:   []HostRule{{pattern: "api.example.com"}, {pattern: "model.example.com"}},
		RouteOrigins: origins("https://api.example.com:8443/v1", "http://model.example.com:9/api", "http://127.0.0.1:9/api", "http://api.example.com/x")}
	tests := []struct {
		name         string
		host         string
		port         int
		route, plain bool
		allow        bool
		code         Code
		reason       string
	}{
		{"route to a base URL's own port", "api.example.com", 8443, true, false, true, CodeRouteHost, ""},
		{"CONNECT to that port", "api.example.com", 8443, false, false, false, CodePort, "HTTPS (443) only"},
		{"route to another port", "api.example.com", 8444, true, false, false, CodePort, "api.example.com:8444 is none"},
		{"http route to an opened address", "model.example.com", 9, true, true, true, CodeRouteHost, ""},
		{"http route to a public address", "api.example.com", 80, true, true, false, CodePlainHTTP, "93.184.216.34 is not an address the operator opened"},
		{"http route to an opened IP literal", "127.0.0.1", 9, true, true, true, CodeRouteHost, ""},
		{"http route to an IP literal no base URL names", "127.0.0.1", 80, true, true, false, CodeNoRule, ""},
		{"plain http without a route", "model.example.com", 80, false, true, false, CodePlainHTTP, "only a base-URL route"},
		{"https route to the http base URL's port", "model.example.com", 9, true, false, false, CodePort, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dec, err := d.Decide(context.Background(), DecideArgs{Policy: p, Host: tt.host, Port: tt.port, Route: tt.route, Plain: tt.plain})
			if err != nil {
				t.Fatalf("Decide: %v", err)
			}
			if dec.Allow != tt.allow || dec.Code != tt.code || !strings.Contains(dec.Reason, tt.reason) {
				t.Errorf("Decide = %v %s (%s); want %v %s containing %q", dec.Allow, dec.Code, dec.Reason, tt.allow, tt.code, tt.reason)
			}
		})
	}
	for in, want := range map[string]Origin{
		"https://Api.Example.com/v1": {Host: "api.example.com", Port: 443},
		"http://u:p@127.0.0.1:9/x?y": {Plain: true, Host: "127.0.0.1", Port: 9},
		"https://[::1]:8443":         {Host: "::1", Port: 8443},
		"HTTP://model.example.com#f": {Plain: true, Host: "model.example.com", Port: 80},
	} {
		if got, ok := OriginOf(in); !ok || got != want {
			t.Errorf("OriginOf(%q) = %+v, %v; want %+v", in, got, ok, want)
		}
	}
	for _, in := range []string{"ftp://x.example", "example.com", "https://", "https://a b/"} {
		if got, ok := OriginOf(in); ok {
			t.Errorf("OriginOf(%q) = %+v; want none", in, got)
		}
	}
}
