package bridge_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/bridge"
)

// A session is kept with the sandbox: it outlives a suspend (a use of the
// id resumes the sandbox), and destroying the sandbox removes it.
func TestSessionsSurviveSuspend(t *testing.T) {
	st, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	c.must(200, "POST", "/v1/sandbox/"+id+"/session", []byte(`{"id":"keep","cwd":"/workspace/w","env":{"TOKEN_NAME":"kept across suspend"}}`))
	c.must(200, "PUT", "/v1/sandbox/"+id+"/file/workspace/w/f.txt", []byte("file kept\n"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := st.Manager.Suspend(ctx, id); err != nil {
		t.Fatal(err)
	}
	if got := string(c.must(200, "GET", "/v1/sandbox/"+id+"/running", nil)); got != `{"running":false}` {
		t.Fatalf("running while suspended: %s", got)
	}
	res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", `pwd; echo "$TOKEN_NAME"; cat f.txt`}}, "Session-Id", "keep")
	if res.stdout != "/workspace/w\nkept across suspend\nfile kept\n" || res.exit != 0 {
		t.Errorf("after a suspend and a resume: %+v", res)
	}
	c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
	res = c.exec(id, map[string]any{"argv": []string{"sh", "-c", `echo "${TOKEN_NAME-none}"; ls /workspace`}}, "Session-Id", "keep")
	if res.stdout != "none\n" {
		t.Errorf("a destroyed sandbox's session came back: %+v", res)
	}
	c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
}

// A link inside /workspace never carries the persisted tar, or a
// hydrated one, out of it: the link is stored as a link, a /workspace
// that is itself a link is refused, and a tar that writes through a link
// replaces the link, never writes through it.
func TestLinksStayLinks(t *testing.T) {
	_, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	defer c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
	if res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", "ln -s /etc /workspace/etc && ln -s ../../etc/passwd /workspace/pw && echo x > /workspace/f"}}); res.exit != 0 {
		t.Fatalf("%+v", res)
	}
	ents, _ := readTar(t, c.must(200, "POST", "/v1/sandbox/"+id+"/persist", nil))
	if e := ents["./etc"]; e.typ != '2' || e.link != "/etc" {
		t.Errorf("./etc: %+v", e)
	}
	if e := ents["./pw"]; e.typ != '2' || e.link != "../../etc/passwd" || e.content != "" {
		t.Errorf("./pw: %+v", e)
	}
	for name, e := range ents {
		if strings.HasPrefix(name, "./etc/") || strings.Contains(e.content, "root:") {
			t.Errorf("the tar holds %s from outside /workspace", name)
		}
	}
	// A tar entry below a link replaces the link with a directory: nothing
	// is written through it.
	c.must(200, "POST", "/v1/sandbox/"+id+"/hydrate", tarOf(t, "etc/evil", "x"))
	res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", "test -d /workspace/etc && ! test -L /workspace/etc && test -f /workspace/etc/evil && ! test -e /etc/evil"}})
	if res.exit != 0 {
		t.Errorf("a tar entry below a link went through it: %+v", res)
	}
	// /workspace itself a link.
	if res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", "cd / && rm -rf /workspace && ln -s /etc /workspace"}}); res.exit != 0 {
		t.Fatalf("%+v", res)
	}
	resp, body := c.do(c.req("POST", "/v1/sandbox/"+id+"/persist", nil))
	if resp.StatusCode != 502 || bytes.Contains(body, []byte("root:")) {
		t.Errorf("persist of a /workspace that is a link to /etc: %d %.200s", resp.StatusCode, body)
	}
}

