// Package wasm runs user-written request-transform modules: WebAssembly
// guests of the http-wasm handler ABI (https://http-wasm.io), hosted on
// wazero, that the egress proxy applies to base-URL routes before the
// secret swap. A module sees placeholders only, never a secret, and can add
// or strip headers, rewrite the path, replace a body, answer or refuse the
// request, and attach notes to the request's audit event.
//
// The pieces:
//
//   - [Runtime] is one shared wazero runtime: the compiler, a compilation
//     cache on disk, the host modules ("http_handler", the ABI; "sandgate",
//     this host's additions; "wasi_snapshot_preview1" with no filesystem,
//     no environment and a real monotonic clock only) and the limits every
//     instance runs under (memory pages, time per call).
//   - [Module] is one guest, compiled once, with its config bytes and a
//     capped pool of instances. Load refuses, by name, a module that does
//     not compile, imports what no host module provides, exports neither
//     handler, exports no memory, or exits during start (a command module).
//   - [Chain] is an ordered list of modules; [HandleRequest] runs a request
//     through chains and returns an [Exchange], which carries each module
//     that continued to its handle_response, in reverse order, and releases
//     the instances.
//
// Everything fails closed. A module that traps, exits, runs out of memory
// or out of time fails the request with a 502 naming it ([Error]); its
// instance is closed and never reused. A module that asks for something the
// proxy cannot send (a bad method token, a URI that is not origin-form, a
// header with control characters, a hop-by-hop header, Host) fails the
// request the same way, but its instance stays healthy and is reused.
//
// See README.md for the ABI version and the features covered.
package wasm
