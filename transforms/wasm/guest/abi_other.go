//go:build !wasip1

package guest

import "unsafe"

// Outside a wasip1 build there is no http-wasm host to call. These
// definitions keep the package compiling (for documentation, type checks
// and vet on every platform) and make any call that would reach the host
// fail loudly instead of returning made-up values.

// errNoHost is the panic value of every host call outside wasip1.
const errNoHost = "guest: no http-wasm host: build the module with GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared"

func hostEnableFeatures(uint32) uint32                                  { panic(errNoHost) }
func hostGetConfig(unsafe.Pointer, uint32) uint32                       { panic(errNoHost) }
func hostLog(int32, string)                                             { panic(errNoHost) }
func hostLogEnabled(int32) uint32                                       { panic(errNoHost) }
func hostGetMethod(unsafe.Pointer, uint32) uint32                       { panic(errNoHost) }
func hostSetMethod(string)                                              { panic(errNoHost) }
func hostGetURI(unsafe.Pointer, uint32) uint32                          { panic(errNoHost) }
func hostSetURI(string)                                                 { panic(errNoHost) }
func hostGetProtocolVersion(unsafe.Pointer, uint32) uint32              { panic(errNoHost) }
func hostGetSourceAddr(unsafe.Pointer, uint32) uint32                   { panic(errNoHost) }
func hostGetHeaderNames(uint32, unsafe.Pointer, uint32) uint64          { panic(errNoHost) }
func hostGetHeaderValues(uint32, string, unsafe.Pointer, uint32) uint64 { panic(errNoHost) }
func hostSetHeaderValue(uint32, string, string)                         { panic(errNoHost) }
func hostAddHeaderValue(uint32, string, string)                         { panic(errNoHost) }
func hostRemoveHeader(uint32, string)                                   { panic(errNoHost) }
func hostReadBody(uint32, unsafe.Pointer, uint32) uint64                { panic(errNoHost) }
func hostWriteBody(uint32, unsafe.Pointer, uint32)                      { panic(errNoHost) }
func hostGetStatusCode() uint32                                         { panic(errNoHost) }
func hostSetStatusCode(uint32)                                          { panic(errNoHost) }
