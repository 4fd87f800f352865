package localbox

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/snapshot"
)

func TestRunOutputAndExitCode(t *testing.T) {
	m := newRuntime(t)
	out := newOutput(t)
	p, err := m.Run(testCtx(t), RunOptions{Config: Config{ID: "out", Cmd: []string{"sh", "-c", "echo hello $GREETING; exit 7"}, Env: []string{"GREETING=world"}}, Stdio: Stdio{Stdout: out.w}})
	if err != nil {
		t.Fatal(err)
	}
	code, err := p.Wait()
	if err != nil || code != 7 {
		t.Fatalf("exit %d, %v; want 7", code, err)
	}
	if got := out.String(t); got != "hello world\n" {
		t.Errorf("stdout %q", got)
	}
	in, err := m.Inspect("out")
	if err != nil || in.State != Stopped || in.ExitCode == nil || *in.ExitCode != 7 {
		t.Errorf("after exit: %+v, %v; want stopped with code 7", in, err)
	}
	if _, err := m.Exec(testCtx(t), "out", ExecOptions{Cmd: []string{"true"}}); !errors.Is(err, ErrNotRunning) {
		t.Errorf("exec into a stopped sandbox: %v", err)
	}

	p, err = m.Run(testCtx(t), RunOptions{Config: Config{ID: "sig", Cmd: []string{"sh", "-c", "kill -9 $$"}}})
	if err != nil {
		t.Fatal(err)
	}
	if code, err := p.Wait(); err != nil || code != 128+9 {
		t.Errorf("killed command: exit %d, %v; want 137", code, err)
	}
	if _, err := m.Run(testCtx(t), RunOptions{Config: Config{ID: "sig", Cmd: []string{"true"}}}); !errors.Is(err, ErrExists) {
		t.Errorf("second run with the same id: %v", err)
	}
	if _, err := m.Run(testCtx(t), RunOptions{Config: Config{ID: "nope", Cmd: []string{"/no/such/binary"}}}); err == nil {
		t.Error("run of a missing binary: no error")
	}
}

// assertGone checks that nothing of a sandbox is left: no directory, no
// process, no mount, no cgroup.
func assertGone(t *testing.T, m *Runtime, id string, rs runState) {
	t.Helper()
	dir := m.sandboxDir(id)
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still exists (%v)", dir, err)
	}
	if rs.Pid > 0 && rs.alive() {
		t.Errorf("init pid %d still alive", rs.Pid)
	}
	if rs.MonitorPid > 0 && rs.monitorAlive() {
		t.Errorf("monitor pid %d still alive", rs.MonitorPid)
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mi), dir) {
		t.Errorf("a mount under %s is left in /proc/self/mountinfo", dir)
	}
	for _, d := range rs.Cgroups {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s left", d)
		}
	}
}

func TestDetachExecDeleteLeavesNothing(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "life", nil)
	code, out, _ := sh(t, m, "life", "echo $0 in $(hostname); exit 5")
	if code != 5 || out != "sh in life\n" {
		t.Errorf("exec: %d %q", code, out)
	}
	var rs runState
	if err := readJSON(filepath.Join(m.sandboxDir("life"), stateFile), &rs); err != nil || !rs.alive() {
		t.Fatalf("state %+v, %v", rs, err)
	}
	// A process left in the background must go too.
	sh(t, m, "life", "setsid sleep 1000 >/dev/null 2>&1 < /dev/null &")
	if err := m.Delete(testCtx(t), "life", false); !errors.Is(err, ErrRunning) {
		t.Fatalf("delete without force of a running sandbox: %v", err)
	}
	if err := m.Delete(testCtx(t), "life", true); err != nil {
		t.Fatal(err)
	}
	assertGone(t, m, "life", rs)
	if err := m.Delete(testCtx(t), "life", true); !errors.Is(err, ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
}

