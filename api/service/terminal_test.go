package service_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
)

// ptyConn is a client of the /v1 terminal route: what it received, in
// bytes of output and text messages.
type ptyConn struct {
	t    *testing.T
	ws   *websocket.Conn
	id   string // X-Sandgate-Terminal
	out  []byte
	text []string
}

// dialPTY opens the terminal route (query: "" for a new terminal, or
// ?terminal=&offset= to attach again); a refusal before the upgrade is
// its status and body.
func (r *rig) dialPTY(name, query string) (*ptyConn, int, string) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	h := http.Header{api.HeaderProtocol: {"1"}, api.HeaderToken: {r.token}}
	ws, resp, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(r.hs.URL, "http")+"/v1/sandboxes/"+name+"/pty"+query, &websocket.DialOptions{HTTPHeader: h})
	if err != nil {
		if resp == nil {
			r.t.Fatalf("dial the terminal: %v", err)
		}
		var b strings.Builder
		if resp.Body != nil {
			var buf [4096]byte
			n, _ := resp.Body.Read(buf[:])
			b.Write(buf[:n])
		}
		return nil, resp.StatusCode, b.String()
	}
	ws.SetReadLimit(1 << 20)
	return &ptyConn{t: r.t, ws: ws, id: resp.Header.Get(server.HeaderTerminal)}, resp.StatusCode, ""
}

func (p *ptyConn) send(typ websocket.MessageType, s string) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := p.ws.Write(ctx, typ, []byte(s)); err != nil {
		p.t.Fatal(err)
	}
}

// until reads until the output holds want (bounded: a minute).
func (p *ptyConn) until(want string) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for !strings.Contains(string(p.out), want) {
		typ, data, err := p.ws.Read(ctx)
		if err != nil {
			p.t.Fatalf("waiting for %q: %v; output so far %q, messages %q", want, err, p.out, p.text)
		}
		if typ == websocket.MessageBinary {
			p.out = append(p.out, data...)
		} else {
			p.text = append(p.text, string(data))
		}
	}
}

// toEnd reads to the connection's end, and returns the last message.
func (p *ptyConn) toEnd() string {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		typ, data, err := p.ws.Read(ctx)
		if err != nil {
			if len(p.text) == 0 {
				p.t.Fatalf("the terminal ended without a last message: %v; output %q", err, p.out)
			}
			return p.text[len(p.text)-1]
		}
		if typ == websocket.MessageBinary {
			p.out = append(p.out, data...)
		} else {
			p.text = append(p.text, string(data))
		}
	}
}

// seqLines is what `seq 1 n` shows on a terminal.
func seqLines(n int) string {
	var b strings.Builder
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&b, "%d\r\n", i)
	}
	return b.String()
}

