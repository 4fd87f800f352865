package wasm

import (
	"fmt"

	"github.com/sandgate/sandgate/transforms"
)

var _ transforms.ModuleFailure = (*Error)(nil)

// Error is a module's failure or refusal to load. The proxy answers a
// failed request with Status (502 for a module that failed, 413 for a
// request body over the buffering cap, 503 when no instance became free in
// time) and records Module in the audit event. Load errors have Status 0:
// they are the operator's to fix, not a request's outcome.
type Error struct {
	// Module is the name of the module that failed.
	Module string
	// Status is the HTTP status the sandbox gets; 0 for load errors.
	Status int
	// Reason says what went wrong, for people; it names the module.
	Reason string
	// Err is the underlying error, if any (a wazero error, an exit).
	Err error
}

// Error returns the reason, with the underlying error when there is one.
func (e *Error) Error() string {
	if e.Err != nil {
		return e.Reason + ": " + e.Err.Error()
	}
	return e.Reason
}

// Unwrap returns the underlying error.
func (e *Error) Unwrap() error { return e.Err }

// ModuleName returns Module: a request's failure names its module in the
// audit event (see [transforms.ModuleFailure]).
func (e *Error) ModuleName() string { return e.Module }

func loadError(name string, err error, format string, args ...any) *Error {
	return &Error{Module: name, Reason: fmt.Sprintf("wasm module %s: ", name) + fmt.Sprintf(format, args...), Err: err}
}

func failure(status int, name, format string, args ...any) *Error {
	return &Error{Module: name, Status: status, Reason: fmt.Sprintf(format, args...)}
}

// abiError is what a host function panics with when a guest breaks the
// ABI (memory out of range, an unknown kind, a write after the next
// handler). The ABI says the host traps; the instance is then discarded.
type abiError struct{ msg string }

func (e *abiError) Error() string { return e.msg }

func trap(format string, args ...any) {
	panic(&abiError{msg: fmt.Sprintf(format, args...)})
}

// Features are the http-wasm feature flags (the ABI's "features" bit set).
type Features uint32

// The features of the ABI. This host supports buffering; trailers are not
// supported (enable_features never reports FeatureTrailers).
const (
	// FeatureBufferRequest buffers the request body when a module reads it,
	// so that the upstream still gets it.
	FeatureBufferRequest Features = 1
	// FeatureBufferResponse buffers the upstream response so that
	// handle_response can read and overwrite its body and status.
	FeatureBufferResponse Features = 2
	// FeatureTrailers is HTTP trailers. Not supported by this host.
	FeatureTrailers Features = 4

	supportedFeatures = FeatureBufferRequest | FeatureBufferResponse
)

// Has reports whether every flag of f2 is set in f.
func (f Features) Has(f2 Features) bool { return f&f2 == f2 }

// String names the flags ("buffer_request|buffer_response"), "none" for
// none, as `sandgate wasm check` and the logs print them.
func (f Features) String() string {
	s := ""
	add := func(flag Features, name string) {
		if f&flag != 0 {
			if s != "" {
				s += "|"
			}
			s += name
		}
	}
	add(FeatureBufferRequest, "buffer_request")
	add(FeatureBufferResponse, "buffer_response")
	add(FeatureTrailers, "trailers")
	if rest := f &^ (FeatureBufferRequest | FeatureBufferResponse | FeatureTrailers); rest != 0 {
		if s != "" {
			s += "|"
		}
		s += fmt.Sprintf("%#x", uint32(rest))
	}
	if s == "" {
		return "none"
	}
	return s
}
