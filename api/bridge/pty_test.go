package bridge_test

import (
	"context"
	"encoding/json"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
)

// term is the contract's terminal as its clients use it (the Python
// client's pty_exec_start, the xterm addon).
type term struct {
	t   *testing.T
	ws  *websocket.Conn
	out strings.Builder
}

func dialTerm(t *testing.T, c *client, id, query string, hdr ...string) *term {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	h := http.Header{"Authorization": {"Bearer " + c.key}}
	for i := 0; i+1 < len(hdr); i += 2 {
		h.Set(hdr[i], hdr[i+1])
	}
	u := "ws" + strings.TrimPrefix(c.base, "http") + "/v1/sandbox/" + id + "/pty" + query
	ws, resp, err := websocket.Dial(ctx, u, &websocket.DialOptions{HTTPHeader: h})
	if err != nil {
		t.Fatalf("dial the terminal: %v (%v)", err, resp)
	}
	tm := &term{t: t, ws: ws}
	// What a terminal kept, when it is one the client comes back to, in
	// one message; then ready.
	for i := 0; ; i++ {
		typ, data, err := ws.Read(ctx)
		if err == nil && typ == websocket.MessageBinary && i == 0 {
			tm.out.Write(data)
			continue
		}
		if err != nil || typ != websocket.MessageText || string(data) != `{"type":"ready"}` {
			t.Fatalf("message %d: %v %q %v, want {\"type\":\"ready\"}", i, typ, data, err)
		}
		return tm
	}
}

func (tm *term) send(typ websocket.MessageType, s string) {
	tm.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := tm.ws.Write(ctx, typ, []byte(s)); err != nil {
		tm.t.Fatal(err)
	}
}

// until reads output until it holds want; a text message (the end) or a
// minute without it fails.
func (tm *term) until(want string) {
	tm.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for !strings.Contains(tm.out.String(), want) {
		typ, data, err := tm.ws.Read(ctx)
		if err != nil || typ != websocket.MessageBinary {
			tm.t.Fatalf("waiting for %q: %v %s; output so far:\n%s", want, err, data, tm.out.String())
		}
		tm.out.Write(data)
	}
}

// end reads to the exit message and returns its code.
func (tm *term) end() int {
	tm.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		typ, data, err := tm.ws.Read(ctx)
		if err != nil {
			tm.t.Fatalf("waiting for the exit: %v; output:\n%s", err, tm.out.String())
		}
		if typ == websocket.MessageBinary {
			tm.out.Write(data)
			continue
		}
		var m struct {
			Type string
			Code *int
		}
		if json.Unmarshal(data, &m) != nil || m.Type != "exit" || m.Code == nil {
			tm.t.Fatalf("a text message that is not the exit: %s", data)
		}
		if _, _, err := tm.ws.Read(ctx); websocket.CloseStatus(err) != websocket.StatusNormalClosure {
			tm.t.Errorf("after the exit: %v, want a normal close", err)
		}
		return *m.Code
	}
}

// The terminal: a shell on a PTY of the size asked, in /workspace, typed
// into as the Python client does (a command line and a newline), resized
// by the xterm addon's control message, ended by the shell's exit.
func TestTerminal(t *testing.T) {
	_, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create() // made on first use, by the terminal itself
	defer c.must(204, "DELETE", "/v1/sandbox/"+id, nil)

	tm := dialTerm(t, c, id, "?cols=100&rows=30")
	tm.send(websocket.MessageBinary, "echo \"size=$(stty size) term=$TERM dir=$(pwd)\"\n")
	tm.until("size=30 100 term=xterm-256color dir=/workspace")
	tm.send(websocket.MessageText, `{"type":"resize","cols":120,"rows":40}`)
	tm.send(websocket.MessageBinary, "echo \"now=$(stty size)\"\n")
	tm.until("now=40 120")
	tm.send(websocket.MessageBinary, "exit 7\n")
	if code := tm.end(); code != 7 {
		t.Errorf("exit code %d, want 7", code)
	}

	// A session's directory and variables, named in ?session=.
	c.must(200, "PUT", "/v1/sandbox/"+id+"/file/workspace/sub/f", []byte("x"))
	c.must(200, "POST", "/v1/sandbox/"+id+"/session", []byte(`{"id":"s1","cwd":"/workspace/sub","env":{"GREETING":"from the session"}}`))
	tm = dialTerm(t, c, id, "?session=s1&shell=/bin/sh")
	tm.send(websocket.MessageBinary, "echo \"[$GREETING] $(pwd)\"; exit\n")
	tm.until("[from the session] /workspace/sub")
	if code := tm.end(); code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
}

