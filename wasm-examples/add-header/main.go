// Command add-header is an http-wasm module that sets one request header,
// named and valued by its config, on every request it sees.
//
// Config (config.txt, passed inline after "?"): "Name: value", e.g.
// "X-Sandgate-Example: added by add-header". An empty value is allowed; a
// missing colon or an invalid name refuses the module at load.
//
// It imports nothing from sandgate, so it runs on any http-wasm host.
package main

import (
	"strconv"
	"strings"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
)

func main() {}

func init() {
	name, value, err := parseConfig(string(guest.Config()))
	if err != nil {
		// Aborting while the module initialises makes the host refuse it
		// at load, with this message, instead of running it misconfigured.
		guest.Abort("add-header: " + err.Error())
	}
	guest.HandleRequest(func(req guest.Request, _ guest.Response) (bool, uint32) {
		req.Header().Set(name, value)
		return true, 0
	})
}

// configError is a config the module cannot use.
type configError string

func (e configError) Error() string { return string(e) }

// parseConfig reads "Name: value". The value is trimmed of surrounding
// spaces, as in an HTTP header line.
func parseConfig(cfg string) (name, value string, err error) {
	cfg = strings.TrimSpace(cfg)
	name, value, ok := strings.Cut(cfg, ":")
	if !ok {
		return "", "", configError(`config must be "Name: value", e.g. "X-Example: 1"; got ` + strconv.Quote(cfg))
	}
	name, value = strings.TrimSpace(name), strings.TrimSpace(value)
	if !validName(name) {
		return "", "", configError("header name " + strconv.Quote(name) + " is not an HTTP token")
	}
	if strings.ContainsAny(value, "\r\n\x00") {
		return "", "", configError("header value must not contain CR, LF or NUL")
	}
	return name, value, nil
}

// validName reports whether s is an HTTP token (RFC 9110 tchar), the only
// form a header name may take.
func validName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}
