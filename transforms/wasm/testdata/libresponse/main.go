// Command libresponse is a guest built with package guest whose response
// handler depends on its config: "none" registers none, "response" one
// that sets X-Resp: 1 on every response, and "late" registers one only
// while handling a request (which the library refuses with a panic).
package main

import (
	"github.com/sandgate/sandgate/transforms/wasm/guest"
)

func main() {}

func setResp(_ uint32, _ guest.Request, resp guest.Response, _ bool) {
	resp.Header().Set("X-Resp", "1")
}

func init() {
	mode := string(guest.Config())
	guest.HandleRequest(func(req guest.Request, _ guest.Response) (bool, uint32) {
		if mode == "late" {
			guest.HandleResponse(setResp)
		}
		req.Header().Set("X-Req", mode)
		return true, 0
	})
	if mode == "response" {
		guest.HandleResponse(setResp)
	}
}
