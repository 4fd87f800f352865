// Command sandgate is the egress-controlled sandbox appliance: the egress
// proxy, the snapshot tools and, later, the sandbox service, in one binary.
// main only wires: every verb lives in this package's builders and the logic
// in the packages they call.
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args, os.Stdout, os.Stderr))
}
