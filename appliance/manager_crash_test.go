package appliance

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
)

// crashChildEnv makes the test binary the service that is killed: see
// crashChild.
const crashChildEnv = "_SANDGATE_TEST_CRASH_CHILD"

func init() {
	if os.Getenv(crashChildEnv) != "" {
		if err := crashChild(); err != nil {
			fmt.Fprintln(os.Stderr, "crash child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
}

// stallingStore stalls a layer's Put once it has read part of the layer,
// after saying so on standard output: the moment the parent kills it.
type stallingStore struct{ store.Store }

func (s stallingStore) Put(ctx context.Context, name string, r io.Reader, o store.PutOptions) (store.Info, error) {
	if strings.HasSuffix(name, ".tar.zst") {
		io.CopyN(io.Discard, r, 1)
		fmt.Println("in-put")
		<-ctx.Done() // the parent kills the process before this ends
		return store.Info{}, ctx.Err()
	}
	return s.Store.Put(ctx, name, r, o)
}

// crashChild is a service that suspends sandbox "crash" once (a good
// snapshot holding /root/v1), resumes it, writes /root/v2, and starts a
// second suspend whose save stalls, to be killed with SIGKILL there.
func crashChild() error {
	ctx := context.Background()
	bin := os.Getenv("CRASH_BIN")
	l, err := NewLauncher(LauncherConfig{CLI: bin, AgentBinary: bin, StateDir: os.Getenv("CRASH_STATE")})
	if err != nil {
		return err
	}
	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{"127.0.0.1:9"}})
	if err != nil {
		return err
	}
	proxy, err := relay.New(relay.Config{Decider: &netpolicy.Decider{Resolver: res}})
	if err != nil {
		return err
	}
	dir, err := store.NewDir(os.Getenv("CRASH_STORE"))
	if err != nil {
		return err
	}
	cfg := ManagerConfig{Launcher: l, Proxy: proxy, Store: dir, WorkDir: os.Getenv("CRASH_WORK"), IdleSuspend: -1, Shard: shortShard}
	m, err := NewManager(ctx, cfg)
	if err != nil {
		return err
	}
	sb, err := m.Create(ctx, "crash", CreateOptions{})
	if err != nil {
		return err
	}
	if err := runIn(ctx, sb, "echo one > /root/v1"); err != nil {
		return err
	}
	if err := m.Suspend(ctx, "crash"); err != nil {
		return err
	}
	if sb, err = m.Resume(ctx, "crash", ResumeOptions{}); err != nil {
		return err
	}
	if err := runIn(ctx, sb, "echo two > /root/v2"); err != nil {
		return err
	}
	m.st = stallingStore{dir}
	return m.Suspend(ctx, "crash")
}

func runIn(ctx context.Context, sb *Sandbox, script string) error {
	st, err := sb.Run(ctx, agentCmd(script))
	if err == nil && !st.Success() {
		err = fmt.Errorf("%q: %v", script, st)
	}
	return err
}

// A service killed with SIGKILL in the middle of a save: its last good
// snapshot is intact, and a new manager over the same state recovers the
// sandbox the crash left running (saving it, newer than the snapshot) and
// resumes it with everything it had.
func TestKilledDuringSaveRecovers(t *testing.T) {
	// Short leases: the new manager waits for the crashed one's to expire.
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.Shard = shortShard })
	storeDir := t.TempDir()
	work := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashChildEnv+"=1", "CRASH_BIN="+r.l.agent, "CRASH_STATE="+r.egress.state, "CRASH_STORE="+storeDir, "CRASH_WORK="+work)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	saving := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "in-put" {
				saving <- true
				return
			}
		}
		saving <- false
	}()
	select {
	case ok := <-saving:
		if !ok {
			go func() { waited <- cmd.Wait() }()
			t.Fatalf("the child ended before its second save: %v\n%s", <-waited, stderr.String())
		}
	case <-time.After(2 * time.Minute):
		cmd.Process.Kill()
		t.Fatalf("the child did not reach its second save in 2m:\n%s", stderr.String())
	}
	cmd.Process.Kill() // SIGKILL, in the middle of the save
	cmd.Wait()

	// The last good snapshot is what the record names, and it verifies.
	st, err := store.NewDir(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	// Closed after the manager below, whose cleanup saves and destroys
	// the resumed sandbox through it (with a closed store the save fails
	// and the sandbox is left running, past the test).
	t.Cleanup(func() { st.Close() })
	r.st = st
	r.cfg.Store, r.cfg.WorkDir = st, work
	probe := &Manager{st: st}
	rec, err := probe.readRecord(r.ctx(), snapshotRecordKey("crash"))
	if err != nil {
		t.Fatalf("the record of the last good snapshot: %v", err)
	}
	l, err := snapshot.Load(r.ctx(), st, rec.Layer)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, l); err != nil {
		t.Errorf("the last good snapshot does not verify: %v", err)
	}
	l.Close()

	// A new service recovers the sandbox the crash left and resumes it.
	r.m = r.open()
	in, err := r.m.Get(r.ctx(), "crash")
	if err != nil || in.State != Suspended {
		t.Fatalf("after recovery: %+v %v", in, err)
	}
	if _, err := r.m.Resume(r.ctx(), "crash", ResumeOptions{Network: NetworkSpec{Policy: ptr(r.pol)}}); err != nil {
		t.Fatal(err)
	}
	if code, out := r.sh("crash", "cat /root/v1 /root/v2"); code != 0 || out != "one\ntwo\n" {
		t.Errorf("resumed after the crash: %d %q", code, out)
	}
}

func agentCmd(script string) agent.Cmd {
	return agent.Cmd{Args: []string{"/bin/sh", "-c", script}}
}
