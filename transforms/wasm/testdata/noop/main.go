// Command noop is the smallest Go guest: it continues every request and
// sets one header, for benchmarks of the host's per-call cost.
package main

import "unsafe"

//go:wasmimport http_handler set_header_value
func setHeaderValue(kind, name, nameLen, value, valueLen uint32)

var name, value = []byte("X-Noop"), []byte("1")

//go:wasmexport handle_request
func handleRequest() int64 {
	setHeaderValue(0, uint32(uintptr(unsafe.Pointer(&name[0]))), uint32(len(name)), uint32(uintptr(unsafe.Pointer(&value[0]))), uint32(len(value)))
	return 1
}

//go:wasmexport handle_response
func handleResponse(reqCtx, isError int32) {}

func main() {}
