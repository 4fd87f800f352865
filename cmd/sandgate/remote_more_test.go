package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// openTestPTY opens a pseudo-terminal here: the slave stands in for a
// user's terminal (a verb's stdin, stdout or stderr), the master is what
// the test reads and types on.
func openTestPTY(t *testing.T, rows, cols uint16) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminal here: %v", err)
	}
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetUint32(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	setSize(t, s, rows, cols)
	t.Cleanup(func() { s.Close(); m.Close() })
	return m, s
}

func setSize(t *testing.T, f *os.File, rows, cols uint16) {
	t.Helper()
	if err := unix.IoctlSetWinsize(int(f.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols}); err != nil {
		t.Fatal(err)
	}
}

// screen is what a terminal shows: it reads the master side until it
// closes, and lets a test wait (bounded) for a string.
type screen struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	moved chan struct{}
}

func watch(master *os.File) *screen {
	s := &screen{moved: make(chan struct{}, 1)}
	go func() {
		b := make([]byte, 4096)
		for {
			n, err := master.Read(b)
			s.mu.Lock()
			s.buf.Write(b[:n])
			s.mu.Unlock()
			select {
			case s.moved <- struct{}{}:
			default:
			}
			if err != nil {
				return
			}
		}
	}()
	return s
}

func (s *screen) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}

func (s *screen) until(t *testing.T, want string) {
	t.Helper()
	deadline := time.After(time.Minute)
	for !strings.Contains(s.String(), want) {
		select {
		case <-s.moved:
		case <-deadline:
			t.Fatalf("waited a minute for %q on the terminal, have %q", want, s.String())
		}
	}
}

// since waits for every one of wants in what the terminal showed after
// its first n bytes.
func (s *screen) since(t *testing.T, n int, wants ...string) {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		got := s.String()[n:]
		missing := ""
		for _, w := range wants {
			if !strings.Contains(got, w) {
				missing = w
			}
		}
		if missing == "" {
			return
		}
		select {
		case <-s.moved:
		case <-deadline:
			t.Fatalf("waited a minute for %q on the terminal, have %q", missing, got)
		}
	}
}

// withService is args with the test service's flags before a "--".
func withService(t *testing.T, args ...string) []string {
	s := remoteService(t)
	service := []string{"--url", s.URL, "--token", s.Token}
	if i := strings.Index(strings.Join(args, "\x00"), "\x00--\x00"); i >= 0 {
		n := strings.Count(strings.Join(args, "\x00")[:i], "\x00") + 1
		return append(append(append([]string{"sandgate"}, args[:n]...), service...), args[n:]...)
	}
	return append(append([]string{"sandgate"}, args...), service...)
}

// exec -it: a shell on a terminal in the sandbox, this terminal in raw
// mode standing in for it: its size, TERM, what is typed, resizes, the
// exit code. It used to be "flag provided but not defined: -it".
func TestRemoteExecTTY(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "tty-box"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "rm", name) })
	master, slave := openTestPTY(t, 33, 101)
	scr := watch(master)
	t.Setenv("TERM", "xterm-test")
	app := newApp(slave, slave)
	app.Reader = slave
	done := make(chan int, 1)
	script := `stty size; echo "term=$TERM"; while [ "$(stty size)" != "40 120" ]; do sleep 0.05; done; echo resized; read line; echo "got:$line"; exit 3`
	go func() { done <- execute(ctx, app, withService(t, "exec", "-it", name, "--", "sh", "-c", script)) }()
	scr.until(t, "33 101")
	scr.until(t, "term=xterm-test")
	setSize(t, slave, 40, 120)
	syscall.Kill(os.Getpid(), syscall.SIGWINCH)
	scr.until(t, "resized")
	master.WriteString("typed\r")
	scr.until(t, "got:typed")
	select {
	case code := <-done:
		if code != 3 {
			t.Errorf("exec -it exited %d, want the command's 3; the terminal showed %q", code, scr.String())
		}
	case <-ctx.Done():
		t.Fatalf("exec -it did not end; the terminal showed %q", scr.String())
	}
	// The terminal is given back as it was (echo on, cooked).
	if st, err := unix.IoctlGetTermios(int(slave.Fd()), unix.TCGETS); err != nil || st.Lflag&unix.ECHO == 0 || st.Lflag&unix.ICANON == 0 {
		t.Errorf("the terminal was left in raw mode: %+v %v", st, err)
	}

	// -t alone: a terminal for the command, no input; -it from a pipe is
	// refused as docker refuses it.
	if code, out, _ := verb(t, ctx, nil, "exec", "-t", name, "--", "sh", "-c", "test -t 0 && test -t 1 && echo on-a-tty"); code != 0 || !strings.Contains(out, "on-a-tty") {
		t.Errorf("exec -t: %d %q", code, out)
	}
	if code, _, errOut := verb(t, ctx, strings.NewReader("x"), "exec", "-it", name, "--", "cat"); code != exitBadInput || !strings.Contains(errOut, "not a terminal") {
		t.Errorf("exec -it from a pipe: %d %q", code, errOut)
	}
	// Written after the name, -ti is read as -t -i too.
	if code, _, errOut := verb(t, ctx, nil, "exec", name, "-ti", "--", "true"); code != exitBadInput || !strings.Contains(errOut, "not a terminal") {
		t.Errorf("exec NAME -ti from a pipe: %d %q", code, errOut)
	}
}

