package agent

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// procInfo is one line of the process table, from /proc/<pid>/stat.
type procInfo struct {
	pid, ppid int
	sid       int // its session's id (the session leader's pid)
	state     byte
	start     uint64 // start time, clock ticks after boot
	holder    bool   // it runs the agent's own executable as `agent --idle`
}

// listProcs reads every process visible in /proc. Processes that vanish
// while it reads are skipped.
func listProcs() ([]procInfo, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	self, selfErr := os.Stat("/proc/self/exe")
	out := make([]procInfo, 0, len(ents))
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		if pi, ok := parseStat(b); ok {
			if selfErr == nil {
				exe, err := os.Stat("/proc/" + e.Name() + "/exe")
				if err == nil && os.SameFile(exe, self) {
					cmdline, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
					args := bytes.Split(bytes.TrimSuffix(cmdline, []byte{0}), []byte{0})
					pi.holder = len(args) == 3 && string(args[1]) == "agent" && string(args[2]) == "--idle"
				}
			}
			out = append(out, pi)
		}
	}
	return out, nil
}

// parseStat reads pid, state, ppid, session and start time from a /proc/<pid>/stat
// line. The command name may hold spaces and parentheses, so fields are
// counted from the last ')'.
func parseStat(b []byte) (procInfo, bool) {
	open := bytes.IndexByte(b, '(')
	end := bytes.LastIndexByte(b, ')')
	if open < 1 || end < open {
		return procInfo{}, false
	}
	pid, err := strconv.Atoi(string(bytes.TrimSpace(b[:open])))
	if err != nil {
		return procInfo{}, false
	}
	f := bytes.Fields(b[end+1:])
	if len(f) < 20 || len(f[0]) != 1 {
		return procInfo{}, false
	}
	ppid, err := strconv.Atoi(string(f[1]))
	if err != nil {
		return procInfo{}, false
	}
	sid, err := strconv.Atoi(string(f[3])) // field 6, session
	if err != nil {
		return procInfo{}, false
	}
	start, err := strconv.ParseUint(string(f[19]), 10, 64) // field 22, starttime
	if err != nil {
		return procInfo{}, false
	}
	return procInfo{pid: pid, ppid: ppid, sid: sid, state: f[0][0], start: start}, true
}

// victims chooses what a kill-all stops, from a process table: for
// KillDescendants, every descendant of self; for KillSandbox, every process
// but self, its ancestors, PID 1, kernel threads (children of PID 2) and the
// sandbox's main process: the oldest process running sandgate's own
// executable as `agent --idle` (its end would stop the sandbox). Only the
// oldest: it started with the sandbox, before any command could, so a
// command that runs the binary the same way (say with LD_PRELOAD) is still
// stopped. Zombies are already dead and never chosen.
func victims(procs []procInfo, self int, scope KillScope) []int {
	parent := make(map[int]int, len(procs))
	for _, p := range procs {
		parent[p.pid] = p.ppid
	}
	var out []int
	switch scope {
	case KillDescendants:
		children := map[int][]int{}
		for _, p := range procs {
			children[p.ppid] = append(children[p.ppid], p.pid)
		}
		seen := map[int]bool{self: true}
		queue := []int{self}
		for len(queue) > 0 {
			q := queue[0]
			queue = queue[1:]
			for _, c := range children[q] {
				if !seen[c] {
					seen[c] = true
					queue = append(queue, c)
				}
			}
		}
		for _, p := range procs {
			if p.pid != self && seen[p.pid] && p.state != 'Z' {
				out = append(out, p.pid)
			}
		}
	default:
		keep := map[int]bool{self: true, 1: true, 2: true}
		holder := -1
		for i, p := range procs {
			if p.holder && p.state != 'Z' && (holder < 0 || p.start < procs[holder].start) {
				holder = i
			}
		}
		if holder >= 0 {
			keep[procs[holder].pid] = true
		}
		for a, n := parent[self], 0; a > 0 && n < len(procs); a, n = parent[a], n+1 {
			keep[a] = true
		}
		for _, p := range procs {
			if !keep[p.pid] && p.ppid != 2 && p.state != 'Z' {
				out = append(out, p.pid)
			}
		}
	}
	slices.Sort(out)
	return out
}

// Kill-all bounds: rounds of SIGKILL until nothing in scope is left (a
// process may fork while its siblings die).
const (
	killRounds    = 100
	killRoundWait = 20 * time.Millisecond
)

// killScope stops every process in scope with SIGKILL and returns how many
// distinct processes it signalled. Processes that survive every round are
// reported by pid.
func killScope(ctx context.Context, scope KillScope) (int, error) {
	self := os.Getpid()
	killed := map[int]bool{}
	var left []int
	for range killRounds {
		procs, err := listProcs()
		if err != nil {
			return len(killed), err
		}
		left = victims(procs, self, scope)
		if len(left) == 0 {
			return len(killed), nil
		}
		for _, pid := range left {
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				killed[pid] = true
			}
		}
		select {
		case <-ctx.Done():
			return len(killed), context.Cause(ctx)
		case <-time.After(killRoundWait):
		}
	}
	return len(killed), fmt.Errorf("kill-all: %d processes survived %d rounds of SIGKILL (pids %v; uninterruptible I/O?)", len(left), killRounds, left)
}

// killSession stops every process of session sid with SIGKILL: a
// terminal's hang-up, which reaches the jobs a shell put in process groups
// of their own too. Bounded as killScope; what survives is left.
func killSession(sid int) {
	for range killRounds {
		procs, err := listProcs()
		if err != nil {
			return
		}
		n := 0
		for _, p := range procs {
			if p.sid == sid && p.state != 'Z' && p.pid != os.Getpid() {
				if syscall.Kill(p.pid, syscall.SIGKILL) == nil {
					n++
				}
			}
		}
		if n == 0 {
			return
		}
		time.Sleep(killRoundWait)
	}
}

// signalScope sends sig, once, to every process in scope but the agent,
// and returns how many it signalled.
func signalScope(scope KillScope, sig syscall.Signal) (int, error) {
	procs, err := listProcs()
	if err != nil {
		return 0, err
	}
	n := 0
	for _, pid := range victims(procs, os.Getpid(), scope) {
		if syscall.Kill(pid, sig) == nil {
			n++
		}
	}
	return n, nil
}

// startReaper makes the process a child subreaper and reaps the orphans
// re-parented to it: zombies whose parent is this process and that are not
// commands a goroutine is waiting for.
func (t *procTable) startReaper(log *slog.Logger) (stop func(), err error) {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return nil, err
	}
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGCHLD)
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		// A signal can be coalesced with another; the tick catches what
		// a lost notification left behind.
		tick := time.NewTicker(5 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-ch:
			case <-tick.C:
			}
			if n := t.reapOrphans(); n > 0 {
				log.Debug("agent: reaped orphans", "count", n)
			}
		}
	}()
	return func() {
		signal.Stop(ch)
		close(done)
		<-finished
	}, nil
}

func (t *procTable) reapOrphans() int {
	procs, err := listProcs()
	if err != nil {
		return 0
	}
	self := os.Getpid()
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, p := range procs {
		if p.ppid != self || p.state != 'Z' || t.ours(p.pid) {
			continue
		}
		var ws unix.WaitStatus
		if pid, _ := unix.Wait4(p.pid, &ws, unix.WNOHANG, nil); pid == p.pid {
			n++
		}
	}
	return n
}
