package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/relay/audit"
)

// auditGet calls the audit route of the test service.
func auditGet(t *testing.T, ctx context.Context, name, query string) *http.Response {
	t.Helper()
	s := remoteService(t)
	req, _ := http.NewRequestWithContext(ctx, "GET", s.URL+"/v1/sandboxes/"+name+"/audit"+query, nil)
	req.Header.Set(api.HeaderToken, s.Token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// auditLines waits (bounded) until the service lists n events of name,
// and returns their bytes as the API page has them.
func auditLines(t *testing.T, name string, n int) []string {
	t.Helper()
	var got []string
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		resp := auditGet(t, testCtx(t), name, "")
		var p struct{ Events []json.RawMessage }
		err := json.NewDecoder(resp.Body).Decode(&p)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		got = got[:0]
		for _, e := range p.Events {
			got = append(got, string(e))
		}
		if len(got) >= n {
			return got
		}
	}
	t.Fatalf("%d events of %s after 20s, want %d", len(got), name, n)
	return nil
}

// One schema: an event is the same bytes in the audit log, the API's
// page, the follow stream and `sandgate audit --json`, and those bytes
// are the one encoding (relay/audit.AppendJSON, whose output
// testdata/events-v1.golden pins there).
func TestAuditOneSchemaEverywhere(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "schema-box"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "destroy", name) })
	must(t, "exec", name, "--", "sh", "-c", `curl -sS -x $HTTPS_PROXY https://denied.example.com/ 2>/dev/null; curl -sS "$HTTPS_PROXY/https/denied.example.com/x" >/dev/null; curl -sS "$ANTHROPIC_BASE_URL/v1/m" >/dev/null; true`)
	api := auditLines(t, name, 3)

	// The audit log: the lines of this sandbox's events.
	var logged []string
	for _, l := range strings.Split(remoteService(t).Log.String(), "\n") {
		if strings.Contains(l, `"message":"egress"`) && strings.Contains(l, `"sandbox":"`+name+`"`) {
			logged = append(logged, l)
		}
	}
	// The follow stream, from the start.
	resp := auditGet(t, ctx, name, "?follow=1")
	var followed []string
	sc := bufio.NewScanner(resp.Body)
	for len(followed) < len(api) && sc.Scan() {
		if sc.Text() != "" {
			followed = append(followed, sc.Text())
		}
	}
	resp.Body.Close()
	cli := strings.Split(strings.TrimSuffix(must(t, "audit", name, "--json"), "\n"), "\n")

	for what, lines := range map[string][]string{"the audit log": logged, "the follow stream": followed, "sandgate audit --json": cli} {
		if strings.Join(lines, "\n") != strings.Join(api, "\n") {
			t.Errorf("%s has\n%s\nthe API has\n%s", what, strings.Join(lines, "\n"), strings.Join(api, "\n"))
		}
	}
	for _, l := range api {
		var e audit.Event
		if err := json.Unmarshal([]byte(l), &e); err != nil {
			t.Fatalf("%s: %v", l, err)
		}
		if again := audit.AppendJSON(nil, &e); string(again) != l+"\n" {
			t.Errorf("an event that is not the one encoding:\n%s\nencoded again:\n%s", l, again)
		}
	}
}

