package localbox

import "errors"

// Exit statuses of `sandgate sandbox` for its own failures, one per error
// a caller branches on, so a program driving the CLI (appliance.Launcher)
// learns what went wrong without reading the message. `run` without
// --detach and `exec` exit with their command's own status instead when
// the command ran: there a status from this table and a command's are
// indistinguishable by the number alone (a command may exit 120 too), so
// the service never takes a command's status from the CLI (the agent
// reports it over its link). The numbers sit below 124 (timeout(1)) and
// the shells' 126, 127 and 128+n, where commands rarely exit.
const (
	ExitFailure    = 1   // anything else; the message says what
	ExitBadInput   = 2   // ErrBadInput: a bad id, flag, mount or size; nothing was changed
	ExitRunning    = 119 // ErrRunning: delete without --force of a running sandbox
	ExitNotFound   = 120 // ErrNotFound: no sandbox has that id
	ExitExists     = 121 // ErrExists: run or fork named an id already taken
	ExitBusy       = 122 // ErrBusy: another sandgate process is creating or deleting it
	ExitNotRunning = 123 // ErrNotRunning: exec into a stopped or crashed sandbox
)

var exitCodes = []struct {
	err  error
	code int
}{
	{ErrBadInput, ExitBadInput},
	{ErrRunning, ExitRunning},
	{ErrNotFound, ExitNotFound},
	{ErrExists, ExitExists},
	{ErrBusy, ExitBusy},
	{ErrNotRunning, ExitNotRunning},
}

// ExitCode is the status `sandgate sandbox` exits with for err: 0 for nil,
// the table above for its errors, ExitFailure for any other.
func ExitCode(err error) int {
	if err == nil {
		return 0
	}
	for _, e := range exitCodes {
		if errors.Is(err, e.err) {
			return e.code
		}
	}
	return ExitFailure
}

// ErrorForExit is the error an exit status of `sandgate sandbox` stands
// for (ErrNotFound for ExitNotFound, ...), or nil for 0, ExitFailure and
// any status not in the table. Only meaningful for a status the CLI
// itself chose, not a command's.
func ErrorForExit(code int) error {
	for _, e := range exitCodes {
		if e.code == code {
			return e.err
		}
	}
	return nil
}
