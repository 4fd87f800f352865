package localbox

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"

	seccompbpf "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	mobyseccomp "github.com/moby/profiles/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// Capabilities is the capability set every command of a sandbox holds
// (effective, permitted and bounding; inheritable and ambient are empty):
// Docker's default set (moby oci/caps) minus CAP_NET_RAW and CAP_MKNOD.
// NET_RAW goes because a sandbox has only loopback and raw sockets are how
// packets get forged; MKNOD goes because there is no device cgroup here to
// make a device node harmless, and a device node in the upper would make
// the layer impossible to save.
var Capabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

var capNumbers = map[string]int{
	"CAP_CHOWN": unix.CAP_CHOWN, "CAP_DAC_OVERRIDE": unix.CAP_DAC_OVERRIDE,
	"CAP_FSETID": unix.CAP_FSETID, "CAP_FOWNER": unix.CAP_FOWNER,
	"CAP_SETGID": unix.CAP_SETGID, "CAP_SETUID": unix.CAP_SETUID,
	"CAP_SETFCAP": unix.CAP_SETFCAP, "CAP_SETPCAP": unix.CAP_SETPCAP,
	"CAP_NET_BIND_SERVICE": unix.CAP_NET_BIND_SERVICE, "CAP_SYS_CHROOT": unix.CAP_SYS_CHROOT,
	"CAP_KILL": unix.CAP_KILL, "CAP_AUDIT_WRITE": unix.CAP_AUDIT_WRITE,
}

