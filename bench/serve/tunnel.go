package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/coder/websocket"
	"golang.org/x/sys/unix"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/localbox"
)

// portServerEnv tells a copy of this program, run inside a sandbox, to
// serve downloads on 127.0.0.1:<its value>.
const portServerEnv = "SANDGATE_BENCH_PORTSERVER"

// portServerChild reports whether this process is the server inside the
// sandbox, and if so serves until killed. Call it first thing in main.
//
// Each connection sends one HTTP/1.1 request head; the answer is a 101
// (saying whether a credential header reached it: the tunnel must strip
// them) and then n bytes, n from the query (?n=), and the connection
// closes. That is what a WebSocket server does after its handshake, minus
// the framing.
func portServerChild() (bool, error) {
	port := os.Getenv(portServerEnv)
	if port == "" {
		return false, nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:"+port)
	if err != nil {
		return true, err
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			return true, err
		}
		go servePort(c)
	}
}

var payload = make([]byte, 256<<10)

func servePort(c net.Conn) {
	defer c.Close()
	req, err := http.ReadRequest(bufio.NewReader(c))
	if err != nil {
		return
	}
	n, _ := strconv.ParseInt(req.URL.Query().Get("n"), 10, 64)
	seen := 0
	for _, h := range []string{api.HeaderToken, "Authorization"} {
		if req.Header.Get(h) != "" {
			seen = 1
		}
	}
	if _, err := fmt.Fprintf(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: bench\r\nX-Bench-Credential-Seen: %d\r\n\r\n", seen); err != nil {
		return
	}
	for n > 0 {
		k := min(n, int64(len(payload)))
		if _, err := c.Write(payload[:k]); err != nil {
			return
		}
		n -= k
	}
}

// path is one way to reach the server in the sandbox: dial returns a
// connection and the request target to send on it, plus headers.
type path struct {
	name  string
	note  string
	dial  func(ctx context.Context, n int64) (net.Conn, string, error)
	rates []float64 // MB/s per round
}

