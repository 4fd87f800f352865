package appliance

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/appliance/agent"
)

// TestKillAllStopsCodeRunFromSandgateBinary: kill-all spares every
// process whose executable is the sandgate binary (to keep the main
// `sandgate agent --idle` and agents). That binary is mounted into every
// sandbox and is dynamically linked (cgo), so any command can run its own
// code in a process that kill-all will never stop: LD_PRELOAD a library
// whose constructor never returns, and exec /.sandgate/sandgate.
func TestKillAllStopsCodeRunFromSandgateBinary(t *testing.T) {
	skipUnlessSandboxes(t)
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("needs a C compiler (cc) to build the preloaded library")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "hold.c")
	if err := os.WriteFile(src, []byte("#include <unistd.h>\n__attribute__((constructor)) static void hold(void) { for (;;) pause(); }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(dir, "hold.so")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
		t.Skipf("cc cannot build a shared library: %v %s", err, out)
	}
	so, err := os.ReadFile(lib)
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	if _, err := e.sb.WriteFile(e.ctx(), "/root/hold.so", bytes.NewReader(so), agent.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	if st, _, errOut := e.sh("LD_PRELOAD=/root/hold.so " + AgentPath + " >/dev/null 2>&1 &"); !st.Success() {
		t.Fatalf("start: %v %s", st, errOut)
	}
	held := func() bool {
		_, out, _ := e.sh("grep -l hold.so /proc/[0-9]*/environ 2>/dev/null | grep -v self || true")
		return strings.TrimSpace(out) != ""
	}
	waitFor(t, "the preloaded process", held)
	if _, err := e.sb.KillAll(e.ctx()); err != nil {
		t.Fatal(err)
	}
	if held() {
		t.Error("a command's own code survived KillAll by running inside the sandgate binary")
	}
}
