package wasm

import (
	"fmt"
	"net/url"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// Limits on what a module may write, beyond the HTTP grammar: the proxy
// must be able to send it, and a module must not be able to make the proxy
// hold unbounded memory.
const (
	maxMethodLen    = 32
	maxURILen       = 8 << 10
	maxHeaderName   = 256
	maxHeaderValue  = 16 << 10
	maxHeaderFields = 1000
	maxReasonLen    = 256
	maxLogLen       = 1024
)

// checkMethod returns why m cannot be sent as a request method, or "".
func checkMethod(m string) string {
	switch {
	case m == "":
		return "set an empty method"
	case len(m) > maxMethodLen:
		return fmt.Sprintf("set a method longer than %d bytes", maxMethodLen)
	case !isToken(m):
		return fmt.Sprintf("set method %q, which is not an HTTP token", clip(m))
	case m == "CONNECT":
		return "set method CONNECT, which a base-URL route cannot carry"
	}
	return ""
}

func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if !httpguts.IsTokenRune(rune(s[i])) {
			return false
		}
	}
	return s != ""
}

// parseURI checks a URI a module set: origin-form ("/path?query"), already
// percent-encoded (visible ASCII only), no fragment, no authority. It
// returns the URL's path parts or why it cannot be sent. A module can
// never change the destination host: that was decided by policy.
func parseURI(s string) (*url.URL, string) {
	if s == "" {
		s = "/" // the ABI: an empty URI is "/"
	}
	if len(s) > maxURILen {
		return nil, fmt.Sprintf("set a URI longer than %d bytes", maxURILen)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f {
			return nil, fmt.Sprintf("set URI %q with byte %#02x; a URI must be percent-encoded ASCII", clip(s), c)
		}
	}
	if s[0] != '/' || strings.HasPrefix(s, "//") {
		return nil, fmt.Sprintf("set URI %q, which is not origin-form (/path?query); a module cannot change the destination host", clip(s))
	}
	if strings.Contains(s, "#") {
		return nil, fmt.Sprintf("set URI %q with a fragment, which is never sent", clip(s))
	}
	u, err := url.ParseRequestURI(s)
	if err != nil || u.Host != "" || u.Scheme != "" || u.Opaque != "" || u.User != nil {
		return nil, fmt.Sprintf("set URI %q, which is not a valid origin-form URI", clip(s))
	}
	return u, ""
}

// hopByHop are headers that describe one connection, which the proxy
// manages itself (RFC 9110 §7.6.1), plus Expect.
var hopByHop = map[string]bool{
	"connection": true, "keep-alive": true, "te": true, "trailer": true,
	"transfer-encoding": true, "upgrade": true, "expect": true,
	"proxy-connection": true,
}

// checkHeaderName returns why name cannot be written by a module, or "".
func checkHeaderName(name string) string {
	lname := strings.ToLower(name)
	switch {
	case name == "":
		return "wrote a header with an empty name"
	case len(name) > maxHeaderName:
		return fmt.Sprintf("wrote a header name longer than %d bytes", maxHeaderName)
	case !httpguts.ValidHeaderFieldName(name):
		return fmt.Sprintf("wrote header name %q, which is not an HTTP token", clip(name))
	case lname == "host":
		return "wrote the Host header; a module cannot change the destination host"
	case hopByHop[lname] || strings.HasPrefix(lname, "proxy-"):
		return fmt.Sprintf("wrote %s, a hop-by-hop header the proxy manages", name)
	}
	return ""
}

// checkHeaderValue returns why value cannot be sent, or "".
func checkHeaderValue(name, value string) string {
	switch {
	case len(value) > maxHeaderValue:
		return fmt.Sprintf("wrote a %s value longer than %d bytes", name, maxHeaderValue)
	case !httpguts.ValidHeaderFieldValue(value):
		return fmt.Sprintf("wrote a %s value with a control character (CR, LF, NUL…)", name)
	}
	return ""
}

// clip shortens s for an error message and keeps it printable.
func clip(s string) string {
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}
