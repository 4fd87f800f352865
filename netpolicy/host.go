package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"unicode/utf8"

	"golang.org/x/net/idna"
)

// HostError says why a host name cannot be used as a target. Its message
// names the host as given and what is wrong with it.
type HostError struct {
	Host   string // the host as the caller spelled it (truncated when huge)
	Reason string
}

func (e *HostError) Error() string { return fmt.Sprintf("invalid host %q: %s", e.Host, e.Reason) }

// ErrInvalidHost matches every *HostError with errors.Is.
var ErrInvalidHost = errors.New("invalid host")

// Is reports whether target is ErrInvalidHost.
func (e *HostError) Is(target error) bool { return target == ErrInvalidHost }

func hostErr(raw, format string, args ...any) error {
	if len(raw) > 80 {
		raw = raw[:80] + "…"
	}
	return &HostError{Host: raw, Reason: fmt.Sprintf(format, args...)}
}

// idnaProfile converts names to their ASCII (punycode) form the way a
// browser looks them up: UTS #46 mapping, non-transitional, with the
// STD3 and bidi checks on.
var idnaProfile = idna.New(
	idna.MapForLookup(),
	idna.Transitional(false),
	idna.BidiRule(),
	idna.ValidateLabels(true),
	idna.StrictDomainName(true),
	idna.CheckHyphens(true),
	idna.CheckJoiners(true),
)

// Host is a canonical target host: either a name (lowercase ASCII, punycode,
// no trailing dot) or an IP address. Exactly one of Name and Addr is set.
type Host struct {
	Name string
	Addr netip.Addr
}

// IsIP reports whether the host is an IP literal.
func (h Host) IsIP() bool { return h.Addr.IsValid() }

// String is the canonical spelling: the name, or the address (IPv6 without
// brackets).
func (h Host) String() string {
	if h.IsIP() {
		return h.Addr.String()
	}
	return h.Name
}

// CanonicalHost parses a host as a sandbox spelled it (no port) and returns
// its canonical form. Every numeric spelling that a C library or a browser
// would read as an IPv4 address (2130706433, 0x7f.1, 0177.0.0.1, 127.1, 0) is
// returned as that address, never as a name, so the address rules judge it.
// Userinfo, zone identifiers, empty labels and names that are not valid
// IDNA are refused with a *HostError.
func CanonicalHost(raw string) (Host, error) {
	s := raw
	if s == "" {
		return Host{}, hostErr(raw, "empty host")
	}
	if len(s) > 1024 {
		return Host{}, hostErr(raw, "longer than 1024 bytes")
	}
	if !utf8.ValidString(s) {
		return Host{}, hostErr(raw, "not valid UTF-8")
	}
	if strings.Contains(s, "@") {
		return Host{}, hostErr(raw, "userinfo (user@host) is not allowed in a target")
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c == 0x7f || c == '/' || c == '\\' || c == '?' || c == '#' {
			return Host{}, hostErr(raw, "contains the character %q", c)
		}
	}
	if strings.Contains(s, "%") {
		return Host{}, hostErr(raw, "percent-encoding and zone identifiers are not allowed")
	}
	if strings.HasPrefix(s, "[") {
		if !strings.HasSuffix(s, "]") {
			return Host{}, hostErr(raw, "unterminated IPv6 literal")
		}
		a, err := netip.ParseAddr(s[1 : len(s)-1])
		if err != nil || !a.Is6() {
			return Host{}, hostErr(raw, "not a valid IPv6 literal")
		}
		return Host{Addr: a}, nil
	}
	if strings.Contains(s, ":") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return Host{}, hostErr(raw, "contains ':' but is not an IPv6 address (write a port separately)")
		}
		return Host{Addr: a}, nil
	}
	s = strings.TrimSuffix(s, ".")
	if s == "" || strings.HasSuffix(s, ".") {
		return Host{}, hostErr(raw, "empty label")
	}
	if a, ok, err := parseIPv4Spelling(s); err != nil {
		return Host{}, hostErr(raw, "%v", err)
	} else if ok {
		return Host{Addr: a}, nil
	}
	ascii, err := idnaProfile.ToASCII(s)
	if err != nil {
		return Host{}, hostErr(raw, "not a valid host name: %v", err)
	}
	ascii = strings.ToLower(strings.TrimSuffix(ascii, "."))
	if ascii == "" || len(ascii) > 253 {
		return Host{}, hostErr(raw, "name must be 1 to 253 bytes long")
	}
	// After IDNA mapping a name may have turned numeric (fullwidth digits,
	// ideographic full stops): judge it again as an address spelling.
	if a, ok, err := parseIPv4Spelling(ascii); err != nil {
		return Host{}, hostErr(raw, "%v", err)
	} else if ok {
		return Host{Addr: a}, nil
	}
	for _, label := range strings.Split(ascii, ".") {
		if label == "" {
			return Host{}, hostErr(raw, "empty label")
		}
		if len(label) > 63 {
			return Host{}, hostErr(raw, "label longer than 63 bytes")
		}
	}
	return Host{Name: ascii}, nil
}

