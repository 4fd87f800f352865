// Command all calls every function of package guest, so that its import
// section lists every http_handler function the library binds.
package main

import (
	"io"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
)

func main() {}

func init() {
	guest.EnableFeatures(guest.FeatureBufferRequest)
	guest.HandleRequest(func(req guest.Request, resp guest.Response) (bool, uint32) {
		guest.Log(guest.LogInfo, string(guest.Config()))
		if guest.LogEnabled(guest.LogDebug) {
			guest.Log(guest.LogDebug, req.ProtocolVersion()+req.SourceAddr())
		}
		req.SetMethod(req.Method())
		req.SetURI(req.URI())
		h := req.Header()
		for _, n := range h.Names() {
			h.Set(n, h.Get(n))
		}
		h.Add("x-a", "1")
		h.Del("x-b")
		b, _ := io.ReadAll(req.Body())
		req.Body().Write(b)
		resp.SetStatusCode(resp.StatusCode())
		return true, 0
	})
	guest.HandleResponse(func(uint32, guest.Request, guest.Response, bool) {})
}
