package localbox

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// cgroups is a sandbox's cgroup: one directory under cgroup v2, or one per
// v1 hierarchy it uses (memory, pids, freezer). Empty when the host has
// none of them mounted: the sandbox then runs without limits or freezing.
type cgroups struct {
	dirs []string
	v2   bool
}

// cgroupParent is the directory every sandbox's cgroup is made in.
const cgroupParent = "sandgate"

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

// newCgroups makes the sandbox's cgroup(s) and applies the limits. Under
// cgroup v2 it is /sys/fs/cgroup/sandgate/<name> (v2 forbids controllers in a
// cgroup that holds processes, so it cannot nest under ours); under v1 it
// nests under this process's own cgroup of each hierarchy, so that limits
// the host set on sandgate keep applying to its sandboxes.
func newCgroups(name string, memory, pids int64) (*cgroups, error) {
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
			parent := filepath.Join(mt.point, cgroupParent)
			if err := os.Mkdir(parent, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
				return nil, fmt.Errorf("cgroup: %w", err)
			}
			// Best effort: without these, limits are refused below.
			_ = os.WriteFile(filepath.Join(mt.point, "cgroup.subtree_control"), []byte("+memory +pids"), 0)
			_ = os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte("+memory +pids"), 0)
			dir := filepath.Join(parent, name)
			if err := os.Mkdir(dir, 0o755); err != nil {
				return nil, fmt.Errorf("cgroup: %w", err)
			}
			cg.dirs = []string{dir}
			break
		}
	}
	if !cg.v2 {
		for _, ctrl := range []string{"memory", "pids", "freezer"} {
			for _, mt := range mounts {
				if mt.fstype != "cgroup" || !contains(mt.opts, ctrl) {
					continue
				}
				rel := strings.TrimPrefix(self[ctrl], mt.root)
				dir := filepath.Join(mt.point, rel, cgroupParent, name)
				if err := os.MkdirAll(dir, 0o755); err != nil {
					cg.remove(context.Background())
					return nil, fmt.Errorf("cgroup %s: %w", ctrl, err)
				}
				cg.dirs = append(cg.dirs, dir)
				break
			}
		}
	}
	if err := cg.limit(memory, pids); err != nil {
		cg.remove(context.Background())
		return nil, err
	}
	return cg, nil
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

func (c *cgroups) limit(memory, pids int64) error {
	set := func(flag string, v int64, names ...string) error {
		if v == 0 {
			return nil
		}
		for i, n := range names {
			p := c.file(n)
			if p == "" {
				if i == 0 {
					return fmt.Errorf("%w: %s needs the cgroup %s controller, which this host does not offer (enable it in cgroup v2 or mount it in v1, or run without %s)", ErrBadInput, flag, strings.SplitN(n, ".", 2)[0], flag)
				}
				continue
			}
			if err := os.WriteFile(p, []byte(strconv.FormatInt(v, 10)), 0); err != nil {
				return fmt.Errorf("cgroup %s: %w", n, err)
			}
		}
		return nil
	}
	if c.v2 {
		if err := set("--memory", memory, "memory.max"); err != nil {
			return err
		}
		if memory > 0 {
			if p := c.file("memory.swap.max"); p != "" {
				_ = os.WriteFile(p, []byte("0"), 0)
			}
		}
		return set("--pids", pids, "pids.max")
	}
	if err := set("--memory", memory, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"); err != nil {
		return err
	}
	return set("--pids", pids, "pids.max")
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

// remove kills whatever is left in the cgroup and removes its directories.
func (c *cgroups) remove(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var errs []error
	for _, d := range c.dirs {
		for delay := 100 * time.Microsecond; ; delay = min(2*delay, 20*time.Millisecond) {
			err := unix.Rmdir(d)
			if err == nil || errors.Is(err, unix.ENOENT) {
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
