package localbox

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestUserNamespace checks that a sandbox's root is not the host's: its
// ids are a range of the host's of its own, a host file reached other than
// through its image is governed by the host's permissions, and its layer
// still records root as 0.
func TestUserNamespace(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "uns", nil)
	inf, err := m.Inspect("uns")
	if err != nil {
		t.Fatal(err)
	}
	if !inf.UserNS {
		b, _ := os.ReadFile(filepath.Join(m.sandboxDir("uns"), logFile))
		t.Skipf("this kernel gives sandboxes no user namespace (see the README's isolation section): %s", b)
	}
	if inf.IDBase < idBase || (inf.IDBase-idBase)%idRange != 0 {
		t.Errorf("id base %d: not a slot of the range", inf.IDBase)
	}
	code, out, errOut := sh(t, m, "uns", `cat /proc/self/uid_map; id -u; echo made > /root/made`)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	want := "0 " + strconv.Itoa(inf.IDBase) + " 65536"
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 2 || strings.Join(strings.Fields(lines[0]), " ") != want || lines[1] != "0" {
		t.Errorf("uid_map and id: %q; want %q and root", out, want)
	}
	// The layer's format is the image's: root's files are 0 on disk.
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(m.sandboxDir("uns"), upperDir, "root", "made"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 || st.Gid != 0 {
		t.Errorf("a file root made is %d:%d in the layer; want 0:0", st.Uid, st.Gid)
	}

	// A host directory that leaks into a command (here: handed over as
	// its standard input, as a descriptor the init once kept did): its
	// root-only file cannot be read, nor a file made in it.
	leak := t.TempDir()
	if err := os.Chmod(leak, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(leak, "secret"), []byte("host secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	try := func(id string) string {
		d, err := os.Open(leak)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		o := newOutput(t)
		p, err := m.Exec(testCtx(t), id, ExecOptions{Cmd: []string{"sh", "-c", `cat /proc/self/fd/0/secret 2>/dev/null; touch /proc/self/fd/0/planted 2>/dev/null && echo planted; ls /proc/self/fd/0/ >/dev/null && echo listed`}, Stdio: Stdio{Stdin: d, Stdout: o.w}})
		if err != nil {
			t.Fatal(err)
		}
		o.w.Close()
		if _, err := p.Wait(); err != nil {
			t.Fatal(err)
		}
		return o.String(t)
	}
	if got := try("uns"); got != "listed\n" {
		t.Errorf("through a leaked host directory, the sandbox's root: %q; want only a listing (the directory is world-readable)", got)
	}
	if _, err := os.Stat(filepath.Join(leak, "planted")); err == nil {
		t.Error("the sandbox's root made a file in a root-owned host directory")
	}
	// Control: without a user namespace the same leak is the host's root's.
	runDetached(t, m, "nouns", func(o *RunOptions) { o.UserNS = UserNSOff })
	if got := try("nouns"); !strings.Contains(got, "host secret") {
		t.Errorf("control without a user namespace: %q; the check cannot see a leak", got)
	}
	if inf, _ := m.Inspect("nouns"); inf.UserNS {
		t.Error("--userns=off: the sandbox has a user namespace")
	}
}

// TestIDSlots checks that every sandbox gets a range of its own and that
// a slot comes back when its sandbox is gone.
func TestIDSlots(t *testing.T) {
	needRoot(t)
	old := idRegistry
	idRegistry = t.TempDir()
	t.Cleanup(func() { idRegistry = old })
	a, b := filepath.Join(t.TempDir(), "a"), filepath.Join(t.TempDir(), "b")
	if err := os.Mkdir(a, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(b, 0o700); err != nil {
		t.Fatal(err)
	}
	ba, err := allocIDs(a)
	if err != nil {
		t.Fatal(err)
	}
	bb, err := allocIDs(b)
	if err != nil {
		t.Fatal(err)
	}
	if ba == bb {
		t.Fatalf("two sandboxes share the range at %d", ba)
	}
	if again, _ := allocIDs(a); again != ba {
		t.Errorf("a sandbox asking again got %d, not its own %d", again, ba)
	}
	releaseIDs(a, ba)
	if _, err := os.Stat(filepath.Join(idRegistry, strconv.Itoa((ba-idBase)/idRange))); err == nil {
		t.Error("a released slot is still taken")
	}
	// A slot whose sandbox directory is gone (removed by hand) is taken
	// back; one whose directory exists is not.
	c := filepath.Join(t.TempDir(), "c")
	slot := filepath.Join(idRegistry, strconv.Itoa(firstSlot(c)))
	if err := os.WriteFile(slot, []byte(filepath.Join(t.TempDir(), "gone")), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, err := allocIDs(c); err != nil || got != idBase+firstSlot(c)*idRange {
		t.Errorf("a stale slot: got %d, %v; want it taken back (%d)", got, err, idBase+firstSlot(c)*idRange)
	}
	d := filepath.Join(t.TempDir(), "d")
	slot = filepath.Join(idRegistry, strconv.Itoa(firstSlot(d)))
	if err := os.WriteFile(slot, []byte(a), 0o600); err == nil {
		if got, err := allocIDs(d); err != nil || got == idBase+firstSlot(d)*idRange {
			t.Errorf("a live slot was taken: got %d, %v", got, err)
		}
	}
}
