package client

import (
	"errors"
	"fmt"
	"net/http"
)

// Errors a caller branches on with errors.Is. Each is wrapped with what
// happened; a failure the service reported also carries a *ServiceError
// (errors.As), with the request, the status and the service's message.
var (
	// ErrSandboxNotFound: no sandbox of that name is running, and none is
	// suspended (Resume never creates one).
	ErrSandboxNotFound = errors.New("sandbox not found")
	// ErrSandboxExists: Create or Fork named a sandbox that exists,
	// running or suspended (Create never resumes).
	ErrSandboxExists = errors.New("sandbox already exists")
	// ErrSandboxNotRunning: the sandbox exists but is suspended (or being
	// suspended or started): resume it first.
	ErrSandboxNotRunning = errors.New("sandbox is not running")
	// ErrTemplateNotFound: the template is not in the service's namespace.
	ErrTemplateNotFound = errors.New("template not found")
	// ErrAuthentication: the service or the front end before it (Cloud
	// Run's IAM) refused the call's credentials (401 or 403). The message
	// says which role to grant or which option to check.
	ErrAuthentication = errors.New("authentication failed")
	// ErrCapabilityUnsupported: what was asked is not available: a port
	// the session does not expose, a route or feature this service does
	// not have (501, or missing from its OpenAPI document).
	ErrCapabilityUnsupported = errors.New("capability unsupported")
	// ErrProtocolMismatch: the service speaks another protocol version
	// (a *ProtocolError names both).
	ErrProtocolMismatch = errors.New("protocol mismatch")
	// ErrOpenService: Preflight found that the service lets a call
	// without credentials through: anyone who reaches it runs commands in
	// its sandboxes. Do not use it.
	ErrOpenService = errors.New("service accepts unauthenticated calls")
	// ErrIntegrity: a workspace tar did not match the digest the service
	// sent with it, or came without one (it was cut short).
	ErrIntegrity = errors.New("integrity check failed")
	// ErrOutputLost: a process's output stream broke and the service no
	// longer holds the bytes from where it broke (it keeps the most recent
	// output of each process, 8 MiB by default).
	ErrOutputLost = errors.New("process output lost")
)

// ServiceError is a call the service (or the front end before it)
// answered with an error status.
type ServiceError struct {
	// Request is the call: "POST /v1/sandboxes/box/exec".
	Request string
	// Status is the HTTP status.
	Status int
	// Message is the service's {"error": ...}, or the body's text when it
	// was not JSON.
	Message string
}

func (e *ServiceError) Error() string {
	msg := e.Message
	if msg == "" {
		msg = http.StatusText(e.Status)
	}
	return fmt.Sprintf("%s: %d %s", e.Request, e.Status, msg)
}

// ProtocolError is a service that speaks another protocol than this
// client: Service is the version it says ("" when it sent none).
type ProtocolError struct {
	Request string
	Client  string
	Service string
}

func (e *ProtocolError) Error() string {
	if e.Service == "" {
		return fmt.Sprintf("%s: the answer carries no %s header: is this a sandgate (or ai-sdk-sandbox-cloud-run) service? This client speaks protocol %s", e.Request, headerProtocol, e.Client)
	}
	return fmt.Sprintf("%s: the service speaks protocol %s, this client protocol %s: use a client and a service of one protocol", e.Request, e.Service, e.Client)
}

// Is makes a *ProtocolError match ErrProtocolMismatch.
func (e *ProtocolError) Is(target error) bool { return target == ErrProtocolMismatch }

// kindError is a category (ErrSandboxNotFound, ...) with the explanation
// and, when the service said so, the *ServiceError.
type kindError struct {
	kind error
	msg  string
	se   *ServiceError // may be nil
}

func (e *kindError) Error() string {
	if e.se == nil {
		return e.msg
	}
	return e.msg + " (" + e.se.Error() + ")"
}

func (e *kindError) Unwrap() []error {
	if e.se == nil {
		return []error{e.kind}
	}
	return []error{e.kind, e.se}
}

// categorize wraps err (a *ServiceError or anything) in kind with msg.
func categorize(kind error, err error, format string, args ...any) error {
	var se *ServiceError
	errors.As(err, &se)
	return &kindError{kind: kind, msg: fmt.Sprintf(format, args...), se: se}
}

// statusOf is the status of a *ServiceError in err, or 0.
func statusOf(err error) int {
	var se *ServiceError
	if errors.As(err, &se) {
		return se.Status
	}
	return 0
}