// Removing a name that does not exist fails, as docker rm does, unless
// --force; the API stays idempotent (protocol 1).
func TestRemoteMissingNames(t *testing.T) {
	ctx := testCtx(t)
	for _, args := range [][]string{{"suspend", "no-such-box"}, {"destroy", "no-such-box"}, {"rm", "no-such-box"}, {"template", "rm", "no-such-template"}, {"inspect", "no-such-box"}} {
		code, out, errOut := verb(t, ctx, nil, args...)
		if code != exitFailure || out != "" || !strings.Contains(errOut, "no such") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want 1 saying there is no such thing", args, code, out, errOut)
		}
		if args[0] == "inspect" {
			continue
		}
		if code, out, errOut := verb(t, ctx, nil, append(args, "-f")...); code != 0 || out != "" || errOut != "" {
			t.Errorf("%v -f: exit %d %q %q, want 0 and nothing said", args, code, out, errOut)
		}
	}
	name := strings.TrimSpace(must(t, "create"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "rm", "-f", name) })
	must(t, "suspend", name)
	if out := must(t, "stop", name); out != name+"\n" {
		t.Errorf("suspending a suspended sandbox: %q", out)
	}
	// One missing among several: the others are done, the exit is 1.
	code, out, errOut := verb(t, ctx, nil, "rm", "no-such-box", name)
	if code != exitFailure || out != name+"\n" || errOut != "sandgate: destroy no-such-box: no such sandbox (--force ignores a missing one)\n" {
		t.Errorf("rm of a missing and an existing one: %d %q %q", code, out, errOut)
	}
}

// Messages name what to do in the reader's words: flags here, not the Go
// client's identifiers, and never end in a colon with nothing after it.
func TestRemoteMessages(t *testing.T) {
	ctx := testCtx(t)
	s := remoteService(t)
	var out, errb bytes.Buffer
	if code := execute(ctx, newApp(&out, &errb), []string{"sandgate", "list", "--url", s.URL}); code != 1 ||
		!strings.Contains(errb.String(), "--token or SANDBOX_SERVICE_TOKEN") || strings.Contains(errb.String(), "client.With") {
		t.Errorf("no token: %d %q", code, errb.String())
	}
	code, _, errOut := verb(t, ctx, nil, "create", "--setup", "false")
	if code != 1 || !strings.Contains(errOut, `setup command "false" exited with 1`) || strings.HasSuffix(strings.TrimSpace(errOut), ":") {
		t.Errorf("a failed --setup: %d %q", code, errOut)
	}
	name := strings.TrimSpace(must(t, "create"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "rm", "-f", name) })
	if code, _, errOut := verb(t, ctx, nil, "create", name); code != 1 || !strings.Contains(errOut, "resume it") || strings.Contains(errOut, "Resume it") {
		t.Errorf("create of a taken name: %d %q", code, errOut)
	}
	if code, _, errOut := verb(t, ctx, nil, "create", "--template", "no-such-template"); code != 1 || !strings.Contains(errOut, "no such template") || strings.Contains(errOut, "no such sandbox") {
		t.Errorf("create from a missing template: %d %q", code, errOut)
	}
}

