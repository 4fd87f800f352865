package localbox

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestIsolation attacks a sandbox from inside, as root, the way an escape
// would be tried, and checks that every attempt fails.
func TestIsolation(t *testing.T) {
	needRoot(t)
	// A state directory on the root file system (not under /tmp, which the
	// sandbox's own tmpfs hides anyway), to check that it is hidden.
	stateDir, err := os.MkdirTemp("/var/tmp", "sandgate-isolation-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	m, err := NewRuntime(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, id := range []string{"jail", "jail-root", "ro"} {
			_ = m.Delete(context.Background(), id, true)
		}
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	hostPort := ln.Addr().(*net.TCPAddr).Port
	marker := "/etc/sandgate-escape-" + filepath.Base(stateDir)

	var capMask uint64
	for _, c := range Capabilities {
		capMask |= 1 << capNumbers[c]
	}
	checks := []struct{ name, script string }{
		{"mount", "mount -t tmpfs none /mnt"},
		{"remount root", "mount -o remount,rw /"},
		{"unshare", "unshare -m true"},
		{"chroot escape via mknod", "mknod /tmp/sda b 8 0"},
		{"init_module", `python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(175,0,0,b"")==0 else 1)'`},
		{"finit_module", `python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(313,0,b"",0)==0 else 1)'`},
		{"raw socket", `python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)'`},
		{"packet socket", `python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)'`},
		{"host loopback", fmt.Sprintf(`python3 -c 'import socket; socket.create_connection(("127.0.0.1", %d), 2)'`, hostPort)},
		{"outside address", `python3 -c 'import socket; socket.create_connection(("192.0.2.1", 80), 2)'`},
		{"host interfaces", `test "$(ls /sys/class/net)" != lo`},
		{"host processes", `n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; test $n -gt 6`},
		{"init environment", "cat /proc/1/environ"},
		{"init root", "ls /proc/1/root/"},
		{"kcore", "test $(head -c 16 /proc/kcore | wc -c) -gt 0"},
		{"keys", "test -s /proc/keys"},
		{"sysctl write", "echo x > /proc/sys/kernel/domainname"},
		{"sysrq", "echo h > /proc/sysrq-trigger"},
		{"sysfs write", "echo 1 > /sys/kernel/profiling"},
		{"firmware", "test -n \"$(ls -A /sys/firmware)\""},
		{"state directory", fmt.Sprintf("ls -A %s | grep -q jail", stateDir)},
		{"device outside the list", `test -n "$(ls /dev | grep -v -x -E 'null|zero|full|random|urandom|tty|ptmx|pts|shm|fd|stdin|stdout|stderr')"`},
		{"leaked descriptor", `test -n "$(ls /proc/self/fd | grep -v -x -E '0|1|2|3')"`},
		{"capabilities", fmt.Sprintf(`grep -q -E 'CapEff:\s*%016x' /proc/self/status && grep -q -E 'CapBnd:\s*%016x' /proc/self/status && grep -q -E 'CapInh:\s*0+$' /proc/self/status && grep -q -E 'CapAmb:\s*0+$' /proc/self/status && grep -q -E 'NoNewPrivs:\s*1' /proc/self/status && grep -q -E 'Seccomp:\s*2' /proc/self/status && exit 1`, capMask, capMask)},
		{"host file", fmt.Sprintf("echo pwned > %s", marker)}, // lands in the layer, never on the host
	}
	// Controls: the tools the checks use work, so a check cannot pass only
	// because its tool is missing.
	controls := []struct{ name, script string }{
		{"python", `python3 -c 'import socket'`},
		{"loopback", `python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(); socket.create_connection(s.getsockname(), 2)'`},
		{"mount binary", "command -v mount && command -v unshare && command -v mknod"},
		{"dgram socket", `python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)'`},
	}
	// On the default image, and on the host's whole root (a configured
	// image, where the state directory is masked).
	for _, jail := range []struct {
		id     string
		rootfs string
	}{{"jail", ""}, {"jail-root", "/"}} {
		runDetached(t, m, jail.id, func(o *RunOptions) { o.Rootfs = jail.rootfs })
		var script strings.Builder
		for _, c := range controls {
			fmt.Fprintf(&script, "if ! ( %s ) >/dev/null 2>&1; then echo 'BROKEN CONTROL: %s'; fi\n", c.script, c.name)
		}
		for _, c := range checks {
			fmt.Fprintf(&script, "if ( %s ) >/dev/null 2>&1; then echo 'ESCAPE: %s'; fi\n", c.script, c.name)
		}
		script.WriteString("echo checked\n")
		code, out, errOut := sh(t, m, jail.id, script.String())
		if code != 0 || !strings.HasSuffix(out, "checked\n") {
			t.Fatalf("%s: exit %d, %q, %q", jail.id, code, out, errOut)
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "BROKEN") || strings.HasPrefix(line, "ESCAPE") && line != "ESCAPE: host file" {
				t.Errorf("%s: %s", jail.id, line)
			}
		}
		if _, err := os.Stat(marker); err == nil {
			os.Remove(marker)
			t.Errorf("%s: a write inside reached the host's %s", jail.id, marker)
		}
	}

	// Without --write the root is read-only; /tmp is still writable.
	runDetached(t, m, "ro", func(o *RunOptions) { o.Write = false })
	if code, out, _ := sh(t, m, "ro", "touch /etc/x 2>/dev/null && echo ESCAPE; echo ok > /tmp/ok && cat /tmp/ok"); code != 0 || out != "ok\n" {
		t.Errorf("read-only sandbox: %d %q", code, out)
	}
}
