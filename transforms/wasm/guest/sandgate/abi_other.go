//go:build !wasip1

package sandgate

import "unsafe"

// Outside a wasip1 build there is no host; see package guest's abi_other.go.

const errNoHost = "sandgate: no http-wasm host: build the module with GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared"

func hostSandboxID(unsafe.Pointer, uint32) uint32 { panic(errNoHost) }
func hostAuditNote(string)                        { panic(errNoHost) }
func hostRefuse(uint32, string)                   { panic(errNoHost) }