// getJSON is the service's answer to GET path, decoded.
func getJSON(t *testing.T, path string) any {
	t.Helper()
	s := remoteService(t)
	req, _ := http.NewRequest("GET", s.URL+path, nil)
	req.Header.Set(api.HeaderToken, s.Token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v any
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// withoutUsage is a sandbox (or a list of them) as decoded, with its
// usage's values replaced by their keys: what it uses now changes between
// two reads, its shape must not.
func withoutUsage(t *testing.T, v any) any {
	t.Helper()
	switch v := v.(type) {
	case []any:
		for i := range v {
			v[i] = withoutUsage(t, v[i])
		}
	case map[string]any:
		if u, ok := v["usage"].(map[string]any); ok {
			for k := range u {
				u[k] = "set"
			}
		}
	}
	return v
}

func decoded(t *testing.T, s string) any {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, s)
	}
	return v
}

// inspect, ls --json, template ls --json and modules ls --json print what
// the service says, in its shape (they printed Go field names and null).
// fork, template save, resume --policy, transformations and modules, end
// to end.
func TestRemoteInspectForkTemplatesEgress(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "shape-box", "--base-url", "X_BASE_URL=https://x.example/v1"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "rm", "-f", name, "shape-copy", "shape-fork") })
	must(t, "exec", name, "--", "sh", "-c", "echo original > f")

	// Modules: set from files, listed in the service's shape.
	guest := gobuild.Wasm(t, "github.com/sandgate/sandgate/wasm-examples/add-header")
	cfgFile := filepath.Join(t.TempDir(), "cfg")
	os.WriteFile(cfgFile, []byte("X-Test: 1"), 0o644)
	must(t, "modules", "set", name, guest+"?@"+cfgFile)
	out := must(t, "modules", "ls", name)
	if !strings.Contains(out, "NAME") || !strings.Contains(out, "add-header") || !strings.Contains(out, "sha256:") {
		t.Errorf("modules ls:\n%s", out)
	}
	mods := decoded(t, must(t, "modules", "ls", name, "--json"))
	if want := getJSON(t, "/v1/sandboxes/"+name).(map[string]any)["modules"]; !reflect.DeepEqual(mods, want) {
		t.Errorf("modules ls --json: %v, the service: %v", mods, want)
	}

	// What a sandbox uses changes from one read to the next: its shape is
	// compared, its values are TestRemoteLimitsAndUsage's.
	got := withoutUsage(t, decoded(t, must(t, "inspect", name)))
	if want := withoutUsage(t, getJSON(t, "/v1/sandboxes/"+name)); !reflect.DeepEqual(got, want) {
		t.Errorf("inspect:\n%v\nthe service's:\n%v", got, want)
	}
	list := withoutUsage(t, decoded(t, must(t, "ls", "--json")))
	if want := withoutUsage(t, getJSON(t, "/v1/sandboxes").(map[string]any)["sandboxes"]); !reflect.DeepEqual(list, want) {
		t.Errorf("ls --json:\n%v\nthe service's:\n%v", list, want)
	}
	if out := must(t, "ls", "--json"); strings.Contains(out, "null") || strings.Contains(out, `"Name"`) {
		t.Errorf("ls --json: %s", out)
	}
	must(t, "modules", "set", name)
	if out := must(t, "modules", "ls", name, "--json"); strings.TrimSpace(out) != "[]" {
		t.Errorf("modules ls --json of none: %q, want []", out)
	}

	// fork, running and suspended.
	if out := must(t, "fork", name, "shape-copy"); out != "shape-copy\trunning\n" {
		t.Errorf("fork printed %q", out)
	}
	if out := must(t, "exec", "shape-copy", "--", "cat", "f"); out != "original\n" {
		t.Errorf("the fork's file: %q", out)
	}
	must(t, "suspend", "shape-copy")
	if out := must(t, "fork", "shape-copy", "shape-fork"); out != "shape-fork\tsuspended\n" {
		t.Errorf("fork of a suspended sandbox printed %q", out)
	}
	if code, _, errOut := verb(t, ctx, nil, "fork", name, "shape-copy"); code != 1 || !strings.Contains(errOut, "exists") {
		t.Errorf("fork onto a taken name: %d %q", code, errOut)
	}

	// resume --policy: the whole policy, which resume used to drop.
	pol := filepath.Join(t.TempDir(), "policy.json")
	os.WriteFile(pol, []byte(`{"mode":"custom","allowedHosts":["api.example.com"],"allowedCIDRs":["198.51.100.7/32"]}`), 0o644)
	must(t, "resume", "shape-fork", "--policy", pol)
	in := decoded(t, must(t, "inspect", "shape-fork")).(map[string]any)
	if p, _ := json.Marshal(in["policy"]); string(p) != `{"allowedCIDRs":["198.51.100.7/32"],"allowedHosts":["api.example.com"],"mode":"custom"}` {
		t.Errorf("resumed with --policy: %s", p)
	}
	if code, _, errOut := verb(t, ctx, nil, "resume", "shape-fork", "--policy", pol, "--allow", "x.example"); code != exitBadInput || !strings.Contains(errOut, "not both") {
		t.Errorf("--policy and --allow: %d %q", code, errOut)
	}

	// template save, then create from it.
	tpl := "shape-template"
	if out := must(t, "template", "save", name, tpl); out != tpl+"\n" {
		t.Errorf("template save printed %q", out)
	}
	t.Cleanup(func() { verb(t, context.Background(), nil, "template", "rm", "-f", tpl) })
	made := strings.TrimSpace(must(t, "create", "--template", tpl))
	t.Cleanup(func() { verb(t, context.Background(), nil, "rm", "-f", made) })
	if out := must(t, "exec", made, "--", "cat", "f"); out != "original\n" {
		t.Errorf("from the saved template: %q", out)
	}
	tpls := decoded(t, must(t, "template", "ls", "--json"))
	if want := getJSON(t, "/v1/templates").(map[string]any)["templates"]; !reflect.DeepEqual(tpls, want) {
		t.Errorf("template ls --json:\n%v\nthe service's:\n%v", tpls, want)
	}

	// transformations: the credential from the environment, swapped in
	// outside the sandbox; typos refused by name; nothing of a credential
	// in what the CLI says.
	t.Setenv("SHAPE_KEY", canary)
	rules := filepath.Join(t.TempDir(), "rules.json")
	os.WriteFile(rules, []byte(`[{"match": {"host": "api.example.com", "headers": [{"key": {"exact": "x-api-key"}, "value": {"exact": "aisdkhc_placeholder_shape"}}]},
	  "transform": {"headers": {"x-api-key": {"env": "SHAPE_KEY"}}}}]`), 0o600)
	must(t, "transformations", "set", name, rules)
	out = must(t, "exec", name, "--", "sh", "-c", `curl -sS -H "X-Api-Key: aisdkhc_placeholder_shape" "$ANTHROPIC_BASE_URL/v1/x"`)
	if out != "path=/v1/x auth= key=aisdkhc_placeholder_shape" {
		t.Errorf("through the base URL: %q", out)
	}
	if seen := remoteService(t).UpstreamSeen(); len(seen) == 0 || seen[len(seen)-1].Get("X-Api-Key") != canary {
		t.Errorf("the upstream did not get the credential")
	}
	if code, _, errOut := verb(t, ctx, nil, "exec", name, "--", "echo", canary); code != 1 || !strings.Contains(errOut, "Credentials stay outside") || strings.Contains(errOut, canary) {
		t.Errorf("the credential in a command: %d %q", code, errOut)
	}
	for _, tc := range []struct{ file, want string }{
		{`[{"match": {"hots": "a.example"}, "transform": {"headers": {}}}]`, `unknown field "hots"`},
		{`[{"match": {"host": "a.example", "path": {"exacct": "/"}}, "transform": {"headers": {}}}]`, `"exacct"`},
		{`[{"match": {"host": "a.example"}, "transfrom": {"headers": {}}}]`, `unknown field "transfrom"`},
		{`[{"match": {"host": "a.example"}, "transform": {"headers": {"k": {"env": "SANDGATE_NOT_SET_ANYWHERE"}}}}]`, "SANDGATE_NOT_SET_ANYWHERE is not set"},
		{`[{"match": {"host": "a.example"}, "transform": {"headers": {"k": {"env": "SHAPE_KEY", "prefx": "Bearer "}}}}]`, `unknown field "prefx"`},
	} {
		f := filepath.Join(t.TempDir(), "bad.json")
		os.WriteFile(f, []byte(tc.file), 0o600)
		if code, _, errOut := verb(t, ctx, nil, "transformations", "add", name, f); code != exitBadInput || !strings.Contains(errOut, tc.want) || strings.Contains(errOut, canary) {
			t.Errorf("transformations add %s: %d %q, want 2 naming %q", tc.file, code, errOut, tc.want)
		}
	}
	// Cleared, the credential stays one of the sandbox's for its life
	// (scrubbed, refused).
	must(t, "transformations", "clear", name)
	if code, _, errOut := verb(t, ctx, nil, "exec", name, "--", "echo", canary); code == 0 || !strings.Contains(errOut, "Credentials stay outside the sandbox") {
		t.Errorf("after clear: %d %q, want the cleared credential refused", code, errOut)
	}
}

