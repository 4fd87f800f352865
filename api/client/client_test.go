package client_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/client"
)

// ctxT is a test's context, bounded: no wait of a test is unbounded.
func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// newClient is a client of the test service.
func newClient(t *testing.T, opts ...client.Option) *client.Client {
	t.Helper()
	s := need(t)
	c, err := client.New(s.URL, append([]client.Option{client.WithToken(s.Token)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// create makes a sandbox that is destroyed when the test ends.
func create(t *testing.T, c *client.Client, opts client.CreateOptions) *client.Session {
	t.Helper()
	s, err := c.Create(ctxT(t), opts)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		s.Destroy(ctx)
	})
	return s
}

// run runs a command that must exit 0 and returns its stdout.
func run(t *testing.T, s interface {
	Run(context.Context, client.Command) (client.Result, error)
}, command string) string {
	t.Helper()
	res, err := s.Run(ctxT(t), client.Command{Command: command})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%q: exit %d, %v: %s", command, res.ExitCode, err, res.Stderr)
	}
	return string(res.Stdout)
}

// front puts a handler of the test's own before the service (a front end
// such as Cloud Run's, or a faulty network) and returns its URL.
func front(t *testing.T, h func(w http.ResponseWriter, r *http.Request, next http.Handler)) string {
	t.Helper()
	s := need(t)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h(w, r, s.Handler) }))
	t.Cleanup(hs.Close)
	return hs.URL
}

func randomName(prefix string) string {
	var b [4]byte
	rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// Create, run, stop, resume, attach, list, destroy: and the errors each
// gives when the sandbox is not as it needs it.
func TestLifecycle(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{Ports: []int{3000}})
	if !strings.HasPrefix(s.ID(), "ai-sdk-") || len(s.ID()) != len("ai-sdk-")+8 {
		t.Errorf("generated id %q, want ai-sdk-<8 hex>", s.ID())
	}
	if s.DefaultWorkingDirectory() != "/workspace" || s.Home() != "/home/agent" || !strings.Contains(s.Description(), s.ID()) {
		t.Errorf("directories %q %q, description %q", s.DefaultWorkingDirectory(), s.Home(), s.Description())
	}
	if got := s.Ports(); len(got) != 1 || got[0] != 3000 {
		t.Errorf("ports %v", got)
	}
	// Create never resumes: the name is taken.
	_, err := c.Create(ctx, client.CreateOptions{ID: s.ID()})
	var se *client.ServiceError
	if !errors.Is(err, client.ErrSandboxExists) || !errors.As(err, &se) || se.Status != http.StatusConflict || !strings.Contains(se.Request, "POST /v1/sandboxes") {
		t.Errorf("create of an existing name: %v (%+v)", err, se)
	}
	if _, err := c.Create(ctx, client.CreateOptions{ID: "Bad_Name"}); err == nil || !strings.Contains(err.Error(), "invalid sandbox name") {
		t.Errorf("a bad name: %v", err)
	}
	// A non-zero exit is a result.
	res, err := s.Run(ctx, client.Command{Command: "echo out; echo err >&2; exit 7"})
	if err != nil || res.ExitCode != 7 || string(res.Stdout) != "out\n" || string(res.Stderr) != "err\n" {
		t.Errorf("run: %+v %v", res, err)
	}
	res, err = s.Run(ctx, client.Command{Command: "pwd; echo $X; cat", WorkingDirectory: "sub", Env: map[string]string{"X": "y"}, Stdin: strings.NewReader("from stdin")})
	if err != nil || res.ExitCode != 2 || !strings.Contains(string(res.Stderr), "/workspace/sub") {
		t.Errorf("a working directory that is not there: %+v %v", res, err)
	}
	run(t, s, "mkdir sub; echo kept > sub/f")
	res, err = s.Run(ctx, client.Command{Command: "pwd; echo $X; cat", WorkingDirectory: "sub", Env: map[string]string{"X": "y"}, Stdin: strings.NewReader("from stdin")})
	if err != nil || string(res.Stdout) != "/workspace/sub\ny\nfrom stdin" {
		t.Errorf("working directory, env, stdin: %+v %v", res, err)
	}
	if _, err := s.Run(ctx, client.Command{Command: "true", Env: map[string]string{"BAD-NAME": "x"}}); err == nil {
		t.Error("a bad variable name was sent")
	}

	// Stop is idempotent; a stopped sandbox is suspended, not found for
	// calls that need it running.
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Stop(ctx); err != nil {
		t.Errorf("stop again: %v", err)
	}
	if _, err := s.Run(ctx, client.Command{Command: "true"}); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("run in a stopped sandbox: %v", err)
	}
	if _, err := s.ReadTextFile(ctx, "sub/f"); !errors.Is(err, client.ErrSandboxNotRunning) {
		t.Errorf("read in a stopped sandbox: %v", err)
	}
	if _, err := c.Attach(ctx, s.ID()); !errors.Is(err, client.ErrSandboxNotRunning) {
		t.Errorf("attach to a suspended sandbox: %v", err)
	}
	infos, err := c.List(ctx)
	found := false
	for _, in := range infos {
		found = found || (in.Name == s.ID() && in.State == "suspended" && in.LayerBytes > 0)
	}
	if err != nil || !found {
		t.Errorf("list: %+v %v", infos, err)
	}

	// Resume, with the files; attach changes nothing.
	r, err := c.Resume(ctx, s.ID(), client.ResumeOptions{Ports: []int{3000}})
	if err != nil {
		t.Fatal(err)
	}
	if got := run(t, r, "cat sub/f"); got != "kept\n" {
		t.Errorf("after resume: %q", got)
	}
	a, err := c.Attach(ctx, s.ID())
	if err != nil || run(t, a, "cat /workspace/sub/f") != "kept\n" {
		t.Errorf("attach: %v", err)
	}
	if in, err := r.Info(ctx); err != nil || in.State != "running" || in.Name != s.ID() {
		t.Errorf("info: %+v %v", in, err)
	}
	if _, err := c.Resume(ctx, "no-such-sandbox", client.ResumeOptions{}); !errors.Is(err, client.ErrSandboxNotFound) || !errors.As(err, &se) || se.Status != 404 {
		t.Errorf("resume of nothing: %v", err)
	}
	if _, err := c.Attach(ctx, "no-such-sandbox"); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("attach to nothing: %v", err)
	}

	// Destroy a running one, again, and a suspended one.
	if err := r.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r.Destroy(ctx); err != nil {
		t.Errorf("destroy again: %v", err)
	}
	if _, err := c.Info(ctx, s.ID()); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("info after destroy: %v", err)
	}
	s2 := create(t, c, client.CreateOptions{ID: randomName("suspended")})
	if err := s2.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Destroy(ctx, s2.ID()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resume(ctx, s2.ID(), client.ResumeOptions{}); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("resume after destroying a suspended sandbox: %v", err)
	}
}

