// Command shards measures sandgate's shards over one store: see
// bench/shards.sh.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
	"github.com/sandgate/sandgate/snapshot/store"
)

func main() {
	execs := flag.Int("execs", 300, "execs through each shard, for p50 and p99")
	migrations := flag.Int("migrations", 5, "owner SIGTERMed → first command on another shard, for the p50")
	changedMB := flag.Int("changed-mb", 10, "MB the migrated sandbox has changed")
	leases := flag.Int("leases", 1000, "sandboxes' leases one shard holds while its store writes are counted")
	flag.Parse()
	if os.Geteuid() != 0 {
		log.Fatal("shards bench: run as root (sandboxes need namespaces, overlayfs and cgroups)")
	}
	if err := run(*execs, *migrations, *changedMB, *leases); err != nil {
		log.Fatal("shards bench: ", err)
	}
}

const token = "sandgate-shards-bench"

// shard is one `sandgate serve` of the bench.
type shard struct {
	id, url string
	port    int
	cmd     *exec.Cmd
	exited  chan struct{}
}

type rig struct {
	dir, bin, store string
	shards          map[string]*shard
	hc              *http.Client
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// start starts shard id (again, on its state, when it ran before).
func (r *rig) start(id string) error {
	s := r.shards[id]
	if s == nil {
		port, err := freePort()
		if err != nil {
			return err
		}
		s = &shard{id: id, port: port, url: fmt.Sprintf("http://127.0.0.1:%d", port)}
		r.shards[id] = s
	}
	state := filepath.Join(r.dir, id)
	if err := os.MkdirAll(state, 0o700); err != nil {
		return err
	}
	s.cmd = exec.Command(r.bin, "serve")
	s.cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + state, "PORT=" + strconv.Itoa(s.port), "LOG_FORMAT=text",
		"SANDBOX_SERVICE_TOKEN=" + token, "SANDGATE_STATE_DIR=" + filepath.Join(state, "state"), "SNAPSHOT_DIRECTORY=" + r.store,
		"SANDGATE_AUDIT_LOG=" + filepath.Join(state, "audit.log"), "SANDBOX_DNS=127.0.0.1:9", "SANDGATE_IDLE_SUSPEND=0",
		"SANDGATE_SHARD_ID=" + id, "SANDGATE_SHARD_URL=" + s.url, "SANDGATE_SHUTDOWN_GRACE=2m"}
	stderr, err := s.cmd.StderrPipe()
	if err != nil {
		return err
	}
	if err := s.cmd.Start(); err != nil {
		return err
	}
	s.exited = make(chan struct{})
	listening := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sent := false
		for sc.Scan() {
			if !sent && strings.Contains(sc.Text(), "sandgate serving") {
				listening <- true
				sent = true
			}
		}
		s.cmd.Wait()
		close(s.exited)
		if !sent {
			listening <- false
		}
	}()
	select {
	case ok := <-listening:
		if !ok {
			return fmt.Errorf("shard %s ended before listening", id)
		}
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("shard %s did not listen within 2m", id)
	}
	return nil
}

// stop ends shard id with SIGTERM (it saves its sandboxes).
func (r *rig) stop(id string) {
	s := r.shards[id]
	select {
	case <-s.exited:
		return
	default:
	}
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(3 * time.Minute):
		s.cmd.Process.Kill()
		<-s.exited
	}
}

