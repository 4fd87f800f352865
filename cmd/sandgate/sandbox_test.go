package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/localbox"
)

// sandboxCLI runs the built sandgate binary (whose main hooks the
// sandbox init) with a private state directory.
func sandboxCLI(t *testing.T, state string, stdin []byte, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(binary(t), append([]string{"sandbox"}, args...)...)
	cmd.Env = append(os.Environ(), "SANDGATE_STATE_DIR="+state)
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return code, out.String(), errOut.String()
}

func TestSandboxCLI(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	state := t.TempDir()
	t.Cleanup(func() {
		sandboxCLI(t, state, nil, "delete", "--force", "cli")
		sandboxCLI(t, state, nil, "delete", "--force", "once")
		sandboxCLI(t, state, nil, "delete", "--force", "copy")
		sandboxCLI(t, state, nil, "delete", "--force", "forked")
	})
	if code, out, errOut := sandboxCLI(t, state, nil, "run", "once", "-e", "X=1", "--", "sh", "-c", "echo $X; echo err >&2; exit 3"); code != 3 || out != "1\n" || errOut != "err\n" {
		t.Errorf("run: %d %q %q", code, out, errOut)
	}
	if code, _, errOut := sandboxCLI(t, state, nil, "run", "bad_id", "--", "true"); code != 2 || !strings.Contains(errOut, "^[a-zA-Z0-9][a-zA-Z0-9-]*$") {
		t.Errorf("bad id: %d %q", code, errOut)
	}
	bin := binary(t)
	// --detach prints the sandbox's id, as docker run -d does (it printed nothing).
	if code, out, errOut := sandboxCLI(t, state, nil, "run", "cli", "--detach", "--write",
		"--mount", "type=bind,source="+bin+",destination=/.sandgate/sandgate,readonly", "--", "sleep", "infinity"); code != 0 || out != "cli\n" {
		t.Fatalf("run --detach: %d %q %q; want 0 and the id on stdout", code, out, errOut)
	}
	// stdin to EOF, binary-safe, through exec.
	payload := bytes.Repeat([]byte{0, 1, 2, 255, '\n'}, 1<<18)
	if code, out, errOut := sandboxCLI(t, state, payload, "exec", "cli", "--", "cat"); code != 0 || out != string(payload) {
		t.Errorf("exec cat: %d, %d bytes back of %d, %q", code, len(out), len(payload), errOut)
	}
	// The bind-mounted binary runs inside the sandbox.
	if code, out, errOut := sandboxCLI(t, state, nil, "exec", "cli", "--", "/.sandgate/sandgate", "--version"); code != 0 || !strings.HasPrefix(out, "sandgate version ") {
		t.Errorf("sandgate --version inside the sandbox: %d %q %q", code, out, errOut)
	}
	if code, _, errOut := sandboxCLI(t, state, nil, "exec", "cli", "--", "sh", "-c", "echo kept > /root/f; echo lost > /tmp/f"); code != 0 {
		t.Fatalf("exec: %d %q", code, errOut)
	}
	layer := filepath.Join(t.TempDir(), "layer.tar")
	if code, _, errOut := sandboxCLI(t, state, nil, "tar", "cli", "--file="+layer); code != 0 {
		t.Fatalf("tar: %d %q", code, errOut)
	}
	if code, out, errOut := sandboxCLI(t, state, nil, "run", "copy", "--import-tar="+layer, "--", "cat", "/root/f"); code != 0 || out != "kept\n" {
		t.Errorf("run --import-tar: %d %q %q", code, out, errOut)
	}
	if code, out, errOut := sandboxCLI(t, state, nil, "fork", "cli", "forked", "--detach"); code != 0 || out != "forked\n" {
		t.Errorf("fork --detach: %d %q %q; want 0 and the new id on stdout", code, out, errOut)
	}
	if code, out, errOut := sandboxCLI(t, state, nil, "exec", "forked", "--", "cat", "/root/f"); code != 0 || out != "kept\n" {
		t.Errorf("exec in the fork: %d %q %q", code, out, errOut)
	}
	_, out, _ := sandboxCLI(t, state, nil, "list", "--json")
	var infos []localbox.Info
	if err := json.Unmarshal([]byte(out), &infos); err != nil || len(infos) != 4 {
		t.Fatalf("list --json: %q, %v", out, err)
	}
	if code, _, _ := sandboxCLI(t, state, nil, "delete", "cli"); code == 0 {
		t.Error("delete of a running sandbox without --force succeeded")
	}
	for _, id := range []string{"cli", "once", "copy", "forked"} {
		if code, _, errOut := sandboxCLI(t, state, nil, "delete", "--force", id); code != 0 {
			t.Errorf("delete %s: %d %q", id, code, errOut)
		}
	}
	if _, out, _ := sandboxCLI(t, state, nil, "list"); strings.Count(out, "\n") != 1 {
		t.Errorf("list after delete: %q", out)
	}
}

