package localbox

import (
	"github.com/sandgate/sandgate/appliance/sandboxcli"

	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultStateDir is where sandboxes live unless told otherwise
// (--state-dir, SANDGATE_STATE_DIR).
const DefaultStateDir = sandboxcli.DefaultStateDir

// Files and directories of a sandbox's state directory.
const (
	configFile  = "config.json"
	stateFile   = "state.json"
	stoppedFile = "stopped.json"
	lockFile    = "lock"
	sockFile    = "ctl.sock"
	logFile     = "init.log"
	upperDir    = "upper"
	workDir     = "work"
	scaffoldDir = "scaffold"
	rootDir     = "root"
)

// State is what List reports for a sandbox (sandboxcli.State).
type State = sandboxcli.State

// The states of a sandbox.
const (
	Creating = sandboxcli.Creating
	Running  = sandboxcli.Running
	Stopped  = sandboxcli.Stopped
	Crashed  = sandboxcli.Crashed
)

// Info describes one sandbox (sandboxcli.Info).
type Info = sandboxcli.Info

// runState is state.json: written by the creating process once the init
// is up.
type runState struct {
	Pid       int      `json:"pid"`
	StartTime uint64   `json:"startTime"` // /proc/<pid>/stat field 22, against pid reuse
	Cgroups   []string `json:"cgroups,omitempty"`
	CgroupV2  bool     `json:"cgroupV2,omitempty"`
	// MonitorPid is the host process that started the init and records
	// its stop (see monitor.go); Delete waits for it to be gone.
	MonitorPid       int    `json:"monitorPid,omitempty"`
	MonitorStartTime uint64 `json:"monitorStartTime,omitempty"`
	// IDBase is the host id of the sandbox's root when it may have a user
	// namespace (its slot, allocIDs; 0: none), UserNS whether it has one.
	IDBase int  `json:"idBase,omitempty"`
	UserNS bool `json:"userns,omitempty"`
}

// stopState is stopped.json: written by the monitor when the init reports
// that run's command exited.
type stopState struct {
	ExitCode int       `json:"exitCode"`
	Time     time.Time `json:"time"`
}

// Runtime runs sandboxes whose state lives under one directory. Its zero
// value is not usable; call New.
type Runtime struct {
	dir string
	exe string
}

// NewRuntime returns a Runtime for the sandboxes under stateDir ("" means
// DefaultStateDir), creating the directory (mode 0700: it holds every
// sandbox's files and control socket) if needed.
func NewRuntime(stateDir string) (*Runtime, error) {
	if stateDir == "" {
		stateDir = DefaultStateDir
	}
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w (set --state-dir or SANDGATE_STATE_DIR to a writable place)", err)
	}
	if real, err := filepath.EvalSymlinks(abs); err == nil {
		abs = real
	}
	return &Runtime{dir: abs, exe: "/proc/self/exe"}, nil
}

// StateDir returns the directory the Runtime keeps its sandboxes in.
func (m *Runtime) StateDir() string { return m.dir }

func (m *Runtime) sandboxDir(id string) string { return filepath.Join(m.dir, id) }

// cgroupNames are the names of sandbox id's cgroup and of its parent: the
// id, under a parent of the state directory's own, sandgate-<a digest of
// the state directory>. Cgroups are global to the host while ids are only
// unique within one state directory (two services, or two test runs, on
// one host may each have a sandbox "s1"), and the parent's CPU weight,
// what all its sandboxes together weigh, is its service's to choose
// (Config.SandboxesCPUWeight).
func (m *Runtime) cgroupNames(id string) (parent, name string) {
	sum := sha256.Sum256([]byte(m.dir))
	return "sandgate-" + hex.EncodeToString(sum[:4]), id
}

func writeJSON(name string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := name + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, name)
}

func readJSON(name string, v any) error {
	b, err := os.ReadFile(name)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// lockSandbox takes the sandbox's lock without waiting: creation and
// deletion hold it, so they never run at once on one sandbox. It is an
// open-file-description write lock on the lock file (released when the
// file is closed, however the holder ends), so that lockHeld can ask
// about it without taking it.
func lockSandbox(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, ErrNotFound
		}
		return nil, err
	}
	lk := unix.Flock_t{Type: unix.F_WRLCK}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk); err != nil {
		f.Close()
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
			return nil, fmt.Errorf("%w: another sandgate process is creating or deleting it; retry when it is done", ErrBusy)
		}
		return nil, err
	}
	return f, nil
}

