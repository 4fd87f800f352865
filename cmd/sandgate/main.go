// Command sandgate is the egress-controlled sandbox appliance: the egress
// proxy, the snapshot tools and, later, the sandbox service, in one binary.
// main only wires: every verb lives in this package's builders and the logic
// in the packages they call.
package main

import (
	"os"

	"github.com/sandgate/sandgate/appliance/localbox"
)

func main() {
	if localbox.IsInit() { // a sandbox's init, re-executed by `sandbox run`
		localbox.InitMain()
	}
	os.Exit(run(os.Args, os.Stdout, os.Stderr))
}
