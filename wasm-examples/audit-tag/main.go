// Command audit-tag is an http-wasm module for sandgate that copies the
// value of one request header into the request's audit event, so that
// egress can be traced back to, say, the ticket or task that caused it.
//
// Config (config.txt, passed inline after "?"): the header name, e.g.
// "X-Task-Id". Requests without the header pass untagged. The header itself
// is sent on unchanged.
//
// It imports sandgate.audit_note, so it runs only on sandgate's proxy.
package main

import (
	"strings"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
	"github.com/sandgate/sandgate/transforms/wasm/guest/sandgate"
)

func main() {}

func init() {
	name := strings.ToLower(strings.TrimSpace(string(guest.Config())))
	if name == "" || strings.ContainsAny(name, " \t\r\n:\x00") {
		guest.Abort(`audit-tag: config must be the name of the header to record, e.g. "X-Task-Id"; got "` + name + `"`)
	}
	guest.HandleRequest(func(req guest.Request, _ guest.Response) (bool, uint32) {
		for _, v := range req.Header().Values(name) {
			sandgate.AuditNote(name + "=" + v)
		}
		return true, 0
	})
}