// lockHeld reports whether a creator or deleter holds the sandbox's lock.
// It neither takes the lock (a reader such as list or exec must never make
// a concurrent create or delete fail as busy) nor creates the lock file (a
// reader must never put a file back into a directory being deleted).
func lockHeld(dir string) bool {
	f, err := os.Open(filepath.Join(dir, lockFile))
	if err != nil {
		return false
	}
	defer f.Close()
	lk := unix.Flock_t{Type: unix.F_WRLCK}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &lk); err != nil {
		return false
	}
	return lk.Type != unix.F_UNLCK
}

// procStartTime returns field 22 of /proc/pid/stat and whether the process
// is a zombie (dead but not reaped: as good as gone).
func procStartTime(pid int) (uint64, bool, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	fields := strings.Fields(s[i+1:])
	if len(fields) < 20 {
		return 0, false, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	st, err := strconv.ParseUint(fields[19], 10, 64)
	return st, fields[0] == "Z" || fields[0] == "X", err
}

// alive reports whether rs's init still runs (same pid, same start time).
func (rs *runState) alive() bool { return procAlive(rs.Pid, rs.StartTime) }

// monitorAlive reports whether rs's monitor still runs.
func (rs *runState) monitorAlive() bool { return procAlive(rs.MonitorPid, rs.MonitorStartTime) }

// procAlive reports whether pid is alive and still the process that
// started at start.
func procAlive(pid int, start uint64) bool {
	if pid <= 0 {
		return false
	}
	st, zombie, err := procStartTime(pid)
	return err == nil && !zombie && st == start
}

// info reads a sandbox's state from its directory.
func (m *Runtime) info(id string) (Info, *Config, *runState, error) {
	dir := m.sandboxDir(id)
	var cfg Config
	if err := readJSON(filepath.Join(dir, configFile), &cfg); err != nil {
		if _, serr := os.Stat(dir); errors.Is(serr, fs.ErrNotExist) {
			return Info{}, nil, nil, fmt.Errorf("%w: %q (see 'sandgate sandbox list')", ErrNotFound, id)
		}
		// A directory without its config: creation died before writing it.
		inf := Info{ID: id, State: Crashed}
		if st, err := os.Stat(dir); err == nil {
			inf.Created = st.ModTime().UTC()
		}
		if lockHeld(dir) {
			inf.State = Creating
		}
		return inf, nil, nil, nil
	}
	inf := Info{ID: id, Created: cfg.Created}
	var rs runState
	_ = readJSON(filepath.Join(dir, stateFile), &rs)
	if rs.UserNS {
		inf.UserNS, inf.IDBase = true, rs.IDBase
	}
	var ss stopState
	switch {
	case readJSON(filepath.Join(dir, stoppedFile), &ss) == nil:
		inf.State = Stopped
		code := ss.ExitCode
		inf.ExitCode = &code
	case rs.alive():
		inf.State = Running
		inf.Pid = rs.Pid
	default:
		inf.State = Crashed
		if lockHeld(dir) {
			inf.State = Creating
		}
	}
	return inf, &cfg, &rs, nil
}

// Inspect returns what List would say of one sandbox.
func (m *Runtime) Inspect(id string) (Info, error) {
	if err := CheckID(id); err != nil {
		return Info{}, err
	}
	inf, _, _, err := m.info(id)
	return inf, err
}

// List returns every sandbox under the state directory, by id.
func (m *Runtime) List() ([]Info, error) {
	ents, err := os.ReadDir(m.dir)
	if err != nil {
		return nil, err
	}
	var out []Info
	for _, e := range ents {
		if !e.IsDir() || CheckID(e.Name()) != nil {
			continue
		}
		inf, _, _, err := m.info(e.Name())
		if err != nil {
			if errors.Is(err, ErrNotFound) { // deleted meanwhile
				continue
			}
			return nil, err
		}
		out = append(out, inf)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}
