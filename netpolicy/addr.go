package netpolicy

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// Class names the kind of address a destination is. Every class but Public
// is refused whatever a policy says, unless an operator exempts the address
// (Decider.AllowPrivate).
type Class string

// The address classes. The string is the adjective used in reasons:
// "resolves only to private addresses (10.0.0.5)".
const (
	Public        Class = "public"
	Unspecified   Class = "unspecified"
	Loopback      Class = "loopback"
	Private       Class = "private"
	CGNAT         Class = "carrier-grade NAT"
	LinkLocal     Class = "link-local"
	Metadata      Class = "cloud metadata"
	ULA           Class = "unique local"
	SiteLocal     Class = "site-local"
	Multicast     Class = "multicast"
	Broadcast     Class = "broadcast"
	Reserved      Class = "reserved"
	Benchmarking  Class = "benchmarking"
	Documentation Class = "documentation"
	Embedded      Class = "unjudgeable IPv4-embedding"
	Zoned         Class = "zoned"
)

type classRange struct {
	prefix netip.Prefix
	class  Class
}

func mustRanges(pairs ...any) []classRange {
	out := make([]classRange, 0, len(pairs)/2)
	for i := 0; i < len(pairs); i += 2 {
		out = append(out, classRange{netip.MustParsePrefix(pairs[i].(string)), pairs[i+1].(Class)})
	}
	return out
}

// metadataAddrs are the instance metadata endpoints of the major clouds.
// They fall in refused ranges anyway; naming them gives a sharper reason.
var metadataAddrs = map[netip.Addr]bool{
	netip.MustParseAddr("169.254.169.254"): true, // AWS, GCP, Azure, OpenStack, …
	netip.MustParseAddr("169.254.170.2"):   true, // AWS ECS task metadata
	netip.MustParseAddr("168.63.129.16"):   true, // Azure wire server
	netip.MustParseAddr("100.100.100.200"): true, // Alibaba Cloud
	netip.MustParseAddr("fd00:ec2::254"):   true, // AWS IMDS over IPv6
}

// v4Ranges are the IPv4 special-purpose ranges (RFC 6890 and its updates)
// that a sandbox must never reach. Order matters only for overlaps: the
// first match names the class.
var v4Ranges = mustRanges(
	"0.0.0.0/8", Unspecified,
	"127.0.0.0/8", Loopback,
	"10.0.0.0/8", Private,
	"172.16.0.0/12", Private,
	"192.168.0.0/16", Private,
	"100.64.0.0/10", CGNAT,
	"169.254.0.0/16", LinkLocal,
	"192.0.0.0/24", Reserved, // IETF protocol assignments, incl. 192.0.0.192
	"192.0.2.0/24", Documentation,
	"198.51.100.0/24", Documentation,
	"203.0.113.0/24", Documentation,
	"192.88.99.0/24", Reserved, // 6to4 relay anycast (deprecated)
	"198.18.0.0/15", Benchmarking,
	"224.0.0.0/4", Multicast,
	"255.255.255.255/32", Broadcast,
	"240.0.0.0/4", Reserved,
)

// v6Ranges are the IPv6 ranges refused outright. The forms that embed an
// IPv4 address are decoded before these apply (see embeddedV4).
var v6Ranges = mustRanges(
	"::/128", Unspecified,
	"::1/128", Loopback,
	"64:ff9b:1::/48", Embedded, // local-use NAT64: the IPv4 position depends on an unknown prefix length
	"100::/64", Reserved, // discard-only
	"2001:2::/48", Benchmarking,
	"2001:db8::/32", Documentation,
	"3fff::/20", Documentation,
	"2001::/23", Reserved, // IETF protocol assignments (Teredo is decoded first)
	"5f00::/16", Reserved, // SRv6 SIDs
	"fc00::/7", ULA,
	"fe80::/10", LinkLocal,
	"fec0::/10", SiteLocal,
	"ff00::/8", Multicast,
)

