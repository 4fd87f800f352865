package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
)

// rig is one bench run's world: benchkit's DNS server, CA and upstream
// process; one relay.Proxy serving both the sandboxes' links and a
// standalone TCP listener; and a Launcher driving `sandgate sandbox` with a
// state directory of its own.
type rig struct {
	env      *benchkit.Env
	proxy    *relay.Proxy
	rings    *audit.Rings
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

	res, err := netpolicy.NewDNSResolver(netpolicy.ResolverConfig{Servers: []string{r.env.DNS.Addr}, Timeout: 2 * time.Second})
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { res.Close() })
	decider := &netpolicy.Decider{Resolver: res, DialTimeout: 5 * time.Second,
		AllowPrivate: []netip.Prefix{netip.PrefixFrom(r.env.Upstream, 32)}}
	// The audit rings let the bench check that each download really went
	// through the proxy, under the identity it expects.
	r.rings = audit.NewRings(256)
	if r.proxy, err = relay.New(relay.Config{Decider: decider, Audit: r.rings, UpstreamRoots: r.env.CA.Pool}); err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { r.proxy.Close() })
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
	sb := relay.NewTenant("standalone", r.policy, nil)
	go func() { r.served <- r.proxy.Serve(ctx, ln, sb) }()
	r.closers = append(r.closers, func() {
		cancel()
		select {
		case <-r.served:
		case <-time.After(10 * time.Second):
		}
	})

	if r.launcher, err = appliance.NewLauncher(appliance.LauncherConfig{CLI: r.env.Bin, StateDir: r.state, AgentBinary: r.env.Bin}); err != nil {
		return nil, err
	}
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
