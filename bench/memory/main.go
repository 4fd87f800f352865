// Command memory measures what an authenticated client can make `sandgate
// serve` hold: it starts a real serve (the binary of this checkout, or
// -bin), runs -commands chatty commands (each writes -output bytes a line
// at a time, one write per line) and then -uploads module uploads at once
// (PUT …/modules of -module bytes each, spread over -sandboxes sandboxes),
// and prints serve's resident memory (VmRSS) before, after each phase and
// once settled, its peak (VmHWM), and each against -bound: the bound this
// branch states for it (see README.md, "Limits"). A retained command's
// output is bounded by SANDGATE_OUTPUT_BUDGET (64m) and an upload by the
// module cap and the loads at once; run it against an older binary (-bin)
// for the figures before.
//
// The sandboxes' own processes are not serve's: only the serve process's
// memory is read. Uploads refused as busy (503) are tried again after the
// client's own retries, a second later, as a caller does; the count is
// printed.
// Run it as root (sandboxes) with bench/memory.sh.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/wasmbin"
)

func main() {
	log.SetFlags(0)
	bin := flag.String("bin", "", "the sandgate binary to run serve from (default: built from this checkout)")
	commands := flag.Int("commands", 1000, "chatty commands to run")
	parallel := flag.Int("parallel", 4, "commands running at once")
	output := flag.Int("output", 512<<10, "bytes each command writes, a line (64 bytes) per write")
	uploads := flag.Int("uploads", 20, "module uploads at once")
	sandboxes := flag.Int("sandboxes", 4, "sandboxes the uploads are spread over (the commands run in the first)")
	module := flag.Int("module", 8<<20, "bytes of each module uploaded (a small module and a custom section)")
	bound := flag.Int("bound", 320, "the bound on serve's RSS to compare with, MiB (README.md, \"Limits\")")
	logFile := flag.String("log", "", "write serve's log to `FILE` (run with GODEBUG=gctrace=1 to see its live heap at each collection)")
	flag.Parse()
	if os.Geteuid() != 0 {
		log.Fatal("bench: sandboxes need root: run bench/memory.sh as root")
	}
	dir, err := os.MkdirTemp("", "sandgate-memory-bench")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if *bin == "" {
		*bin = filepath.Join(dir, "sandgate")
		if out, err := exec.Command("go", "build", "-o", *bin, "./cmd/sandgate").CombinedOutput(); err != nil {
			log.Fatalf("building sandgate: %v\n%s", err, out)
		}
	}
	if *logFile == "" {
		*logFile = filepath.Join(dir, "serve.log")
	}
	srv, err := startServe(*bin, dir, *logFile)
	if err != nil {
		log.Fatal(err)
	}
	defer srv.stop()
	if err := run(srv, *commands, *parallel, *output, *uploads, *sandboxes, *module, *bound); err != nil {
		srv.stop()
		log.Fatal(err)
	}
}

