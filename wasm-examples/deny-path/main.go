// Command deny-path is an http-wasm module for sandgate that refuses every
// request whose path matches a regular expression from its config, with
// 403 and a reason that the audit event records.
//
// Config (config.txt, passed inline after "?"): an RE2 regular expression
// matched against the request path (without the query string), unanchored:
// write ^…$ to anchor it. An empty or invalid expression refuses the module
// at load.
//
// It imports sandgate.refuse, so it runs only on sandgate's proxy.
package main

import (
	"regexp"
	"strings"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
	"github.com/sandgate/sandgate/transforms/wasm/guest/sandgate"
)

func main() {}

func init() {
	pattern := strings.TrimSpace(string(guest.Config()))
	if pattern == "" {
		guest.Abort(`deny-path: config must be a regular expression for the paths to refuse, e.g. "^/admin(/|$)"`)
	}
	deny, err := regexp.Compile(pattern)
	if err != nil {
		guest.Abort("deny-path: config: " + err.Error())
	}
	guest.HandleRequest(func(req guest.Request, _ guest.Response) (bool, uint32) {
		path, _, _ := strings.Cut(req.URI(), "?")
		if deny.MatchString(path) {
			sandgate.Refuse(403, "path "+path+" matches the deny pattern "+pattern)
			return false, 0
		}
		return true, 0
	})
}
