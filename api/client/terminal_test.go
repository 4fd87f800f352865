package client_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/client"
)

// termOutput collects what a terminal shows and lets a test wait
// (bounded) for a string in it.
type termOutput struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	moved chan struct{}
	done  chan struct{}
}

func readTerminal(term *client.Terminal) *termOutput {
	o := &termOutput{moved: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(o.done)
		b := make([]byte, 4096)
		for {
			n, err := term.Read(b)
			o.mu.Lock()
			o.buf.Write(b[:n])
			o.mu.Unlock()
			select {
			case o.moved <- struct{}{}:
			default:
			}
			if err != nil {
				return
			}
		}
	}()
	return o
}

func (o *termOutput) until(t *testing.T, s string) string {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		o.mu.Lock()
		got := o.buf.String()
		o.mu.Unlock()
		if strings.Contains(got, s) {
			return got
		}
		select {
		case <-o.moved:
		case <-o.done:
			o.mu.Lock()
			got = o.buf.String()
			o.mu.Unlock()
			if !strings.Contains(got, s) {
				t.Fatalf("the terminal ended without %q: %q", s, got)
			}
			return got
		case <-deadline:
			t.Fatalf("waited a minute for %q on the terminal, have %q", s, got)
		}
	}
}

// A command on a terminal, end to end through the service: it has a
// terminal of the size asked, resizes reach it, what is typed is echoed
// as at a console, its environment is a command's, and its exit code
// comes back.
func TestTerminal(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	term, err := s.Terminal(ctx, client.TerminalOptions{
		Command: `tty; stty size; echo "term=$TERM home=$HOME pwd=$(pwd)"; read a; stty size; read line; echo "got:$line"; exit 7`,
		Env:     map[string]string{"TERM": "xterm-256color"}, Rows: 30, Cols: 90,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer term.Close()
	out := readTerminal(term)
	got := out.until(t, "pwd=")
	for _, want := range []string{"/dev/pts/", "30 90", "term=xterm-256color home=" + s.Home()} {
		if !strings.Contains(got, want) {
			t.Errorf("the terminal shows %q, want %q in it", got, want)
		}
	}
	out.until(t, "pwd="+s.DefaultWorkingDirectory())
	if err := term.Resize(50, 132); err != nil {
		t.Fatal(err)
	}
	io.WriteString(term, "\r")
	out.until(t, "50 132")
	io.WriteString(term, "typed here\r")
	got = out.until(t, "got:typed here")
	if !strings.Contains(got, "typed here\r\n") {
		t.Errorf("what was typed was not echoed: %q", got)
	}
	if code, err := term.Wait(ctx); code != 7 || err != nil {
		t.Errorf("exit: %d %v, want 7", code, err)
	}
	<-out.done

	// Hanging up kills the command.
	term, err = s.Terminal(ctx, client.TerminalOptions{Command: "echo $$ > /tmp/pid; echo ready; exec sleep 600"})
	if err != nil {
		t.Fatal(err)
	}
	out = readTerminal(term)
	out.until(t, "ready")
	pid := strings.TrimSpace(run(t, s, "cat /tmp/pid"))
	term.Close()
	// tail --pid returns once the process is gone (bounded by ctx).
	if got := run(t, s, "tail --pid="+pid+" -f /dev/null; echo gone"); got != "gone\n" {
		t.Fatalf("the command of a terminal hung up: %q", got)
	}

	// Nothing of a held credential goes in, typed or in the command.
	canary := "sk-canary-" + randomName("pty")
	if err := s.SetRequestTransformations(ctx, []client.RequestTransformation{{
		Match:     client.Match{Host: "api.example.com"},
		Transform: client.Transform{Headers: map[string]string{"x-api-key": canary}},
	}}); err != nil {
		t.Fatal(err)
	}
	term, err = s.Terminal(ctx, client.TerminalOptions{Command: "stty -echo; echo ready; cat > /tmp/typed"})
	if err != nil {
		t.Fatal(err)
	}
	out = readTerminal(term)
	out.until(t, "ready")
	io.WriteString(term, "before "+canary[:5])
	io.WriteString(term, canary[5:]+" after\r")
	code, err := term.Wait(ctx)
	if code != 137 || err == nil || !strings.Contains(err.Error(), "Credentials stay outside the sandbox") {
		t.Errorf("a credential typed: %d %v, want 137 and the refusal", code, err)
	}
	if typed := run(t, s, "cat /tmp/typed 2>/dev/null || true"); strings.Contains(typed, "sk-") {
		t.Errorf("the sandbox got %q", typed)
	}
	term, err = s.Terminal(ctx, client.TerminalOptions{Command: "echo " + canary})
	if err != nil {
		t.Fatal(err)
	}
	readTerminal(term)
	var se *client.ServiceError
	if _, err := term.Wait(ctx); !errors.As(err, &se) || se.Status != 400 || !strings.Contains(se.Message, "Credentials stay outside") {
		t.Errorf("a credential in the command: %v, want a 400 refusal", err)
	}
	if _, err := c.Create(ctx, client.CreateOptions{}); err != nil {
		t.Fatal(err) // the service is fine after all this
	}
}

// A terminal of a sandbox that does not run.
func TestTerminalNotRunning(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Terminal(ctx, client.TerminalOptions{Command: "sh"}); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("a terminal in a suspended sandbox: %v", err)
	}
}

// raw is GET path's JSON, decoded.
func raw(t *testing.T, path string) any {
	t.Helper()
	s := need(t)
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

// reshaped is v marshalled and decoded again: what a program printing it
// as JSON shows.
func reshaped(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	json.Unmarshal(b, &out)
	return out
}

// The client's descriptions marshal exactly as the service writes them:
// one JSON shape for one thing (they printed Go field names, and null for
// no ports).
func TestInfoIsTheServicesShape(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{
		NetworkPolicy: &client.NetworkPolicy{Mode: client.ModeCustom, AllowedHosts: []string{"api.example.com"}, DeniedCIDRs: []string{"203.0.113.0/24"}},
		BaseURLs:      map[string]string{"X_BASE_URL": "https://x.example/v1"},
	})
	in, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := reshaped(t, in), raw(t, "/v1/sandboxes/"+s.ID()); !reflect.DeepEqual(got, want) {
		t.Errorf("Info as JSON:\n%v\nthe service's:\n%v", got, want)
	}
	if b, _ := json.Marshal(in); bytes.Contains(b, []byte("null")) || bytes.Contains(b, []byte(`"Name"`)) {
		t.Errorf("Info as JSON: %s", b)
	}
	list, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := reshaped(t, list), raw(t, "/v1/sandboxes").(map[string]any)["sandboxes"]; !reflect.DeepEqual(got, want) {
		t.Errorf("List as JSON:\n%v\nthe service's:\n%v", got, want)
	}
	if err := s.SaveTemplate(ctx, randomName("shape")); err != nil {
		t.Fatal(err)
	}
	tpls, err := c.Templates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := reshaped(t, tpls), raw(t, "/v1/templates").(map[string]any)["templates"]; !reflect.DeepEqual(got, want) {
		t.Errorf("Templates as JSON:\n%v\nthe service's:\n%v", got, want)
	}
	for _, tp := range tpls {
		c.DeleteTemplate(ctx, tp.ID)
	}
}

// Resume honours a whole policy (the route ignored it, and the sandbox
// came back with none); a suspended sandbox forks by name.
func TestResumeWithPolicyAndForkSuspended(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{AllowedHosts: []string{"api.example.com"}})
	run(t, s, "echo kept > f")
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	copyName := randomName("fork")
	if st, err := c.Fork(ctx, s.ID(), copyName); err != nil || st != "suspended" {
		t.Fatalf("fork of a suspended sandbox: %q %v", st, err)
	}
	t.Cleanup(func() { c.Destroy(context.Background(), copyName) })
	if _, err := c.Fork(ctx, "no-such-box", randomName("x")); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("fork of nothing: %v", err)
	}
	policy := client.NetworkPolicy{Mode: client.ModeCustom, AllowedHosts: []string{"api.example.com"}, AllowedCIDRs: []string{"198.51.100.7/32"}}
	r, err := c.Resume(ctx, copyName, client.ResumeOptions{NetworkPolicy: &policy})
	if err != nil {
		t.Fatal(err)
	}
	in, err := r.Info(ctx)
	if err != nil || in.Policy == nil || !reflect.DeepEqual(*in.Policy, policy) {
		t.Errorf("resumed with a policy: %+v %v, want %+v", in.Policy, err, policy)
	}
	if got := run(t, r, "cat f"); got != "kept\n" {
		t.Errorf("the fork's files: %q", got)
	}
}