// A setup command that fails destroys the sandbox and fails Create.
func TestSetup(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{Setup: []string{"echo one > /workspace/setup", "echo two >> /workspace/setup"}})
	if got := run(t, s, "cat setup"); got != "one\ntwo\n" {
		t.Errorf("setup ran: %q", got)
	}
	id := randomName("setup-fails")
	_, err := c.Create(ctx, client.CreateOptions{ID: id, Setup: []string{"true", "echo broken >&2; exit 3"}})
	if err == nil || !strings.Contains(err.Error(), "exited with 3") || !strings.Contains(err.Error(), "broken") {
		t.Errorf("a failing setup: %v", err)
	}
	if _, err := c.Info(ctx, id); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("the sandbox of a failed setup is still there: %v", err)
	}
}

// A sandbox's own limits at create stay with it (Info says them, over the
// service's defaults), and Info says what it uses while it runs; a limit
// out of range is refused, naming it, and nothing is made.
func TestLimitsAndUsage(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{Limits: client.Limits{CPU: 0.5, Memory: 256 << 20, Lifetime: 24 * time.Hour}})
	run(t, s, "head -c 8388608 /dev/zero > /tmp/held")
	in, err := c.Info(ctx, s.ID())
	if err != nil {
		t.Fatal(err)
	}
	if l := in.Limits; l == nil || l.CPU != 0.5 || l.Memory != 256<<20 || l.Lifetime != 24*time.Hour || l.CPUWeight != 100 || l.Pids == 0 {
		t.Errorf("limits %+v: want its own cpu, memory and lifetime over the service's weight and pids", l)
	}
	if u := in.Usage; u == nil || u.MemoryBytes < 8<<20 || u.MemoryBytes > 256<<20 || u.Processes < 1 || u.CPUSeconds <= 0 {
		t.Errorf("usage %+v: want the 8 MiB it holds, within its limit, processes and CPU time", u)
	}
	id := randomName("limits-bad")
	_, err = c.Create(ctx, client.CreateOptions{ID: id, Limits: client.Limits{CPUWeight: 20000}})
	var se *client.ServiceError
	if !errors.As(err, &se) || se.Status != http.StatusBadRequest || !strings.Contains(err.Error(), "limits.cpuWeight") {
		t.Errorf("cpuWeight 20000: %v, want a 400 naming limits.cpuWeight", err)
	}
	if _, err := c.Info(ctx, id); !errors.Is(err, client.ErrSandboxNotFound) {
		t.Errorf("a refused create made %s: %v", id, err)
	}
}

