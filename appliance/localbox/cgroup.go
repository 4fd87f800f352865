package localbox

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
)

// cgroups is a sandbox's cgroup: one directory under cgroup v2, or one per
// v1 hierarchy it uses (v1Controllers). Empty when the host has
// none of them mounted: the sandbox then runs without limits or freezing.
type cgroups struct {
	dirs []string
	v2   bool
}

type cgMount struct {
	point, root, fstype string
	opts                []string
}

func readCgroupMounts() ([]cgMount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []cgMount
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		a, b := strings.Fields(pre), strings.Fields(post)
		if len(a) < 5 || len(b) < 3 || (b[0] != "cgroup" && b[0] != "cgroup2") {
			continue
		}
		out = append(out, cgMount{point: unescapeMount(a[4]), root: unescapeMount(a[3]), fstype: b[0], opts: strings.Split(b[2], ",")})
	}
	return out, sc.Err()
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// selfCgroups maps a v1 controller (or "" for v2) to this process's cgroup
// path.
func selfCgroups() (map[string]string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			out[c] = parts[2]
		}
	}
	return out, nil
}

// cgroupLimits are what a sandbox's cgroups bound (its Config's limits);
// a zero field means none (the kernel's default weight). sandboxesWeight
// is the CPU weight of their parent, all the state directory's sandboxes
// together (Config.SandboxesCPUWeight); zero leaves it as it is.
type cgroupLimits struct {
	memory, pids    int64
	cpu             float64
	cpuWeight       int
	sandboxesWeight int
}

func (c *Config) cgroupLimits() cgroupLimits {
	return cgroupLimits{memory: c.Memory, pids: c.Pids, cpu: c.CPU, cpuWeight: c.CPUWeight, sandboxesWeight: c.SandboxesCPUWeight}
}

// v1Controllers are the cgroup v1 hierarchies a sandbox gets a cgroup in
// (where the host mounts them): its limits, its freezing, and what it uses
// (cpuacct). Every sandbox has a cpu cgroup of its own, limited or not, so
// that the scheduler shares the cores between sandboxes, not between their
// processes: eight busy processes of one sandbox weigh as much as one of
// another's.
var v1Controllers = []string{"memory", "pids", "freezer", "cpu", "cpuacct"}

// newCgroups makes the sandbox's cgroup(s), name under parent (the state
// directory's: see Runtime.cgroupNames), and applies the limits. Under
// cgroup v2 it is /sys/fs/cgroup/<parent>/<name> (v2 forbids controllers
// in a cgroup that holds processes, so it cannot nest under ours); under
// v1 it nests under this process's own cgroup of each hierarchy, so that
// limits the host set on sandgate keep applying to its sandboxes, and the
// parent sits beside the service's own processes.
func newCgroups(parent, name string, lim cgroupLimits) (*cgroups, error) {
	mounts, err := readCgroupMounts()
	if err != nil {
		return nil, err
	}
	self, err := selfCgroups()
	if err != nil {
		return nil, err
	}
	cg := &cgroups{}
	for _, mt := range mounts {
		if mt.fstype == "cgroup2" && mt.point == "/sys/fs/cgroup" {
			cg.v2 = true
			dir := filepath.Join(mt.point, parent, name)
			if err := mkdirCgroup(dir, func(parent string) {
				// Best effort, one controller at a time (a write naming
				// one the host lacks fails whole): without them, limits
				// are refused below.
				for _, ctrl := range []string{"+cpu", "+memory", "+pids"} {
					_ = os.WriteFile(filepath.Join(mt.point, "cgroup.subtree_control"), []byte(ctrl), 0)
					_ = os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte(ctrl), 0)
				}
				if lim.sandboxesWeight > 0 {
					_ = os.WriteFile(filepath.Join(parent, "cpu.weight"), []byte(strconv.Itoa(lim.sandboxesWeight)), 0)
				}
			}); err != nil {
				return nil, fmt.Errorf("cgroup: %w", err)
			}
			cg.dirs = []string{dir}
			break
		}
	}
	if !cg.v2 {
		for _, ctrl := range v1Controllers {
			for _, mt := range mounts {
				if mt.fstype != "cgroup" || !contains(mt.opts, ctrl) {
					continue
				}
				rel := strings.TrimPrefix(self[ctrl], mt.root)
				dir := filepath.Join(mt.point, rel, parent, name)
				if contains(cg.dirs, dir) { // a hierarchy of several (cpu,cpuacct)
					break
				}
				if err := mkdirCgroup(dir, func(parent string) {
					if ctrl == "cpu" && lim.sandboxesWeight > 0 {
						_ = os.WriteFile(filepath.Join(parent, "cpu.shares"), []byte(strconv.FormatInt(cpuShares(lim.sandboxesWeight), 10)), 0)
					}
				}); err != nil {
					cg.remove(context.Background())
					return nil, fmt.Errorf("cgroup %s: %w", ctrl, err)
				}
				cg.dirs = append(cg.dirs, dir)
				break
			}
		}
	}
	if err := cg.limit(lim); err != nil {
		cg.remove(context.Background())
		return nil, err
	}
	return cg, nil
}

