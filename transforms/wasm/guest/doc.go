// Package guest lets users write http-wasm request-transform modules for
// sandgate in standard Go (GOOS=wasip1 GOARCH=wasm, -buildmode=c-shared),
// without TinyGo.
//
// It binds the guest side of the http-wasm handler ABI
// (https://http-wasm.io/http-handler-abi/): the host module "http_handler"
// and the two exports the host calls, handle_request and handle_response.
// A module written with it runs on any http-wasm host, sandgate's or
// another's, as long as it does not use the sandgate-only functions of the
// sub-package [github.com/sandgate/sandgate/transforms/wasm/guest/sandgate].
//
// A module is a Go reactor: package main with an empty main, and handlers
// registered while the package initialises (the host runs _initialize,
// which runs init functions, before its first call):
//
//	package main
//
//	import "github.com/sandgate/sandgate/transforms/wasm/guest"
//
//	func main() {}
//
//	func init() {
//		value := string(guest.Config())
//		guest.HandleRequest(func(req guest.Request, resp guest.Response) (bool, uint32) {
//			req.Header().Set("x-added", value)
//			return true, 0 // continue to the upstream
//		})
//	}
//
// Build it with
//
//	GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared -o add.wasm .
//
// Every accessor calls the host: nothing is cached except [Config], which
// cannot change for the life of a module. Values the host returns are
// copied into fresh Go strings and slices; a buffer that turns out too
// small is grown to the length the host reported and the call retried, as
// the ABI intends.
//
// The functions of this package are valid only while the host is inside
// handle_request or handle_response (and [EnableFeatures], [Config] and
// [Log] also during initialisation). Outside a wasip1 build there is no
// host: the package compiles everywhere, so that its documentation and
// type checks work on any platform, but every call that would reach the
// host panics there.
package guest