// A session is a shell: `cd`, `export`, unexported variables, functions
// and aliases carry from one exec to the next (each exec started fresh:
// `cd /tmp; export X=1`, then `pwd; echo $X` printed /workspace and
// nothing), each command keeping its exact exit code, its stdout and
// stderr apart and its timeout; a cwd given with one command is for it
// alone; sessions are apart from each other and from commands without
// one; and the directory and exported variables outlive a suspend
// (functions and aliases do not).
func TestSessionsAreShells(t *testing.T) {
	st, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	run := func(sid string, argv ...string) execResult {
		t.Helper()
		if sid == "" {
			return c.exec(id, map[string]any{"argv": argv})
		}
		return c.exec(id, map[string]any{"argv": argv}, "Session-Id", sid)
	}
	// The issue's own example, as a bridge client sends it.
	if res := run("one", "sh", "-c", "cd /tmp; export X=1"); res.exit != 0 {
		t.Fatalf("cd and export: %+v", res)
	}
	if res := run("one", "sh", "-c", `pwd; echo "$X"`); res.stdout != "/tmp\n1\n" {
		t.Errorf("the next command of the session: %q, want /tmp and 1", res.stdout)
	}
	res := run("one", "bash", "-c", `Y=2; f() { echo "fun $1"; }; alias hi='echo aliased'; unset HOME; echo out; echo err >&2; exit 7`)
	if res.exit != 7 || res.stdout != "out\n" || res.stderr != "err\n" {
		t.Errorf("exit code and streams in a session: %+v", res)
	}
	if res := run("one", "bash", "-c", `echo "Y=$Y HOME=${HOME-unset}"; f a; hi b`); res.stdout != "Y=2 HOME=unset\nfun a\naliased b\n" || res.exit != 0 {
		t.Errorf("variables, functions and aliases carried: %+v", res)
	}
	// argv run in the shell itself: a builtin changes the session.
	run("one", "cd", "/workspace")
	c.must(200, "PUT", "/v1/sandbox/"+id+"/file/workspace/sub/f", []byte("x"))
	if res := c.exec(id, map[string]any{"argv": []string{"pwd"}, "cwd": "/workspace/sub"}, "Session-Id", "one"); res.stdout != "/workspace/sub\n" {
		t.Errorf("a command with its own cwd: %q", res.stdout)
	}
	if res := run("one", "pwd"); res.stdout != "/workspace\n" {
		t.Errorf("after a command with its own cwd, the session's: %q, want /workspace", res.stdout)
	}
	// A timeout stops the command, not the session.
	if res := c.exec(id, map[string]any{"argv": []string{"sleep", "60"}, "timeout_ms": 300}, "Session-Id", "one"); res.exit != 124 {
		t.Errorf("a session command past its timeout: %+v, want exit 124", res)
	}
	// Apart: another session, and a command without one.
	if res := run("two", "sh", "-c", `pwd; echo "${X-none}"`); res.stdout != "/workspace\nnone\n" {
		t.Errorf("another session: %q", res.stdout)
	}
	if res := run("", "sh", "-c", `pwd; echo "${X-none}"`); res.stdout != "/workspace\nnone\n" {
		t.Errorf("a command without a session: %q", res.stdout)
	}

	// Suspended and resumed: its directory and exported variables are
	// back; functions, aliases and unexported variables are not.
	run("one", "sh", "-c", "cd /workspace/sub; export KEPT='a b'")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := st.Manager.Suspend(ctx, id); err != nil {
		t.Fatal(err)
	}
	if res := run("one", "bash", "-c", `pwd; echo "$X|$KEPT|${HOME-unset}|${Y-none}"; type f >/dev/null 2>&1 || echo no-f`); res.stdout != "/workspace/sub\n1|a b|unset|none\nno-f\n" {
		t.Errorf("after a suspend and a resume: %q", res.stdout)
	}
	c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
}

// Commands of one session run one at a time, in order, as the
// reference's do: the second waits for the first (its stream starting at
// once, the process id in a comment) and sees what it did.
func TestSessionCommandsTakeTurns(t *testing.T) {
	_, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	first := make(chan execResult, 1)
	go func() {
		first <- c.exec(id, map[string]any{"argv": []string{"bash", "-c", "touch /workspace/started; sleep 1; export ORDER=first; echo done"}}, "Session-Id", "s")
	}()
	waitFor(t, "the first command to start", func() bool {
		resp, _ := c.do(c.req("GET", "/v1/sandbox/"+id+"/file/workspace/started", nil))
		return resp.StatusCode == 200
	})
	b, _ := json.Marshal(map[string]any{"argv": []string{"sh", "-c", `echo "$ORDER"`}})
	resp, out := c.do(c.req("POST", "/v1/sandbox/"+id+"/exec", bytes.NewReader(b), "Session-Id", "s"))
	second := parseExec(t, out)
	if second.stdout != "first\n" {
		t.Errorf("the second command of the session: %q, want what the first exported", second.stdout)
	}
	if resp.Header.Get(bridge.HeaderProcessID) == "" && !strings.Contains(string(out), ": X-Process-Id: ") {
		t.Errorf("the second command's stream names no process id:\n%s", out)
	}
	if res := <-first; res.stdout != "done\n" {
		t.Errorf("the first command: %+v", res)
	}
	c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
}
