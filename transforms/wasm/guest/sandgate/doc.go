// Package sandgate binds the functions sandgate's proxy adds to the
// http-wasm handler ABI, in its own host module "sandgate": the id of the
// sandbox whose request is being handled, audit notes, and refusals with a
// reason.
//
// A module that calls none of these imports nothing from "sandgate" (Go
// links only the host functions a module reaches), so it runs unchanged on
// any http-wasm host. One that calls them runs only on sandgate.
//
// Like package guest, these functions are valid only while the host is
// inside handle_request or handle_response, and outside a wasip1 build
// every call panics.
package sandgate