// Spawn streams output as it arrives, kills on cancel, and Kill is
// idempotent.
func TestSpawn(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	// The command waits for a file the test writes once it has read the
	// first line: the first line arrived while it ran.
	p, err := s.Spawn(ctx, client.Command{Command: "echo first; echo to-stderr >&2; while [ ! -e /tmp/go ]; do sleep 0.02; done; echo second; exit 4"})
	if err != nil {
		t.Fatal(err)
	}
	if p.ID() == "" {
		t.Error("no process id")
	}
	br := bufio.NewReader(p.Stdout)
	if line, err := br.ReadString('\n'); err != nil || line != "first\n" {
		t.Fatalf("first line: %q %v", line, err)
	}
	run(t, s, "touch /tmp/go")
	rest, _ := io.ReadAll(br)
	errOut, _ := io.ReadAll(p.Stderr)
	code, err := p.Wait(ctx)
	if string(rest) != "second\n" || string(errOut) != "to-stderr\n" || code != 4 || err != nil {
		t.Errorf("rest %q, stderr %q, exit %d %v", rest, errOut, code, err)
	}
	if err := p.Kill(ctx); err != nil {
		t.Errorf("kill of an exited process: %v", err)
	}

	// Kill: the process and what it started; twice is fine.
	p, err = s.Spawn(ctx, client.Command{Command: "sleep 300 & sleep 301; wait"})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Kill(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Kill(ctx); err != nil {
		t.Errorf("kill again: %v", err)
	}
	if code, err := p.Wait(ctx); code != 143 || err != nil {
		t.Errorf("killed: exit %d %v, want 143", code, err)
	}
	if got := run(t, s, "pgrep -c sleep || true"); strings.TrimSpace(got) != "0" {
		t.Errorf("sleeps left after kill: %q", got)
	}

	// Cancelling the spawn context kills it; Wait says why.
	sctx, cancel := context.WithCancel(ctx)
	p, err = s.Spawn(sctx, client.Command{Command: "echo started; exec sleep 300"})
	if err != nil {
		t.Fatal(err)
	}
	if line, _ := bufio.NewReader(p.Stdout).ReadString('\n'); line != "started\n" {
		t.Fatalf("started: %q", line)
	}
	cancel()
	if code, err := p.Wait(ctx); code != 143 || !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: exit %d %v, want 143 and context.Canceled", code, err)
	}
	// Wait's own context bounds Wait only.
	p, err = s.Spawn(ctx, client.Command{Command: "exec sleep 300"})
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithCancel(ctx)
	wcancel()
	if _, err := p.Wait(wctx); !errors.Is(err, context.Canceled) {
		t.Errorf("wait with an ended context: %v", err)
	}
	if err := s.KillAllProcesses(ctx); err != nil {
		t.Fatal(err)
	}
	if code, err := p.Wait(ctx); code <= 128 || err != nil {
		t.Errorf("after kill-all: %d %v, want 128+signal", code, err)
	}
	// Output to writers of the caller's own, and a reader closed early.
	var out bytes.Buffer
	p, err = s.Spawn(ctx, client.Command{Command: "head -c 3000000 /dev/zero; echo done >&2", Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	if p.Stdout != nil {
		t.Error("Stdout is a reader although the command has a writer")
	}
	errOut, _ = io.ReadAll(p.Stderr)
	if code, err := p.Wait(ctx); code != 0 || err != nil || out.Len() != 3000000 || string(errOut) != "done\n" {
		t.Errorf("to a writer: %d %v, %d bytes, %q", code, err, out.Len(), errOut)
	}
	p, err = s.Spawn(ctx, client.Command{Command: "head -c 20000000 /dev/zero"})
	if err != nil {
		t.Fatal(err)
	}
	p.Stdout.Close() // not read: dropped, and the command is not held back
	if code, err := p.Wait(ctx); code != 0 || err != nil {
		t.Errorf("output nobody reads: %d %v", code, err)
	}
}

// cutter is a dialer whose connections the test can cut, as a network
// that drops them would.
type cutter struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (c *cutter) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err == nil {
		c.mu.Lock()
		c.conns = append(c.conns, conn)
		c.mu.Unlock()
	}
	return conn, err
}

func (c *cutter) cut() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.conns {
		conn.Close()
	}
	c.conns = nil
}

// pathCounter counts the requests whose path contains a string.
type pathCounter struct {
	next   http.RoundTripper
	needle string
	n      atomic.Int32
}

func (p *pathCounter) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.Contains(r.URL.Path, p.needle) {
		p.n.Add(1)
	}
	return p.next.RoundTrip(r)
}