// A terminal whose WebSocket dropped died with it (the command hung up,
// nothing kept). Now the client attaches again within the grace and gets
// exactly the bytes it missed, from the offset it had reached: together
// with what it had, the terminal's whole output, each byte once. While it
// is attached and answers, another client is refused; past the grace, the
// terminal is gone and the route says so.
func TestTerminalReattachGetsWhatItMissed(t *testing.T) {
	r := newRigOn(t, stacktest.Config{Manager: func(mc *appliance.ManagerConfig) { mc.TerminalGrace = 10 * time.Minute }}, nil)
	r.create("box", nil)
	p, code, body := r.dialPTY("box", "")
	if p == nil || p.id == "" {
		t.Fatalf("the terminal route: %d %s, want a 101 naming its terminal", code, body)
	}
	start, _ := json.Marshal(map[string]any{"command": `echo one; read a; echo "two-$a"; seq 1 3000; read b; echo "end-$b"`})
	p.send(websocket.MessageText, string(start))
	p.until("one\r\n")
	// Typed, then gone without a close frame while the output comes.
	p.send(websocket.MessageBinary, "x\r")
	p.ws.CloseNow()
	had := p.out

	q, code, body := r.dialPTY("box", fmt.Sprintf("?terminal=%s&offset=%d", p.id, len(had)))
	if q == nil {
		t.Fatalf("attaching again: %d %s", code, body)
	}
	if q.id != p.id {
		t.Errorf("attached to %q, want %q", q.id, p.id)
	}
	q.until("3000\r\n")
	// One client at a time: a third is refused while this one answers
	// (its pings, which it answers while it reads).
	ended := make(chan string, 1)
	go func() { ended <- q.toEnd() }()
	if x, code, body := r.dialPTY("box", "?terminal="+p.id); x != nil || code != http.StatusConflict || !strings.Contains(body, "another client is attached") {
		t.Errorf("a second client: %d %s, want 409", code, body)
	}
	q.send(websocket.MessageBinary, "y\r")
	last := <-ended
	if last != `{"exitCode":0}` {
		t.Errorf("the terminal's end: %s", last)
	}
	want := "one\r\nx\r\ntwo-x\r\n" + seqLines(3000) + "y\r\nend-y\r\n"
	if got := string(had) + string(q.out); got != want {
		t.Errorf("what the two connections received, together (%d bytes, want %d): each byte once, none missing", len(got), len(want))
	}

	// A terminal ended and read to its end is gone.
	if _, code, body := r.dialPTY("box", "?terminal="+p.id); code != http.StatusNotFound || !strings.Contains(body, "no terminal") {
		t.Errorf("attaching to an ended terminal: %d %s, want 404", code, body)
	}
}

// Past its grace a terminal whose client went away is hung up, as it was
// at once before there was a grace: the /v1 route says it is gone, and
// the bridge's next connection gets a new shell.
func TestTerminalPastItsGraceIsHungUp(t *testing.T) {
	const key = "test-bridge-key-0123456789"
	r := newRigOn(t, stacktest.Config{
		Manager: func(mc *appliance.ManagerConfig) { mc.TerminalGrace = -1 },
		Bridge:  bridge.Config{Key: key},
	}, nil)
	r.create("box", nil)
	p, _, _ := r.dialPTY("box", "")
	start, _ := json.Marshal(map[string]any{"command": `echo ready; exec sleep 600`})
	p.send(websocket.MessageText, string(start))
	p.until("ready")
	p.ws.CloseNow()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		_, code, body := r.dialPTY("box", "?terminal="+p.id)
		if code == http.StatusNotFound && strings.Contains(body, "no terminal") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after its client went away, with no grace: %d %s", code, body)
		}
	}
	// tail --pid returns once the process is gone (bounded by ctx).
	if res := r.exec("box", "for p in $(pgrep -x sleep); do tail --pid=$p -f /dev/null; done; echo gone", nil); res.stdout != "gone\n" {
		t.Errorf("the hung-up terminal's command: %q", res.stdout)
	}

	// The bridge: a new shell each time its client goes away.
	shown := regexp.MustCompile(`pid:([0-9]+)\.\r\n`)
	pid := func(ws *websocket.Conn) string {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := ws.Write(ctx, websocket.MessageBinary, []byte("printf 'pid:%s.\\n' $$\n")); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		for shown.FindStringSubmatch(out.String()) == nil {
			typ, data, err := ws.Read(ctx)
			if err != nil {
				t.Fatalf("the bridge's terminal: %v; %q", err, out.String())
			}
			if typ == websocket.MessageBinary {
				out.Write(data)
			}
		}
		return shown.FindStringSubmatch(out.String())[1]
	}
	dial := func() *websocket.Conn {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		ws, _, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(r.hs.URL, "http")+"/v1/sandbox/box/pty", &websocket.DialOptions{HTTPHeader: http.Header{"Authorization": {"Bearer " + key}}})
		if err != nil {
			t.Fatal(err)
		}
		return ws
	}
	first := dial()
	one := pid(first)
	first.CloseNow()
	var two string
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		ws := dial()
		two = pid(ws)
		ws.Close(websocket.StatusNormalClosure, "")
		if two != one {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after its client went away, the bridge's terminal is still the shell %s", one)
		}
	}
}
