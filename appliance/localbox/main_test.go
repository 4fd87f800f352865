package localbox

import (
	"bytes"
	"context"
	"io"
	"os"
	"runtime"
	"testing"
	"time"
)

func TestMain(m *testing.M) {
	if IsInit() {
		InitMain()
	}
	os.Exit(m.Run())
}

// needRoot skips tests that make real sandboxes where they cannot run.
func needRoot(t testing.TB) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("sandboxes need Linux")
	}
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
}

func newRuntime(t testing.TB) *Runtime {
	t.Helper()
	needRoot(t)
	m, err := NewRuntime(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		infos, _ := m.List()
		for _, in := range infos {
			_ = m.Delete(context.Background(), in.ID, true)
		}
		// Templates are mounted: unmounted here, or the state directory
		// could not be removed.
		names, _ := m.Templates()
		for _, n := range names {
			if err := m.RemoveTemplate(n); err != nil {
				t.Errorf("removing template %s: %v", n, err)
			}
		}
	})
	return m
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// output is a pipe whose read side is collected into a buffer.
type output struct {
	w    *os.File
	buf  bytes.Buffer
	done chan struct{}
}

func newOutput(t testing.TB) *output {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	o := &output{w: w, done: make(chan struct{})}
	go func() {
		io.Copy(&o.buf, r)
		r.Close()
		close(o.done)
	}()
	t.Cleanup(func() { w.Close() })
	return o
}

// String closes the write side and returns everything read once every
// writer (the command too) has closed it.
func (o *output) String(t testing.TB) string {
	t.Helper()
	o.w.Close()
	select {
	case <-o.done:
	case <-time.After(30 * time.Second):
		t.Fatal("output never reached EOF")
	}
	return o.buf.String()
}

// runDetached starts a sandbox whose command sleeps, so exec can run in it.
func runDetached(t testing.TB, m *Runtime, id string, mod func(*RunOptions)) {
	t.Helper()
	opts := RunOptions{Config: Config{ID: id, Write: true, Cmd: []string{"sleep", "infinity"}}}
	if mod != nil {
		mod(&opts)
	}
	p, err := m.Run(testCtx(t), opts)
	if err != nil {
		t.Fatalf("run %s: %v", id, err)
	}
	if err := p.Detach(); err != nil {
		t.Fatal(err)
	}
}

// sh runs a shell script in the sandbox and returns its exit code, stdout
// and stderr.
func sh(t testing.TB, m *Runtime, id, script string) (int, string, string) {
	t.Helper()
	out, errOut := newOutput(t), newOutput(t)
	p, err := m.Exec(testCtx(t), id, ExecOptions{Cmd: []string{"sh", "-c", script}, Stdio: Stdio{Stdout: out.w, Stderr: errOut.w}})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	out.w.Close()
	errOut.w.Close()
	code, err := p.Wait()
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	return code, out.String(t), errOut.String(t)
}