// An exec stream that breaks is resumed from the byte it reached: every
// byte of output arrives once, in order, with the exit code.
func TestBrokenStreamResumed(t *testing.T) {
	cut := &cutter{}
	counter := &pathCounter{next: &http.Transport{DialContext: cut.dial}, needle: "/output"}
	c := newClient(t, client.WithHTTPClient(&http.Client{Transport: counter}))
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	script := `i=0; while [ $i -lt 300 ]; do echo "line $i"; i=$((i+1)); done; echo err-before >&2
while [ ! -e /tmp/go ]; do sleep 0.02; done
i=300; while [ $i -lt 20000 ]; do echo "line $i"; i=$((i+1)); done; echo err-after >&2; exit 9`
	p, err := s.Spawn(ctx, client.Command{Command: script})
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(p.Stdout)
	var got strings.Builder
	for i := 0; i < 300; i++ {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("line %d: %v", i, err)
		}
		got.WriteString(line)
	}
	cut.cut() // the stream breaks; the process runs on
	// Another connection lets the command go on.
	other := newClient(t)
	o, err := other.Attach(ctx, s.ID())
	if err != nil {
		t.Fatal(err)
	}
	run(t, o, "touch /tmp/go")
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("reading after the cut: %v", err)
	}
	got.Write(rest)
	errOut, _ := io.ReadAll(p.Stderr)
	code, err := p.Wait(ctx)
	var want strings.Builder
	for i := range 20000 {
		fmt.Fprintf(&want, "line %d\n", i)
	}
	if got.String() != want.String() {
		t.Errorf("output after a broken stream: %d bytes, want %d identical", got.Len(), want.Len())
	}
	if code != 9 || err != nil || string(errOut) != "err-before\nerr-after\n" {
		t.Errorf("exit %d %v, stderr %q", code, err, errOut)
	}
	if counter.n.Load() == 0 {
		t.Error("the stream was not resumed through the output route")
	}
}

// Files: streamed both ways, parents made, text and line ranges, and the
// errors of a missing file and a directory.
func TestFiles(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	big := bytes.Repeat([]byte("0123456789abcdef"), 256<<10) // 4 MiB
	if err := s.WriteFile(ctx, "deep/er/big.bin", bytes.NewReader(big)); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteFile(ctx, "/workspace/piped.bin", io.MultiReader(bytes.NewReader(big[:1000]), strings.NewReader("end"))); err != nil {
		t.Fatal(err)
	}
	rc, err := s.ReadFile(ctx, "/workspace/deep/er/big.bin")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || !bytes.Equal(b, big) {
		t.Errorf("read back %d bytes, %v", len(b), err)
	}
	if got := run(t, s, "wc -c < piped.bin"); strings.TrimSpace(got) != "1003" {
		t.Errorf("a streamed write: %q", got)
	}
	odd := "dir with space/a#b?c%20d é.txt"
	if err := s.WriteTextFile(ctx, odd, "odd"); err != nil {
		t.Fatal(err)
	}
	if got, err := s.ReadTextFile(ctx, odd); err != nil || got != "odd" {
		t.Errorf("a path that needs escaping: %q %v", got, err)
	}
	if got := run(t, s, `cat "/workspace/dir with space/a#b?c%20d é.txt"`); got != "odd" {
		t.Errorf("the file of the odd path in the sandbox: %q", got)
	}
	if err := s.WriteTextFile(ctx, "text.txt", "one\ntwo\nthree\n"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		start, end int
		want       string
	}{{1, 0, "one\ntwo\nthree\n"}, {2, 3, "two\nthree"}, {3, 3, "three"}, {2, 0, "two\nthree\n"}, {3, 10, "three\n"}, {9, 0, ""}} {
		if got, err := s.ReadTextLines(ctx, "text.txt", tc.start, tc.end); err != nil || got != tc.want {
			t.Errorf("lines %d-%d: %q %v, want %q", tc.start, tc.end, got, err, tc.want)
		}
	}
	if _, err := s.ReadTextLines(ctx, "text.txt", 0, 1); err == nil {
		t.Error("line 0 was accepted")
	}
	if text, err := s.Restricted().ReadTextFile(ctx, "/workspace/text.txt"); err != nil || text != "one\ntwo\nthree\n" {
		t.Errorf("text: %q %v", text, err)
	}
	if _, err := s.ReadFile(ctx, "missing"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a missing file: %v", err)
	}
	var pe *fs.PathError
	if _, err := s.ReadFile(ctx, "deep"); !errors.Is(err, syscall.EISDIR) || !errors.As(err, &pe) || pe.Path != "/workspace/deep" {
		t.Errorf("a directory: %v", err)
	}
	if err := s.WriteTextFile(ctx, "deep", "x"); !errors.Is(err, syscall.EISDIR) {
		t.Errorf("writing a directory: %v", err)
	}
}

