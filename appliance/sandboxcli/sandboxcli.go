// Package sandboxcli is the contract of a sandbox CLI, the command line
// the appliance drives with the verbs of Cloud Run's `sandbox` (run, exec,
// tar, fork, delete): the rule of sandbox ids, the errors a caller branches
// on and the exit statuses that carry them, the shape `list --json`
// prints, and the size syntax of its flags. Both sides import it:
// appliance's Launcher, which drives Google's CLI or `sandgate sandbox`,
// and localbox, which implements `sandgate sandbox`; the launcher so needs
// nothing of the Linux runtime.
package sandboxcli

import (
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// DefaultStateDir is where `sandgate sandbox` keeps its sandboxes unless
// told otherwise (--state-dir, SANDGATE_STATE_DIR).
const DefaultStateDir = "/var/lib/sandgate/sandboxes"

// Errors callers branch on with errors.Is (appliance names the same
// values). ErrNotFound also matches fs.ErrNotExist and ErrExists
// fs.ErrExist, the categories every layer of sandgate relates its own
// "not found" and "already exists" to (store objects, files in a sandbox).
var (
	// ErrBadInput marks a caller's mistake (a bad id, mount, size or
	// option); nothing was changed.
	ErrBadInput = errors.New("bad input")
	// ErrNotFound: no sandbox has that id in the state directory.
	ErrNotFound error = &kindError{"no such sandbox", fs.ErrNotExist}
	// ErrExists: run or fork named an id that is already taken.
	ErrExists error = &kindError{"sandbox already exists", fs.ErrExist}
	// ErrNotRunning: exec into a sandbox whose init is gone (stopped or
	// crashed).
	ErrNotRunning = errors.New("sandbox is not running")
	// ErrRunning: delete without force of a sandbox that still runs.
	ErrRunning = errors.New("sandbox is running")
	// ErrBusy: another sandgate process is creating or deleting the sandbox.
	ErrBusy = errors.New("sandbox is busy")
)

// kindError is a sentinel that also matches a standard category.
type kindError struct {
	msg  string
	kind error
}

func (e *kindError) Error() string        { return e.msg }
func (e *kindError) Is(target error) bool { return target == e.kind }

// MaxIDLength bounds ids: an id becomes the sandbox's host name, which the
// kernel limits to 64 bytes.
const MaxIDLength = 63

var idPattern = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9-]*$`)

// CheckID reports whether id is a valid sandbox id: it must match
// ^[a-zA-Z0-9][a-zA-Z0-9-]*$ (Cloud Run's rule) and be at most 63 bytes.
func CheckID(id string) error {
	if !idPattern.MatchString(id) || len(id) > MaxIDLength {
		return fmt.Errorf("%w: sandbox id %q must match ^[a-zA-Z0-9][a-zA-Z0-9-]*$ and be at most %d characters", ErrBadInput, id, MaxIDLength)
	}
	return nil
}

// CPU bounds of a sandbox of `sandgate sandbox` (run's --cpus and
// --cpu-weight): the kernel's smallest quota is 1 ms per 100 ms period,
// and cgroup v2's cpu.weight runs from 1 to 10000 (100 is the default, an
// equal share).
const (
	MinCPU           = 0.01
	MaxCPUWeight     = 10000
	DefaultCPUWeight = 100
)

// ParseSize parses a byte count: a plain number of bytes or one with a
// suffix k, m, g, t (powers of 1024; "KiB", "MB", "G" all accepted).
func ParseSize(s string) (int64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "b"), "i")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'k':
			mult = 1 << 10
		case 'm':
			mult = 1 << 20
		case 'g':
			mult = 1 << 30
		case 't':
			mult = 1 << 40
		}
		if mult > 1 {
			t = t[:n-1]
		}
	}
	v, err := strconv.ParseInt(t, 10, 64)
	if err != nil || v <= 0 || v > (1<<62)/mult {
		return 0, fmt.Errorf("%w: size %q: want a positive number of bytes, optionally with k, m, g or t", ErrBadInput, s)
	}
	return v * mult, nil
}

// MinDisk is the smallest disk quota a sandbox may have (`run --disk`):
// room for an ext4 file system and a little in it.
const MinDisk = 1 << 20

// FormatSize writes a byte count as ParseSize reads it: with the largest
// unit that divides it (k, m, g, t), else in bytes.
func FormatSize(n int64) string {
	for _, u := range []struct {
		suffix string
		shift  uint
	}{{"t", 40}, {"g", 30}, {"m", 20}, {"k", 10}} {
		if n > 0 && n%(1<<u.shift) == 0 {
			return strconv.FormatInt(n>>u.shift, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}

// State is what List reports for a sandbox.
type State string

// The states of a sandbox.
const (
	// Creating: a run or fork is still setting it up (or a delete is
	// removing it).
	Creating State = "creating"
	// Running: its init is alive; exec works.
	Running State = "running"
	// Stopped: run's command exited, and with it every process; the
	// upper is still there for tar until delete.
	Stopped State = "stopped"
	// Crashed: its init died without stopping cleanly (killed, or the
	// host went down); delete cleans it.
	Crashed State = "crashed"
)

// Info describes one sandbox.
type Info struct {
	ID      string    `json:"id"`
	State   State     `json:"state"`
	Pid     int       `json:"pid,omitempty"` // host pid of its init while running
	Created time.Time `json:"created"`
	// ExitCode is run's command's exit code once Stopped (128+signal for a
	// signal).
	ExitCode *int `json:"exitCode,omitempty"`
	// UserNS: it runs in a user namespace, its root being host id IDBase
	// (see userns.go). False for a sandbox that has not started.
	UserNS bool `json:"userns"`
	IDBase int  `json:"idBase,omitempty"`
}

// CheckTemplateName reports whether name can name a template: the rule of
// sandbox ids.
func CheckTemplateName(name string) error {
	if !idPattern.MatchString(name) || len(name) > MaxIDLength {
		return fmt.Errorf("%w: template name %q must match ^[a-zA-Z0-9][a-zA-Z0-9-]*$ and be at most %d characters", ErrBadInput, name, MaxIDLength)
	}
	return nil
}

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
