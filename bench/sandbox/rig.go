package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api/service"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
)

// rig is one bench run's world: benchkit's DNS server, CA and upstream
// process; the service as serve assembles it, whose proxy serves both the
// sandboxes' links and a standalone TCP listener and whose launcher drives
// `sandgate sandbox` with a state directory of its own; and a second
// launcher driving the same CLI as Google's is driven.
type rig struct {
	env      *benchkit.Env
	svc      *service.Service
	proxy    *relay.Proxy
	audit    *audit.Journals
	policy   netpolicy.Policy
	launcher *appliance.Launcher
	// pipes drives the same `sandgate sandbox` as Google's CLI is driven
	// (through a wrapper named "sandbox"): the agent's link is then a pair
	// of pipes, and egress crosses the agent and the yamux link as bytes,
	// as it does on Cloud Run.
	pipes  *appliance.Launcher
	state  string
	prefix string // sandbox ids start with it: unique to this run

	standalone     string // the standalone proxy's TCP address
	stopStandalone context.CancelFunc
	served         chan error
	closers        []func()
	closeOnce      sync.Once
}

func newRig(bin string) (_ *rig, err error) {
	r := &rig{prefix: fmt.Sprintf("sgbench%d", os.Getpid())}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	if r.env, err = benchkit.Setup(bin); err != nil {
		return nil, err
	}
	r.closers = append(r.closers, r.env.Close)
	r.state = filepath.Join(r.env.Dir, "sandboxes")
	if err := os.Mkdir(r.state, 0o700); err != nil {
		return nil, err
	}

	st, err := store.NewDir(filepath.Join(r.env.Dir, "store"))
	if err != nil {
		return nil, err
	}
	// The service as serve assembles it; its audit (each sandbox's opened
	// as the bench creates it) lets the bench check that each download
	// really went through the proxy, under the identity it expects.
	if r.svc, err = service.New(context.Background(), service.Config{
		DNSServers: []string{r.env.DNS.Addr}, DialTimeout: 5 * time.Second,
		AllowPrivate:  []netip.Prefix{netip.PrefixFrom(r.env.Upstream, 32)},
		UpstreamRoots: r.env.CA.Pool, Store: st,
		Launcher: appliance.LauncherConfig{CLI: r.env.Bin, StateDir: r.state, AgentBinary: r.env.Bin, Capture: true, PrivateDir: r.env.Dir},
		Manager:  appliance.ManagerConfig{Version: "bench", WorkDir: filepath.Join(r.env.Dir, "work"), IdleSuspend: -1},
	}); err != nil {
		return nil, err
	}
	r.proxy, r.audit, r.launcher = r.svc.Proxy, r.svc.Audit, r.svc.Launcher
	r.closers = append(r.closers, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r.svc.Shutdown(ctx)
	})
	if r.policy, err = netpolicy.ParsePolicy([]byte(`{"mode":"custom","allowedHosts":["` + benchkit.Host + `"]}`)); err != nil {
		return nil, err
	}

	// The baseline: the same proxy on a TCP listener.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r.standalone = ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	r.stopStandalone, r.served = cancel, make(chan error, 1)
	tenant := relay.NewTenant("standalone", r.policy, nil)
	r.audit.Open("standalone") // its events are kept, as a sandbox's are
	go func() { r.served <- r.proxy.Serve(ctx, ln, tenant) }()
	r.closers = append(r.closers, func() {
		cancel()
		select {
		case <-r.served:
		case <-time.After(10 * time.Second):
		}
	})

	wrapper := filepath.Join(r.env.Dir, "google", "sandbox")
	if err := os.MkdirAll(filepath.Dir(wrapper), 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(wrapper, []byte("#!/bin/sh\nexec '"+r.env.Bin+"' sandbox \"$@\"\n"), 0o700); err != nil {
		return nil, err
	}
	if r.pipes, err = appliance.NewLauncher(appliance.LauncherConfig{CLI: wrapper, StateDir: r.state, AgentBinary: r.env.Bin}); err != nil {
		return nil, err
	}
	if !r.pipes.Google() {
		return nil, errors.New("the wrapper named sandbox was not driven as Google's CLI")
	}
	return r, nil
}

// close removes everything the rig started, in reverse order. Sandboxes
// the bench left behind (after a failure) are deleted first, so no process,
// mount or cgroup of this run outlives it.
func (r *rig) close() { r.closeOnce.Do(r.closeAll) }

func (r *rig) closeAll() {
	if r.launcher != nil && r.state != "" {
		ents, _ := os.ReadDir(r.state)
		for _, d := range ents {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			if err := r.launcher.Delete(ctx, d.Name()); err != nil {
				fmt.Fprintf(os.Stderr, "cleanup: deleting sandbox %s: %v\n", d.Name(), err)
			}
			cancel()
		}
	}
	for i := len(r.closers) - 1; i >= 0; i-- {
		r.closers[i]()
	}
	r.closers = nil
}

// id names the n-th sandbox of a kind for this run. Sandbox cgroups are
// machine-wide, so ids carry the bench's pid.
func (r *rig) id(kind string, n int) string { return fmt.Sprintf("%s-%s%d", r.prefix, kind, n) }

// ctx bounds one bench operation, so a hang fails loudly instead of
// stalling the run.
func ctx(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(context.Background(), d, errors.New("bench operation timed out"))
}

// events are the audit events held in memory of sandbox id (not yet
// written to the store: a bench's few are in the segment being filled).
func (r *rig) events(id string) []audit.Event {
	var out []audit.Event
	for _, seg := range r.audit.Held(id) {
		b, _ := seg.Lines(context.Background())
		for _, l := range bytes.Split(bytes.TrimSpace(b), []byte("\n")) {
			var e audit.Event
			if json.Unmarshal(l, &e) == nil {
				out = append(out, e)
			}
		}
	}
	return out
}
