package appliance

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"runtime"
	"strconv"
	"time"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
)

// Limits bound what one sandbox may take of the host and of the service.
// A zero field means the service's default (ManagerConfig.Limits, whose
// own zero fields mean the built-in defaults or none, as each says). A
// sandbox's limits are kept with its record: a resume, on this shard or
// another, applies the same.
type Limits struct {
	// CPU is how many cores' worth of time its processes may use together
	// (cgroup v2 cpu.max, v1 cpu.cfs_quota_us), e.g. 0.5 or 2.
	CPU float64
	// CPUWeight is its share of the cores when sandboxes contend for them,
	// 1 to 10000 (cgroup v2 cpu.weight, 100 for an equal share; v1
	// cpu.shares scaled to it).
	CPUWeight int
	// Memory is the bytes its processes, /tmp and /dev/shm may hold
	// (cgroup memory.max; the kernel's out-of-memory killer acts in the
	// sandbox alone).
	Memory int64
	// Pids is how many processes and threads it may have at once.
	Pids int
	// Disk is the bytes its writable layer may allocate (holes are free);
	// past it, writes in the sandbox fail with ENOSPC.
	Disk int64
	// Lifetime is the longest it may exist from its creation, running or
	// suspended; past it any shard destroys it.
	Lifetime time.Duration
	// KeepSuspended is how long it is kept while suspended; past it any
	// shard destroys it (its audit stays for the audit's own retention).
	KeepSuspended time.Duration
}

// DefaultCPUWeight is every sandbox's CPU weight unless told otherwise:
// an equal share. DefaultSandboxesCPUWeight is what serve gives all its
// sandboxes together against the processes beside them, its own among
// them (LauncherConfig.SandboxesCPUWeight): a quarter of one, so that the
// service runs first when it has work (see RATIONALE.md, "A sandbox's
// CPU").
const (
	DefaultCPUWeight          = sandboxcli.DefaultCPUWeight
	DefaultSandboxesCPUWeight = 25
)

// DefaultCPULimit is every sandbox's CPU limit unless told otherwise: the
// host's cores less one (half of it on a host of one), so that no sandbox
// ever takes every core (see RATIONALE.md, "A sandbox's CPU").
func DefaultCPULimit() float64 {
	n := runtime.NumCPU()
	if n <= 1 {
		return 0.5
	}
	return float64(n - 1)
}

// Or is l with each zero field taken from def.
func (l Limits) Or(def Limits) Limits {
	if l.CPU == 0 {
		l.CPU = def.CPU
	}
	if l.CPUWeight == 0 {
		l.CPUWeight = def.CPUWeight
	}
	if l.Memory == 0 {
		l.Memory = def.Memory
	}
	if l.Pids == 0 {
		l.Pids = def.Pids
	}
	if l.Disk == 0 {
		l.Disk = def.Disk
	}
	if l.Lifetime == 0 {
		l.Lifetime = def.Lifetime
	}
	if l.KeepSuspended == 0 {
		l.KeepSuspended = def.KeepSuspended
	}
	return l
}

// DefaultDiskLimit is `sandgate serve`'s default disk quota of each
// sandbox (SANDGATE_SANDBOX_DISK): room for a repository, its
// dependencies and build outputs (E2B gives 10 GB on its smaller plan).
const DefaultDiskLimit = "10g"

// Minimums below which a sandbox cannot do useful work: a value under
// one of them is refused, naming it, rather than giving a sandbox that
// fails in ways its caller cannot explain.
const (
	MinCPU             = sandboxcli.MinCPU
	MinMemory    int64 = 16 << 20
	MinPids            = 16
	MinDisk      int64 = sandboxcli.MinDisk
	MinLife            = time.Minute
	MaxCPUWeight       = sandboxcli.MaxCPUWeight
)

