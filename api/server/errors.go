package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"strconv"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/transforms"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// httpError is an error that carries its own status: bad input of a
// request, found by the server itself.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func errorf(status int, format string, args ...any) error {
	return &httpError{status: status, msg: fmt.Sprintf(format, args...)}
}

func badRequest(format string, args ...any) error {
	return errorf(http.StatusBadRequest, format, args...)
}

// status is the one place an error becomes an HTTP status. Errors carry
// their meaning (not found, conflict, invalid, unavailable); only here is
// it a number.
func status(err error) int {
	var he *httpError
	var re *transforms.RuleError
	var we *wasm.Error
	switch {
	case errors.As(err, &he):
		return he.status
	case errors.Is(err, transforms.ErrCredential): // the credential guard (protocol 1 §8)
		return http.StatusBadRequest
	case errors.Is(err, appliance.ErrBadInput), errors.As(err, &re), errors.Is(err, netpolicy.ErrInvalidPolicy),
		errors.Is(err, agent.ErrRefused), errors.Is(err, fs.ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, agent.ErrTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, appliance.ErrNoModules), errors.Is(err, appliance.ErrNoAudit):
		return http.StatusNotImplemented
	case errors.Is(err, appliance.ErrOutputDropped):
		return http.StatusGone
	case errors.Is(err, agent.ErrUnreachable):
		return http.StatusBadGateway
	case errors.Is(err, appliance.ErrExists), errors.Is(err, appliance.ErrRunning):
		return http.StatusConflict
	case errors.Is(err, appliance.ErrNotFound), errors.Is(err, appliance.ErrNotRunning):
		return http.StatusNotFound
	case errors.Is(err, appliance.ErrCapacity), errors.Is(err, appliance.ErrStore),
		errors.Is(err, appliance.ErrClosed), errors.Is(err, appliance.ErrBusy),
		errors.Is(err, appliance.ErrElsewhere), errors.Is(err, appliance.ErrFenced), errors.Is(err, agent.ErrExpired):
		return http.StatusServiceUnavailable
	case errors.Is(err, agent.ErrLinkDown):
		return http.StatusBadGateway
	case errors.Is(err, wasm.ErrModuleTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, wasm.ErrLoadBusy):
		return http.StatusServiceUnavailable
	case errors.As(err, &we): // a module that does not load
		return http.StatusBadRequest
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// Status is the HTTP status of err as the server's routes answer it, for
// another front door over the same backend (the console).
func Status(err error) int { return status(err) }

// Errorf is an error that Status answers with status: another front
// door's own refusals.
func Errorf(status int, format string, args ...any) error { return errorf(status, format, args...) }

// writeJSON writes a JSON reply.
func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		code, b = http.StatusInternalServerError, []byte(`{"error":"encoding the reply failed"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(code)
	w.Write(append(b, '\n'))
}

// writeError writes err as {"error": message} with its status. A service
// that is full says when to try again.
func writeError(w http.ResponseWriter, err error) {
	code := status(err)
	if code == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "5")
	}
	var held *cluster.HeldError
	if errors.As(err, &held) {
		// It moved to another shard under this request: go there.
		owner := held.Shard.URL
		if owner == "" {
			owner = held.Shard.ID
		}
		w.Header().Set(api.HeaderOwner, owner)
		w.Header().Set("Retry-After", "1")
	}
	writeJSON(w, code, api.Error{Error: err.Error()})
}

// noContent writes a 204: no body, no content type.
func noContent(w http.ResponseWriter) { w.WriteHeader(http.StatusNoContent) }
