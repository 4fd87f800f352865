package localbox

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The init forks every command from one OS thread that it dropped to the
// sandbox's capability set. Capabilities are per thread, but /proc access
// checks (ptrace_may_access) are made against the thread named in the path:
// /proc/1/task/<forker>/ passed them for any command, since its permitted
// set equals theirs, and that thread shares the init's descriptor table and
// memory with the threads that kept every capability. The init is now not
// dumpable, and holds no host file a sandbox could reach even if it were.

// TestInitForkerThreadLeaksNoHostDirectory opens the init's descriptors
// through every thread's /proc entry. One of them was the sandbox's state
// directory on the host (kept to write stopped.json): through it a command
// wrote outside its layer, and ".." walked to the host's root.
func TestInitForkerThreadLeaksNoHostDirectory(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "leak", nil)
	script := `for fd in /proc/1/task/*/fd/*; do
	if [ -d "$fd" ] && echo pwned > "$fd/escape-marker" 2>/dev/null; then echo "ESCAPE via $fd"; fi
done
echo checked`
	code, out, errOut := sh(t, m, "leak", script)
	if code != 0 || !strings.HasSuffix(out, "checked\n") {
		t.Fatalf("exit %d, %q, %q", code, out, errOut)
	}
	marker := filepath.Join(m.sandboxDir("leak"), "escape-marker")
	if _, err := os.Stat(marker); err == nil {
		t.Errorf("a command wrote %s, outside its layer, through an init descriptor (%s)", marker, strings.TrimSpace(out))
	}
}

// TestInitNotPtraceable attaches to each thread of the init with
// PTRACE_SEIZE. Attaching to the forker thread gave a command the init's
// memory, and with it the threads that hold every capability.
func TestInitNotPtraceable(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "trace", nil)
	script := `python3 - <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
for tid in sorted(os.listdir("/proc/1/task")):
    if libc.ptrace(0x4206, int(tid), None, None) == 0:  # PTRACE_SEIZE
        print("ATTACHED init thread", tid)
print("checked")
EOF`
	code, out, errOut := sh(t, m, "trace", script)
	if code != 0 || !strings.HasSuffix(out, "checked\n") {
		t.Fatalf("exit %d, %q, %q (needs python3 in the rootfs)", code, out, errOut)
	}
	if strings.Contains(out, "ATTACHED") {
		t.Errorf("a command can ptrace the sandbox's init: %s", strings.TrimSpace(out))
	}
}

// TestInitThreadsUnreadable tries every /proc file of every init thread
// that would give a command the init's environment (the host state path),
// memory, descriptors, executable (the host binary), root or working
// directory. Controls: the same files of the command's own process open.
func TestInitThreadsUnreadable(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "threads", nil)
	script := `n=0
for task in /proc/1/task/*; do
	n=$((n+1))
	cat $task/environ >/dev/null 2>&1 && echo "READ $task/environ"
	head -c1 $task/mem >/dev/null 2>&1 && echo "OPENED $task/mem"
	ls $task/fd/ 2>/dev/null | while read fd; do readlink $task/fd/$fd >/dev/null 2>&1 && echo "FOLLOWED $task/fd/$fd"; done
	for l in exe root cwd; do readlink $task/$l >/dev/null 2>&1 && echo "FOLLOWED $task/$l"; done
	ls $task/map_files/ >/dev/null 2>&1 && echo "LISTED $task/map_files"
done
[ $n -gt 1 ] || echo "BROKEN CONTROL: the init shows $n threads"
cat /proc/self/environ >/dev/null && readlink /proc/self/exe >/dev/null && readlink /proc/self/fd/0 >/dev/null || echo "BROKEN CONTROL: own /proc"
echo checked`
	code, out, errOut := sh(t, m, "threads", script)
	if code != 0 || !strings.HasSuffix(out, "checked\n") {
		t.Fatalf("exit %d, %q, %q", code, out, errOut)
	}
	if out != "checked\n" {
		t.Errorf("the init's threads are open to a command:\n%s", out)
	}
}