// Under WithProgress, suspend, resume and a template's save report how
// far they came while the service works, then end as they would have.
func TestProgress(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	run(t, s, "head -c 8388608 /dev/urandom > big")
	var mu sync.Mutex
	steps := map[string][]client.Progress{}
	pctx := client.WithProgress(ctx, func(p client.Progress) {
		mu.Lock()
		steps[p.Step] = append(steps[p.Step], p)
		mu.Unlock()
	})
	tpl := randomName("progress")
	if err := s.SaveTemplate(pctx, tpl); err != nil {
		t.Fatal(err)
	}
	defer c.DeleteTemplate(ctx, tpl)
	if err := c.Suspend(pctx, s.ID()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resume(pctx, s.ID(), client.ResumeOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resume(pctx, "no-such-box", client.ResumeOptions{}); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("resume of nothing with progress: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, step := range []string{"save", "fetch"} {
		ps := steps[step]
		if len(ps) == 0 {
			t.Errorf("no %s progress", step)
			continue
		}
		last := ps[len(ps)-1]
		if last.Bytes <= 0 || last.Total < 8<<20 {
			t.Errorf("%s: last progress %+v, want bytes and a total of at least the 8 MiB file", step, last)
		}
	}
}

// A terminal whose connection dropped ended with it (the service hung it
// up). Now the client attaches to it again, from the byte its output had
// reached: the command runs on, and every byte it shows arrives once.
func TestTerminalReattachesAfterADrop(t *testing.T) {
	cut := &cutter{}
	c := newClient(t, client.WithHTTPClient(&http.Client{Transport: &http.Transport{DialContext: cut.dial}}))
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	term, err := s.Terminal(ctx, client.TerminalOptions{Command: `echo one; read a; echo "two-$a"; seq 1 3000; read b; echo "end-$b"`})
	if err != nil {
		t.Fatal(err)
	}
	defer term.Close()
	out := readTerminal(term)
	out.until(t, "one\r\n")
	cut.cut() // the network drops the connection
	// What is typed while it is down fails; once attached again, it goes in.
	for i := 0; ; i++ {
		if _, err := io.WriteString(term, "x\r"); err == nil {
			break
		}
		if i == 600 {
			t.Fatal("a minute after the drop, the terminal takes no input")
		}
		time.Sleep(100 * time.Millisecond)
	}
	out.until(t, "3000\r\n")
	io.WriteString(term, "y\r")
	if code, err := term.Wait(ctx); code != 0 || err != nil {
		t.Fatalf("exit: %d %v", code, err)
	}
	<-out.done
	var want strings.Builder
	want.WriteString("one\r\nx\r\ntwo-x\r\n")
	for i := 1; i <= 3000; i++ {
		want.WriteString(strconv.Itoa(i) + "\r\n")
	}
	want.WriteString("y\r\nend-y\r\n")
	if got := out.buf.String(); got != want.String() {
		t.Errorf("the terminal across a drop showed %d bytes, want %d: each byte once", len(got), want.Len())
	}
}