// The workspace as a tar, out with its digest checked and in again.
func TestWorkspace(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	run(t, s, "mkdir -p a/b && echo hello > a/b/f && head -c 100000 /dev/urandom > r")
	var tarball bytes.Buffer
	digest, err := s.ExportWorkspace(ctx, &tarball)
	if err != nil || !strings.HasPrefix(digest, "sha256:") || tarball.Len() < 100000 {
		t.Fatalf("export: %q %v (%d bytes)", digest, err, tarball.Len())
	}
	other := create(t, c, client.CreateOptions{})
	if err := other.ImportWorkspace(ctx, bytes.NewReader(tarball.Bytes())); err != nil {
		t.Fatal(err)
	}
	if got := run(t, other, "cat a/b/f; wc -c < r"); got != "hello\n100000\n" {
		t.Errorf("imported: %q", got)
	}
	// A tar changed on its way: refused.
	flip := front(t, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if strings.HasSuffix(r.URL.Path, "/workspace") {
			w = &flipWriter{ResponseWriter: w}
		}
		next.ServeHTTP(w, r)
	})
	fc, err := client.New(flip, client.WithToken(svc.Token))
	if err != nil {
		t.Fatal(err)
	}
	fs, err := fc.Attach(ctx, s.ID())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fs.ExportWorkspace(ctx, io.Discard); !errors.Is(err, client.ErrIntegrity) {
		t.Errorf("a changed tar: %v, want ErrIntegrity", err)
	}
}

// flipWriter changes the first byte of a body.
type flipWriter struct {
	http.ResponseWriter
	done bool
}

func (f *flipWriter) Write(b []byte) (int, error) {
	if !f.done && len(b) > 0 {
		f.done = true
		c := append([]byte(nil), b...)
		c[0] ^= 0xff
		return f.ResponseWriter.Write(c)
	}
	return f.ResponseWriter.Write(b)
}

func (f *flipWriter) Flush() { http.NewResponseController(f.ResponseWriter).Flush() }

// Ports: the endpoint of the port tunnel for exposed ports only, and the
// TCP bridge to any.
func TestPorts(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{Ports: []int{8000}})
	if err := s.WriteTextFile(ctx, "site/index.html", "in the sandbox\n"); err != nil {
		t.Fatal(err)
	}
	srv, err := s.Spawn(ctx, client.Command{Command: "exec python3 -m http.server 8000 --bind 127.0.0.1 --directory site", Stdout: io.Discard, Stderr: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Kill(ctx)
	run(t, s, `for i in $(seq 400); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8000))' 2>/dev/null && exit 0; sleep 0.05; done; exit 1`)

	if _, err := s.PortEndpoint(ctx, 9000, "http"); !errors.Is(err, client.ErrCapabilityUnsupported) {
		t.Errorf("a port not exposed: %v", err)
	}
	if _, err := s.PortEndpoint(ctx, 8000, "gopher"); err == nil {
		t.Error("an unknown protocol was accepted")
	}
	ep, err := s.PortEndpoint(ctx, 8000, "http")
	if err != nil {
		t.Fatal(err)
	}
	if ep.URL != svc.URL+"/v1/sandboxes/"+s.ID()+"/ports/8000" || ep.Header.Get(api.HeaderToken) != svc.Token || ep.Header.Get(api.HeaderProtocol) != "1" {
		t.Errorf("endpoint %+v", ep)
	}
	// The tunnel takes requests that upgrade; the server in the sandbox
	// answers (here without upgrading).
	req, _ := http.NewRequestWithContext(ctx, "GET", ep.URL+"/index.html", nil)
	req.Header = ep.Header.Clone()
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "test")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "in the sandbox\n" {
		t.Errorf("through the endpoint: %d %q", resp.StatusCode, body)
	}
	if ws, _ := s.PortEndpoint(ctx, 8000, "ws"); !strings.HasPrefix(ws.URL, "ws://") {
		t.Errorf("ws endpoint %q", ws.URL)
	}
	if err := s.SetPorts([]int{8000, 9000}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.PortEndpoint(ctx, 9000, "http"); err != nil {
		t.Errorf("after SetPorts: %v", err)
	}
	if err := s.SetPorts([]int{0}); err == nil {
		t.Error("port 0 was accepted")
	}

	// The TCP bridge.
	conn, err := s.DialPort(ctx, 8000)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "GET /index.html HTTP/1.0\r\n\r\n")
	all, _ := io.ReadAll(conn)
	conn.Close()
	if !strings.HasPrefix(string(all), "HTTP/1.0 200") || !strings.HasSuffix(string(all), "in the sandbox\n") {
		t.Errorf("through the bridge: %q", all)
	}
	var se *client.ServiceError
	if _, err := s.DialPort(ctx, 8001); !errors.As(err, &se) || se.Status != http.StatusBadGateway {
		t.Errorf("a port nothing listens on: %v", err)
	}
}

