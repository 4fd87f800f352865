package appliance

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// TestLauncherErrorsTyped: each failure of `sandgate sandbox` reaches the
// launcher's caller as the sentinel it means (from the CLI's exit status,
// not its text), still a *CLIError with the CLI's message.
func TestLauncherErrorsTyped(t *testing.T) {
	skipUnlessSandboxes(t)
	bin := gobuild.Sandgate(t)
	state := t.TempDir()
	l, err := NewLauncher(LauncherConfig{CLI: bin, StateDir: state, AgentBinary: bin})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t.Cleanup(func() {
		for _, id := range []string{"typed", "typed-copy"} {
			l.Delete(context.Background(), id)
		}
	})
	is := func(what string, err, want error) {
		t.Helper()
		var ce *CLIError
		if !errors.Is(err, want) || !errors.As(err, &ce) || ce.Kind != want || ce.Output == "" {
			t.Fatalf("%s: %v (%T), want a *CLIError matching %v", what, err, err, want)
		}
		for _, other := range []error{ErrNotFound, ErrExists, ErrBusy, ErrNotRunning, ErrRunning, ErrBadInput} {
			if other != want && errors.Is(err, other) {
				t.Fatalf("%s: %v also matches %v", what, err, other)
			}
		}
	}

	if err := l.Create(ctx, "typed", LaunchOptions{}); err != nil {
		t.Fatal(err)
	}
	is("create of a taken id", l.Create(ctx, "typed", LaunchOptions{}), ErrExists)
	if err := l.Fork(ctx, "typed", "typed-copy"); err != nil {
		t.Fatal(err)
	}
	is("fork onto a taken id", l.Fork(ctx, "typed", "typed-copy"), ErrExists)
	file := filepath.Join(t.TempDir(), "layer.tar")
	is("tar of an unknown id", l.Tar(ctx, "nobody", file), ErrNotFound)
	is("fork of an unknown id", l.Fork(ctx, "nobody", "typed-2"), ErrNotFound)
	is("delete of an unknown id", l.Delete(ctx, "nobody"), ErrNotFound)

	// Busy: another process holds the sandbox's lock while creating it.
	busy := filepath.Join(state, "held")
	if err := os.Mkdir(busy, 0o700); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(busy, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.FcntlFlock(lock.Fd(), unix.F_OFD_SETLK, &unix.Flock_t{Type: unix.F_WRLCK}); err != nil {
		t.Fatal(err)
	}
	is("tar of a sandbox being created", l.Tar(ctx, "held", file), ErrBusy)
	lock.Close()
	os.RemoveAll(busy)

	// Bad input is refused before the CLI runs: typed, but no CLIError.
	if err := l.Create(ctx, "bad_id", LaunchOptions{}); !errors.Is(err, ErrBadInput) {
		t.Fatalf("create of a bad id: %v", err)
	}

	for _, id := range []string{"typed", "typed-copy"} {
		if err := l.Delete(ctx, id); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}
}

// TestExitCodesComeFromTheAgent: a command's exit status is what the agent
// reports, never read from the sandbox CLI's: a command exiting with each
// status a CLI uses for its own failures is just that command's status,
// on `sandgate sandbox` (typed statuses) and on Google's CLI (which would
// say 1 for all of them).
func TestExitCodesComeFromTheAgent(t *testing.T) {
	for _, mode := range cliModes {
		t.Run(string(mode), func(t *testing.T) { testExitCodesComeFromTheAgent(t, mode) })
	}
}

func testExitCodesComeFromTheAgent(t *testing.T, mode cliMode) {
	e := newEnvOn(t, mode)
	for _, code := range []int{1, 2, 119, 120, 121, 122, 123, 137} {
		st, err := e.sb.Run(e.ctx(), agent.Cmd{Args: []string{"/bin/sh", "-c", fmt.Sprintf("exit %d", code)}})
		if err != nil || st.Code != code || st.Signal != 0 {
			t.Errorf("exit %d: got %v, %v", code, st, err)
		}
	}
	st, err := e.sb.Run(e.ctx(), agent.Cmd{Args: []string{"/bin/sh", "-c", "kill -KILL $$"}})
	if err != nil || st.Signal != unix.SIGKILL {
		t.Errorf("a command killed by SIGKILL: %v, %v", st, err)
	}
}

// TestSandboxDeletedBehindItsBack: when the sandbox is deleted by someone
// else, its agent is not restarted in vain: operations fail with
// ErrNotFound, and Destroy, finding it gone, succeeds.
func TestSandboxDeletedBehindItsBack(t *testing.T) {
	e := newEnv(t)
	cmd := exec.Command(gobuild.Sandgate(t), "sandbox", "delete", "--force", e.sb.ID())
	cmd.Env = append(os.Environ(), "SANDGATE_STATE_DIR="+e.state)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("delete behind its back: %v %s", err, out)
	}
	var err error
	seen := map[string]int{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("errors of Run meanwhile: %v", seen)
		}
	})
	waitFor(t, "operations to report the sandbox gone", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = e.sb.Run(ctx, agent.Cmd{Args: []string{"true"}})
		seen[fmt.Sprint(err)]++
		return errors.Is(err, ErrNotFound)
	})
	if !strings.Contains(err.Error(), e.sb.ID()) {
		t.Errorf("the error does not name the sandbox: %v", err)
	}
}

