package appliance

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// TestKillAllStopsCodeRunFromSandgateBinary: kill-all once spared every
// process whose executable is the sandgate binary (to keep the agent). That
// binary is mounted into every sandbox, so a command could keep code
// running through kill-all by running it in such a process: a long-lived
// verb of the binary (here `proxy`), or, where the binary is dynamically
// linked (a cgo build), any code of its own through LD_PRELOAD. Kill-all
// now spares only the agent, its ancestors and PID 1.
func TestKillAllStopsCodeRunFromSandgateBinary(t *testing.T) {
	skipUnlessSandboxes(t)
	e := newEnv(t)
	// A process of the sandgate binary that runs until it is killed,
	// marked by its environment.
	cmds := []string{"SANDGATE_KILLALL_MARK=proxy " + AgentPath + " proxy --listen 127.0.0.1:0 >/dev/null 2>&1 &"}
	if dynamic(t, gobuild.Sandgate(t)) {
		if lib := holdLibrary(t); lib != nil {
			if _, err := e.sb.WriteFile(e.ctx(), "/root/hold.so", strings.NewReader(string(lib)), agent.WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			cmds = append(cmds, "SANDGATE_KILLALL_MARK=preload LD_PRELOAD=/root/hold.so "+AgentPath+" >/dev/null 2>&1 &")
		}
	} else {
		t.Log("the sandgate binary is statically linked: LD_PRELOAD cannot put code into it; checking a long-lived verb only")
	}
	marked := func() int {
		_, out, _ := e.sh("grep -l SANDGATE_KILLALL_MARK /proc/[0-9]*/environ 2>/dev/null | grep -v self || true")
		return len(strings.Fields(out))
	}
	for _, c := range cmds {
		if st, _, errOut := e.sh(c); !st.Success() {
			t.Fatalf("start %q: %v %s", c, st, errOut)
		}
	}
	waitFor(t, "the sandgate processes", func() bool { return marked() == len(cmds) })
	if _, err := e.sb.KillAll(e.ctx()); err != nil {
		t.Fatal(err)
	}
	if n := marked(); n != 0 {
		t.Errorf("%d process(es) of the sandgate binary survived KillAll", n)
	}
}

// dynamic reports whether the executable at path asks for a dynamic
// loader.
func dynamic(t *testing.T, path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return true
		}
	}
	return false
}

// holdLibrary builds a shared library whose constructor never returns, or
// returns nil (and logs why) when there is no C compiler.
func holdLibrary(t *testing.T) []byte {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Log("no C compiler (cc): not checking LD_PRELOAD")
		return nil
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "hold.c")
	if err := os.WriteFile(src, []byte("#include <unistd.h>\n__attribute__((constructor)) static void hold(void) { for (;;) pause(); }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(dir, "hold.so")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
		t.Logf("cc cannot build a shared library: %v %s", err, out)
		return nil
	}
	so, err := os.ReadFile(lib)
	if err != nil {
		t.Fatal(err)
	}
	return so
}
