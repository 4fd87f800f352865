package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"

	"github.com/sandgate/sandgate/snapshot"
)

// Errors to branch on with errors.Is. An *Error from the agent also matches
// the io/fs errors of its category (fs.ErrNotExist, fs.ErrExist,
// fs.ErrPermission), os.ErrProcessDone and ErrRefused (= snapshot.ErrRefused).
var (
	// ErrVersionMismatch: the agent and the service speak different
	// protocol versions.
	ErrVersionMismatch = errors.New("agent protocol version mismatch")
	// ErrLinkDown: the link to the agent closed (the agent exited, the
	// sandbox went away, or Close was called). The launcher restarts the
	// agent; operations in flight are lost.
	ErrLinkDown = errors.New("agent link is down")
	// ErrTooLarge: a write or tar stream went over its byte cap.
	ErrTooLarge = errors.New("over the size cap")
	// ErrRefused: the agent refused a request as unsafe or invalid
	// (a hostile tar entry, a proxy variable pointing elsewhere, a bad
	// base URL). It is snapshot.ErrRefused itself: one "refused",
	// whichever side of the link refused.
	ErrRefused = snapshot.ErrRefused
	// ErrUnreachable: nothing listens on the dialed port in the sandbox.
	ErrUnreachable = errors.New("unreachable")
	// ErrExpired: the deadline the service set (SetDeadline) passed
	// without a new one: the agent stopped every command and starts none.
	ErrExpired = errors.New("the service's deadline for this sandbox passed")
)

// Error codes on the wire.
const (
	codeNotFound   = "not_found"
	codeExists     = "exists"
	codePermission = "permission"
	codeInvalid    = "invalid"
	codeRefused    = "refused"
	codeTooLarge   = "too_large"
	codeDone       = "done"
	codeVersion    = "version"
	codeUnreach    = "unreachable"
	codeFailed     = "failed"
	codeExpired    = "expired"
)

// Error is a failure the agent reported for an operation.
type Error struct {
	Op      string // the operation: exec, read, write, ...
	Code    string // the category on the wire (not_found, refused, ...)
	Message string // what happened and, where it can, how to fix it
}

func (e *Error) Error() string {
	if e.Op == "" {
		return "agent: " + e.Message
	}
	return "agent " + e.Op + ": " + e.Message
}

// Is maps the wire category onto the errors callers already branch on.
func (e *Error) Is(target error) bool {
	switch e.Code {
	case codeNotFound:
		return target == fs.ErrNotExist
	case codeExists:
		return target == fs.ErrExist
	case codePermission:
		return target == fs.ErrPermission
	case codeInvalid:
		return target == fs.ErrInvalid
	case codeRefused:
		return target == ErrRefused
	case codeTooLarge:
		return target == ErrTooLarge
	case codeDone:
		return target == os.ErrProcessDone
	case codeExpired:
		return target == ErrExpired
	case codeVersion:
		return target == ErrVersionMismatch
	case codeUnreach:
		return target == ErrUnreachable
	}
	return false
}

func (w *wireError) toError(op string) error {
	return &Error{Op: op, Code: w.Code, Message: w.Message}
}

// toWire classifies an error for the wire.
func toWire(err error) *wireError {
	var ae *Error
	if errors.As(err, &ae) {
		return &wireError{Code: ae.Code, Message: ae.Message}
	}
	code := codeFailed
	switch {
	case errors.Is(err, fs.ErrNotExist):
		code = codeNotFound
	case errors.Is(err, fs.ErrExist):
		code = codeExists
	case errors.Is(err, fs.ErrPermission):
		code = codePermission
	case errors.Is(err, ErrRefused):
		code = codeRefused
	case errors.Is(err, ErrTooLarge):
		code = codeTooLarge
	case errors.Is(err, os.ErrProcessDone):
		code = codeDone
	case errors.Is(err, syscall.ECONNREFUSED):
		code = codeUnreach
	case errors.Is(err, fs.ErrInvalid), errors.Is(err, syscall.EINVAL):
		code = codeInvalid
	}
	return &wireError{Code: code, Message: err.Error()}
}

// invalid is a request the agent will not serve, with the fix in msg.
func invalid(format string, args ...any) error {
	return &Error{Code: codeInvalid, Message: fmt.Sprintf(format, args...)}
}

// refused is a request the agent refuses as unsafe.
func refused(format string, args ...any) error {
	return &Error{Code: codeRefused, Message: fmt.Sprintf(format, args...)}
}