var (
	globalUnicast6 = netip.MustParsePrefix("2000::/3")
	mapped6        = netip.MustParsePrefix("::ffff:0:0/96")
	translated6    = netip.MustParsePrefix("::ffff:0:0:0/96")
	compatible6    = netip.MustParsePrefix("::/96")
	nat64          = netip.MustParsePrefix("64:ff9b::/96")
	sixToFour      = netip.MustParsePrefix("2002::/16")
	teredo         = netip.MustParsePrefix("2001::/32")
)

// embeddedV4 returns the IPv4 addresses an IPv6 address carries (mapped,
// compatible, SIIT-translated, NAT64 well-known prefix, 6to4, Teredo server
// and client) and a name for the form. ok is false when a carries none.
func embeddedV4(a netip.Addr) (v4 []netip.Addr, form string, ok bool) {
	b := a.As16()
	last4 := netip.AddrFrom4([4]byte(b[12:16]))
	switch {
	case mapped6.Contains(a):
		return []netip.Addr{last4}, "IPv4-mapped", true
	case translated6.Contains(a):
		return []netip.Addr{last4}, "IPv4-translated", true
	case compatible6.Contains(a) && a != netip.IPv6Unspecified() && a != netip.IPv6Loopback():
		return []netip.Addr{last4}, "IPv4-compatible", true
	case nat64.Contains(a):
		return []netip.Addr{last4}, "NAT64", true
	case sixToFour.Contains(a):
		return []netip.Addr{netip.AddrFrom4([4]byte(b[2:6]))}, "6to4", true
	case teredo.Contains(a):
		server := netip.AddrFrom4([4]byte(b[4:8]))
		c := binary.BigEndian.Uint32(b[12:16]) ^ 0xffffffff
		var cb [4]byte
		binary.BigEndian.PutUint32(cb[:], c)
		return []netip.Addr{server, netip.AddrFrom4(cb)}, "Teredo", true
	}
	return nil, "", false
}

// Classify says which class an address belongs to, and for refused classes a
// short explanation naming the address ("10.0.0.5 is a private address",
// "::ffff:127.0.0.1 carries 127.0.0.1, a loopback address"). An IPv6 form
// that embeds an IPv4 address is judged by the IPv4 address inside.
func Classify(a netip.Addr) (Class, string) {
	if !a.IsValid() {
		return Reserved, "invalid address"
	}
	if a.Zone() != "" {
		return Zoned, fmt.Sprintf("%s has a zone; zoned addresses are local", a)
	}
	if metadataAddrs[a] {
		return Metadata, fmt.Sprintf("%s is a cloud metadata address", a)
	}
	if a.Is4() {
		for _, r := range v4Ranges {
			if r.prefix.Contains(a) {
				return r.class, fmt.Sprintf("%s is %s %s address", a, article(r.class), r.class)
			}
		}
		return Public, ""
	}
	if v4s, form, ok := embeddedV4(a); ok {
		for _, v4 := range v4s {
			if c, _ := Classify(v4); c != Public {
				return c, fmt.Sprintf("%s is %s %s address carrying %s, %s %s address", a, articleFor(form), form, v4, article(c), c)
			}
		}
		return Public, ""
	}
	for _, r := range v6Ranges {
		if r.prefix.Contains(a) {
			return r.class, fmt.Sprintf("%s is %s %s address", a, article(r.class), r.class)
		}
	}
	if !globalUnicast6.Contains(a) {
		return Reserved, fmt.Sprintf("%s is outside IPv6 global unicast space", a)
	}
	return Public, ""
}

func article(c Class) string {
	if c == ULA { // "a unique local"
		return "a"
	}
	return articleFor(string(c))
}

// articleFor is "an" before a vowel sound, as the class and form names
// here are spelled.
func articleFor(word string) string {
	switch word[0] {
	case 'a', 'e', 'i', 'o', 'u', 'I':
		return "an"
	}
	return "a"
}