// TestInitHoldsNoHostFiles looks at the init's descriptors from the host:
// even if a command could reach them (the init were ever dumpable again),
// none is a host file or directory. Before, they included the state
// directory, init.log (fds 1 and 2) and the host's cgroup CPU files that
// the Go runtime keeps open.
func TestInitHoldsNoHostFiles(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "fds", nil)
	var rs runState
	if err := readJSON(filepath.Join(m.sandboxDir("fds"), stateFile), &rs); err != nil {
		t.Fatal(err)
	}
	dir := "/proc/" + strconv.Itoa(rs.Pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) < 3 {
		t.Fatalf("the init has %d descriptors: the listing is broken", len(ents))
	}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		switch {
		case strings.HasPrefix(target, "socket:"), strings.HasPrefix(target, "pipe:"), strings.HasPrefix(target, "anon_inode:"):
		case target == "/dev/null":
			// The sandbox's own /dev/null (fd 0): check it is not the host's.
			var hostNull, fdNull unix.Stat_t
			if unix.Stat("/dev/null", &hostNull) == nil && unix.Stat(filepath.Join(dir, e.Name()), &fdNull) == nil && hostNull.Dev == fdNull.Dev && hostNull.Ino == fdNull.Ino {
				t.Errorf("init fd %s is the host's /dev/null", e.Name())
			}
		default:
			t.Errorf("init fd %s → %s: a host file held by the init", e.Name(), target)
		}
	}
}

// TestOOMKillsCommandNotInit fills /tmp (a tmpfs charged to the sandbox's
// memory cgroup) past --memory. The kernel's OOM killer picked the largest
// process, which was the init (the Go binary) rather than the writer, so the
// whole sandbox crashed instead of the offending command failing.
func TestOOMKillsCommandNotInit(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "oom", func(o *RunOptions) { o.Memory = 64 << 20 })
	var rs runState
	if err := readJSON(filepath.Join(m.sandboxDir("oom"), stateFile), &rs); err != nil {
		t.Fatal(err)
	}
	if (&cgroups{dirs: rs.Cgroups, v2: rs.CgroupV2}).file("memory.max") == "" && (&cgroups{dirs: rs.Cgroups}).file("memory.limit_in_bytes") == "" {
		t.Skip("no memory controller on this host")
	}
	// Every command, and what it forks at once, runs 1000 above the init.
	b, err := os.ReadFile("/proc/" + strconv.Itoa(rs.Pid) + "/oom_score_adj")
	if err != nil {
		t.Fatal(err)
	}
	initAdj, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	want := strconv.Itoa(min(initAdj+1000, 1000))
	if code, out, errOut := sh(t, m, "oom", "cat /proc/self/oom_score_adj; (cat /proc/self/oom_score_adj)"); code != 0 || out != want+"\n"+want+"\n" {
		t.Errorf("commands' oom_score_adj: %d %q %q, want %s twice (the init has %d)", code, out, errOut, want, initAdj)
	}
	// Where the init is exempt, a command cannot make itself exempt too.
	if initAdj == -1000 {
		if code, _, _ := sh(t, m, "oom", "echo -1000 > /proc/self/oom_score_adj"); code == 0 {
			t.Error("a command lowered its oom_score_adj to -1000")
		}
	}
	// The exit code does not matter: dd may fail or be killed.
	p, err := m.Exec(testCtx(t), "oom", ExecOptions{Cmd: []string{"sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=256"}})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = p.Wait()
	inf, err := m.Inspect("oom")
	if err != nil {
		t.Fatal(err)
	}
	if inf.State != Running {
		t.Errorf("after one command exceeded --memory the sandbox is %s, want running (the command should die, not the init)", inf.State)
	}
}