// mkdirCgroup makes cgroup dir and its parent, calling setParent on the
// parent before dir is made in it. A delete in the same state directory
// removes the parent once it is empty (cgroups.remove): one that does so
// between the two is met by making both again, a few times.
func mkdirCgroup(dir string, setParent func(parent string)) error {
	var err error
	for range 3 {
		if err = os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
			return err
		}
		setParent(filepath.Dir(dir))
		if err = os.Mkdir(dir, 0o755); !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return err
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// file returns the first of the cgroup's directories holding name.
func (c *cgroups) file(name string) string {
	for _, d := range c.dirs {
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// cfsPeriod is the period of a sandbox's CPU limit, in microseconds: the
// kernel's default, 100 ms. A limit of c cores is c×100 ms of CPU time per
// period, spent by any of its processes on any core.
const cfsPeriod = 100_000

// cpuQuota is the CPU time per cfsPeriod, in microseconds, of a limit of
// cpu cores; 0 for none: no limit asked, or one of the host's cores or more,
// which bounds nothing (and a quota that large the kernel may refuse).
func cpuQuota(cpu float64) int64 {
	if cpu <= 0 || cpu >= float64(runtime.NumCPU()) {
		return 0
	}
	return max(int64(math.Round(cpu*cfsPeriod)), 1000)
}

// cpuShares is cgroup v1's cpu.shares for a cgroup v2 cpu.weight, scaled as
// systemd scales CPUWeight on v1 hosts: the defaults meet (100 ↔ 1024), so
// a sandbox of the default weight weighs what any other cgroup of the host
// does.
func cpuShares(weight int) int64 {
	return min(max(int64(weight)*1024/sandboxcli.DefaultCPUWeight, 2), 262144)
}

func (c *cgroups) limit(lim cgroupLimits) error {
	// set writes v to the first of names (a later one, optional, goes with
	// it); flag is what asked, for the error where the host lacks it.
	set := func(flag string, v string, names ...string) error {
		for i, n := range names {
			p := c.file(n)
			if p == "" {
				if i == 0 {
					return fmt.Errorf("%w: %s needs the cgroup %s controller, which this host does not offer (enable it in cgroup v2 or mount it in v1, or run without %s)", ErrBadInput, flag, strings.SplitN(n, ".", 2)[0], flag)
				}
				continue
			}
			if err := os.WriteFile(p, []byte(v), 0); err != nil {
				return fmt.Errorf("cgroup %s: %w", n, err)
			}
		}
		return nil
	}
	setInt := func(flag string, v int64, names ...string) error {
		if v == 0 {
			return nil
		}
		return set(flag, strconv.FormatInt(v, 10), names...)
	}
	// The default weight asks nothing of a host without the cpu
	// controller: it is what every cgroup has there.
	weightFile := "cpu.shares"
	if c.v2 {
		weightFile = "cpu.weight"
	}
	weight := lim.cpuWeight
	if weight == sandboxcli.DefaultCPUWeight && c.file(weightFile) == "" {
		weight = 0
	}
	quota := cpuQuota(lim.cpu)
	if c.v2 {
		if err := setInt("--memory", lim.memory, "memory.max"); err != nil {
			return err
		}
		if lim.memory > 0 {
			if p := c.file("memory.swap.max"); p != "" {
				_ = os.WriteFile(p, []byte("0"), 0)
			}
		}
		if err := setInt("--pids", lim.pids, "pids.max"); err != nil {
			return err
		}
		if quota > 0 {
			if err := set("--cpus", fmt.Sprintf("%d %d", quota, cfsPeriod), "cpu.max"); err != nil {
				return err
			}
		}
		return setInt("--cpu-weight", int64(weight), "cpu.weight")
	}
	if err := setInt("--memory", lim.memory, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"); err != nil {
		return err
	}
	if err := setInt("--pids", lim.pids, "pids.max"); err != nil {
		return err
	}
	if quota > 0 {
		if err := setInt("--cpus", cfsPeriod, "cpu.cfs_period_us"); err != nil {
			return err
		}
		// v1 refuses a quota above the one of a cgroup above (EINVAL):
		// that one bounds the sandbox more tightly already.
		if err := setInt("--cpus", quota, "cpu.cfs_quota_us"); err != nil && !errors.Is(err, unix.EINVAL) {
			return err
		}
	}
	if weight > 0 {
		return setInt("--cpu-weight", cpuShares(weight), "cpu.shares")
	}
	return nil
}

// add moves pid into every directory of the cgroup.
func (c *cgroups) add(pid int) error {
	for _, d := range c.dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("cgroup: add %d to %s: %w", pid, d, err)
		}
	}
	return nil
}

// procs lists the processes in the cgroup.
func (c *cgroups) procs() []int {
	seen := map[int]bool{}
	var out []int
	for _, d := range c.dirs {
		b, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil && !seen[pid] {
				seen[pid] = true
				out = append(out, pid)
			}
		}
	}
	return out
}