// Check refuses a limit out of range, naming its field and what it takes.
// Zero fields are fine (the default applies).
func (l Limits) Check() error {
	switch {
	case l.CPU != 0 && (math.IsNaN(l.CPU) || l.CPU < MinCPU || l.CPU > 1<<20):
		return fmt.Errorf("%w: limits.cpu %v: give the cores' worth of time it may use, at least %v (e.g. 0.5, 2)", ErrBadInput, l.CPU, MinCPU)
	case l.CPUWeight < 0 || l.CPUWeight > MaxCPUWeight:
		return fmt.Errorf("%w: limits.cpuWeight %d: give 1 to %d (100 is an equal share)", ErrBadInput, l.CPUWeight, MaxCPUWeight)
	case l.Memory != 0 && l.Memory < MinMemory:
		return fmt.Errorf("%w: limits.memory %d bytes: give at least %dm", ErrBadInput, l.Memory, MinMemory>>20)
	case l.Pids != 0 && l.Pids < MinPids:
		return fmt.Errorf("%w: limits.pids %d: give at least %d", ErrBadInput, l.Pids, MinPids)
	case l.Disk != 0 && l.Disk < MinDisk:
		return fmt.Errorf("%w: limits.disk %d bytes: give at least %dm", ErrBadInput, l.Disk, MinDisk>>20)
	case l.Lifetime != 0 && l.Lifetime < MinLife:
		return fmt.Errorf("%w: limits.lifetime %v: give at least %v (e.g. \"24h\")", ErrBadInput, l.Lifetime, MinLife)
	case l.KeepSuspended != 0 && l.KeepSuspended < MinLife:
		return fmt.Errorf("%w: limits.keepSuspended %v: give at least %v (e.g. \"720h\")", ErrBadInput, l.KeepSuspended, MinLife)
	case l.Memory < 0 || l.Pids < 0 || l.Disk < 0 || l.Lifetime < 0 || l.KeepSuspended < 0 || l.CPU < 0:
		return fmt.Errorf("%w: limits must not be negative", ErrBadInput)
	}
	return nil
}

// limitsJSON is Limits on the wire and in the store: sizes in bytes,
// durations as Go durations ("24h"), zero fields left out.
type limitsJSON struct {
	CPU           float64   `json:"cpu,omitempty"`
	CPUWeight     int       `json:"cpuWeight,omitempty"`
	Memory        jsonSize  `json:"memory,omitempty"`
	Pids          int       `json:"pids,omitempty"`
	Disk          jsonSize  `json:"disk,omitempty"`
	Lifetime      jsonDurat `json:"lifetime,omitempty"`
	KeepSuspended jsonDurat `json:"keepSuspended,omitempty"`
}

// MarshalJSON writes sizes as numbers of bytes and durations as strings.
func (l Limits) MarshalJSON() ([]byte, error) {
	return json.Marshal(limitsJSON{l.CPU, l.CPUWeight, jsonSize(l.Memory), l.Pids, jsonSize(l.Disk), jsonDurat(l.Lifetime), jsonDurat(l.KeepSuspended)})
}

// UnmarshalJSON reads what MarshalJSON writes, and also sizes as strings
// with a unit ("2g", "512m") as the service's settings take them. A field
// it does not know is refused by name; the values are not checked (Check).
func (l *Limits) UnmarshalJSON(data []byte) error {
	var j limitsJSON
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&j); err != nil {
		return fmt.Errorf("%w: limits: %v (it takes \"cpu\", \"cpuWeight\", \"memory\", \"pids\", \"disk\", \"lifetime\" and \"keepSuspended\")", ErrBadInput, err)
	}
	*l = Limits{j.CPU, j.CPUWeight, int64(j.Memory), j.Pids, int64(j.Disk), time.Duration(j.Lifetime), time.Duration(j.KeepSuspended)}
	return nil
}

// jsonSize is a byte count: a number, or a string such as "2g".
type jsonSize int64

func (s *jsonSize) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var str string
		if err := json.Unmarshal(b, &str); err != nil {
			return err
		}
		v, err := sandboxcli.ParseSize(str)
		if err != nil {
			return err
		}
		*s = jsonSize(v)
		return nil
	}
	v, err := strconv.ParseInt(string(b), 10, 64)
	if err != nil {
		return fmt.Errorf("size %s: want a number of bytes or a string such as \"2g\"", b)
	}
	*s = jsonSize(v)
	return nil
}

// jsonDurat is a duration written as a string ("24h0m0s").
type jsonDurat time.Duration

func (d jsonDurat) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *jsonDurat) UnmarshalJSON(b []byte) error {
	var str string
	if err := json.Unmarshal(b, &str); err != nil {
		return fmt.Errorf("duration %s: want a string such as \"24h\" or \"90m\"", b)
	}
	v, err := time.ParseDuration(str)
	if err != nil {
		return fmt.Errorf("duration %q: want a string such as \"24h\" or \"90m\"", str)
	}
	*d = jsonDurat(v)
	return nil
}
