package agent

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/sandgate/sandgate/internal/testkit/syncbuf"
)

// TestDialPort: a port dial over every kind of link. Over a socketpair
// (sandgate sandbox's link) the agent passes the socket it connected, so
// the port's bytes never cross the agent; over pipes (Google's CLI) they
// ride a yamux stream. Both have TCP's half-close.
func TestDialPort(t *testing.T) {
	for _, kind := range []transport{netPipe, osPipes, socketPair} {
		t.Run(kind.String(), func(t *testing.T) {
			l := startLinkOver(t, kind, ClientOptions{}, nil)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			// An upper-casing echo server that answers after its client's EOF.
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				b, _ := io.ReadAll(c)
				c.Write([]byte(strings.ToUpper(string(b))))
			}()
			port := ln.Addr().(*net.TCPAddr).Port
			conn, err := l.c.DialPort(testCtx(t), port)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			_, passed := conn.(*linkBoundConn)
			if passed != (kind == socketPair) {
				t.Errorf("the conn is a %T over a %v link", conn, kind)
			}
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			io.WriteString(conn, "hello from the service")
			conn.(interface{ CloseWrite() error }).CloseWrite()
			got, err := io.ReadAll(conn)
			if err != nil || string(got) != "HELLO FROM THE SERVICE" {
				t.Errorf("got %q, %v", got, err)
			}
			if conn.RemoteAddr().String() != ln.Addr().String() {
				t.Errorf("RemoteAddr = %v, want %v", conn.RemoteAddr(), ln.Addr())
			}
			ln.Close()
			if _, err := l.c.DialPort(testCtx(t), port); !errors.Is(err, ErrUnreachable) {
				t.Errorf("dial to a closed port = %v, want ErrUnreachable", err)
			}
			if _, err := l.c.DialPort(testCtx(t), 70000); !errors.Is(err, fs.ErrInvalid) {
				t.Errorf("dial to port 70000 = %v, want fs.ErrInvalid", err)
			}
		})
	}
}

// TestEnvExact: a command's environment is exactly the documented set.
func TestEnvExact(t *testing.T) {
	l := startLink(t, ClientOptions{Config: Config{
		Path:     "/usr/bin:/bin",
		Home:     "/tmp",
		BaseURLs: map[string]string{"GEMINI_BASE_URL": "https://generativelanguage.googleapis.com", "CUSTOM_BASE_URL": ""},
	}})
	relay := "http://" + l.c.Info().RelayAddr
	var out syncbuf.Buffer
	st, err := l.c.Run(testCtx(t), Cmd{Args: []string{"env"}, Stdout: &out, Env: []string{
		"FOO=bar",
		"ANTHROPIC_BASE_URL=https://example.com/v1",
		"CUSTOM_BASE_URL=" + relay + "/https/custom.example.com/x", // already a route: kept
		"NO_PROXY=internal.example",
		"HTTPS_PROXY=" + relay + "/", // the relay itself: allowed
	}})
	if err != nil || !st.Success() {
		t.Fatalf("env: %v %v", st, err)
	}
	got := strings.Split(strings.TrimSpace(out.String()), "\n")
	slices.Sort(got)
	want := []string{
		"ANTHROPIC_BASE_URL=" + relay + "/https/example.com/v1",
		"CUSTOM_BASE_URL=" + relay + "/https/custom.example.com/x",
		"FOO=bar",
		"GEMINI_BASE_URL=" + relay + "/https/generativelanguage.googleapis.com",
		"HOME=/tmp",
		"HTTPS_PROXY=" + relay,
		"HTTP_PROXY=" + relay,
		"IS_SANDBOX=1",
		"NO_PROXY=internal.example,localhost,127.0.0.1",
		"LANG=C.UTF-8",
		"NODE_USE_ENV_PROXY=1",
		"OPENAI_BASE_URL=" + relay + "/https/api.openai.com/v1",
		"PATH=/usr/bin:/bin",
		"http_proxy=" + relay,
		"https_proxy=" + relay,
		"no_proxy=internal.example,localhost,127.0.0.1",
		"pnpm_config_side_effects_cache=false",
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("environment:\n got %q\nwant %q", got, want)
	}

	refusals := map[string]string{
		"HTTPS_PROXY=http://proxy.example:8080":  "HTTPS_PROXY",
		"all_proxy=socks5://10.0.0.1:1080":       "all_proxy",
		"ANTHROPIC_BASE_URL=https://u:p@x.ex/v1": "ANTHROPIC_BASE_URL",
		"NOEQUALS":                               "KEY=VALUE",
	}
	for kv, name := range refusals {
		_, err := l.c.Run(testCtx(t), Cmd{Args: []string{"true"}, Env: []string{kv}})
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("Env %q: %v, want an error naming %s", kv, err, name)
		}
	}
}

