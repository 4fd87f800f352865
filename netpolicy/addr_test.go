package netpolicy

import (
	"net/netip"
	"strings"
	"testing"
)

func TestClassify(t *testing.T) {
	tests := []struct {
		addr string
		want Class
	}{
		{"0.0.0.0", Unspecified},
		{"0.1.2.3", Unspecified},
		{"127.0.0.1", Loopback},
		{"127.255.255.254", Loopback},
		{"10.0.0.5", Private},
		{"172.16.0.1", Private},
		{"172.31.255.255", Private},
		{"192.168.1.1", Private},
		{"100.64.0.1", CGNAT},
		{"100.127.255.255", CGNAT},
		{"169.254.1.1", LinkLocal},
		{"169.254.169.254", Metadata},
		{"169.254.170.2", Metadata},
		{"168.63.129.16", Metadata},
		{"100.100.100.200", Metadata},
		{"fd00:ec2::254", Metadata},
		{"192.0.0.192", Reserved},
		{"192.0.0.8", Reserved},
		{"192.0.2.1", Documentation},
		{"198.18.0.1", Benchmarking},
		{"198.19.255.255", Benchmarking},
		{"224.0.0.1", Multicast},
		{"239.255.255.250", Multicast},
		{"240.0.0.1", Reserved},
		{"255.255.255.255", Broadcast},
		{"::", Unspecified},
		{"::1", Loopback},
		{"fc00::1", ULA},
		{"fd12:3456::1", ULA},
		{"fe80::1", LinkLocal},
		{"fec0::1", SiteLocal},
		{"ff02::1", Multicast},
		{"2001:db8::1", Documentation},
		{"100::1", Reserved},
		{"::2:3:4:5", Reserved}, // not global unicast
		// IPv4 embedded in IPv6, judged by the IPv4 inside
		{"::ffff:127.0.0.1", Loopback},
		{"::ffff:10.0.0.1", Private},
		{"::ffff:169.254.169.254", Metadata},
		{"::127.0.0.1", Loopback},
		{"::ffff:0:7f00:1", Loopback}, // SIIT translated
		{"64:ff9b::127.0.0.1", Loopback},
		{"64:ff9b::a9fe:a9fe", Metadata},
		{"64:ff9b::10.1.2.3", Private},
		{"64:ff9b:1::1", Embedded},
		{"64:ff9b:1:ffff::808:808", Embedded},
		{"2002:7f00:1::", Loopback},
		{"2002:a00:1::1", Private},
		{"2002:a9fe:a9fe::", Metadata},
		{"2001:0:4136:e378:8000:63bf:80ff:fffe", Loopback}, // Teredo client 127.0.0.1
		{"2001:0:a00:1::1", Private},                       // Teredo server 10.0.0.1
		{"2001:2::1", Benchmarking},
		{"2001:10::1", Reserved},
		// public
		{"8.8.8.8", Public},
		{"1.1.1.1", Public},
		{"172.32.0.1", Public},
		{"100.128.0.1", Public},
		{"2606:4700::1111", Public},
		{"::ffff:8.8.8.8", Public},
		{"64:ff9b::808:808", Public},
		{"2002:808:808::1", Public},
	}
	for _, tt := range tests {
		a := netip.MustParseAddr(tt.addr)
		got, why := Classify(a)
		if got != tt.want {
			t.Errorf("Classify(%s) = %q (%s), want %q", tt.addr, got, why, tt.want)
		}
		if got != Public && !strings.Contains(why, a.String()) {
			t.Errorf("Classify(%s) explanation %q does not name the address", tt.addr, why)
		}
	}
}

func TestClassifyZoned(t *testing.T) {
	a := netip.MustParseAddr("2606:4700::1111%eth0")
	if c, _ := Classify(a); c != Zoned {
		t.Errorf("Classify(%s) = %q, want %q", a, c, Zoned)
	}
}