// dropCapabilities leaves the calling thread with Capabilities only, in
// every set. Capabilities are per thread: the caller has locked itself to
// its OS thread and forks every command from it.
func dropCapabilities() error {
	var keep [2]uint32
	for _, c := range Capabilities {
		n := capNumbers[c]
		keep[n/32] |= 1 << (n % 32)
	}
	last := unix.CAP_LAST_CAP
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			last = v
		}
	}
	for c := 0; c <= last; c++ {
		if c < 64 && keep[c/32]&(1<<(c%32)) != 0 {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && err != unix.EINVAL {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil && err != unix.EINVAL {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: keep[0], Permitted: keep[0]},
		{Effective: keep[1], Permitted: keep[1]},
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}

// SeccompReport says how Docker's default profile was translated.
type SeccompReport struct {
	Rules int // syscall rules kept (after includes/excludes)
	// Unknown are syscall names the profile allows that this
	// architecture's table lacks; they stay denied.
	Unknown []string
	// Dropped are rules whose argument conditions cannot be expressed;
	// their syscalls stay denied (fail closed).
	Dropped []string
}

// extraSyscalls completes go-seccomp-bpf's x86-64 table with syscalls that
// Docker's profile allows and that table predates.
var extraSyscalls = map[string]map[string]int{
	"amd64": {
		"uretprobe": 335, "setxattrat": 463, "getxattrat": 464,
		"listxattrat": 465, "removexattrat": 466, "open_tree_attr": 467,
		"file_getattr": 468, "file_setattr": 469,
	},
}

var extendTable sync.Once

var goArchToSpec = map[string]string{"amd64": "amd64", "arm64": "arm64", "386": "x86"}

// SeccompPolicy translates Docker's default seccomp profile
// (github.com/moby/profiles/seccomp) for the given capability set, this
// kernel and this architecture into a go-seccomp-bpf policy:
//
//   - includes/excludes on caps, arches and minKernel are evaluated as
//     Docker does; the native architecture only: other ABIs (i386
//     compatibility, x32) get the default action, which fails closed;
//   - SCMP_CMP_EQ, NE, LT, LE, GT, GE map to their operations and
//     SCMP_CMP_MASKED_EQ with a zero result to BitsNotSet; any other
//     masked comparison cannot be expressed and its rule is dropped,
//     leaving the syscall denied;
//   - rules with a non-allow action (clone3 → ENOSYS) come first, so
//     the stricter answer wins where rules overlap;
//   - the default action is SCMP_ACT_ERRNO with EPERM, as in Docker.
func SeccompPolicy(caps []string) (*seccompbpf.Policy, *SeccompReport, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, nil, err
	}
	extendTable.Do(func() {
		// The table is go-seccomp-bpf's global; it only ever gains
		// names, with the kernel's numbers, once.
		for name, nr := range extraSyscalls[runtime.GOARCH] {
			if _, ok := info.SyscallNames[name]; !ok {
				info.SyscallNames[name] = nr
				info.SyscallNumbers[nr] = name
			}
		}
	})
	prof := mobyseccomp.DefaultProfile()
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	kmaj, kmin := parseKernel(unix.ByteSliceToString(uts.Release[:]))
	specArch := goArchToSpec[runtime.GOARCH]
	hasCap := map[string]bool{}
	for _, c := range caps {
		hasCap[c] = true
	}
	errnoOf := func(ret *uint, def uint) uint32 {
		if ret != nil {
			return uint32(*ret)
		}
		return uint32(def)
	}
	defErrno := uint(unix.EPERM)
	if prof.DefaultErrnoRet != nil {
		defErrno = *prof.DefaultErrnoRet
	}
	rep := &SeccompReport{}
	groups := map[seccompbpf.Action]*seccompbpf.SyscallGroup{}
	var order []seccompbpf.Action
	uncond := map[seccompbpf.Action]map[string]bool{}
	conds := map[seccompbpf.Action]map[string][]seccompbpf.ArgumentConditions{}
	lookup := func(name string) bool {
		_, ok := info.SyscallNames[name]
		return ok
	}
	for _, rule := range prof.Syscalls {
		if !ruleApplies(rule, hasCap, specArch, kmaj, kmin) {
			continue
		}
		var action seccompbpf.Action
		switch rule.Action {
		case specs.ActAllow:
			action = seccompbpf.ActionAllow
		case specs.ActErrno:
			action = seccompbpf.ActionErrno | seccompbpf.Action(errnoOf(rule.ErrnoRet, defErrno)&0xffff)
		default:
			rep.Dropped = append(rep.Dropped, fmt.Sprintf("%v: action %s", rule.Names, rule.Action))
			continue
		}
		var cond seccompbpf.ArgumentConditions
		ok := true
		for _, a := range rule.Args {
			c := seccompbpf.Condition{Argument: uint32(a.Index), Value: a.Value}
			switch a.Op {
			case specs.OpEqualTo:
				c.Operation = seccompbpf.Equal
			case specs.OpNotEqual:
				c.Operation = seccompbpf.NotEqual
			case specs.OpLessThan:
				c.Operation = seccompbpf.LessThan
			case specs.OpLessEqual:
				c.Operation = seccompbpf.LessOrEqual
			case specs.OpGreaterThan:
				c.Operation = seccompbpf.GreaterThan
			case specs.OpGreaterEqual:
				c.Operation = seccompbpf.GreaterOrEqual
			case specs.OpMaskedEqual:
				if a.ValueTwo != 0 {
					ok = false
				}
				c.Operation = seccompbpf.BitsNotSet
			default:
				ok = false
			}
			cond = append(cond, c)
		}
		if !ok {
			rep.Dropped = append(rep.Dropped, fmt.Sprintf("%v: args %v", rule.Names, rule.Args))
			continue
		}
		if groups[action] == nil {
			groups[action] = &seccompbpf.SyscallGroup{Action: action}
			uncond[action] = map[string]bool{}
			conds[action] = map[string][]seccompbpf.ArgumentConditions{}
			order = append(order, action)
		}
		rep.Rules++
		for _, name := range rule.Names {
			if !lookup(name) {
				rep.Unknown = append(rep.Unknown, name)
				continue
			}
			if len(cond) == 0 {
				uncond[action][name] = true
			} else {
				conds[action][name] = append(conds[action][name], cond)
			}
		}
	}
	if defErrno != uint(unix.EPERM) {
		// go-seccomp-bpf's default action can only be errno EPERM.
		return nil, nil, fmt.Errorf("seccomp: default errno %d: only EPERM is supported", defErrno)
	}
	policy := &seccompbpf.Policy{DefaultAction: seccompbpf.ActionErrno}
	// Stricter actions first: an errno rule wins over an allow that
	// overlaps it.
	var sorted []seccompbpf.Action
	for _, a := range order {
		if a != seccompbpf.ActionAllow {
			sorted = append(sorted, a)
		}
	}
	if groups[seccompbpf.ActionAllow] != nil {
		sorted = append(sorted, seccompbpf.ActionAllow)
	}
	for _, a := range sorted {
		g := groups[a]
		for name := range uncond[a] {
			g.Names = append(g.Names, name)
		}
		for name, cs := range conds[a] {
			if uncond[a][name] {
				continue // an unconditional rule already covers every argument
			}
			for _, c := range cs {
				g.NamesWithCondtions = append(g.NamesWithCondtions, seccompbpf.NameWithConditions{Name: name, Conditions: c})
			}
		}
		sortStrings(g.Names)
		policy.Syscalls = append(policy.Syscalls, *g)
	}
	return policy, rep, nil
}

func sortStrings(s []string) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

func parseKernel(release string) (uint64, uint64) {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return 0, 0
	}
	maj, _ := strconv.ParseUint(parts[0], 10, 64)
	minStr := parts[1]
	for i, r := range minStr {
		if r < '0' || r > '9' {
			minStr = minStr[:i]
			break
		}
	}
	mn, _ := strconv.ParseUint(minStr, 10, 64)
	return maj, mn
}

func ruleApplies(r *mobyseccomp.Syscall, hasCap map[string]bool, specArch string, kmaj, kmin uint64) bool {
	if inc := r.Includes; inc != nil {
		for _, c := range inc.Caps {
			if !hasCap[c] {
				return false
			}
		}
		if len(inc.Arches) > 0 && !contains(inc.Arches, specArch) {
			return false
		}
		if k := inc.MinKernel; k != nil && (kmaj < k.Kernel || (kmaj == k.Kernel && kmin < k.Major)) {
			return false
		}
	}
	if exc := r.Excludes; exc != nil {
		for _, c := range exc.Caps {
			if hasCap[c] {
				return false
			}
		}
		if contains(exc.Arches, specArch) {
			return false
		}
		if k := exc.MinKernel; k != nil && !(kmaj < k.Kernel || (kmaj == k.Kernel && kmin < k.Major)) {
			return false
		}
	}
	return true
}

// loadSeccomp sets no_new_privs and installs the policy on the calling
// thread (no TSYNC: only the forking thread and its children get it).
func loadSeccomp(p *seccompbpf.Policy) error {
	return seccompbpf.LoadFilter(seccompbpf.Filter{NoNewPrivs: true, Policy: *p})
}