// TestGoogleCLIFailuresUntyped: Google's CLI exits with one status for
// every failure, so the launcher types none of them, even a status that
// means "not found" from `sandgate sandbox`; the same status from a
// sandgate CLI is typed. (The sandbox here still runs commands: exec
// succeeds, so the launcher has no second observation that it is gone.)
func TestGoogleCLIFailuresUntyped(t *testing.T) {
	dir := t.TempDir()
	script := "#!/bin/sh\n[ \"$1\" = exec ] && exit 0\necho 'something failed' >&2\nexit 120\n"
	google := filepath.Join(dir, "google", "sandbox") // the launcher knows Google's CLI by its name
	ours := filepath.Join(dir, "ours", "sandgate")
	for _, p := range []string{google, ours} {
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		cli      string
		isGoogle bool
	}{{google, true}, {ours, false}} {
		l, err := NewLauncher(LauncherConfig{CLI: tc.cli, AgentBinary: ours})
		if err != nil {
			t.Fatal(err)
		}
		if l.Google() != tc.isGoogle {
			t.Fatalf("%s: Google() = %v", tc.cli, l.Google())
		}
		err = l.Delete(context.Background(), "some-id")
		var ce *CLIError
		if !errors.As(err, &ce) || !strings.Contains(ce.Output, "something failed") {
			t.Fatalf("%s: %v, want a *CLIError with the output", tc.cli, err)
		}
		if typed := errors.Is(err, ErrNotFound); typed == tc.isGoogle {
			t.Errorf("%s: errors.Is(err, ErrNotFound) = %v", tc.cli, typed)
		}
	}
}