// The progress of a long call draws on a terminal (bytes, rate, ETA) and
// nowhere else: a suspend's save, a resume's fetch, a template's save, cp
// of a large tree both ways, snapshot pack.
func TestRemoteProgressBars(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "bar-box"))
	t.Cleanup(func() {
		verb(t, context.Background(), nil, "rm", "-f", name)
		verb(t, context.Background(), nil, "template", "rm", "-f", "bar-template")
	})
	must(t, "exec", name, "--", "sh", "-c", "mkdir -p tree && for i in 1 2; do head -c 3145728 /dev/urandom > tree/f$i; done")
	master, slave := openTestPTY(t, 24, 100)
	scr := watch(master)
	onTTY := func(args ...string) {
		t.Helper()
		var out bytes.Buffer
		app := newApp(&out, slave)
		app.Reader = strings.NewReader("")
		if code := execute(ctx, app, withService(t, args...)); code != 0 {
			t.Fatalf("%v: exit %d; the terminal showed %q", args, code, scr.String())
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"template", "save", name, "bar-template"}, "template save bar-template: saving  "},
		{[]string{"suspend", name}, "suspend " + name + ": saving  "},
		{[]string{"resume", name}, "resume " + name + ": fetching  "},
		{[]string{"cp", name + ":tree", t.TempDir()}, "cp  "},
	} {
		before := len(scr.String())
		onTTY(tc.args...)
		scr.since(t, before, tc.want, " / ", "/s  ETA ") // bytes of a total, a rate, an ETA
	}
	local := filepath.Join(t.TempDir(), "up")
	os.MkdirAll(local, 0o755)
	for i := range 2 {
		b := make([]byte, 3<<20)
		for j := range b {
			b[j] = byte(i + j)
		}
		os.WriteFile(filepath.Join(local, fmt.Sprint(i)), b, 0o644)
	}
	before := len(scr.String())
	onTTY("cp", local, name+":up")
	scr.since(t, before, "cp  ", "6.0 MiB", "ETA")
	before = len(scr.String())
	var out bytes.Buffer
	app := newApp(&out, slave)
	if code := execute(ctx, app, []string{"sandgate", "snapshot", "pack", local, "--out", "file://" + filepath.Join(t.TempDir(), "l.tar.zst")}); code != 0 {
		t.Fatalf("snapshot pack: %d", code)
	}
	scr.since(t, before, "pack  ", "ETA")

	// Not a terminal: nothing drawn, and no progress asked of the service.
	for _, args := range [][]string{{"suspend", name}, {"resume", name}, {"cp", name + ":tree", t.TempDir()}} {
		if code, _, errOut := verb(t, ctx, nil, args...); code != 0 || errOut != "" {
			t.Errorf("%v off a terminal: %d, stderr %q", args, code, errOut)
		}
	}
}