// The network policy, CIDR rules included, and the request
// transformations: a credential swapped outside the sandbox and refused
// inside it.
func TestNetworkAndCredentials(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{AllowedHosts: []string{"api.example.com"}})
	if err := s.WriteFile(ctx, "/etc/test-ca.pem", bytes.NewReader(svc.CA.PEM)); err != nil {
		t.Fatal(err)
	}
	connect := func() string {
		return run(t, s, "curl -sS -o /dev/null -w '%{http_code}' --cacert /etc/test-ca.pem https://api.example.com/x 2>&1 || true")
	}
	if got := connect(); got != "200" {
		t.Errorf("CONNECT to an allowed host: %q", got)
	}
	if err := s.SetNetworkPolicy(ctx, client.NetworkPolicy{Mode: client.ModeDenyAll}); err != nil {
		t.Fatal(err)
	}
	if got := connect(); got == "200" {
		t.Errorf("CONNECT under deny-all: %q", got)
	}
	if err := s.SetNetworkPolicy(ctx, client.NetworkPolicy{Mode: client.ModeCustom, AllowedHosts: []string{"api.example.com"}, DeniedCIDRs: []string{"203.0.113.0/24"}}); err != nil {
		t.Fatal(err)
	}
	if got := connect(); got != "200" {
		t.Errorf("CONNECT under a custom policy: %q", got)
	}
	if in, err := s.Info(ctx); err != nil || in.Policy == nil || in.Policy.Mode != "custom" || len(in.Policy.DeniedCIDRs) != 1 {
		t.Errorf("info's policy: %+v %v", in.Policy, err)
	}
	var se *client.ServiceError
	if err := s.SetNetworkPolicy(ctx, client.NetworkPolicy{Mode: client.ModeCustom, AllowedCIDRs: []string{"nonsense"}}); !errors.As(err, &se) || se.Status != 400 {
		t.Errorf("a bad CIDR: %v", err)
	}
	if err := s.SetNetworkPolicy(ctx, client.NetworkPolicy{Mode: "open"}); err == nil {
		t.Error("mode open was sent")
	}
	if _, err := c.Create(ctx, client.CreateOptions{AllowedHosts: []string{"a.example"}, NetworkPolicy: &client.NetworkPolicy{Mode: client.ModeDenyAll}}); err == nil {
		t.Error("hosts and a policy were both accepted")
	}
	// Create with a whole policy.
	p := create(t, c, client.CreateOptions{NetworkPolicy: &client.NetworkPolicy{Mode: client.ModeCustom, AllowedHosts: []string{"api.example.com"}, AllowedCIDRs: []string{"198.51.100.7/32"}}})
	if in, err := p.Info(ctx); err != nil || in.Policy == nil || len(in.Policy.AllowedCIDRs) != 1 {
		t.Errorf("created with a policy: %+v %v", in.Policy, err)
	}

	// Credentials.
	canary := "sk-canary-" + randomName("client")
	ph := "aisdkhc_placeholder_0123456789"
	rule := func(secret string) []client.RequestTransformation {
		return []client.RequestTransformation{{
			Match:     client.Match{Host: "api.example.com", Path: client.StartsWith("/v1/"), Headers: []client.KeyValueMatcher{{Key: client.Exact("x-api-key"), Value: client.Exact(ph)}}},
			Transform: client.Transform{Headers: map[string]string{"x-api-key": secret}},
		}}
	}
	if err := s.AddRequestTransformations(ctx, rule(canary)); err != nil {
		t.Fatal(err)
	}
	curl := `curl -sS -H "X-Api-Key: ` + ph + `" "$ANTHROPIC_BASE_URL/v1/messages"`
	if got := run(t, s, curl); got != "path=/v1/messages auth= key="+ph {
		t.Errorf("through the base URL: %q", got)
	}
	seen := svc.UpstreamSeen()
	if len(seen) == 0 || seen[len(seen)-1].Get("X-Api-Key") != canary {
		t.Error("the upstream did not get the credential")
	}
	if _, err := s.Run(ctx, client.Command{Command: "echo " + canary}); !errors.As(err, &se) || se.Status != 400 {
		t.Errorf("the credential in a command: %v", err)
	}
	// Set replaces; the value replaced stays a credential of the sandbox
	// (still scrubbed, still refused) for its life.
	if err := s.SetRequestTransformations(ctx, rule("sk-another-credential-00")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Run(ctx, client.Command{Command: "echo " + canary}); !errors.As(err, &se) || se.Status != 400 {
		t.Errorf("the replaced credential in a command: %v", err)
	}
	if err := s.SetRequestTransformations(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if err := s.AddRequestTransformations(ctx, []client.RequestTransformation{{Match: client.Match{Host: "x.example"}}}); err == nil {
		t.Error("a transformation without headers was sent")
	}
	if err := s.AddRequestTransformations(ctx, []client.RequestTransformation{{Match: client.Match{Host: "x.example", Path: client.Regex("(")}, Transform: client.Transform{Headers: map[string]string{"a": "b"}}}}); !errors.As(err, &se) || se.Status != 400 {
		t.Errorf("a regex that does not compile: %v", err)
	}
}

// Audit: kept events and followed ones; modules on a service without a
// module runtime; fork.
func TestAuditModulesFork(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	s := create(t, c, client.CreateOptions{})
	fctx, stop := context.WithCancel(ctx)
	events := make(chan client.AuditEvent, 16)
	followed := make(chan error, 1)
	go func() {
		defer close(followed)
		for e, err := range s.FollowAudit(fctx, client.AuditQuery{}) {
			if err != nil {
				followed <- err
				return
			}
			events <- e
		}
	}()
	run(t, s, "curl -sS -x $HTTPS_PROXY https://denied.example.com/ >/dev/null 2>&1 || true")
	select {
	case e := <-events:
		if e.Host != "denied.example.com" || e.Allow() || e.Sandbox != s.ID() || e.Code == "" || !strings.HasPrefix(e.Cmd, "curl -sS") {
			t.Errorf("followed: %+v", e)
		}
	case err := <-followed:
		t.Fatalf("follow ended: %v", err)
	case <-ctx.Done():
		t.Fatal("no event followed")
	}
	stop()
	if err := <-followed; err != nil {
		t.Errorf("follow after its context ended: %v", err)
	}
	kept, err := s.Audit(ctx, client.AuditQuery{Decision: "deny"})
	if err != nil || len(kept.Events) == 0 || kept.Events[0].Host != "denied.example.com" || kept.More {
		t.Errorf("kept: %+v %v", kept, err)
	}

	if err := s.SetModules(ctx, nil); !errors.Is(err, client.ErrCapabilityUnsupported) {
		t.Errorf("modules on a service without them: %v", err)
	}

	run(t, s, "echo original > f")
	copyName := randomName("copy")
	cp, err := s.Fork(ctx, copyName)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Destroy(context.Background(), copyName) })
	if cp.ID() != copyName || run(t, cp, "cat f") != "original\n" {
		t.Errorf("the copy: %s", cp.ID())
	}
	if _, err := s.Fork(ctx, copyName); !errors.Is(err, client.ErrSandboxExists) {
		t.Errorf("fork onto a taken name: %v", err)
	}
}