// TestTmpfsSizes checks that /tmp and /dev/shm are bounded: by default
// (DefaultTmpSize, DefaultShmSize) and as configured, and that filling
// one fails the writer, not the sandbox.
func TestTmpfsSizes(t *testing.T) {
	m := newRuntime(t)
	size := `echo $(( $(stat -f -c '%b*%S' /tmp) )) $(( $(stat -f -c '%b*%S' /dev/shm) ))`
	runDetached(t, m, "dflt", nil)
	if code, out, errOut := sh(t, m, "dflt", size); code != 0 || out != strconv.Itoa(DefaultTmpSize)+" "+strconv.Itoa(DefaultShmSize)+"\n" {
		t.Errorf("default sizes: %d %q %q, want %d %d", code, out, errOut, DefaultTmpSize, DefaultShmSize)
	}
	runDetached(t, m, "small", func(o *RunOptions) { o.TmpSize = 4 << 20; o.ShmSize = 2 << 20 })
	if code, out, errOut := sh(t, m, "small", size); code != 0 || out != strconv.Itoa(4<<20)+" "+strconv.Itoa(2<<20)+"\n" {
		t.Errorf("configured sizes: %d %q %q", code, out, errOut)
	}
	code, _, errOut := sh(t, m, "small", "dd if=/dev/zero of=/tmp/fill bs=1M count=8")
	if code == 0 || !strings.Contains(errOut, "No space left") {
		t.Errorf("8 MiB into a 4 MiB /tmp: exit %d, %q; want ENOSPC", code, errOut)
	}
	if inf, err := m.Inspect("small"); err != nil || inf.State != Running {
		t.Errorf("after /tmp filled up: %+v, %v", inf, err)
	}
	if _, err := m.Run(testCtx(t), RunOptions{Config: Config{ID: "neg", TmpSize: -1, Cmd: []string{"true"}}}); !errors.Is(err, ErrBadInput) {
		t.Errorf("negative --tmp-size: %v", err)
	}
}

// TestMountSourceRules refuses bind sources that would hand a sandbox the
// kernel's interfaces, devices, the host's root, or the sandboxes' state,
// each with an error naming the rule, and creates nothing.
func TestMountSourceRules(t *testing.T) {
	m := newRuntime(t)
	inside := filepath.Join(m.StateDir(), "other")
	if err := os.Mkdir(inside, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "proc-link")
	if err := os.Symlink("/proc", link); err != nil {
		t.Fatal(err)
	}
	cases := []struct{ source, rule string }{
		{"/proc", "proc file system"},
		{"/proc/self", "proc file system"},
		{link, "proc file system"}, // followed, then judged
		{"/sys", "sysfs file system"},
		{"/dev", "devtmpfs file system"},
		{"/dev/pts", "devpts file system"},
		{"/dev/null", "never bound"},
		{"/", "the host's root"},
		{inside, "inside the sandboxes' state directory"},
		{filepath.Dir(m.StateDir()), "contains the sandboxes' state directory"},
	}
	if mounts, err := readCgroupMounts(); err == nil && len(mounts) > 0 {
		cases = append(cases, struct{ source, rule string }{mounts[0].point, mounts[0].fstype + " file system"})
	}
	for _, c := range cases {
		_, err := m.Run(testCtx(t), RunOptions{Config: Config{ID: "mnt", Cmd: []string{"true"}, Mounts: []Mount{{Source: c.source, Destination: "/mnt/x"}}}})
		if !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), c.rule) {
			t.Errorf("mount source %s: %v; want ErrBadInput naming %q", c.source, err, c.rule)
		}
		if _, err := os.Stat(m.sandboxDir("mnt")); err == nil {
			t.Fatalf("mount source %s: the sandbox was created", c.source)
		}
	}
}

// TestMountSourceRecheckedByInit skips Run's check (as a path swapped
// after it would) and finds the init refusing the source itself.
func TestMountSourceRecheckedByInit(t *testing.T) {
	m := newRuntime(t)
	cfg := Config{ID: "late", Rootfs: "/", Cmd: []string{"true"}, Mounts: []Mount{{Source: "/proc", Destination: "/mnt/x"}}}
	_, err := m.create(testCtx(t), &cfg, func(upper string) error { return os.Mkdir(upper, 0o755) }, Stdio{})
	if err == nil || !strings.Contains(err.Error(), "proc file system") {
		t.Errorf("the init mounted /proc of the host: %v", err)
	}
	if _, err := os.Stat(m.sandboxDir("late")); err == nil {
		t.Error("a failed creation left the sandbox's directory")
	}
	_ = m.Delete(context.Background(), "late", true)
}