// A client that goes away (its WebSocket dropped mid-output) used to hang
// the terminal up. Now, as the contract's container does, the shell runs
// on: a client that connects again within the grace gets what the
// terminal kept, in one message before ready (the xterm add-on clears
// its screen and draws it again), each byte once, then the terminal from
// there on: the same shell. While it is attached and answers, another
// client is refused. A client that closes it hangs it up after the grace
// (TestTerminalPastItsGraceIsHungUp, api/service).
func TestTerminalReconnectReplays(t *testing.T) {
	_, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	defer c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
	tm := dialTerm(t, c, id, "?cols=200&session=keep")
	tm.send(websocket.MessageBinary, "printf 'start:%s.\\n' $$\n")
	shown := regexp.MustCompile(`start:([0-9]+)\.\r\n`)
	for i := 0; shown.FindStringSubmatch(tm.out.String()) == nil; i++ {
		tm.until(".\r\n")
		if i > 100 {
			t.Fatalf("the shell's pid: %q", tm.out.String())
		}
	}
	pid := shown.FindStringSubmatch(tm.out.String())[1]
	tm.send(websocket.MessageBinary, "sleep 0.2; seq 1 3000; printf 'done:%s.\\n' $$\n")
	tm.ws.CloseNow() // mid-output: what comes now goes to no client

	back := dialTerm(t, c, id, "?session=keep")
	back.until("done:" + pid + ".")
	got := back.out.String()
	if strings.Count(got, "start:"+pid+".\r\n") != 1 || strings.Count(got, "\r\n1500\r\n") != 1 || !strings.Contains(got, "\r"+seqLines(3000)+"done:"+pid+".") {
		t.Errorf("a client that came back got (replay and what followed) %d bytes ending %q; want the terminal's output since it started, each line once, from the same shell", len(got), got[max(0, len(got)-200):])
	}
	// One client at a time: another is refused while this one answers
	// (its pings, which it answers while it reads).
	reading := make(chan struct{})
	go func() {
		defer close(reading)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for {
			if _, _, err := back.ws.Read(ctx); err != nil {
				return
			}
		}
	}()
	ws := []string{"Upgrade", "websocket", "Connection", "Upgrade", "Sec-WebSocket-Version", "13", "Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="}
	resp, body := c.do(c.req("GET", "/v1/sandbox/"+id+"/pty?session=keep", nil, ws...))
	if resp.StatusCode != 502 || !strings.Contains(string(body), "another client is attached") {
		t.Errorf("a second client: %d %s, want the contract's terminal failure", resp.StatusCode, body)
	}
	back.ws.Close(websocket.StatusNormalClosure, "")
	<-reading
}

// seqLines is what `seq 1 n` shows on a terminal.
func seqLines(n int) string {
	var b strings.Builder
	for i := 1; i <= n; i++ {
		b.WriteString(strconv.Itoa(i) + "\r\n")
	}
	return b.String()
}

// What the terminal refuses, before any shell starts, in the contract's
// error shape.
func TestTerminalRefusals(t *testing.T) {
	_, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	defer c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
	ws := []string{"Upgrade", "websocket", "Connection", "Upgrade", "Sec-WebSocket-Version", "13", "Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="}
	for _, tc := range []struct {
		query string
		hdr   []string
		want  int
		says  string
	}{
		{"", nil, 400, "WebSocket upgrade required"},
		{"?cols=wide", ws, 400, "cols and rows must be valid numbers"},
		{"?rows=-1", ws, 400, "cols and rows must be valid numbers"},
		{"?rows=NaN", ws, 400, "cols and rows must be valid numbers"},
		{"?shell=sh%20-c%20id", ws, 400, "shell must name a program"},
		{"?shell=../../bin/sh", ws, 400, "shell must name a program"},
		{"?session=a/b", ws, 400, "Invalid session ID format"},
		{"", append([]string{"Session-Id", ".."}, ws...), 400, "Invalid session ID format"},
	} {
		resp, body := c.do(c.req("GET", "/v1/sandbox/"+id+"/pty"+tc.query, nil, tc.hdr...))
		if resp.StatusCode != tc.want || !strings.Contains(string(body), tc.says) || !strings.Contains(string(body), `"code":"invalid_request"`) {
			t.Errorf("pty%s: %d %s, want %d saying %q", tc.query, resp.StatusCode, body, tc.want, tc.says)
		}
	}
	// A shell that cannot start is the contract's terminal failure.
	resp, body := c.do(c.req("GET", "/v1/sandbox/"+id+"/pty?shell=/no/such/shell", nil, ws...))
	if resp.StatusCode != 502 || !strings.Contains(string(body), "/no/such/shell") || !strings.Contains(string(body), `"code":"exec_transport_error"`) {
		t.Errorf("pty with a missing shell: %d %s", resp.StatusCode, body)
	}
	bad := &client{t: t, base: base, key: "not the key of this service"}
	if resp, body := bad.do(bad.req("GET", "/v1/sandbox/"+id+"/pty", nil, ws...)); resp.StatusCode != 401 {
		t.Errorf("pty with a wrong key: %d %s", resp.StatusCode, body)
	}
}