// layerNames lists the entries of a layer.
func layerNames(t *testing.T, r io.Reader) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	if _, err := snapshot.Inspect(context.Background(), r, func(h *tar.Header) error {
		names[strings.TrimSuffix(h.Name, "/")] = true
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return names
}

func TestTarImportAndBindMount(t *testing.T) {
	m := newRuntime(t)
	src := filepath.Join(t.TempDir(), "tool")
	if err := os.WriteFile(src, []byte("#!/bin/sh\necho tool says $1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	data := t.TempDir()
	runDetached(t, m, "a", func(o *RunOptions) {
		o.Mounts = []Mount{
			{Source: src, Destination: "/.sandgate/sandgate", ReadOnly: true},
			{Source: data, Destination: "/data"},
		}
	})
	code, out, errOut := sh(t, m, "a", `/.sandgate/sandgate hi && mkdir -p /work/x && echo layer > /work/x/f && echo tmp > /tmp/junk && echo out > /data/o && rm /etc/hostname &&
		! echo x > /.sandgate/sandgate 2>/dev/null`)
	if code != 0 || out != "tool says hi\n" {
		t.Fatalf("exec: %d %q %q", code, out, errOut)
	}
	if b, _ := os.ReadFile(filepath.Join(data, "o")); string(b) != "out\n" {
		t.Errorf("read-write bind mount: host sees %q", b)
	}
	var layer bytes.Buffer
	if _, err := m.Tar(testCtx(t), "a", &layer, snapshot.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	names := layerNames(t, bytes.NewReader(layer.Bytes()))
	if !names["work/x/f"] || !names["etc/.wh.hostname"] {
		t.Errorf("layer lacks the written file or the whiteout: %v", names)
	}
	for n := range names {
		for _, bad := range []string{"tmp", ".sandgate", "data", "proc", "dev", "sys"} {
			if n == bad || strings.HasPrefix(n, bad+"/") {
				t.Errorf("layer holds %q", n)
			}
		}
	}
	// Round trip: the layer becomes another sandbox's upper.
	f := filepath.Join(t.TempDir(), "layer.tar.zst")
	if err := os.WriteFile(f, layer.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	runDetached(t, m, "b", func(o *RunOptions) { o.ImportTar = f })
	if code, out, _ := sh(t, m, "b", "cat /work/x/f; test -e /etc/hostname || echo gone"); code != 0 || out != "layer\ngone\n" {
		t.Errorf("imported layer: %d %q", code, out)
	}
}

func TestFork(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "src", func(o *RunOptions) { o.Env = []string{"WHO=fork"} })
	sh(t, m, "src", "echo copied > /root/state")
	p, err := m.Fork(testCtx(t), "src", "dst", Stdio{})
	if err != nil {
		t.Fatal(err)
	}
	p.Detach()
	if code, out, _ := sh(t, m, "dst", "cat /root/state; echo $WHO; hostname; cat /proc/1/cmdline >/dev/null; ps -o args= 2>/dev/null | grep -c 'sleep infinity' || true"); code != 0 || !strings.HasPrefix(out, "copied\nfork\ndst\n") {
		t.Errorf("forked sandbox: %d %q", code, out)
	}
	// The source runs on, unfrozen, and the two are separate.
	sh(t, m, "dst", "echo changed > /root/state")
	if _, out, _ := sh(t, m, "src", "cat /root/state"); out != "copied\n" {
		t.Errorf("source after fork: %q", out)
	}
}

func TestCrashRecovery(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "crash", nil)
	var rs runState
	if err := readJSON(filepath.Join(m.sandboxDir("crash"), stateFile), &rs); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(rs.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for rs.alive() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	infos, err := m.List()
	if err != nil || len(infos) != 1 || infos[0].State != Crashed {
		t.Fatalf("list after kill -9 of the init: %+v, %v", infos, err)
	}
	if _, err := m.Exec(testCtx(t), "crash", ExecOptions{Cmd: []string{"true"}}); !errors.Is(err, ErrNotRunning) {
		t.Errorf("exec into a crashed sandbox: %v", err)
	}
	if err := m.Delete(testCtx(t), "crash", true); err != nil {
		t.Fatal(err)
	}
	assertGone(t, m, "crash", rs)
}

func TestExecStdinEOF(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "stdin", nil)
	r, w, _ := os.Pipe()
	out := newOutput(t)
	p, err := m.Exec(testCtx(t), "stdin", ExecOptions{Cmd: []string{"sh", "-c", "wc -c; echo done"}, Stdio: Stdio{Stdin: r, Stdout: out.w}})
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	w.Write([]byte("12345"))
	w.Close() // EOF must reach wc
	if code, err := p.Wait(); code != 0 || err != nil {
		t.Fatalf("exit %d, %v", code, err)
	}
	if got := strings.Fields(out.String(t)); len(got) != 2 || got[0] != "5" {
		t.Errorf("stdout %q", got)
	}
}

// TestExecBinaryRoundTrip pushes a few MiB of random bytes through cat in
// the sandbox: nothing added, lost or reordered.
func TestExecBinaryRoundTrip(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "bin", nil)
	data := make([]byte, 4<<20+17)
	rand.Read(data)
	r, w, _ := os.Pipe()
	out := newOutput(t)
	errOut := newOutput(t)
	p, err := m.Exec(testCtx(t), "bin", ExecOptions{Cmd: []string{"cat"}, Stdio: Stdio{Stdin: r, Stdout: out.w, Stderr: errOut.w}})
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	go func() { w.Write(data); w.Close() }()
	if code, err := p.Wait(); code != 0 || err != nil {
		t.Fatalf("exit %d, %v; stderr %q, out %d", code, err, errOut.String(t), len(out.String(t)))
	}
	if got := out.String(t); got != string(data) {
		t.Errorf("got %d bytes back, want %d identical; stderr %q", len(got), len(data), errOut.String(t))
	}
}

func TestPidsLimit(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "pids", func(o *RunOptions) { o.Pids = 40; o.Memory = 256 << 20 })
	var rs runState
	readJSON(filepath.Join(m.sandboxDir("pids"), stateFile), &rs)
	cg := &cgroups{dirs: rs.Cgroups, v2: rs.CgroupV2}
	if cg.file("pids.max") == "" {
		t.Skip("no pids controller on this host")
	}
	// dash gives up at the first fork the cgroup refuses.
	code, out, errOut := sh(t, m, "pids", "i=0; while [ $i -lt 60 ]; do sleep 60 </dev/null >/dev/null 2>&1 & i=$((i+1)); done; echo all")
	if code == 0 || out != "" || !strings.Contains(strings.ToLower(errOut), "fork") {
		t.Errorf("60 processes under --pids 40: exit %d, %q, %q", code, out, errOut)
	}
	for _, name := range []string{"memory.max", "memory.limit_in_bytes"} {
		if p := cg.file(name); p != "" {
			if b, _ := os.ReadFile(p); strings.TrimSpace(string(b)) != strconv.Itoa(256<<20) {
				t.Errorf("%s = %q", p, b)
			}
		}
	}
}

// TestWhiteoutNamedFilesKeepMeaning: a command may name a regular file
// ".wh.<name>" or ".wh..wh..opq". tar wrote it verbatim, and --import-tar
// then read it as an OCI whiteout or opaque marker, so the resumed sandbox
// was not the one saved: here /usr made opaque (emptied) and /opt deleted,
// and the sandbox could not even start a shell. (Fixed in snapshot, which
// packs such files as literals; this is the round trip through sandboxes.)
func TestWhiteoutNamedFilesKeepMeaning(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "wh", nil)
	if code, out, errOut := sh(t, m, "wh", "echo data > /usr/.wh..wh..opq && echo data > /.wh.opt"); code != 0 {
		t.Fatalf("exit %d %q %q", code, out, errOut)
	}
	layer := filepath.Join(t.TempDir(), "wh.tar")
	f, err := os.Create(layer)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Tar(testCtx(t), "wh", f, snapshot.PackOptions{Compression: snapshot.None}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out := newOutput(t)
	p, err := m.Run(testCtx(t), RunOptions{
		Config:    Config{ID: "wh2", Cmd: []string{"/bin/sh", "-c", "cat /usr/.wh..wh..opq /.wh.opt && test -d /opt && test -x /usr/bin/env && echo intact"}},
		ImportTar: layer,
		Stdio:     Stdio{Stdout: out.w, Stderr: out.w},
	})
	if err != nil {
		t.Fatalf("the sandbox saved by tar cannot be resumed: %v", err)
	}
	out.w.Close()
	if _, err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if got := out.String(t); got != "data\ndata\nintact\n" {
		t.Errorf("after tar and --import-tar: %q, want the two files and an intact /usr and /opt", got)
	}
}