func TestRouteBaseURL(t *testing.T) {
	const relay = "127.0.0.1:3128"
	tests := []struct{ in, want string }{
		{"https://api.anthropic.com", "http://127.0.0.1:3128/https/api.anthropic.com"},
		{"https://api.openai.com/v1", "http://127.0.0.1:3128/https/api.openai.com/v1"},
		{"https://example.com/v1/", "http://127.0.0.1:3128/https/example.com/v1"},
		{"https://example.com:443/a%20b", "http://127.0.0.1:3128/https/example.com:443/a%20b"},
		{"https://example.com:8443/v1", "http://127.0.0.1:3128/https/example.com:8443/v1"},
		{"http://127.0.0.1:9/api", "http://127.0.0.1:3128/http/127.0.0.1:9/api"},
		{"http://127.0.0.1:3128/https/x.example/y", "http://127.0.0.1:3128/https/x.example/y"},
		{"https://example.com/v1?q=1#f", "http://127.0.0.1:3128/https/example.com/v1"},
		{"https://example.com/a/../../evil.example/x", "http://127.0.0.1:3128/https/example.com/evil.example/x"},
		// Not an http(s) URL with a host: left as it is.
		{"https:///path", "https:///path"},
		{"example.com", "example.com"},
		{"ftp://x.example/", "ftp://x.example/"},
	}
	for _, tt := range tests {
		if got := RouteBaseURL(relay, tt.in); got != tt.want {
			t.Errorf("RouteBaseURL(%q) = %q; want %q", tt.in, got, tt.want)
		}
	}
	if err := CheckBaseURL("X_BASE_URL", "https://u:p@x.example/v1"); err == nil || !strings.Contains(err.Error(), "X_BASE_URL") {
		t.Errorf("a base URL with credentials: %v; want an error naming the variable", err)
	}
	if err := CheckBaseURL("X_BASE_URL", "http://x.example:8080/v1"); err != nil {
		t.Errorf("an http base URL with a port: %v", err)
	}
}

func TestConfigRefusals(t *testing.T) {
	tests := []struct {
		cfg  Config
		want string
	}{
		{Config{RelayAddr: "0.0.0.0:3128"}, "loopback"},
		{Config{RelayAddr: "localhost:3128"}, "loopback"},
		{Config{Home: "relative"}, "home"},
		{Config{BaseURLs: map[string]string{"1BAD": ""}}, "environment variable name"},
		{Config{BaseURLs: map[string]string{"HTTPS_PROXY": ""}}, "proxy variable"},
		{Config{BaseURLs: map[string]string{"X_URL": "https://u:p@x.example/v1"}}, "X_URL"},
		{Config{KillScope: "everything"}, "killScope"},
	}
	for _, tt := range tests {
		if _, err := tt.cfg.resolve(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%+v: %v, want an error with %q", tt.cfg, err, tt.want)
		}
	}
	if inInitialPIDNamespace() {
		_, err := Config{}.resolve()
		if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "descendants") {
			t.Errorf("kill scope sandbox on the host: %v, want a refusal naming the fix", err)
		}
	}
}

func TestVersionMismatch(t *testing.T) {
	skipIfNotLinux(t)
	// A service of another release.
	svc, agentEnd := pipePair(t, netPipe)
	served := make(chan error, 1)
	go func() { served <- Serve(context.Background(), agentEnd, ServerOptions{}) }()
	_, err := NewClient(testCtx(t), svc, ClientOptions{Config: testConfig(), version: ProtocolVersion + 1})
	if !errors.Is(err, ErrVersionMismatch) || !strings.Contains(err.Error(), "release") {
		t.Errorf("newer service: %v, want ErrVersionMismatch explaining the fix", err)
	}
	waitServed(t, served)

	// An agent of another release.
	svc, agentEnd = pipePair(t, netPipe)
	s := newServer(ServerOptions{})
	s.version = ProtocolVersion + 1
	go func() { served <- s.serve(context.Background(), agentEnd) }()
	_, err = NewClient(testCtx(t), svc, ClientOptions{Config: testConfig()})
	if !errors.Is(err, ErrVersionMismatch) {
		t.Errorf("newer agent: %v, want ErrVersionMismatch", err)
	}
	waitServed(t, served)
}

func waitServed(t *testing.T, served chan error) {
	t.Helper()
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not stop within 10s of its link closing")
	}
}

func TestHelloRules(t *testing.T) {
	l := startLink(t, ClientOptions{})
	_, err := l.c.call(testCtx(t), request{Op: "hello", Version: ProtocolVersion, Config: &Config{RelayAddr: "127.0.0.1:0", KillScope: KillDescendants}})
	if !errors.Is(err, fs.ErrInvalid) || !strings.Contains(err.Error(), "already") {
		t.Errorf("second hello = %v", err)
	}
	if d, err := l.c.Ping(testCtx(t)); err != nil || d <= 0 {
		t.Errorf("Ping = %v, %v", d, err)
	}

	// An op before hello is refused.
	svc, agentEnd := pipePair(t, netPipe)
	served := make(chan error, 1)
	go func() { served <- Serve(context.Background(), agentEnd, ServerOptions{}) }()
	c := &Client{opts: ClientOptions{version: ProtocolVersion}}
	c.sess, _ = yamux.Client(svc, yamuxConfig(slog.New(slog.DiscardHandler)))
	if _, err := c.call(testCtx(t), request{Op: "ping"}); err == nil || !strings.Contains(err.Error(), "before hello") {
		t.Errorf("ping before hello = %v", err)
	}
	c.sess.Close()
	waitServed(t, served)
}