// TestSandboxCLIExitCodes: each failure the runtime types has its own exit
// status (localbox.ExitCode), the same the help text and README list, and
// a command's own status still passes through exec.
func TestSandboxCLIExitCodes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	state := t.TempDir()
	t.Cleanup(func() {
		for _, id := range []string{"ec", "ec-stopped"} {
			sandboxCLI(t, state, nil, "delete", "--force", id)
		}
	})
	if code, _, errOut := sandboxCLI(t, state, nil, "run", "ec", "--detach", "--", "sleep", "infinity"); code != 0 {
		t.Fatalf("run: %d %q", code, errOut)
	}
	if code, _, errOut := sandboxCLI(t, state, nil, "run", "ec-stopped", "--", "true"); code != 0 {
		t.Fatalf("run: %d %q", code, errOut)
	}
	held := filepath.Join(state, "held")
	if err := os.Mkdir(held, 0o700); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(held, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.FcntlFlock(lock.Fd(), unix.F_OFD_SETLK, &unix.Flock_t{Type: unix.F_WRLCK}); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "l.tar")
	for _, tc := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"run", "bad_id", "--", "true"}, localbox.ExitBadInput, "must match"},
		{[]string{"run", "cpus", "--cpus", "half", "--", "true"}, localbox.ExitBadInput, "--cpus"},
		{[]string{"run", "cpus", "--cpus", "0.001", "--", "true"}, localbox.ExitBadInput, "--cpus"},
		{[]string{"run", "cpus", "--cpus", "-1", "--", "true"}, localbox.ExitBadInput, "--cpus"},
		{[]string{"run", "cpus", "--cpu-weight", "10001", "--", "true"}, localbox.ExitBadInput, "--cpu-weight"},
		{[]string{"run", "cpus", "--cpu-weight", "heavy", "--", "true"}, localbox.ExitBadInput, "cpu-weight"},
		{[]string{"run", "cpus", "--sandboxes-cpu-weight", "10001", "--", "true"}, localbox.ExitBadInput, "--sandboxes-cpu-weight"},
		{[]string{"delete", "ec"}, localbox.ExitRunning, "is running"},
		{[]string{"exec", "nobody", "--", "true"}, localbox.ExitNotFound, "no such sandbox"},
		{[]string{"tar", "nobody", "--file=" + file}, localbox.ExitNotFound, "no such sandbox"},
		{[]string{"fork", "nobody", "other", "--detach"}, localbox.ExitNotFound, "no such sandbox"},
		{[]string{"delete", "--force", "nobody"}, localbox.ExitNotFound, "no such sandbox"},
		{[]string{"run", "ec", "--detach", "--", "true"}, localbox.ExitExists, "already exists"},
		{[]string{"fork", "ec-stopped", "ec", "--detach"}, localbox.ExitExists, "already exists"},
		{[]string{"tar", "held", "--file=" + file}, localbox.ExitBusy, "busy"},
		{[]string{"exec", "held", "--", "true"}, localbox.ExitBusy, "busy"},
		{[]string{"exec", "ec-stopped", "--", "true"}, localbox.ExitNotRunning, "not running"},
		{[]string{"exec", "ec", "--", "sh", "-c", "exit 120"}, 120, ""}, // the command's own
	} {
		code, _, errOut := sandboxCLI(t, state, nil, tc.args...)
		if code != tc.code || !strings.Contains(errOut, tc.says) {
			t.Errorf("%v: exit %d %q, want %d and %q", tc.args, code, errOut, tc.code, tc.says)
		}
	}
	if _, err := os.Stat(filepath.Join(state, "cpus")); err == nil {
		t.Errorf("a run refused for its CPU flags left sandbox cpus behind")
	}
	if code, out, _ := sandboxCLI(t, state, nil, "--help"); code != 0 || !strings.Contains(out, "120    no such sandbox") {
		t.Errorf("help does not list the exit statuses: %d %q", code, out)
	}
}
