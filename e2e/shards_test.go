package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/internal/testkit/servetest"
	"github.com/sandgate/sandgate/internal/wsconn"
)

// shardLease is the shards' lease time in these tests: a shard that
// stops renewing loses its sandboxes this long after its last heartbeat.
const shardLease = 10 * time.Second

// cluster is several `sandgate serve` processes sharing one store.
type cluster struct {
	t      *testing.T
	f      *fixtures
	dir    string
	token  string
	store  []string // the store's variables, the same for every shard
	shards map[string]*serve
	ports  map[string]int
}

func newCluster(t *testing.T, store ...string) *cluster {
	return &cluster{t: t, f: newFixtures(t), dir: t.TempDir(), token: "shards-token-" + nonce(), store: store,
		shards: map[string]*serve{}, ports: map[string]int{}}
}

// freePort is a loopback port nothing listens on now.
func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// start starts (or restarts, on its state) shard id, holding at most max
// sandboxes.
func (c *cluster) start(id string, max int) *serve {
	c.t.Helper()
	port, ok := c.ports[id]
	if !ok {
		port = freePort(c.t)
		c.ports[id] = port
	}
	if err := os.MkdirAll(filepath.Join(c.dir, id), 0o755); err != nil {
		c.t.Fatal(err)
	}
	var env []string
	for _, e := range serveEnv(c.f, filepath.Join(c.dir, id), c.token, "") {
		if !strings.HasPrefix(e, "PORT=") && !strings.HasPrefix(e, "SNAPSHOT_DIRECTORY=") {
			env = append(env, e)
		}
	}
	env = append(env, c.store...)
	env = append(env, "PORT="+strconv.Itoa(port), "SANDGATE_SHARD_ID="+id, fmt.Sprintf("SANDGATE_SHARD_URL=http://127.0.0.1:%d", port),
		"SANDGATE_LEASE_TIME="+shardLease.String(), "SANDGATE_LEASE_RENEW=2s", "SANDGATE_CHECKPOINT_INTERVAL=2s",
		"SANDGATE_MAX_SANDBOXES="+strconv.Itoa(max))
	s := startServe(c.t, env)
	c.shards[id] = s
	c.t.Cleanup(func() {
		if c.t.Failed() {
			log := s.log.String()
			c.t.Logf("shard %s's log, its end:\n%s", id, log[len(log)-min(len(log), 6000):])
		}
	})
	return s
}

// call sends one request to shard via and returns the status, the body and
// the shard that answered for the sandbox (x-sandgate-owner).
func (c *cluster) call(via, method, path, body string) (int, string, string) {
	c.t.Helper()
	req, _ := http.NewRequest(method, c.shards[via].url+path, strings.NewReader(body))
	req.Header.Set(api.HeaderProtocol, "1")
	req.Header.Set(api.HeaderToken, c.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s via %s: %v", method, path, via, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), c.shardAt(resp.Header.Get(api.HeaderOwner))
}

// auditFollow is a follow stream of a sandbox's audit: its lines, as they
// come.
type auditFollow struct {
	lines  chan string
	cancel context.CancelFunc
}

// followAudit follows sandbox name's audit through shard via (query: the
// audit route's, follow=1 among it) until the test ends.
func (c *cluster) followAudit(via, name, query string) *auditFollow {
	c.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c.t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, "GET", c.shards[via].url+"/v1/sandboxes/"+name+"/audit"+query, nil)
	req.Header.Set(api.HeaderToken, c.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		c.t.Fatalf("following %s's audit via %s: %v %v", name, via, err, resp)
	}
	f := &auditFollow{lines: make(chan string, 1000), cancel: cancel}
	go func() {
		defer resp.Body.Close()
		defer close(f.lines)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			f.lines <- sc.Text()
		}
	}()
	return f
}

// want waits (bounded: the store gets a running sandbox's events every
// flush, 10 s) for a line holding s.
func (f *auditFollow) want(t *testing.T, s string) {
	t.Helper()
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case l, ok := <-f.lines:
			if !ok {
				t.Fatalf("the audit follow stream ended before an event with %s", s)
			}
			if strings.Contains(l, s) {
				return
			}
		case <-timeout:
			t.Fatalf("no event with %s in the audit follow stream within 2 minutes", s)
		}
	}
}

// shardAt is the id of the shard at url.
func (c *cluster) shardAt(url string) string {
	for id, port := range c.ports {
		if url == fmt.Sprintf("http://127.0.0.1:%d", port) {
			return id
		}
	}
	return url
}