// Templates: built once for concurrent callers, the builder always
// removed, listed, a failed build retried, built again once deleted.
func TestTemplates(t *testing.T) {
	c := newClient(t)
	ctx := ctxT(t)
	identity := randomName("harness")
	var prepares atomic.Int32
	fail := atomic.Bool{}
	fail.Store(true)
	tmpl := client.Template{
		Identity: identity,
		Setup:    []string{"mkdir -p /opt/h && echo set-up > /opt/h/setup"},
		Prepare: func(ctx context.Context, sb *client.Restricted) error {
			prepares.Add(1)
			if fail.Load() {
				return errors.New("the harness failed to install")
			}
			return sb.WriteTextFile(ctx, "/opt/h/baked", "baked\n")
		},
	}
	id := client.TemplateID(identity, tmpl.Setup)
	if _, err := c.EnsureTemplate(ctx, tmpl); err == nil || !strings.Contains(err.Error(), "failed to install") {
		t.Fatalf("a failing build: %v", err)
	}
	fail.Store(false)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() {
			got, err := c.EnsureTemplate(ctx, tmpl)
			if err == nil && got != id {
				err = fmt.Errorf("id %q, want %q", got, id)
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if n := prepares.Load(); n != 2 {
		t.Errorf("prepared %d times, want 2: one failed build, then one for 4 concurrent callers", n)
	}
	infos, _ := c.List(ctx)
	for _, in := range infos {
		if strings.HasPrefix(in.Name, client.TemplatePrefix) {
			t.Errorf("a builder sandbox is left: %s", in.Name)
		}
	}
	list, err := c.Templates(ctx)
	found := false
	for _, ti := range list {
		found = found || (ti.ID == id && ti.LayerBytes > 0)
	}
	if err != nil || !found {
		t.Errorf("templates %+v %v, want %s", list, err, id)
	}
	s := create(t, c, client.CreateOptions{Template: &tmpl})
	if got := run(t, s, "cat /opt/h/setup /opt/h/baked"); got != "set-up\nbaked\n" {
		t.Errorf("from the template: %q", got)
	}
	if n := prepares.Load(); n != 2 {
		t.Errorf("create built the template again: %d prepares", n)
	}
	// Deleted behind this client's back: the next create builds it again.
	other := newClient(t)
	if err := other.DeleteTemplate(ctx, id); err != nil {
		t.Fatal(err)
	}
	if ok, err := c.TemplateExists(ctx, id); ok || err != nil {
		t.Errorf("exists after delete: %v %v", ok, err)
	}
	s2 := create(t, c, client.CreateOptions{Template: &tmpl})
	if got := run(t, s2, "cat /opt/h/baked"); got != "baked\n" || prepares.Load() != 3 {
		t.Errorf("after the template was deleted: %q, %d prepares", got, prepares.Load())
	}
	c.DeleteTemplate(ctx, id)
}

// Template ids are the TypeScript client's: the SHA-256 of JSON.stringify
// of [1, identity, setup], whose escaping differs from encoding/json's.
func TestTemplateID(t *testing.T) {
	for _, tc := range []struct {
		identity string
		setup    []string
		want     string
	}{
		// Computed with Node.js: createHash("sha256").update(JSON.stringify([1, identity, setup])).
		{"claude-code@1.0.0", []string{}, "ai-sdk-harness-template-27846c87f682f056383b7f23"},
		{"x", []string{"npm i -g pnpm@10 && echo '<ok>' & true"}, "ai-sdk-harness-template-8238b8b2c756c9537d7b35f7"},
		{"é\u2028\x01\"\\\n", []string{"a\tb"}, "ai-sdk-harness-template-ba8c06f6be0ce7f4bc020e6c"},
	} {
		if got := client.TemplateID(tc.identity, tc.setup); got != tc.want {
			t.Errorf("TemplateID(%q, %q) = %s, want %s", tc.identity, tc.setup, got, tc.want)
		}
	}
	if got := client.TemplateID("claude-code@1.0.0", nil); got != client.TemplateID("claude-code@1.0.0", []string{}) {
		t.Errorf("nil setup and none differ: %s", got)
	}
}

// Output the service no longer holds when a broken stream is resumed:
// the rest of the output is ErrOutputLost, and the exit code still comes.
func TestOutputLost(t *testing.T) {
	ctx := ctxT(t)
	var down atomic.Bool
	url := front(t, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if down.Load() && strings.HasSuffix(r.URL.Path, "/output") {
			w.Header().Set(api.HeaderProtocol, "1")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		next.ServeHTTP(w, r)
	})
	cut := &cutter{}
	c, err := client.New(url, client.WithToken(svc.Token), client.WithHTTPClient(&http.Client{Transport: &http.Transport{DialContext: cut.dial}}))
	if err != nil {
		t.Fatal(err)
	}
	s := create(t, c, client.CreateOptions{})
	p, err := s.Spawn(ctx, client.Command{Command: "echo start; while [ ! -e /tmp/go ]; do sleep 0.02; done; head -c 12000000 /dev/zero; touch /tmp/done; exit 3"})
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(p.Stdout)
	if line, _ := br.ReadString('\n'); line != "start\n" {
		t.Fatalf("start: %q", line)
	}
	// The stream breaks and cannot be resumed while the command writes
	// more than the service keeps (8 MiB).
	down.Store(true)
	cut.cut()
	o, err := newClient(t).Attach(ctx, s.ID())
	if err != nil {
		t.Fatal(err)
	}
	run(t, o, "touch /tmp/go; while [ ! -e /tmp/done ]; do sleep 0.02; done")
	down.Store(false)
	_, rerr := io.ReadAll(br)
	code, err := p.Wait(ctx)
	if !errors.Is(rerr, client.ErrOutputLost) || !errors.Is(err, client.ErrOutputLost) || code != 3 {
		t.Errorf("read %v; wait %d %v; want ErrOutputLost and exit 3", rerr, code, err)
	}
	var se *client.ServiceError
	if !errors.As(err, &se) || se.Status != http.StatusGone {
		t.Errorf("the service's 410 is not in the error: %v", err)
	}
}

// A template that is not there.
func TestTemplateNotFound(t *testing.T) {
	c := newClient(t)
	_, err := c.Create(ctxT(t), client.CreateOptions{TemplateID: "no-such-template"})
	var se *client.ServiceError
	if !errors.Is(err, client.ErrTemplateNotFound) || !errors.As(err, &se) || se.Status != 404 {
		t.Errorf("create from a missing template: %v", err)
	}
	if _, err := c.Create(ctxT(t), client.CreateOptions{TemplateID: "x", Template: &client.Template{}}); err == nil {
		t.Error("Template and TemplateID were both accepted")
	}
}
