// Command redact-body is an http-wasm module that replaces every match of a
// regular expression in request bodies before they leave the sandbox: for
// example, to keep personal data out of prompts sent to an API.
//
// Config (config.txt, passed inline after "?"): "REGEX => REPLACEMENT".
// REGEX is RE2; REPLACEMENT may use $1-style references to groups (Go's
// regexp.Expand syntax). An invalid config refuses the module at load.
//
// The module enables buffer_request at load, so the host holds each request
// body for it to read and the upstream receives the redacted body. It
// imports nothing from sandgate, so it runs on any http-wasm host.
package main

import (
	"io"
	"regexp"
	"strings"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
)

func main() {}

func init() {
	pattern, replacement, ok := strings.Cut(strings.TrimSpace(string(guest.Config())), "=>")
	pattern, replacement = strings.TrimSpace(pattern), strings.TrimSpace(replacement)
	if !ok || pattern == "" {
		guest.Abort(`redact-body: config must be "REGEX => REPLACEMENT", e.g. "sk-[A-Za-z0-9]+ => [key]"`)
	}
	re, err := regexp.Compile(pattern)
	if err != nil {
		guest.Abort("redact-body: config: " + err.Error())
	}
	if got := guest.EnableFeatures(guest.FeatureBufferRequest); !got.Has(guest.FeatureBufferRequest) {
		guest.Abort("redact-body: the host cannot buffer request bodies (enabled: " + got.String() + ")")
	}
	repl := []byte(replacement)
	guest.HandleRequest(func(req guest.Request, _ guest.Response) (bool, uint32) {
		body, err := io.ReadAll(req.Body())
		if err != nil {
			guest.Abort("redact-body: reading the request body: " + err.Error())
		}
		if !re.Match(body) {
			return true, 0 // leave the body as the sandbox sent it
		}
		req.Body().Write(re.ReplaceAll(body, repl))
		guest.Log(guest.LogInfo, "redact-body: redacted the request body")
		return true, 0
	})
}
