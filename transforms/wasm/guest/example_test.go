//go:build !wasip1

package guest_test

import (
	"fmt"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
)

// A module's handlers are registered while it initialises; in package main
// this is func init, next to an empty func main. Outside a wasm build only
// the values of the package can be shown running.
func ExampleFeatures() {
	f := guest.FeatureBufferRequest | guest.FeatureTrailers
	fmt.Println(f, f.Has(guest.FeatureBufferRequest), f.Has(guest.FeatureBufferResponse))
	// Output: buffer_request|trailers true false
}
