package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// benchCreate creates n sandboxes through appliance.Create, one after
// another, runs `true` in each and destroys it; then runs n `sandgate
// sandbox run --detach` / `delete --force` pairs through the CLI alone.
// One unmeasured sandbox first warms the page cache and the cgroup tree.
func (r *rig) benchCreate(n int) error {
	var total, create, first, destroy []time.Duration
	for i := -1; i < n; i++ {
		c, f, sb, err := r.create(r.id("c", i+1))
		if err != nil {
			return err
		}
		t1 := time.Now()
		dctx, cancel := ctx(60 * time.Second)
		err = sb.Destroy(dctx)
		cancel()
		if err != nil {
			return err
		}
		if i >= 0 {
			total, create, first = append(total, c+f), append(create, c), append(first, f)
			destroy = append(destroy, time.Since(t1))
		}
	}
	row("create → first command", total, "(target < 150 ms)")
	row("  of which Create", create, "")
	row("  of which first Run", first, "")
	row("destroy", destroy, "")

	// The CLI alone, with the argv the launcher uses.
	var run, del []time.Duration
	for i := -1; i < n; i++ {
		id := r.id("cli", i+1)
		d, err := r.cli(60*time.Second, "run", id, "--detach", "--write",
			"--mount", "type=bind,source="+r.env.Bin+",destination="+appliance.AgentPath+",readonly",
			"--stdin=false", "--", appliance.AgentPath, "agent", "--idle")
		if err != nil {
			return err
		}
		dd, err := r.cli(60*time.Second, "delete", id, "--force")
		if err != nil {
			return err
		}
		if i >= 0 {
			run, del = append(run, d), append(del, dd)
		}
	}
	row("CLI run --detach", run, "")
	row("CLI delete --force", del, "")
	fmt.Println()
	return nil
}

// create makes one sandbox with appliance.Create and runs /bin/true in it,
// returning how long each took; the sandbox is left running.
func (r *rig) create(id string) (time.Duration, time.Duration, *appliance.Sandbox, error) {
	return r.createWith(r.launcher, id)
}

// createWith is create with launcher l.
func (r *rig) createWith(l *appliance.Launcher, id string) (time.Duration, time.Duration, *appliance.Sandbox, error) {
	cctx, cancel := ctx(60 * time.Second)
	defer cancel()
	r.audit.Open(id)
	t0 := time.Now()
	sb, err := appliance.Create(cctx, l, r.proxy, id, appliance.Options{Policy: r.policy})
	if err != nil {
		return 0, 0, nil, fmt.Errorf("creating sandbox %s: %w", id, err)
	}
	t1 := time.Now()
	if err := runTrue(cctx, sb); err != nil {
		dctx, dcancel := ctx(30 * time.Second)
		sb.Destroy(dctx)
		dcancel()
		return 0, 0, nil, err
	}
	return t1.Sub(t0), time.Since(t1), sb, nil
}

// runTrue runs /bin/true in sb; anything but success is an error.
func runTrue(ctx context.Context, sb *appliance.Sandbox) error {
	st, err := sb.Run(ctx, agent.Cmd{Args: []string{"/bin/true"}})
	if err != nil {
		return fmt.Errorf("sandbox %s: running /bin/true: %w", sb.ID(), err)
	}
	if !st.Success() {
		return fmt.Errorf("sandbox %s: /bin/true ended with %v", sb.ID(), st)
	}
	return nil
}

// cli runs one `sandgate sandbox` verb against the rig's state directory
// and returns how long the call took, CLI process start included.
func (r *rig) cli(limit time.Duration, args ...string) (time.Duration, error) {
	c, cancel := ctx(limit)
	defer cancel()
	cmd := exec.CommandContext(c, r.env.Bin, append([]string{"sandbox", "--state-dir", r.state}, args...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	t0 := time.Now()
	err := cmd.Run()
	d := time.Since(t0)
	if err != nil {
		return 0, fmt.Errorf("sandgate sandbox %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out.Bytes()))
	}
	return d, nil
}

// benchExec measures `exec true` round trips on one live sandbox: n
// through Sandbox.Run, then cliN through the CLI.
func (r *rig) benchExec(n, cliN int) error {
	_, _, sb, err := r.create(r.id("exec", 0))
	if err != nil {
		return err
	}
	defer func() {
		dctx, cancel := ctx(60 * time.Second)
		sb.Destroy(dctx)
		cancel()
	}()
	c, cancel := ctx(10 * time.Minute)
	defer cancel()
	for range 20 { // warm up
		if err := runTrue(c, sb); err != nil {
			return err
		}
	}
	lat := make([]time.Duration, 0, n)
	for range n {
		t0 := time.Now()
		if err := runTrue(c, sb); err != nil {
			return err
		}
		lat = append(lat, time.Since(t0))
	}
	row("exec true (Sandbox.Run)", lat, "(target < 10 ms)")

	cli := make([]time.Duration, 0, cliN)
	for i := -3; i < cliN; i++ {
		d, err := r.cli(30*time.Second, "exec", sb.ID(), "--", "/bin/true")
		if err != nil {
			return err
		}
		if i >= 0 {
			cli = append(cli, d)
		}
	}
	row("exec true (CLI exec)", cli, "(includes starting the CLI process)")
	fmt.Println()
	return nil
}

// row prints one latency figure: p50 and p99 in milliseconds, and the
// sample count.
func row(name string, ds []time.Duration, note string) {
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	fmt.Printf("%-28s p50 %8.2f ms   p99 %8.2f ms   n=%-5d %s\n", name, ms(benchkit.Pct(ds, 50)), ms(benchkit.Pct(ds, 99)), len(ds), note)
}
