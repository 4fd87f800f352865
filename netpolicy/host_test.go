package netpolicy

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
)

func TestCanonicalHost(t *testing.T) {
	tests := []struct {
		in       string
		wantName string
		wantAddr string
	}{
		{"example.com", "example.com", ""},
		{"Example.COM", "example.com", ""},
		{"example.com.", "example.com", ""},
		{"bücher.example", "xn--bcher-kva.example", ""},
		{"BÜCHER.example", "xn--bcher-kva.example", ""},
		{"xn--bcher-kva.example", "xn--bcher-kva.example", ""},
		{"exаmple.com", "xn--exmple-4nf.com", ""}, // Cyrillic а
		{"a-b.c", "a-b.c", ""},
		// every numeric spelling is the address it spells
		{"127.0.0.1", "", "127.0.0.1"},
		{"2130706433", "", "127.0.0.1"},
		{"0x7f.1", "", "127.0.0.1"},
		{"0x7f000001", "", "127.0.0.1"},
		{"0177.0.0.1", "", "127.0.0.1"},
		{"0177.0.0.01", "", "127.0.0.1"},
		{"127.1", "", "127.0.0.1"},
		{"127.0.1", "", "127.0.0.1"},
		{"0", "", "0.0.0.0"},
		{"0x", "", "0.0.0.0"},
		{"0x0.0", "", "0.0.0.0"},
		{"017700000001", "", "127.0.0.1"},
		{"127.0.0.1.", "", "127.0.0.1"},
		{"0xA9.0xFE.0xA9.0xFE", "", "169.254.169.254"},
		{"169.254.43518", "", "169.254.169.254"},
		{"２１３０７０６４３３", "", "127.0.0.1"}, // fullwidth digits map to ASCII
		{"127。0。0。1", "", "127.0.0.1"},  // ideographic full stops
		{"[::1]", "", "::1"},
		{"::1", "", "::1"},
		{"[::ffff:127.0.0.1]", "", "::ffff:127.0.0.1"},
		{"[0:0:0:0:0:ffff:7f00:1]", "", "::ffff:127.0.0.1"},
		{"1.2.3.4", "", "1.2.3.4"},
		{"a.1", "", ""}, // numeric last label with a non-numeric part: error
	}
	for _, tt := range tests {
		h, err := CanonicalHost(tt.in)
		if tt.wantName == "" && tt.wantAddr == "" {
			if err == nil {
				t.Errorf("CanonicalHost(%q) = %v, want error", tt.in, h)
			}
			continue
		}
		if err != nil {
			t.Errorf("CanonicalHost(%q): %v", tt.in, err)
			continue
		}
		if tt.wantName != "" && (h.Name != tt.wantName || h.IsIP()) {
			t.Errorf("CanonicalHost(%q) = %v, want name %q", tt.in, h, tt.wantName)
		}
		if tt.wantAddr != "" && h.Addr != netip.MustParseAddr(tt.wantAddr) {
			t.Errorf("CanonicalHost(%q) = %v, want address %s", tt.in, h, tt.wantAddr)
		}
	}
}

func TestCanonicalHostRefuses(t *testing.T) {
	for _, in := range []string{
		"", ".", "..", "a..b", "user@example.com", "user:pass@example.com", "@example.com",
		"exa mple.com", "example.com\x00", "exam\nple.com", "example.com/", "ex\\ample.com",
		"example.com?", "example.com#", "%65xample.com", "[fe80::1%25eth0]", "fe80::1%eth0",
		"[::1", "[1.2.3.4]", "1.2.3.256", "256.1", "1.2.3.4.5", "0x100.0.0.1", "1.16777216",
		"4294967296", "09.1.1.1", "0x7g.1", "a.b:c", strings.Repeat("a", 64) + ".com",
		strings.Repeat("a.", 130) + "com", "-a.com", "a_b.com", "xn--.com",
		"a\u200db.com", strings.Repeat("x", 2000),
	} {
		if h, err := CanonicalHost(in); err == nil {
			t.Errorf("CanonicalHost(%q) = %v, want error", in, h)
		} else if !errors.Is(err, ErrInvalidHost) {
			t.Errorf("CanonicalHost(%q) error %v is not ErrInvalidHost", in, err)
		}
	}
}

func TestSplitHostPort(t *testing.T) {
	tests := []struct {
		in, host string
		port     int
		bad      bool
	}{
		{"example.com:443", "example.com", 443, false},
		{"example.com", "example.com", 0, false},
		{"[::1]:443", "[::1]", 443, false},
		{"[::1]", "[::1]", 0, false},
		{"::1", "::1", 0, false},
		{"example.com:0", "", 0, true},
		{"example.com:65536", "", 0, true},
		{"example.com:+443", "", 0, true},
		{"example.com:0443", "example.com", 443, false},
		{"example.com:", "", 0, true},
		{"[::1]x", "", 0, true},
		{"[::1:443", "", 0, true},
	}
	for _, tt := range tests {
		h, p, err := SplitHostPort(tt.in)
		if tt.bad {
			if err == nil {
				t.Errorf("SplitHostPort(%q) = %q, %d, want error", tt.in, h, p)
			}
			continue
		}
		if err != nil || h != tt.host || p != tt.port {
			t.Errorf("SplitHostPort(%q) = %q, %d, %v; want %q, %d", tt.in, h, p, err, tt.host, tt.port)
		}
	}
}

func FuzzCanonicalHost(f *testing.F) {
	for _, s := range []string{"example.com", "2130706433", "0x7f.1", "[::ffff:127.0.0.1]", "bücher.example", "127。0。0。1", "a..b", "xn--bcher-kva.example"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		h, err := CanonicalHost(in)
		if err != nil {
			return
		}
		if h.IsIP() == (h.Name != "") {
			t.Fatalf("CanonicalHost(%q) = %+v: exactly one of Name and Addr must be set", in, h)
		}
		// Canonical form is a fixed point.
		h2, err := CanonicalHost(h.String())
		if err != nil {
			t.Fatalf("CanonicalHost(%q) = %q, which does not parse again: %v", in, h, err)
		}
		if h2 != h {
			t.Fatalf("CanonicalHost(%q) = %v, but again gives %v", in, h, h2)
		}
		if !h.IsIP() {
			if _, ok, _ := parseIPv4Spelling(h.Name); ok {
				t.Fatalf("CanonicalHost(%q) returned name %q that spells an address", in, h.Name)
			}
			for _, c := range []byte(h.Name) {
				if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.') {
					t.Fatalf("CanonicalHost(%q) = %q contains %q", in, h.Name, c)
				}
			}
		}
	})
}