// parseIPv4Spelling reads s the way inet_aton and the WHATWG URL parser do:
// when the last label is a number (decimal, 0x hex or 0-led octal), the whole
// host is an IPv4 address of one to four parts, and it is an error if it is
// not a valid one. ok is false when s is a name.
func parseIPv4Spelling(s string) (addr netip.Addr, ok bool, err error) {
	parts := strings.Split(s, ".")
	if !isNumericLabel(parts[len(parts)-1]) {
		return netip.Addr{}, false, nil
	}
	if len(parts) > 4 {
		return netip.Addr{}, false, errors.New("numeric host with more than four parts")
	}
	nums := make([]uint64, len(parts))
	for i, p := range parts {
		n, err := parseInetNumber(p)
		if err != nil {
			return netip.Addr{}, false, fmt.Errorf("numeric host part %q: %v", p, err)
		}
		nums[i] = n
	}
	var v uint64
	for i, n := range nums[:len(nums)-1] {
		if n > 255 {
			return netip.Addr{}, false, fmt.Errorf("numeric host part %d exceeds 255", i+1)
		}
		v |= n << (8 * (3 - uint(i)))
	}
	last := nums[len(nums)-1]
	if last >= 1<<(8*(5-uint(len(nums)))) {
		return netip.Addr{}, false, errors.New("numeric host is out of the IPv4 range")
	}
	v |= last
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}), true, nil
}

// isNumericLabel reports whether a label is spelled as a number in any base
// inet_aton accepts (including a bare "0x", which is zero).
func isNumericLabel(l string) bool {
	if l == "" {
		return false
	}
	if len(l) >= 2 && l[0] == '0' && (l[1] == 'x' || l[1] == 'X') {
		for _, c := range l[2:] {
			if !strings.ContainsRune("0123456789abcdefABCDEF", c) {
				return false
			}
		}
		return true
	}
	for _, c := range l {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

func parseInetNumber(p string) (uint64, error) {
	if p == "" {
		return 0, errors.New("empty")
	}
	base := 10
	switch {
	case len(p) >= 2 && (p[:2] == "0x" || p[:2] == "0X"):
		base, p = 16, p[2:]
		if p == "" {
			return 0, nil
		}
	case len(p) > 1 && p[0] == '0':
		base, p = 8, p[1:]
	}
	if len(p) > 32 {
		return 0, errors.New("too long")
	}
	n, err := strconv.ParseUint(p, base, 64)
	if err != nil {
		return 0, fmt.Errorf("not a base-%d number", base)
	}
	return n, nil
}

// SplitHostPort splits "host:port", "[v6]:port" or a bare host (port 0).
// The port must be a decimal number from 1 to 65535.
func SplitHostPort(hostport string) (host string, port int, err error) {
	if strings.HasPrefix(hostport, "[") {
		end := strings.Index(hostport, "]")
		if end < 0 {
			return "", 0, hostErr(hostport, "unterminated IPv6 literal")
		}
		host, rest := hostport[:end+1], hostport[end+1:]
		if rest == "" {
			return host, 0, nil
		}
		if rest[0] != ':' {
			return "", 0, hostErr(hostport, "unexpected text after IPv6 literal")
		}
		p, err := parsePort(rest[1:])
		if err != nil {
			return "", 0, hostErr(hostport, "%v", err)
		}
		return host, p, nil
	}
	i := strings.LastIndex(hostport, ":")
	if i < 0 {
		return hostport, 0, nil
	}
	if strings.Count(hostport, ":") > 1 {
		return hostport, 0, nil // bare IPv6; CanonicalHost judges it
	}
	p, err := parsePort(hostport[i+1:])
	if err != nil {
		return "", 0, hostErr(hostport, "%v", err)
	}
	return hostport[:i], p, nil
}

func parsePort(s string) (int, error) {
	if s == "" || len(s) > 5 {
		return 0, fmt.Errorf("port %q is not a number from 1 to 65535", s)
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("port %q is not a number from 1 to 65535", s)
		}
	}
	n, _ := strconv.Atoi(s)
	if n < 1 || n > 65535 {
		return 0, fmt.Errorf("port %q is not a number from 1 to 65535", s)
	}
	return n, nil
}

// localNameReason says why a canonical name is refused before any lookup, or
// "" when it may be looked up: a cloud's metadata service is never asked
// for. Other local names (single labels, .internal, .local, localhost) are
// looked up like any name a rule allows, and their addresses judged: they
// resolve to private addresses, refused unless the operator opened them.
func localNameReason(name string) string {
	for _, n := range localNames {
		if name == n {
			return "it names a cloud metadata service"
		}
	}
	return ""
}

var localNames = []string{
	"metadata.google.internal", "metadata.goog", "instance-data.ec2.internal",
	"metadata.azure.com", "metadata.tencentyun.com",
}