// TestGoogleCLIGoneFromASecondObservation: with Google's CLI a failed
// delete is ErrNotFound only when the sandbox cannot run anything either
// (exec fails too), whatever status the CLI chose.
func TestGoogleCLIGoneFromASecondObservation(t *testing.T) {
	dir := t.TempDir()
	google := filepath.Join(dir, "google", "sandbox")
	os.MkdirAll(filepath.Dir(google), 0o755)
	if err := os.WriteFile(google, []byte("#!/bin/sh\necho \"$1 failed\" >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := NewLauncher(LauncherConfig{CLI: google, AgentBinary: google})
	if err != nil {
		t.Fatal(err)
	}
	err = l.Delete(context.Background(), "some-id")
	var ce *CLIError
	if !errors.Is(err, ErrNotFound) || !errors.As(err, &ce) || !strings.Contains(ce.Output, "delete failed") {
		t.Errorf("delete of a sandbox that runs nothing: %v, want ErrNotFound with the CLI's output", err)
	}
	if !l.Gone(context.Background(), "some-id") {
		t.Error("Gone = false for a sandbox that runs nothing")
	}
	ours, err := NewLauncher(LauncherConfig{CLI: filepath.Join(dir, "sandgate"), AgentBinary: google})
	if err != nil {
		t.Fatal(err)
	}
	if ours.Gone(context.Background(), "some-id") {
		t.Error("Gone is true for `sandgate sandbox`, whose statuses say it")
	}
}

// TestAgentLinkOverGoogleCLIIsPipes: on Google's CLI the agent's link is
// the CLI's stdio relayed through pipes (its stand-in, as Google's CLI,
// never hands over its own descriptors), so the agent cannot pass sockets
// and egress goes over the link as bytes.
func TestAgentLinkOverGoogleCLIIsPipes(t *testing.T) {
	e := newEnvOn(t, googleCLI)
	// The agent is the process whose command line is exactly AgentPath
	// agent (the sandbox's main one has --idle).
	st, out, errs := e.sh(`for p in /proc/[0-9]*; do
	if [ "$(tr '\0' ' ' < $p/cmdline 2>/dev/null)" = "` + AgentPath + ` agent " ]; then readlink $p/fd/0 $p/fd/1; fi
done`)
	fds := strings.Fields(out)
	if st.Code != 0 || len(fds) != 2 {
		t.Fatalf("the agent's stdio: %v %q %q", st, out, errs)
	}
	if !strings.HasPrefix(fds[0], "pipe:[") || !strings.HasPrefix(fds[1], "pipe:[") || fds[0] == fds[1] {
		t.Errorf("the agent's stdin and stdout are %q; want two pipes", fds)
	}
	// Egress still works, over the link.
	if st, out, _ := e.sh("curl -sS $ANTHROPIC_BASE_URL/v1/pipes"); st.Code != 0 || out != "upstream saw GET /v1/pipes" {
		t.Errorf("egress over the pipes: %v %q", st, out)
	}
}

// TestGoogleCLIGetsBareTars: a compressed layer is refused for Google's CLI
// before it runs (its reference promises nothing but "a tarball"); a bare
// one is passed on.
func TestGoogleCLIGetsBareTars(t *testing.T) {
	dir := t.TempDir()
	ran := filepath.Join(dir, "ran")
	google := filepath.Join(dir, "google", "sandbox")
	os.MkdirAll(filepath.Dir(google), 0o755)
	if err := os.WriteFile(google, []byte("#!/bin/sh\necho \"$@\" >> "+ran+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := NewLauncher(LauncherConfig{CLI: google, AgentBinary: google})
	if err != nil {
		t.Fatal(err)
	}
	zst := filepath.Join(dir, "layer.tar.zst")
	os.WriteFile(zst, []byte{0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0}, 0o600)
	gz := filepath.Join(dir, "layer.tar.gz")
	os.WriteFile(gz, []byte{0x1f, 0x8b, 8, 0}, 0o600)
	for _, f := range []string{zst, gz} {
		if err := l.Create(context.Background(), "bare", LaunchOptions{ImportTar: f}); !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "bare tar") {
			t.Errorf("create from %s: %v, want ErrBadInput naming bare tars", f, err)
		}
	}
	if _, err := os.Stat(ran); err == nil {
		t.Fatal("the CLI ran for a compressed layer")
	}
	bare := filepath.Join(dir, "layer.tar")
	os.WriteFile(bare, make([]byte, 1024), 0o600)
	if err := l.Create(context.Background(), "bare", LaunchOptions{ImportTar: bare}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(ran); !strings.Contains(string(b), "--import-tar="+bare) {
		t.Errorf("the CLI ran with %q", b)
	}
}
