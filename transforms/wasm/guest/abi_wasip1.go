//go:build wasip1

package guest

import "unsafe"

// The imports of host module "http_handler", exactly as the http-wasm
// handler ABI declares them. Go links only the functions a module reaches,
// so a module imports only what it uses.

//go:wasmimport http_handler enable_features
func hostEnableFeatures(features uint32) uint32

//go:wasmimport http_handler get_config
func hostGetConfig(buf unsafe.Pointer, limit uint32) uint32

//go:wasmimport http_handler log
func hostLog(level int32, msg string)

//go:wasmimport http_handler log_enabled
func hostLogEnabled(level int32) uint32

//go:wasmimport http_handler get_method
func hostGetMethod(buf unsafe.Pointer, limit uint32) uint32

//go:wasmimport http_handler set_method
func hostSetMethod(method string)

//go:wasmimport http_handler get_uri
func hostGetURI(buf unsafe.Pointer, limit uint32) uint32

//go:wasmimport http_handler set_uri
func hostSetURI(uri string)

//go:wasmimport http_handler get_protocol_version
func hostGetProtocolVersion(buf unsafe.Pointer, limit uint32) uint32

//go:wasmimport http_handler get_source_addr
func hostGetSourceAddr(buf unsafe.Pointer, limit uint32) uint32

//go:wasmimport http_handler get_header_names
func hostGetHeaderNames(kind uint32, buf unsafe.Pointer, limit uint32) uint64

//go:wasmimport http_handler get_header_values
func hostGetHeaderValues(kind uint32, name string, buf unsafe.Pointer, limit uint32) uint64

//go:wasmimport http_handler set_header_value
func hostSetHeaderValue(kind uint32, name, value string)

//go:wasmimport http_handler add_header_value
func hostAddHeaderValue(kind uint32, name, value string)

//go:wasmimport http_handler remove_header
func hostRemoveHeader(kind uint32, name string)

//go:wasmimport http_handler read_body
func hostReadBody(kind uint32, buf unsafe.Pointer, limit uint32) uint64

//go:wasmimport http_handler write_body
func hostWriteBody(kind uint32, buf unsafe.Pointer, n uint32)

//go:wasmimport http_handler get_status_code
func hostGetStatusCode() uint32

//go:wasmimport http_handler set_status_code
func hostSetStatusCode(code uint32)
