package localbox

import "github.com/sandgate/sandgate/appliance/sandboxcli"

// Exit statuses of `sandgate sandbox` (the contract's: sandboxcli).
const (
	ExitFailure    = sandboxcli.ExitFailure
	ExitBadInput   = sandboxcli.ExitBadInput
	ExitRunning    = sandboxcli.ExitRunning
	ExitNotFound   = sandboxcli.ExitNotFound
	ExitExists     = sandboxcli.ExitExists
	ExitBusy       = sandboxcli.ExitBusy
	ExitNotRunning = sandboxcli.ExitNotRunning
)

// ExitCode is the status `sandgate sandbox` exits with for err
// (sandboxcli.ExitCode).
func ExitCode(err error) int { return sandboxcli.ExitCode(err) }

// ErrorForExit is the error an exit status stands for
// (sandboxcli.ErrorForExit).
func ErrorForExit(code int) error { return sandboxcli.ErrorForExit(code) }