// exec runs command in sandbox name via a shard and returns its stdout,
// exit code and the shard that ran it.
func (c *cluster) exec(via, name, command string) (string, int, string) {
	c.t.Helper()
	code, body, owner := c.call(via, "POST", "/v1/sandboxes/"+name+"/exec", `{"command":`+strconv.Quote(command)+`}`+"\n")
	if code != 200 {
		c.t.Fatalf("exec %q in %s via %s: %d %s", command, name, via, code, body)
	}
	out, err := api.ReadExec(strings.NewReader(body))
	if err != nil || !out.Exited {
		c.t.Fatalf("exec %q in %s via %s: %v %+v", command, name, via, err, out)
	}
	return string(out.Stdout), out.ExitCode, owner
}

// writer is a command printing the time every 100 ms in a sandbox, and the
// times it printed, by run ("<shard>#<n>": the n-th run, on that shard).
type writer struct {
	mu    sync.Mutex
	times map[string][]int64
	runs  []string
	done  chan struct{}
}

// startWriter starts a writer in sandbox name via a shard, and waits
// (bounded) for its first lines.
func (c *cluster) startWriter(via, name string, w *writer) string {
	c.t.Helper()
	req, _ := http.NewRequest("POST", c.shards[via].url+"/v1/sandboxes/"+name+"/exec",
		strings.NewReader(`{"command":"while :; do date +%s%N; sleep 0.1; done"}`+"\n"))
	req.Header.Set(api.HeaderProtocol, "1")
	req.Header.Set(api.HeaderToken, c.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		c.t.Fatalf("writer in %s via %s: %v %v", name, via, err, resp)
	}
	owner := c.shardAt(resp.Header.Get(api.HeaderOwner))
	w.mu.Lock()
	run := fmt.Sprintf("%s#%d", owner, len(w.runs))
	w.runs = append(w.runs, run)
	w.mu.Unlock()
	done := make(chan struct{})
	w.done = done
	go func() {
		defer close(done)
		defer resp.Body.Close()
		fr := api.NewFrameReader(resp.Body)
		var line []byte
		for {
			f, err := fr.Next()
			if err != nil || f.Type == api.FrameExit {
				return
			}
			for _, b := range f.Payload {
				if b != '\n' {
					line = append(line, b)
					continue
				}
				if ns, err := strconv.ParseInt(string(line), 10, 64); err == nil {
					w.mu.Lock()
					w.times[run] = append(w.times[run], ns)
					w.mu.Unlock()
				}
				line = line[:0]
			}
		}
	}()
	for deadline := time.Now().Add(hang); ; time.Sleep(50 * time.Millisecond) {
		w.mu.Lock()
		n := len(w.times[run])
		w.mu.Unlock()
		if n >= 3 {
			return owner
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("the writer in %s via %s printed nothing within %s", name, via, hang)
		}
	}
}

// waitEnded waits (bounded) for the writer's stream to end.
func (w *writer) waitEnded(t *testing.T, what string) {
	t.Helper()
	select {
	case <-w.done:
	case <-time.After(hang):
		t.Fatalf("%s: the writer's stream never ended", what)
	}
}

// noOverlap checks that the sandbox's runs never overlap in time: each
// run's last line is before the next one's first.
func (w *writer) noOverlap(t *testing.T, name string) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	order := w.runs
	for i := 1; i < len(order); i++ {
		prev, next := w.times[order[i-1]], w.times[order[i]]
		if len(prev) == 0 || len(next) == 0 {
			t.Errorf("%s: no lines from %s or %s (%d, %d)", name, order[i-1], order[i], len(prev), len(next))
			continue
		}
		if last, first := slices.Max(prev), slices.Min(next); last >= first {
			t.Errorf("%s ran on %s and %s at once: %s's last line %s after %s's first", name, order[i-1], order[i], order[i-1],
				time.Duration(last-first), order[i])
		} else {
			t.Logf("%s: %s → %s, no command for %s", name, order[i-1], order[i], time.Duration(first-last))
		}
	}
}

