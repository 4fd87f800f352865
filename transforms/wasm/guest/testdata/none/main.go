// Command none registers a handler that calls no host function, so that
// its import section shows which http_handler imports are inherent (none).
package main

import "github.com/sandgate/sandgate/transforms/wasm/guest"

func main() {}

func init() {
	guest.HandleRequest(func(guest.Request, guest.Response) (bool, uint32) { return true, 0 })
}
