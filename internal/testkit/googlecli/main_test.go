package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// cli runs the stand-in with args and stdin over a state directory.
func cli(t *testing.T, state string, stdin []byte, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, gobuild.GoogleCLI(t), args...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SANDGATE_STATE_DIR=" + state}
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("sandbox %v: %v", args, ctx.Err())
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), out.String(), errb.String()
	} else if err != nil {
		t.Fatalf("sandbox %v: %v", args, err)
	}
	return 0, out.String(), errb.String()
}

// Flags and verbs it does not know are refused as a cobra command refuses
// them, with exit 1 and before anything runs.
func TestRefusesWhatItDoesNotKnow(t *testing.T) {
	state := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "a", "--bogus", "--", "true"}, "unknown flag: --bogus"},
		{[]string{"run", "a", "-x", "--", "true"}, `unknown shorthand flag: "x"`},
		{[]string{"exec", "a", "--detach", "--", "true"}, "unknown flag: --detach"},
		{[]string{"tar", "a", "--file=f", "--compression=zstd"}, "unknown flag: --compression"},
		{[]string{"delete", "a", "--template", "t"}, "unknown flag: --template"},
		{[]string{"list"}, `unknown command "list"`},
		{[]string{"template", "ls"}, `unknown command "template"`},
		{[]string{"run", "a_b", "--detach", "--", "true"}, "invalid sandbox id"},
		{[]string{"run", "a", "--detach", "true"}, "got 2 arguments"},
		{[]string{"run", "a", "--detach"}, "put the command after --"},
		{[]string{"run", "a", "--stdin=maybe", "--", "true"}, `invalid argument "maybe"`},
		{[]string{"run", "a", "--allow-egress", "--", "true"}, "--allow-egress"},
		{[]string{"tar", "a"}, "--file=F"},
	} {
		code, _, errs := cli(t, state, nil, tc.args...)
		if code != exitFailure || !strings.Contains(errs, tc.want) {
			t.Errorf("sandbox %v: exit %d, %q; want exit %d saying %q", tc.args, code, errs, exitFailure, tc.want)
		}
	}
	if ents, _ := os.ReadDir(state); len(ents) != 0 {
		t.Errorf("a refused command left state: %v", ents)
	}
}

func TestParse(t *testing.T) {
	p, err := parse(verbs["run"].flags, []string{"id", "--detach", "--write=false", "--import-tar", "f.tar", "-e", "A=1", "-eB=2", "--mount=m1", "--mount", "m2", "--stdin=false", "--", "cmd", "--detach"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(p.pos, ",") != "id" || !p.bools["detach"] || p.bools["write"] || p.bools["stdin"] || p.str["import-tar"] != "f.tar" ||
		strings.Join(p.multi["env"], ",") != "A=1,B=2" || strings.Join(p.multi["mount"], ",") != "m1,m2" || strings.Join(p.cmd, " ") != "cmd --detach" {
		t.Errorf("parsed %+v", p)
	}
	if p, _ := parse(verbs["exec"].flags, []string{"id", "--", "x"}); !p.bools["stdin"] {
		t.Error("--stdin does not default to true")
	}
}

func skipUnlessSandboxes(t *testing.T) {
	t.Helper()
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		t.Skip("sandboxes need Linux and root")
	}
}

// Every failure exits 1, whatever `sandgate sandbox` said (not found 120,
// exists 121, a command's own status, a command killed by SIGKILL), and
// success 0.
func TestEveryFailureExitsOne(t *testing.T) {
	skipUnlessSandboxes(t)
	state := t.TempDir()
	t.Cleanup(func() { cli(t, state, nil, "delete", "one", "--force") })
	if code, _, errs := cli(t, state, nil, "run", "one", "--detach", "--write", "--stdin=false", "--", "sleep", "infinity"); code != 0 {
		t.Fatalf("run: %d %s", code, errs)
	}
	for _, tc := range [][]string{
		{"run", "one", "--detach", "--", "sleep", "infinity"}, // exists
		{"delete", "nobody", "--force"},                       // not found
		{"tar", "nobody", "--file=" + filepath.Join(t.TempDir(), "l.tar")},
		{"fork", "nobody", "two", "--detach"},
		{"exec", "nobody", "--", "true"},
		{"exec", "one", "--", "sh", "-c", "exit 7"},
		{"exec", "one", "--", "sh", "-c", "exit 120"},
		{"exec", "one", "--", "sh", "-c", "kill -KILL $$"}, // 1, not 137
	} {
		if code, _, _ := cli(t, state, nil, tc...); code != exitFailure {
			t.Errorf("sandbox %v: exit %d, want %d", tc, code, exitFailure)
		}
	}
	if code, out, errs := cli(t, state, nil, "exec", "one", "--", "echo", "ok"); code != 0 || out != "ok\n" {
		t.Errorf("exec echo: %d %q %q", code, out, errs)
	}
	// A compressed layer is refused before anything runs.
	var z bytes.Buffer
	enc, _ := zstd.NewWriter(&z)
	enc.Write(make([]byte, 1024))
	enc.Close()
	f := filepath.Join(t.TempDir(), "layer.tar.zst")
	os.WriteFile(f, z.Bytes(), 0o600)
	if code, _, errs := cli(t, state, nil, "run", "two", "--detach", "--write", "--import-tar="+f, "--", "true"); code != exitFailure || !strings.Contains(errs, "compressed") {
		t.Errorf("run with a zstd layer: %d %q", code, errs)
	}
}

// The command's stdio are pipes between it and the stand-in, never the
// stand-in's own descriptors, and bytes cross them both ways intact.
func TestStdioRelayedThroughPipes(t *testing.T) {
	skipUnlessSandboxes(t)
	state := t.TempDir()
	t.Cleanup(func() { cli(t, state, nil, "delete", "relay", "--force") })
	if code, _, errs := cli(t, state, nil, "run", "relay", "--detach", "--write", "--stdin=false", "--", "sleep", "infinity"); code != 0 {
		t.Fatalf("run: %d %s", code, errs)
	}
	// The caller's stdin is a regular file: the command must see a pipe.
	in := filepath.Join(t.TempDir(), "stdin")
	os.WriteFile(in, []byte("from the file"), 0o600)
	f, err := os.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(gobuild.GoogleCLI(t), "exec", "relay", "--", "sh", "-c", "readlink /proc/self/fd/0 /proc/self/fd/1 /proc/self/fd/2; cat")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "SANDGATE_STATE_DIR=" + state}
	cmd.Stdin = f
	var errb bytes.Buffer
	cmd.Stderr = &errb
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("exec: %v %s", err, errb.String())
	}
	lines := strings.Split(string(out), "\n")
	if len(lines) != 4 || lines[3] != "from the file" {
		t.Fatalf("exec output %q", out)
	}
	for _, l := range lines[:3] {
		if !strings.HasPrefix(l, "pipe:[") {
			t.Errorf("the command's stdio %q: want pipes only", lines[:3])
		}
	}
	// Binary bytes round trip.
	payload := make([]byte, 1<<20)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	if code, got, errs := cli(t, state, payload, "exec", "relay", "--", "cat"); code != 0 || got != string(payload) {
		t.Errorf("cat of 1 MiB: exit %d, %d bytes back, %q", code, len(got), errs)
	}
}