func run(srv *serve, commands, parallel, output, uploads, sandboxes, module, bound int) error {
	ctx := context.Background()
	c, err := client.New(srv.url)
	if err != nil {
		return err
	}
	var boxes []*client.Session
	for i := range max(1, sandboxes) {
		s, err := c.Create(ctx, client.CreateOptions{ID: fmt.Sprintf("memory-bench-%d", i)})
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
		defer s.Destroy(context.WithoutCancel(ctx))
		boxes = append(boxes, s)
	}
	lines := max(1, output/64)
	// Each line is 64 bytes: "chatty line 00000001 ", 42 dots, a newline.
	chatty := fmt.Sprintf(`awk 'BEGIN { for (i = 0; i < %d; i++) { printf "chatty line %%08d %s\n", i; fflush() } }'`, lines, strings.Repeat(".", 42))
	for range 3 { // warm up
		if _, err := boxes[0].Run(ctx, client.Command{Command: "true"}); err != nil {
			return err
		}
	}
	time.Sleep(2 * time.Second)
	before := srv.mem()

	start := time.Now()
	var next, failed atomic.Int64
	var firstErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range max(1, parallel) {
		wg.Go(func() {
			for next.Add(1) <= int64(commands) {
				r, err := boxes[0].Run(ctx, client.Command{Command: chatty})
				if err == nil && (r.ExitCode != 0 || len(r.Stdout) != lines*64) {
					err = fmt.Errorf("exit %d, %d bytes of output (want %d): %s", r.ExitCode, len(r.Stdout), lines*64, r.Stderr)
				}
				if err != nil {
					failed.Add(1)
					mu.Lock()
					firstErr = cmp(firstErr, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return fmt.Errorf("%d of %d commands failed; the first: %w", failed.Load(), commands, firstErr)
	}
	cmdTime := time.Since(start)
	afterCommands := srv.mem()

	start = time.Now()
	var busy atomic.Int64
	errs := make(chan error, uploads)
	for i := range uploads {
		wg.Go(func() {
			mod := client.Module{Name: fmt.Sprintf("m%d", i), Wasm: wasmbin.Padded(wasmbin.Pass(), module, i)}
			for try := 0; ; try++ {
				err := boxes[i%len(boxes)].SetModules(ctx, []client.Module{mod})
				var se *client.ServiceError
				if errors.As(err, &se) && se.Status == 503 && try < 100 {
					busy.Add(1) // the client tried again already; so does a caller
					time.Sleep(time.Second)
					continue
				}
				errs <- err
				return
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return fmt.Errorf("upload: %w", err)
		}
	}
	upTime := time.Since(start)
	afterUploads := srv.mem()
	time.Sleep(10 * time.Second)
	settled := srv.mem()

	load, _ := os.ReadFile("/proc/loadavg")
	fmt.Printf("serve %s; %d chatty commands of %d bytes (%d at once) in %s; %d uploads of %d-byte modules over %d sandboxes in %s (%d answered busy and tried again)\n",
		srv.version, commands, lines*64, parallel, cmdTime.Round(time.Millisecond), uploads, module, len(boxes), upTime.Round(time.Millisecond), busy.Load())
	fmt.Printf("load average during the run: %s", load)
	fmt.Printf("%-28s %10s %10s %14s %14s\n", "serve's memory", "RSS MiB", "÷ bound", "Go heap MiB", "output kept")
	row := func(name string, m memory) {
		fmt.Printf("%-28s %10.1f %10.2f %14.1f %14.1f\n", name, float64(m.rss)/1024, float64(m.rss)/1024/float64(bound), float64(m.heap)/1024, float64(m.output)/1024)
	}
	row("before", before)
	row("after the commands", afterCommands)
	row("after the uploads", afterUploads)
	row("settled (10 s later)", settled)
	fmt.Printf("%-28s %10.1f %10.2f\n", "peak RSS (VmHWM)", float64(settled.hwm)/1024, float64(settled.hwm)/1024/float64(bound))
	fmt.Printf("bound %d MiB: RSS settled %s it\n", bound, map[bool]string{true: "is within", false: "is OVER"}[settled.rss <= int64(bound)<<10])
	return nil
}

func cmp(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// serve is a running `sandgate serve`.
type serve struct {
	cmd     *exec.Cmd
	url     string
	version string
	once    sync.Once
}

// memory is serve's: RSS and its peak (KiB), and what its Go heap holds
// (objects alive or not yet collected, and sandgate_output_kept_bytes),
// from its /metrics.
type memory struct{ rss, hwm, heap, output int64 }

// mem reads serve's VmRSS and VmHWM.
func (s *serve) mem() memory {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		log.Fatal(err)
	}
	var m memory
	if resp, err := http.Get(s.url + "/metrics"); err == nil {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) == 2 {
				v, _ := strconv.ParseFloat(f[1], 64)
				switch f[0] {
				case "go_memstats_heap_alloc_bytes":
					m.heap = int64(v) >> 10
				case "sandgate_output_kept_bytes":
					m.output = int64(v) >> 10
				}
			}
		}
		resp.Body.Close()
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			switch f[0] {
			case "VmRSS:":
				m.rss = v
			case "VmHWM:":
				m.hwm = v
			}
		}
	}
	return m
}

func startServe(bin, dir, logFile string) (*serve, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	cmd := exec.Command(bin, "serve")
	var env []string
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "SANDGATE_") && !strings.HasPrefix(e, "SANDBOX_") && !strings.HasPrefix(e, "SNAPSHOT_") {
			env = append(env, e)
		}
	}
	cmd.Env = append(env, "HOST=127.0.0.1", "PORT="+strconv.Itoa(port), "LOG_FORMAT=json",
		"SANDGATE_STATE_DIR="+filepath.Join(dir, "state"), "SNAPSHOT_DIRECTORY="+filepath.Join(dir, "snapshots"),
		"SANDGATE_AUDIT_LOG="+filepath.Join(dir, "audit.jsonl"), "SANDGATE_WASM_CACHE_DIR="+filepath.Join(dir, "wasm-cache"),
		"SANDGATE_IDLE_SUSPEND=0", "SANDGATE_SHUTDOWN_GRACE=60s")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	logf, err := os.Create(logFile)
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &serve{cmd: cmd, url: fmt.Sprintf("http://127.0.0.1:%d", port)}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil && m["message"] == "sandgate serving" {
				select {
				case ready <- fmt.Sprint(m["version"]):
				default:
				}
			}
		}
		close(ready)
	}()
	select {
	case v, ok := <-ready:
		if !ok {
			log, _ := os.ReadFile(logFile)
			return nil, fmt.Errorf("serve ended before serving:\n%s", log)
		}
		s.version = bin
		_ = v
		return s, nil
	case <-time.After(3 * time.Minute):
		cmd.Process.Kill()
		return nil, errors.New("serve did not serve within 3m")
	}
}

// stop ends serve: SIGTERM (it saves what runs), then SIGKILL a minute on.
func (s *serve) stop() {
	s.once.Do(func() {
		s.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { s.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Minute):
			s.cmd.Process.Kill()
			<-done
		}
	})
}
