// Command sandgateonly calls every function of package sandgate and
// nothing else.
package main

import (
	"github.com/sandgate/sandgate/transforms/wasm/guest"
	"github.com/sandgate/sandgate/transforms/wasm/guest/sandgate"
)

func main() {}

func init() {
	guest.HandleRequest(func(guest.Request, guest.Response) (bool, uint32) {
		id := sandgate.SandboxID()
		sandgate.AuditNote(id)
		sandgate.Refuse(403, id)
		return false, 0
	})
}