// TestLinkDropClientSide: when the agent's end goes away, the client sees
// it (Done, Err) and waits in flight end with ErrLinkDown.
func TestLinkDropClientSide(t *testing.T) {
	skipIfNotLinux(t)
	svc, agentEnd := pipePair(t, osPipes)
	served := make(chan error, 1)
	go func() { served <- Serve(context.Background(), agentEnd, ServerOptions{}) }()
	c, err := NewClient(testCtx(t), svc, ClientOptions{Config: testConfig()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p, err := c.Spawn(testCtx(t), Cmd{Args: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	agentEnd.Close() // the agent's stdio is gone
	select {
	case <-c.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the client did not notice the link drop within 10s")
	}
	if !errors.Is(c.Err(), ErrLinkDown) {
		t.Errorf("Err = %v, want ErrLinkDown", c.Err())
	}
	if _, err := p.Wait(testCtx(t)); !errors.Is(err, ErrLinkDown) {
		t.Errorf("Wait after the link dropped = %v, want ErrLinkDown", err)
	}
	if _, err := c.Ping(testCtx(t)); !errors.Is(err, ErrLinkDown) {
		t.Errorf("Ping after the link dropped = %v, want ErrLinkDown", err)
	}
	waitServed(t, served)
	waitDead(t, p.PID) // the agent killed what it started
}

// TestLinkDropAgentSide: when the service goes away, Serve returns and the
// commands the agent started are killed.
func TestLinkDropAgentSide(t *testing.T) {
	skipIfNotLinux(t)
	svc, agentEnd := pipePair(t, netPipe)
	served := make(chan error, 1)
	go func() { served <- Serve(context.Background(), agentEnd, ServerOptions{}) }()
	c, err := NewClient(testCtx(t), svc, ClientOptions{Config: testConfig()})
	if err != nil {
		t.Fatal(err)
	}
	lw := newLineWaiter()
	p, err := c.Spawn(testCtx(t), Cmd{Args: []string{"sh", "-c", "sleep 1000 & echo $!; wait"}, Stdout: lw})
	if err != nil {
		t.Fatal(err)
	}
	child := atoi(t, lw.lines(t, 1)[0])
	svc.Close() // not Client.Close: the transport just vanishes
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("Serve = %v, want nil for a closed link", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Serve did not notice the link drop within 15s")
	}
	waitDead(t, p.PID, child)
	if st, _ := p.Wait(testCtx(t)); st.Code != -1 {
		t.Errorf("Wait = %v", st)
	}
	c.Close()
}

func TestVictims(t *testing.T) {
	// 1 init, 2 kthreadd, 3 a kernel thread, 10 sandbox exec shim,
	// 20 the agent, 21-23 its commands and their children, 30 another
	// process in the sandbox, 31 a zombie, 5 the sandbox's main process
	// (`sandgate agent --idle`, started first), 40 a command that runs
	// sandgate the same way later: only the oldest holder is spared.
	procs := []procInfo{
		{pid: 1, start: 1}, {pid: 2, start: 1}, {pid: 3, ppid: 2, state: 'I'}, {pid: 5, ppid: 1, start: 2, holder: true},
		{pid: 10, ppid: 1, start: 3}, {pid: 20, ppid: 10, start: 4},
		{pid: 21, ppid: 20, start: 5}, {pid: 22, ppid: 21, start: 6}, {pid: 23, ppid: 20, state: 'R', start: 7},
		{pid: 30, ppid: 1, start: 8}, {pid: 31, ppid: 1, state: 'Z', start: 9}, {pid: 40, ppid: 1, start: 10, holder: true},
	}
	for i := range procs {
		if procs[i].state == 0 {
			procs[i].state = 'S'
		}
	}
	if got := victims(procs, 20, KillDescendants); !slices.Equal(got, []int{21, 22, 23}) {
		t.Errorf("descendants: %v", got)
	}
	if got := victims(procs, 20, KillSandbox); !slices.Equal(got, []int{21, 22, 23, 30, 40}) {
		t.Errorf("sandbox: %v", got)
	}
	// A parent cycle (a torn read of /proc) does not loop.
	cyc := []procInfo{{pid: 5, ppid: 6, state: 'S'}, {pid: 6, ppid: 5, state: 'S'}, {pid: 7, ppid: 5, state: 'S'}}
	if got := victims(cyc, 7, KillSandbox); len(got) != 0 {
		t.Errorf("cycle: %v", got)
	}
	st := "1234 (a (weird) name) S 99 1234 1200 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 555 1000 200"
	if pi, ok := parseStat([]byte(st)); !ok || pi.pid != 1234 || pi.ppid != 99 || pi.sid != 1200 || pi.state != 'S' || pi.start != 555 {
		t.Errorf("parseStat(%q) = %+v %v", st, pi, ok)
	}
}