func (r *rig) call(via, method, path, body string) (int, []byte, error) {
	req, err := http.NewRequest(method, r.shards[via].url+path, strings.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set(api.HeaderProtocol, "1")
	req.Header.Set(api.HeaderToken, token)
	resp, err := r.hc.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func (r *rig) must(want int, via, method, path, body string) error {
	code, b, err := r.call(via, method, path, body)
	if err != nil {
		return fmt.Errorf("%s %s via %s: %w", method, path, via, err)
	}
	if code != want {
		return fmt.Errorf("%s %s via %s: %d, want %d: %s", method, path, via, code, want, b)
	}
	return nil
}

// exec runs command in name via a shard, and checks it exited 0.
func (r *rig) exec(via, name, command string) error {
	code, b, err := r.call(via, "POST", "/v1/sandboxes/"+name+"/exec", `{"command":`+strconv.Quote(command)+`}`+"\n")
	if err != nil || code != 200 {
		return fmt.Errorf("exec %q in %s via %s: %d %v %s", command, name, via, code, err, b)
	}
	out, err := api.ReadExec(strings.NewReader(string(b)))
	if err != nil || !out.Exited || out.ExitCode != 0 {
		return fmt.Errorf("exec %q in %s via %s: %+v %v", command, name, via, out, err)
	}
	return nil
}

func run(execs, migrations, changedMB, leases int) error {
	dir, err := os.MkdirTemp("/var/tmp", "sandgate-shards-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	r := &rig{dir: dir, bin: filepath.Join(dir, "sandgate"), store: filepath.Join(dir, "store"), shards: map[string]*shard{},
		hc: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}}
	fmt.Fprintln(os.Stderr, "building sandgate...")
	if err := benchkit.GoBuild(r.bin, nil, "./cmd/sandgate"); err != nil {
		return err
	}
	for _, id := range []string{"a", "b"} {
		if err := r.start(id); err != nil {
			return err
		}
		defer r.stop(id)
	}
	fmt.Printf("sandgate shards bench — %s\n\n", benchkit.Machine())

	// Exec through the owner and through another shard, interleaved.
	if err := r.must(201, "a", "POST", "/v1/sandboxes", `{"name":"bench"}`); err != nil {
		return err
	}
	defer r.call("a", "DELETE", "/v1/sandboxes/bench", "")
	var direct, forwarded []time.Duration
	for i := range execs + 20 {
		for _, via := range []string{"a", "b"} {
			t0 := time.Now()
			if err := r.exec(via, "bench", "true"); err != nil {
				return err
			}
			if i >= 20 { // warm-up
				if via == "a" {
					direct = append(direct, time.Since(t0))
				} else {
					forwarded = append(forwarded, time.Since(t0))
				}
			}
		}
	}
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	dp50, fp50 := benchkit.Pct(direct, 50), benchkit.Pct(forwarded, 50)
	fmt.Printf("exec true via the owner              p50 %7.3f ms  p99 %7.3f ms  n=%d\n", ms(dp50), ms(benchkit.Pct(direct, 99)), len(direct))
	fmt.Printf("exec true via another shard          p50 %7.3f ms  p99 %7.3f ms  n=%d\n", ms(fp50), ms(benchkit.Pct(forwarded, 99)), len(forwarded))
	fmt.Printf("  forwarding adds                    p50 %7.3f ms  (%.2fx the owner's)\n\n", ms(fp50-dp50), float64(fp50)/float64(dp50))

	// Migration: the owner SIGTERMed with a sandbox of changedMB changed →
	// its first command answered on the other shard.
	var moves, saves []time.Duration
	owner, other := "a", "b"
	for i := range migrations {
		name := fmt.Sprintf("move%d", i)
		if err := r.must(201, owner, "POST", "/v1/sandboxes", `{"name":"`+name+`"}`); err != nil {
			return err
		}
		if err := r.exec(owner, name, fmt.Sprintf("head -c %d /dev/urandom > /workspace/changed", changedMB<<20)); err != nil {
			return err
		}
		t0 := time.Now()
		r.shards[owner].cmd.Process.Signal(syscall.SIGTERM)
		<-r.shards[owner].exited
		saved := time.Since(t0)
		if err := r.must(200, other, "POST", "/v1/sandboxes/"+name+"/resume", `{}`); err != nil {
			return err
		}
		if err := r.exec(other, name, "test -s /workspace/changed"); err != nil {
			return err
		}
		moves, saves = append(moves, time.Since(t0)), append(saves, saved)
		r.call(other, "DELETE", "/v1/sandboxes/"+name, "")
		if err := r.start(owner); err != nil {
			return err
		}
		owner, other = other, owner
	}
	fmt.Printf("migration, %d MB changed: SIGTERM → first command on the other shard  p50 %7.1f ms (of which the owner's save and exit %7.1f ms)  n=%d\n\n",
		changedMB, ms(benchkit.Pct(moves, 50)), ms(benchkit.Pct(saves, 50)), len(moves))

	// Lease renewal: the store writes one shard makes per second holding
	// many leases, against one lease object renewed per sandbox.
	st, err := store.NewDir(filepath.Join(dir, "lease-store"))
	if err != nil {
		return err
	}
	counting := &countingStore{Store: st}
	renew := time.Second
	c, err := cluster.Open(context.Background(), cluster.Config{Store: counting, ID: "counted", LeaseTime: 3 * renew, Renew: renew})
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	for i := range leases {
		if _, err := c.Acquire(context.Background(), fmt.Sprintf("sb-%d", i)); err != nil {
			return err
		}
	}
	counting.writes.Store(0)
	window := 5 * renew
	time.Sleep(window)
	w := counting.writes.Load()
	perSec := float64(w) / window.Seconds()
	scale := float64(renew) / float64(cluster.DefaultRenew)
	fmt.Printf("lease renewal, %d sandboxes on one shard: %d store writes in %s (renewing every %s) = %.2f/s; at the default %s: %.2f/s, against %.0f/s renewing a lease per sandbox (%.4fx)\n",
		leases, w, window, renew, perSec, cluster.DefaultRenew, perSec*scale, float64(leases)/cluster.DefaultRenew.Seconds(), perSec*scale/(float64(leases)/cluster.DefaultRenew.Seconds()))
	return nil
}

// countingStore counts the writes (puts and deletes) made through it.
type countingStore struct {
	store.Store
	writes atomic.Int64
}

func (c *countingStore) Put(ctx context.Context, name string, r io.Reader, o store.PutOptions) (store.Info, error) {
	c.writes.Add(1)
	return c.Store.Put(ctx, name, r, o)
}

func (c *countingStore) DeleteIf(ctx context.Context, name string, gen int64) error {
	c.writes.Add(1)
	return c.Store.DeleteIf(ctx, name, gen)
}
