package bridge

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"strconv"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/transforms"
)

// The contract's error codes ({"error": message, "code": code}).
const (
	codeUnauthorized   = "unauthorized"
	codeInvalid        = "invalid_request"
	codeExec           = "exec_error"
	codeExecTransport  = "exec_transport_error"
	codeReadNotFound   = "workspace_read_not_found"
	codeArchiveRead    = "workspace_archive_read_error"
	codeArchiveWrite   = "workspace_archive_write_error"
	codeCapacity       = "capacity_exceeded"
	codePool           = "pool_error"
	codeMount          = "mount_error"
	codeUnmount        = "unmount_error"
	codeSession        = "session_error"
	codeTunnel         = "tunnel_error"
	codePayloadTooLong = "payload_too_large"
)

// ErrorBody is the body of every error the bridge answers, and the data of
// an exec stream's error event.
type ErrorBody struct {
	Error string `json:"error"`
	Code  string `json:"code"`
}

// apiError is an answer the bridge decided: a status, a contract code and
// a message.
type apiError struct {
	status int
	code   string
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func fail(status int, code, format string, args ...any) error {
	return &apiError{status: status, code: code, msg: fmt.Sprintf(format, args...)}
}

// invalid is the contract's 400 invalid_request.
func invalid(format string, args ...any) error {
	return fail(http.StatusBadRequest, codeInvalid, format, args...)
}

// failure says how an operation's own failures are answered: the status
// and code the contract gives them, and the prefix of their message
// ("read failed: ...").
type failure struct {
	status int
	code   string
	prefix string
}

// Failures of each kind of operation, as the contract answers them.
var (
	poolFailure    = failure{http.StatusBadGateway, codePool, "pool error: "}
	readFailure    = failure{http.StatusBadGateway, codeExecTransport, "read failed: "}
	writeFailure   = failure{http.StatusBadGateway, codeArchiveWrite, "write failed: "}
	hydrateFailure = failure{http.StatusBadGateway, codeArchiveWrite, "hydrate failed: "}
	persistFailure = failure{http.StatusBadGateway, codeArchiveRead, "persist failed: "}
	execFailure    = failure{http.StatusBadGateway, codeExecTransport, "exec failed: "}
	termFailure    = failure{http.StatusBadGateway, codeExecTransport, "terminal failed: "}
	sessionFailure = failure{http.StatusBadGateway, codeSession, "session failed: "}
	tunnelFailure  = failure{http.StatusBadGateway, codeTunnel, "tunnel failed: "}
)

// answer is the one place an error becomes the contract's status and
// code: the bridge's own answers as they are; what the service cannot do
// now (full, shutting down, its store failing) as 503, which the
// contract's clients retry; a refused credential and the caller's bad
// input as 400; anything else as the operation's failure.
func answer(err error, f failure) *apiError {
	var ae *apiError
	var re *transforms.RuleError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.Is(err, appliance.ErrCapacity):
		return &apiError{http.StatusServiceUnavailable, codeCapacity, "instance limit reached: " + err.Error()}
	case errors.Is(err, appliance.ErrClosed), errors.Is(err, appliance.ErrStore), errors.Is(err, appliance.ErrBusy):
		return &apiError{http.StatusServiceUnavailable, codePool, "pool error: " + err.Error()}
	case errors.Is(err, transforms.ErrCredential), errors.As(err, &re):
		return &apiError{http.StatusBadRequest, codeInvalid, err.Error()}
	case errors.Is(err, appliance.ErrBadInput), errors.Is(err, agent.ErrRefused), errors.Is(err, fs.ErrInvalid):
		if f.code == codeSession { // the contract documents no 400 there
			return &apiError{f.status, f.code, f.prefix + err.Error()}
		}
		return &apiError{http.StatusBadRequest, codeInvalid, err.Error()}
	}
	return &apiError{f.status, f.code, f.prefix + err.Error()}
}

// writeError writes err as the contract's error body, with its status.
func writeError(w http.ResponseWriter, err error, f failure) {
	ae := answer(err, f)
	if ae.status == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "5")
	}
	writeJSON(w, ae.status, ErrorBody{Error: ae.msg, Code: ae.code})
}

// writeJSON writes a JSON reply.
func writeJSON(w http.ResponseWriter, code int, v any) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // messages say <SANDBOX_API_KEY>, not \u003c...
	var b []byte
	if err := enc.Encode(v); err != nil {
		code, b = http.StatusInternalServerError, []byte(`{"error":"encoding the reply failed","code":"invalid_request"}`)
	} else {
		b = bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(code)
	w.Write(b)
}

// ok is the contract's {"ok": true}.
func ok(w http.ResponseWriter) { writeJSON(w, http.StatusOK, map[string]bool{"ok": true}) }