// printList writes [] for no items, and each item in the API's shape.
func TestPrintListJSON(t *testing.T) {
	var out bytes.Buffer
	app := newApp(&out, io.Discard)
	app.Commands = append(app.Commands, &cli.Command{Name: "t", Flags: []cli.Flag{&cli.BoolFlag{Name: "json"}}, Action: func(c *cli.Context) error {
		if err := printList[client.SandboxInfo](c, nil, "", nil); err != nil {
			return err
		}
		return printList(c, []client.SandboxInfo{{Name: "a", State: "suspended", Created: time.Unix(0, 0).UTC()}}, "", nil)
	}})
	if code := execute(context.Background(), app, []string{"sandgate", "t", "--json"}); code != 0 {
		t.Fatal(code)
	}
	want := "[]\n[\n  {\n    \"name\": \"a\",\n    \"state\": \"suspended\",\n    \"created\": \"1970-01-01T00:00:00Z\",\n    \"layerBytes\": 0,\n    \"home\": \"\",\n    \"workingDirectory\": \"\"\n  }\n]\n"
	if out.String() != want {
		t.Errorf("got %q, want %q", out.String(), want)
	}
}

// create's limit flags reach the service and stay with the sandbox;
// inspect and ls show its limits and what it uses; a bad value is refused,
// naming it, and nothing is made.
func TestRemoteLimitsAndUsage(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "lim-box", "--cpus", "0.5", "--cpu-weight", "50", "--memory", "256m", "--pids", "128",
		"--disk", "1g", "--lifetime", "24h", "--keep-suspended", "48h"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "rm", "-f", name) })
	must(t, "exec", name, "--", "sh", "-c", "head -c 8388608 /dev/zero > /tmp/held; head -c 1048576 /dev/urandom > data; sleep 600 </dev/null >/dev/null 2>&1 &")

	in := decoded(t, must(t, "inspect", name)).(map[string]any)
	if l, _ := json.Marshal(in["limits"]); string(l) != `{"cpu":0.5,"cpuWeight":50,"disk":1073741824,"keepSuspended":"48h0m0s","lifetime":"24h0m0s","memory":268435456,"pids":128}` {
		t.Errorf("inspect: limits %s", l)
	}
	u, _ := in["usage"].(map[string]any)
	if u["memoryBytes"].(float64) < 8<<20 || u["memoryBytes"].(float64) > 256<<20 || u["processes"].(float64) < 2 ||
		u["cpuSeconds"].(float64) <= 0 || u["diskBytes"].(float64) < 1<<20 || u["diskQuotaBytes"].(float64) != 1<<30 {
		t.Errorf("inspect: usage %v", u)
	}
	out := must(t, "ls")
	lines := strings.Split(out, "\n")
	if f := strings.Fields(lines[0]); !slices.Equal(f[len(f)-4:], []string{"CPU", "MEMORY", "DISK", "PIDS"}) {
		t.Errorf("ls header: %q", lines[0])
	}
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 0 && f[0] == name {
			if !strings.Contains(l, " of 1.0 GiB") || strings.Count(l, " - ") > 1 {
				t.Errorf("ls: %q: want its CPU, memory, disk (of its quota) and processes", l)
			}
		}
	}

	for _, tc := range []struct {
		args []string
		code int
		says string
	}{
		// The service's refusal (400), naming the field.
		{[]string{"create", "lim-bad", "--cpus", "0.001"}, exitFailure, "limits.cpu 0.001"},
		{[]string{"create", "lim-bad", "--cpu-weight", "20000"}, exitFailure, "limits.cpuWeight"},
		{[]string{"create", "lim-bad", "--pids", "3"}, exitFailure, "limits.pids"},
		// The CLI's own.
		{[]string{"create", "lim-bad", "--memory", "lots"}, exitBadInput, "--memory"},
		{[]string{"create", "lim-bad", "--cpus", "half"}, exitBadInput, "cpus"},
	} {
		if code, _, errOut := verb(t, ctx, nil, tc.args...); code != tc.code || !strings.Contains(errOut, tc.says) {
			t.Errorf("%v: exit %d %q, want %d naming %s", tc.args, code, errOut, tc.code, tc.says)
		}
	}
	if code, _, _ := verb(t, ctx, nil, "inspect", "lim-bad"); code != 1 {
		t.Errorf("a refused create made lim-bad (inspect exit %d)", code)
	}
}
