package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/api/service"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
	"github.com/sandgate/sandgate/snapshot/store"
)

// token is the service token of the bench's server: every request pays
// the check, as it does beyond loopback.
const token = "sandgate-bench-token"

// bridgeKey is the Cloudflare bridge's key (SANDBOX_API_KEY) of the bench's
// server: its exec route is measured beside protocol 1's.
const bridgeKey = "sandgate-bench-bridge-key"

// rig is one run's world: a directory under /var/tmp (sandboxes see it),
// the sandgate binary built from this checkout, and the service assembled
// as serve assembles it, its handler timed, on a loopback listener.
type rig struct {
	dir        string
	bin        string // sandgate, the sandbox CLI and the agent
	portServer string // this program, copied where sandboxes can run it
	state      string // the sandbox CLI's state directory
	launcher   *appliance.Launcher
	m          *appliance.Manager
	svc        *service.Service
	hs         *http.Server
	addr       string // the service's address
	client     *http.Client
	// handled is how long the service took over the last request, from
	// the handler's start to its return: a call's time less this is
	// HTTP's own (client, loopback, net/http's server).
	handled atomic.Int64

	closers   []func()
	closeOnce sync.Once
}

func newRig() (_ *rig, err error) {
	r := &rig{}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	if r.dir, err = os.MkdirTemp("/var/tmp", "sandgate-serve-bench-"); err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { os.RemoveAll(r.dir) })
	if err := os.Chmod(r.dir, 0o755); err != nil {
		return nil, err
	}
	r.bin = filepath.Join(r.dir, "sandgate")
	fmt.Fprintln(os.Stderr, "building sandgate...")
	if err := benchkit.GoBuild(r.bin, nil, "./cmd/sandgate"); err != nil {
		return nil, err
	}
	if r.portServer, err = copySelf(filepath.Join(r.dir, "portserver")); err != nil {
		return nil, err
	}

	r.state = filepath.Join(r.dir, "sandboxes")
	st, err := store.NewDir(filepath.Join(r.dir, "store"))
	if err != nil {
		return nil, err
	}
	// The service as serve assembles it. No egress is measured: a resolver
	// that answers nothing, and a proxy that would refuse everything.
	if r.svc, err = service.New(context.Background(), service.Config{
		DNSServers: []string{"127.0.0.1:9"}, Store: st,
		Launcher: appliance.LauncherConfig{CLI: r.bin, AgentBinary: r.bin, StateDir: r.state, SandboxesCPUWeight: appliance.DefaultSandboxesCPUWeight},
		Manager: appliance.ManagerConfig{
			Version: "bench", WorkDir: filepath.Join(r.dir, "work"), IdleSuspend: -1, BaseURLs: map[string]string{},
		},
		Server: server.Config{Token: token, Version: "bench", EgressPort: 3128},
		Bridge: bridge.Config{Key: bridgeKey},
	}); err != nil {
		return nil, err
	}
	r.m, r.launcher = r.svc.Manager, r.svc.Launcher
	r.closers = append(r.closers, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r.svc.Shutdown(ctx)
	})
	r.closers = append(r.closers, r.removeSandboxes)

	// Served as `sandgate serve` serves it: HTTP/1.1 and HTTP/2 without TLS.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r.addr = ln.Addr().String()
	handler := r.svc.Handler()
	r.hs = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		t0 := time.Now()
		handler.ServeHTTP(w, q)
		r.handled.Store(int64(time.Since(t0)))
	}), ReadHeaderTimeout: 30 * time.Second}
	r.hs.Protocols = new(http.Protocols)
	r.hs.Protocols.SetHTTP1(true)
	r.hs.Protocols.SetUnencryptedHTTP2(true)
	go r.hs.Serve(ln)
	r.closers = append(r.closers, func() { r.hs.Close() })
	r.client = &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 4, DisableCompression: true}}
	return r, nil
}

// copySelf copies this program's executable to dst, runnable by all.
func copySelf(dst string) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	in, err := os.Open(self)
	if err != nil {
		return "", err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return "", err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return "", err
	}
	return dst, out.Close()
}

// removeSandboxes destroys every sandbox and template the run made, so no
// process, mount or cgroup outlives it.
func (r *rig) removeSandboxes() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	infos, _ := r.m.List(ctx)
	for _, in := range infos {
		if err := r.m.Destroy(ctx, in.ID); err != nil {
			fmt.Fprintf(os.Stderr, "cleanup: destroying sandbox %s: %v\n", in.ID, err)
		}
	}
	names, _ := r.launcher.ListTemplates(ctx)
	for _, n := range names {
		r.launcher.RemoveTemplate(ctx, n)
	}
	// Any sandbox the CLI still has (a create cut short).
	ents, _ := os.ReadDir(r.state)
	for _, d := range ents {
		r.launcher.Delete(ctx, d.Name())
	}
}

// close removes everything the rig started, in reverse order.
func (r *rig) close() {
	r.closeOnce.Do(func() {
		for i := len(r.closers) - 1; i >= 0; i-- {
			r.closers[i]()
		}
	})
}

// onInterrupt cleans up and exits on SIGINT/SIGTERM: an interrupted bench
// must not leave sandboxes running.
func (r *rig) onInterrupt() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		fmt.Fprintln(os.Stderr, "bench: interrupted; removing its sandboxes")
		r.close()
		os.Exit(130)
	}()
}

// call sends one request to the service with the protocol and token
// headers, and returns the status and the whole body.
func (r *rig) call(ctx context.Context, method, path string, body any) (int, []byte, error) {
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		rd = bytes.NewReader(b)
	default:
		data, err := json.Marshal(b)
		if err != nil {
			return 0, nil, err
		}
		rd = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://"+r.addr+path, rd)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set(api.HeaderProtocol, "1")
	req.Header.Set(api.HeaderToken, token)
	resp, err := r.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	return resp.StatusCode, data, err
}

// must is call for a request that must answer want.
func (r *rig) must(ctx context.Context, want int, method, path string, body any) ([]byte, error) {
	code, data, err := r.call(ctx, method, path, body)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, path, err)
	}
	if code != want {
		return nil, fmt.Errorf("%s %s: status %d, want %d: %s", method, path, code, want, bytes.TrimSpace(data))
	}
	return data, nil
}

// ctx bounds one bench operation, so a hang fails loudly.
func ctx(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(context.Background(), d, errors.New("bench operation timed out"))
}

// row prints one latency figure: p50 and p99 in milliseconds.
func row(name string, ds []time.Duration, note string) {
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	fmt.Printf("%-34s p50 %8.3f ms   p99 %8.3f ms   n=%-4d %s\n", name, ms(benchkit.Pct(ds, 50)), ms(benchkit.Pct(ds, 99)), len(ds), note)
}
