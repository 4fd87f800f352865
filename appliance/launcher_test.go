package appliance

import (
	"fmt"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestAgentSocketpairNotInherited: the service's end of the agent's
// socketpair is close-on-exec, so no child (the sandbox CLI given the other
// end as its stdio, or another sandbox's CLI started at the same moment)
// holds it: none can hand the service's end into a sandbox.
func TestAgentSocketpairNotInherited(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("socketpair and /proc/<pid>/fd are Linux-only here")
	}
	ours, child, err := socketpair()
	if err != nil {
		t.Fatal(err)
	}
	defer ours.Close()
	defer child.Close()
	rc, err := ours.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	rc.Control(func(fd uintptr) { err = unix.Fstat(int(fd), &st) })
	if err != nil {
		t.Fatal(err)
	}
	ourLink := fmt.Sprintf("socket:[%d]", st.Ino)
	var cst unix.Stat_t
	if err := unix.Fstat(int(child.Fd()), &cst); err != nil {
		t.Fatal(err)
	}
	childLink := fmt.Sprintf("socket:[%d]", cst.Ino)

	list := "for f in /proc/$$/fd/*; do echo \"${f##*/} $(readlink $f)\"; done >&2"
	// The CLI, given the agent's end as stdin and stdout.
	cmd := exec.Command("/bin/sh", "-c", list)
	cmd.Stdin, cmd.Stdout = child, child
	var cli strings.Builder
	cmd.Stderr = &cli
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(cli.String(), ourLink) {
		t.Errorf("the CLI inherited the service's end %s:\n%s", ourLink, cli.String())
	}
	// Any other child, started while both ends are open.
	other := exec.Command("/bin/sh", "-c", list)
	var o strings.Builder
	other.Stderr = &o
	if err := other.Run(); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(o.String(), ourLink) || strings.Contains(o.String(), childLink) {
		t.Errorf("another child inherited an end of the agent's socketpair (%s, %s):\n%s", ourLink, childLink, o.String())
	}
}