// checkpointed waits (bounded) until sandbox name's record in the
// directory store was saved after since: its last checkpoint holds what
// it did before.
func (c *cluster) checkpointed(storeDir, name string, since time.Time) {
	c.t.Helper()
	deadline := time.Now().Add(hang)
	for {
		b, err := os.ReadFile(filepath.Join(storeDir, "snapshots", name+".json"))
		var rec struct{ Saved time.Time }
		if err == nil && json.Unmarshal(b, &rec) == nil && rec.Saved.After(since) {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: no checkpoint after %s within %s", name, since, hang)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// resume resumes sandbox name via a shard, retrying (bounded) while its
// lease is held by a shard that stopped renewing.
func (c *cluster) resume(via, name string) string {
	c.t.Helper()
	deadline := time.Now().Add(hang)
	for {
		code, body, owner := c.call(via, "POST", "/v1/sandboxes/"+name+"/resume", `{}`)
		if code == 200 {
			return owner
		}
		if code != 503 || time.Now().After(deadline) {
			c.t.Fatalf("resume %s via %s: %d %s", name, via, code, body)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Three shards over one directory store: creates spread once one is full,
// any shard answers for any sandbox as its owner does, and no sandbox ever
// runs on two shards at once — across SIGSTOP past the lease, SIGTERM and
// kill -9 — nor loses what it had at its last save or checkpoint.
func TestShardsOverOneStore(t *testing.T) {
	if ok, why := servetest.CanRun(); !ok {
		t.Skip(why)
	}
	t.Parallel()
	storeDir := filepath.Join(t.TempDir(), "store")
	c := newCluster(t, "SNAPSHOT_DIRECTORY="+storeDir)
	for _, id := range []string{"a", "b", "c"} {
		c.start(id, 10)
	}
	// 30 sandboxes created through a: ten there, the rest where there is
	// room.
	owner := map[string]string{}
	count := map[string]int{}
	var names []string
	for i := range 30 {
		name := fmt.Sprintf("s%02d", i)
		code, body, o := c.call("a", "POST", "/v1/sandboxes", `{"name":"`+name+`"}`)
		if code != 201 {
			t.Fatalf("create %s: %d %s", name, code, body)
		}
		owner[name], names = o, append(names, name)
		count[o]++
	}
	if count["a"] != 10 || count["b"]+count["c"] != 20 || count["b"] > 10 || count["c"] > 10 {
		t.Fatalf("30 creates through a with room for 10 each: %v", count)
	}
	// Every shard answers for every sandbox as its owner.
	for _, name := range names {
		for _, via := range []string{"a", "b", "c"} {
			out, code, o := c.exec(via, name, "echo $((6*7)) > /workspace/n; cat /workspace/n")
			if out != "42\n" || code != 0 || o != owner[name] {
				t.Fatalf("exec in %s (on %s) via %s: %q %d, answered by %s", name, owner[name], via, out, code, o)
			}
		}
	}
	// The Go client with every shard's URL sends each sandbox's calls to
	// its owner.
	gc, err := client.New(c.shards["a"].url, client.WithToken(c.token), client.WithShards(c.shards["b"].url, c.shards["c"].url))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names[:6] {
		in, err := gc.Info(context.Background(), name)
		if err != nil || in.Shard != owner[name] {
			t.Fatalf("the Go client gets %s: %+v %v, want it on %s", name, in, err, owner[name])
		}
	}

	pick := func(shard string) string {
		for _, name := range names {
			if owner[name] == shard {
				return name
			}
		}
		t.Fatalf("no sandbox on %s", shard)
		return ""
	}
	// A suspended sandbox asked for at a full shard is resumed where
	// there is room: a is full again once one of its sandboxes is
	// suspended and another created in its place; one of b's goes, and b
	// resumes the suspended one.
	moved, gone := pick("a"), pick("b")
	if code, body, _ := c.call("a", "POST", "/v1/sandboxes/"+moved+"/suspend", ""); code != 204 {
		t.Fatalf("suspend %s via a: %d %s", moved, code, body)
	}
	if code, body, o := c.call("a", "POST", "/v1/sandboxes", `{"name":"fill"}`); code != 201 || o != "a" {
		t.Fatalf("create fill via a: %d %s, on %s", code, body, o)
	}
	if code, body, _ := c.call("a", "DELETE", "/v1/sandboxes/"+gone, ""); code != 204 {
		t.Fatalf("destroy %s via a: %d %s", gone, code, body)
	}
	if o := c.resume("a", moved); o != "b" {
		t.Fatalf("%s resumed via a, which is full, runs on %s; want b, which has room", moved, o)
	}
	if out, _, _ := c.exec("a", moved, "cat /workspace/n"); out != "42\n" {
		t.Errorf("%s resumed on b: %q", moved, out)
	}
	owner[moved], owner["fill"] = "b", "a"
	names = append(slices.DeleteFunc(names, func(n string) bool { return n == gone }), "fill")

	// A sandbox of each shard runs a writer.
	wa, wb, wc := pick("a"), pick("b"), pick("c")
	// The others go, leaving every shard room to take a writer's sandbox.
	for _, name := range names {
		if name != wa && name != wb && name != wc {
			if code, body, _ := c.call("c", "DELETE", "/v1/sandboxes/"+name, ""); code != 204 {
				t.Fatalf("destroy %s via c: %d %s", name, code, body)
			}
		}
	}
	names = []string{wa, wb, wc}
	writers := map[string]*writer{}
	for _, name := range []string{wa, wb, wc} {
		writers[name] = &writer{times: map[string][]int64{}}
		c.startWriter("a", name, writers[name])
	}
	mark := func(name, via, marker string) {
		if _, code, _ := c.exec(via, name, "echo "+marker+" > /workspace/"+marker); code != 0 {
			t.Fatalf("marking %s", name)
		}
	}

	// a paused past its lease: its commands stop by their own deadline,
	// and b resumes wa from its last checkpoint.
	since := time.Now()
	mark(wa, "a", "before-stop")
	c.checkpointed(storeDir, wa, since)
	c.shards["a"].cmd.Process.Signal(syscall.SIGSTOP)
	t.Cleanup(func() { c.shards["a"].cmd.Process.Signal(syscall.SIGCONT) })
	time.Sleep(shardLease + 2*time.Second)
	if o := c.resume("b", wa); o != "b" {
		t.Fatalf("%s resumed via b runs on %s", wa, o)
	}
	if out, _, _ := c.exec("b", wa, "cat /workspace/before-stop"); out != "before-stop\n" {
		t.Errorf("%s resumed on b after a stopped: %q, want its checkpoint", wa, out)
	}
	c.startWriter("b", wa, writers[wa])
	// Continued, a finds itself fenced: it drops its copy, unsaved.
	c.shards["a"].cmd.Process.Signal(syscall.SIGCONT)

	// b stopped with SIGTERM: it saves and releases; a resumes them at
	// once.
	mark(wb, "b", "before-term")
	if err := c.shards["b"].terminate(t); err != nil {
		t.Fatalf("b after SIGTERM: %v", err)
	}
	writers[wb].waitEnded(t, wb+" on b")
	// A follow of wb's audit through c, which has room, while wb is
	// suspended: it goes on once a runs wb, from what a writes to the
	// store.
	follow := c.followAudit("c", wb, "?follow=1&decision=deny&since="+time.Now().UTC().Format(time.RFC3339Nano))
	for _, name := range []string{wa, wb} {
		writers[name].waitEnded(t, name+" on b")
		c.resume("a", name)
		c.startWriter("a", name, writers[name])
	}
	c.exec("a", wb, "curl -sS https://followed.example.com/ || true")
	follow.want(t, `"host":"followed.example.com"`)
	if out, _, _ := c.exec("a", wb, "cat /workspace/before-term"); out != "before-term\n" {
		t.Errorf("%s resumed on a after b's SIGTERM: %q", wb, out)
	}

	// c killed with SIGKILL: its commands stop with its links, and a
	// resumes wc from its last checkpoint once c's lease expired.
	since = time.Now()
	mark(wc, "c", "before-kill")
	c.checkpointed(storeDir, wc, since)
	c.shards["c"].cmd.Process.Kill()
	writers[wc].waitEnded(t, wc+" on c")
	c.resume("a", wc)
	if out, _, _ := c.exec("a", wc, "cat /workspace/before-kill"); out != "before-kill\n" {
		t.Errorf("%s resumed on a after c was killed: %q, want its checkpoint", wc, out)
	}
	c.startWriter("a", wc, writers[wc])
	time.Sleep(time.Second) // every writer prints on a

	// The killed shard comes back: what it left is stale, removed.
	<-c.shards["c"].exited
	c.start("c", 10)
	c.start("b", 10)
	for _, name := range []string{wa, wb, wc} {
		writers[name].noOverlap(t, name)
	}
	// Every sandbox ends running or suspended, listed by every shard.
	for _, via := range []string{"a", "b", "c"} {
		code, body, _ := c.call(via, "GET", "/v1/sandboxes", "")
		var list api.SandboxList
		if code != 200 || json.Unmarshal([]byte(body), &list) != nil {
			t.Fatalf("list via %s: %d %s", via, code, body)
		}
		states := map[string]int{}
		for _, sb := range list.Sandboxes {
			states[sb.State]++
		}
		if states["running"]+states["suspended"] != 3 || len(list.Sandboxes) != 3 {
			t.Errorf("list via %s: %v", via, states)
		}
	}
	for _, name := range names {
		c.call("a", "DELETE", "/v1/sandboxes/"+name, "")
	}
}

// checkTunnels reaches a server on port of sandbox name through shard
// via: the port tunnel (an Upgrade request, carried raw) and the TCP
// bridge (a WebSocket), waiting (bounded) for the server to listen.
func (c *cluster) checkTunnels(via, name string, port int) {
	c.t.Helper()
	url := fmt.Sprintf("%s/v1/sandboxes/%s/ports/%d/", c.shards[via].url, name, port)
	deadline := time.Now().Add(hang)
	for {
		req, _ := http.NewRequest("GET", url, nil)
		req.Header.Set(api.HeaderProtocol, "1")
		req.Header.Set(api.HeaderToken, c.token)
		req.Header.Set("Connection", "Upgrade")
		req.Header.Set("Upgrade", "websocket")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 && strings.Contains(string(b), "Directory listing") {
				break
			}
			err = fmt.Errorf("%d %.200q", resp.StatusCode, b)
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("the port tunnel to %s:%d via %s: %v", name, port, via, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	ws, _, err := websocket.Dial(ctx, strings.Replace(fmt.Sprintf("%s/v1/sandboxes/%s/tcp/%d", c.shards[via].url, name, port), "http://", "ws://", 1),
		&websocket.DialOptions{HTTPHeader: http.Header{api.HeaderProtocol: {"1"}, api.HeaderToken: {c.token}}})
	if err != nil {
		c.t.Fatalf("the TCP bridge to %s:%d via %s: %v", name, port, via, err)
	}
	conn := wsconn.New(ws)
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(hang))
	fmt.Fprint(conn, "GET / HTTP/1.0\r\n\r\n")
	if got, err := io.ReadAll(conn); err != nil || !strings.Contains(string(got), "Directory listing") {
		c.t.Fatalf("the TCP bridge to %s:%d via %s: %v %.200q", name, port, via, err, got)
	}
}

// Three shards over one bucket (the Cloud Storage emulator): creates
// spread, every shard answers for every sandbox as its owner (the port
// tunnel and the TCP bridge included), and a create finds no room only
// when every shard is full.
func TestShardsOverOneBucket(t *testing.T) {
	if ok, why := servetest.CanRun(); !ok {
		t.Skip(why)
	}
	t.Parallel()
	srv, _ := gcstest.Start(t, "shards")
	c := newCluster(t, "SNAPSHOT_BUCKET=shards", "STORAGE_EMULATOR_HOST="+strings.TrimPrefix(srv.URL(), "http://"))
	for _, id := range []string{"a", "b", "c"} {
		c.start(id, 2)
	}
	owner := map[string]string{}
	for i := range 6 {
		name := fmt.Sprintf("g%d", i)
		code, body, o := c.call("b", "POST", "/v1/sandboxes", `{"name":"`+name+`"}`)
		if code != 201 {
			t.Fatalf("create %s: %d %s", name, code, body)
		}
		owner[name] = o
	}
	if code, body, _ := c.call("b", "POST", "/v1/sandboxes", `{"name":"full"}`); code != 503 {
		t.Errorf("a create with every shard full: %d %s, want 503", code, body)
	}
	// The port tunnel and the TCP bridge, through a shard that forwards.
	var g0via string
	for _, id := range []string{"a", "b", "c"} {
		if id != owner["g0"] {
			g0via = id
		}
	}
	c.exec(g0via, "g0", "cd /tmp && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &")
	c.checkTunnels(g0via, "g0", 8000)
	for name, o := range owner {
		for _, via := range []string{"a", "b", "c"} {
			if out, _, got := c.exec(via, name, "echo "+name); out != name+"\n" || got != o {
				t.Errorf("exec in %s (on %s) via %s: %q, answered by %s", name, o, via, out, got)
			}
		}
		if code, body, _ := c.call("c", "POST", "/v1/sandboxes/"+name+"/suspend", ""); code != 204 {
			t.Errorf("suspend %s via c: %d %s", name, code, body)
		}
	}
	// Suspended, any shard resumes one: the one asked.
	if o := c.resume("c", "g0"); o != "c" {
		t.Errorf("g0 resumed via c runs on %s", o)
	}
	for name := range owner {
		c.call("a", "DELETE", "/v1/sandboxes/"+name, "")
	}
}