// benchTunnel measures downloads from the server in sandbox "exec" over
// each path, the paths taking turns, rounds times.
func (r *rig) benchTunnel(port int, bulk int64, rounds int) error {
	c, cancel := ctx(60 * time.Minute)
	defer cancel()
	sb, err := r.m.Sandbox("exec")
	if err != nil {
		return err
	}
	proc, err := sb.Spawn(context.Background(), agent.Cmd{Args: []string{r.portServer}, Env: []string{portServerEnv + "=" + strconv.Itoa(port)}})
	if err != nil {
		return fmt.Errorf("starting the server in the sandbox: %w", err)
	}
	defer proc.Signal(context.Background(), unix.SIGKILL)
	deadline := time.Now().Add(30 * time.Second)
	for {
		conn, err := sb.DialPort(c, port)
		if err == nil {
			conn.Close()
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the server in the sandbox does not answer on port %d: %w", port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	netns, err := r.netns("exec")
	if err != nil {
		return err
	}
	defer netns.Close()

	tunnelTarget := func(n int64) string {
		return fmt.Sprintf("/v1/sandboxes/exec/ports/%d/bulk?n=%d", port, n)
	}
	paths := []*path{
		{name: "direct (in its netns)", note: "loopback TCP to the server, dialled from the sandbox's network namespace",
			dial: func(ctx context.Context, n int64) (net.Conn, string, error) {
				conn, err := dialInNetns(netns, fmt.Sprintf("127.0.0.1:%d", port))
				return conn, fmt.Sprintf("/bulk?n=%d", n), err
			}},
		{name: "Sandbox.DialPort", note: "the agent's port dial alone: the socket it passes over a socket link, else a stream of it (what the tunnel copies to)",
			dial: func(ctx context.Context, n int64) (net.Conn, string, error) {
				conn, err := sb.DialPort(ctx, port)
				return conn, fmt.Sprintf("/bulk?n=%d", n), err
			}},
		{name: "port tunnel (protocol 1)", note: "Upgrade on …/ports/{port}/…: the service's HTTP server, then DialPort",
			dial: func(ctx context.Context, n int64) (net.Conn, string, error) {
				var d net.Dialer
				conn, err := d.DialContext(ctx, "tcp", r.addr)
				return conn, tunnelTarget(n), err
			}},
		{name: "TCP bridge (WebSocket)", note: "sandgate's …/tcp/{port}: binary WebSocket messages, then DialPort",
			dial: func(ctx context.Context, n int64) (net.Conn, string, error) {
				h := http.Header{}
				h.Set(api.HeaderProtocol, "1")
				h.Set(api.HeaderToken, token)
				ws, _, err := websocket.Dial(ctx, fmt.Sprintf("ws://%s/v1/sandboxes/exec/tcp/%d", r.addr, port), &websocket.DialOptions{HTTPHeader: h})
				if err != nil {
					return nil, "", err
				}
				ws.SetReadLimit(-1)
				return websocket.NetConn(context.Background(), ws, websocket.MessageBinary), fmt.Sprintf("/bulk?n=%d", n), nil
			}},
	}
	// One small download each first: every path works, and no credential
	// header crosses the tunnel.
	for _, p := range paths {
		if _, err := download(c, p, 1<<20); err != nil {
			return err
		}
	}
	fmt.Fprintf(os.Stderr, "downloading %d MiB %d times over each of %d paths...\n", bulk>>20, rounds, len(paths))
	for i := range rounds {
		for j := range paths {
			p := paths[(i+j)%len(paths)] // a different path goes first each round
			d, err := download(c, p, bulk)
			if err != nil {
				return err
			}
			p.rates = append(p.rates, float64(bulk)/1e6/d.Seconds())
		}
	}
	median := func(x []float64) float64 { s := slices.Clone(x); slices.Sort(s); return s[len(s)/2] }
	base := median(paths[0].rates)
	fmt.Printf("port download, %d MiB × %d rounds (median MB/s; ratio to direct)\n", bulk>>20, rounds)
	for _, p := range paths {
		fmt.Printf("  %-26s %8.0f MB/s   %.2f   %s\n", p.name, median(p.rates), median(p.rates)/base, p.note)
	}
	tun, dp := median(paths[2].rates), median(paths[1].rates)
	fmt.Printf("  port tunnel / direct %.2f (target ≥ 0.8); port tunnel / DialPort %.2f (the HTTP service's own share)\n", tun/base, tun/dp)
	return nil
}

// download sends the request head over p and reads the 101 and n bytes,
// returning how long it took from the dial to the last byte.
func download(ctx context.Context, p *path, n int64) (time.Duration, error) {
	t0 := time.Now()
	conn, target, err := p.dial(ctx, n)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", p.name, err)
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	head := "GET " + target + " HTTP/1.1\r\nHost: bench\r\nConnection: Upgrade\r\nUpgrade: bench\r\n" +
		api.HeaderProtocol + ": 1\r\n" + api.HeaderToken + ": " + token + "\r\n\r\n"
	if _, err := io.WriteString(conn, head); err != nil {
		return 0, fmt.Errorf("%s: %w", p.name, err)
	}
	br := bufio.NewReaderSize(conn, 256<<10)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, fmt.Errorf("%s: reading the answer: %w", p.name, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		return 0, fmt.Errorf("%s: status %d, want 101", p.name, resp.StatusCode)
	}
	// Only the paths that add the service token may see it, and only the
	// tunnel may strip it; the others send it to the server themselves.
	if p.name == "port tunnel (protocol 1)" && resp.Header.Get("X-Bench-Credential-Seen") != "0" {
		return 0, fmt.Errorf("%s: the service token reached the server in the sandbox", p.name)
	}
	buf := make([]byte, 256<<10)
	var got int64
	for got < n {
		k, err := br.Read(buf)
		got += int64(k)
		if err != nil {
			if errors.Is(err, io.EOF) && got >= n {
				break
			}
			return 0, fmt.Errorf("%s: after %d of %d bytes: %w", p.name, got, n, err)
		}
	}
	return time.Since(t0), nil
}

// netns opens the network namespace of sandbox id: its init's, as
// `sandgate sandbox list` names it.
func (r *rig) netns(id string) (*os.File, error) {
	c, cancel := ctx(30 * time.Second)
	defer cancel()
	out, err := exec.CommandContext(c, r.bin, "sandbox", "--state-dir", r.state, "list", "--json").Output()
	if err != nil {
		return nil, fmt.Errorf("sandgate sandbox list: %w", err)
	}
	var infos []localbox.Info
	if err := json.Unmarshal(out, &infos); err != nil {
		return nil, fmt.Errorf("sandgate sandbox list --json: %w", err)
	}
	for _, in := range infos {
		if in.ID == id && in.Pid > 0 {
			return os.Open(fmt.Sprintf("/proc/%d/ns/net", in.Pid))
		}
	}
	return nil, fmt.Errorf("sandbox %s is not running according to `sandgate sandbox list`", id)
}

// dialInNetns dials addr from the network namespace ns. The dial runs on
// a thread of its own that enters ns and is never handed back to the Go
// scheduler (it ends with its goroutine); the socket, once made, belongs
// to ns whichever thread uses it.
func dialInNetns(ns *os.File, addr string) (net.Conn, error) {
	type result struct {
		conn net.Conn
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			ch <- result{err: fmt.Errorf("entering the sandbox's network namespace: %w", err)}
			return
		}
		conn, err := net.DialTimeout("tcp", addr, 10*time.Second)
		ch <- result{conn, err}
	}()
	res := <-ch
	return res.conn, res.err
}