// sandgate audit: a line per event for a person, filters, the audit of a
// suspended sandbox, and -f waiting for a suspended sandbox to resume.
func TestAuditVerb(t *testing.T) {
	ctx := testCtx(t)
	name := strings.TrimSpace(must(t, "create", "audit-box", "--allow", "api.example.com"))
	t.Cleanup(func() { verb(t, context.Background(), nil, "destroy", name) })
	must(t, "exec", name, "--", "sh", "-c", `curl -sS -x $HTTPS_PROXY https://denied.example.com/ 2>/dev/null; curl -sS "$ANTHROPIC_BASE_URL/v1/m" >/dev/null; true`)
	auditLines(t, name, 2)
	out := must(t, "audit", name)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "  deny   connect  denied.example.com  403  curl -sS -x http://127.0.0.1:") ||
		!strings.HasSuffix(lines[0], "(no_rule: no allowedHosts rule matches denied.example.com)") ||
		!strings.Contains(lines[1], "  allow  route    GET api.example.com/v1/m  200  curl -sS http://127.0.0.1:") {
		t.Errorf("sandgate audit printed:\n%s", out)
	}
	if out := must(t, "audit", name, "--decision", "allow", "--since", "1h", "--host", "*.example.com"); strings.Count(out, "\n") != 1 || !strings.Contains(out, "allow  route") {
		t.Errorf("allows of the last hour: %q", out)
	}
	if out := must(t, "audit", name, "--until", "2000-01-01"); out != "" {
		t.Errorf("before 2000: %q", out)
	}
	for _, bad := range [][]string{{"--since", "yesterday"}, {"--decision", "maybe"}} {
		if code, _, errOut := verb(t, ctx, nil, append([]string{"audit", name}, bad...)...); code != 2 || !strings.Contains(errOut, bad[0]) {
			t.Errorf("audit %v: exit %d %q", bad, code, errOut)
		}
	}
	if code, _, errOut := verb(t, ctx, nil, "audit", "no-such-box"); code != 1 || !strings.Contains(errOut, "neither running nor suspended") {
		t.Errorf("audit of nothing: exit %d %q", code, errOut)
	}

	// Suspended: the same events, from the store.
	must(t, "suspend", name)
	if again := must(t, "audit", name); again != out {
		t.Errorf("suspended, sandgate audit printed\n%s\nwant\n%s", again, out)
	}

	// -f on the suspended sandbox: its events, then it waits; the events
	// of its next run follow.
	fctx, stop := context.WithCancel(ctx)
	pr, pw := io.Pipe()
	var stderr bytes.Buffer
	followed := make(chan int, 1)
	go func() {
		s := remoteService(t)
		followed <- execute(fctx, newApp(pw, &stderr), []string{"sandgate", "audit", "-f", name, "--url", s.URL, "--token", s.Token})
		pw.Close()
	}()
	sc := bufio.NewScanner(pr)
	for range 2 {
		if !sc.Scan() {
			t.Fatalf("audit -f ended: %q", stderr.String())
		}
	}
	// Through the client: urfave/cli's help flag is not safe for two apps
	// at once in one process.
	s := remoteService(t)
	cl, err := client.New(s.URL, client.WithToken(s.Token))
	if err != nil {
		t.Fatal(err)
	}
	sess, err := cl.Resume(ctx, name, client.ResumeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sess.Run(ctx, client.Command{Command: "curl -sS -x $HTTPS_PROXY https://resumed.example.com/ >/dev/null 2>&1 || true"}); err != nil {
		t.Fatal(err)
	}
	if !sc.Scan() || !strings.Contains(sc.Text(), "resumed.example.com") {
		t.Errorf("after the resume audit -f printed %q (%v)", sc.Text(), sc.Err())
	}
	stop()
	go io.Copy(io.Discard, pr)
	if code := <-followed; code != 0 || !strings.Contains(stderr.String(), "is suspended") {
		t.Errorf("audit -f: exit %d, stderr %q", code, stderr.String())
	}

	// -f on a sandbox that is destroyed: it says so, rather than
	// exiting silently.
	pr2, pw2 := io.Pipe()
	var stderr2 bytes.Buffer
	followed2 := make(chan int, 1)
	go func() {
		followed2 <- execute(ctx, newApp(pw2, &stderr2), []string{"sandgate", "audit", "-f", name, "--url", s.URL, "--token", s.Token})
		pw2.Close()
	}()
	sc = bufio.NewScanner(pr2)
	for range 3 {
		if !sc.Scan() {
			t.Fatalf("audit -f ended: %q", stderr2.String())
		}
	}
	if err := cl.Destroy(ctx, name); err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, pr2)
	if code := <-followed2; code != 0 || !strings.Contains(stderr2.String(), name+" was destroyed") {
		t.Errorf("audit -f of a destroyed sandbox: exit %d, stderr %q", code, stderr2.String())
	}
}
