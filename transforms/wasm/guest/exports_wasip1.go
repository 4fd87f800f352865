//go:build wasip1

package guest

// handleRequest is the ABI's handle_request: it runs the registered
// RequestHandler and packs its answer as ctx_next (reqCtx<<32 | next).
//
//go:wasmexport handle_request
func handleRequest() uint64 {
	return runRequest()
}

// handleResponse is the ABI's handle_response, called by the host after
// the next handler when handle_request returned next=1.
//
//go:wasmexport handle_response
func handleResponse(reqCtx uint32, isError uint32) {
	runResponse(reqCtx, isError != 0)
}

// responseNoop is sandgate's optional export sandgate_response_noop: the
// host calls it once per instance, after initialisation; 1 means
// handle_response does nothing (no ResponseHandler), so the host need not
// keep the instance for it. Other http-wasm hosts ignore it.
//
//go:wasmexport sandgate_response_noop
func responseNoop() uint32 {
	return runResponseNoop()
}