// freeze stops every process of the cgroup until thaw is called, so that
// a copy of the upper is consistent. It does nothing (and says so with
// ok=false) where no freezer exists.
func (c *cgroups) freeze(ctx context.Context) (thaw func(), ok bool, err error) {
	var file, on, off, want string
	var poll func() bool
	if c.v2 {
		file, on, off = c.file("cgroup.freeze"), "1", "0"
		events := c.file("cgroup.events")
		poll = func() bool {
			b, _ := os.ReadFile(events)
			return strings.Contains(string(b), "frozen 1")
		}
	} else {
		file, on, off, want = c.file("freezer.state"), "FROZEN", "THAWED", "FROZEN"
		poll = func() bool {
			b, _ := os.ReadFile(file)
			return strings.TrimSpace(string(b)) == want
		}
	}
	if file == "" {
		return func() {}, false, nil
	}
	thaw = func() { _ = os.WriteFile(file, []byte(off), 0) }
	if err := os.WriteFile(file, []byte(on), 0); err != nil {
		return nil, false, fmt.Errorf("cgroup freeze: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for delay := 100 * time.Microsecond; !poll(); delay = min(2*delay, 20*time.Millisecond) {
		select {
		case <-ctx.Done():
			thaw()
			return nil, false, fmt.Errorf("cgroup freeze: not frozen: %w", context.Cause(ctx))
		case <-time.After(delay):
		}
	}
	return thaw, true, nil
}

// remove kills whatever is left in the cgroup and removes its directories,
// and their parent if no other sandbox is left in it.
func (c *cgroups) remove(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var errs []error
	for _, d := range c.dirs {
		for delay := 100 * time.Microsecond; ; delay = min(2*delay, 20*time.Millisecond) {
			err := unix.Rmdir(d)
			if err == nil || errors.Is(err, unix.ENOENT) {
				// The state directory's parent goes with its last
				// sandbox (a cgroup that still has one stays: EBUSY).
				_ = unix.Rmdir(filepath.Dir(d))
				break
			}
			if !errors.Is(err, unix.EBUSY) {
				errs = append(errs, fmt.Errorf("cgroup %s: %w", d, err))
				break
			}
			if p := filepath.Join(d, "freezer.state"); c.file("freezer.state") != "" {
				_ = os.WriteFile(p, []byte("THAWED"), 0)
			}
			for _, pid := range (&cgroups{dirs: []string{d}}).procs() {
				_ = unix.Kill(pid, unix.SIGKILL)
			}
			select {
			case <-ctx.Done():
				errs = append(errs, fmt.Errorf("cgroup %s: processes still in it: %w", d, context.Cause(ctx)))
			case <-time.After(delay):
				continue
			}
			break
		}
	}
	return errors.Join(errs...)
}
