// Command loop is the bench's misbehaving http-wasm module: it loops
// forever on every request whose path starts with the prefix in its config
// (default "/loop"), and lets every other request through untouched. The
// host must stop it at its time limit, fail only that request, and keep
// serving everyone else; bench/wasm measures what the loops cost the rest.
package main

import (
	"strings"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
)

func main() {}

// spins counts loop iterations; a side effect keeps the loop from being
// compiled away.
var spins uint64

func init() {
	prefix := strings.TrimSpace(string(guest.Config()))
	if prefix == "" {
		prefix = "/loop"
	}
	guest.HandleRequest(func(req guest.Request, _ guest.Response) (bool, uint32) {
		if strings.HasPrefix(req.URI(), prefix) {
			for {
				spins++
			}
		}
		return true, 0
	})
}
