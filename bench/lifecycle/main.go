// Command lifecycle measures appliance.Manager on real sandboxes over a
// local store: see bench/lifecycle.sh.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/sandgate/sandgate/api/service"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
)

func main() {
	mb := flag.Int("mb", 650, "size of the template tree, MB")
	small := flag.Int("small", 40000, "small files in the template tree")
	changed := flag.Int("changed-mb", 10, "MB each sandbox writes")
	creates := flag.Int("creates", 5, "creates of each kind, for the p50")
	saveAll := flag.Int("saveall", 4, "sandboxes saved together by SaveAll")
	flag.Parse()
	if os.Geteuid() != 0 {
		log.Fatal("lifecycle bench: run as root (sandboxes need namespaces, overlayfs, cgroups and loop devices)")
	}
	if err := run(*mb, *small, *changed, *creates, *saveAll); err != nil {
		log.Fatal("lifecycle bench: ", err)
	}
}

func run(mb, small, changedMB, creates, saveAll int) error {
	dir, err := os.MkdirTemp("/var/tmp", "sandgate-lifecycle-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin, gentree := filepath.Join(dir, "sandgate"), filepath.Join(dir, "gentree")
	fmt.Fprintln(os.Stderr, "building sandgate and the tree generator...")
	if err := benchkit.GoBuild(bin, nil, "./cmd/sandgate"); err != nil {
		return err
	}
	if err := benchkit.GoBuild(gentree, nil, "./bench/snapshot/gentree"); err != nil {
		return err
	}
	state := filepath.Join(dir, "sandboxes")
	st, err := store.NewDir(filepath.Join(dir, "store"))
	if err != nil {
		return err
	}
	ctx := context.Background()
	// The service as serve assembles it; no egress is measured: a resolver
	// that answers nothing.
	svc, err := service.New(ctx, service.Config{
		DNSServers: []string{"127.0.0.1:9"}, Store: st,
		Launcher: appliance.LauncherConfig{CLI: bin, AgentBinary: bin, StateDir: state},
		Manager:  appliance.ManagerConfig{Version: "bench", WorkDir: filepath.Join(dir, "work"), IdleSuspend: -1},
	})
	if err != nil {
		return err
	}
	m, l := svc.Manager, svc.Launcher
	defer func() {
		infos, _ := m.List(ctx)
		for _, in := range infos {
			m.Destroy(ctx, in.ID)
		}
		names, _ := l.ListTemplates(ctx)
		for _, n := range names {
			l.RemoveTemplate(ctx, n)
		}
		svc.Shutdown(ctx)
	}()
	sh := func(id, script string) error {
		sb, err := m.Sandbox(id)
		if err != nil {
			return err
		}
		var out strings.Builder
		status, err := sb.Run(ctx, agent.Cmd{Args: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &out})
		if err == nil && !status.Success() {
			err = fmt.Errorf("%q: %v: %s", script, status, out.String())
		}
		return err
	}
	// 10 MB of new and changed files: a session's work.
	change := fmt.Sprintf("mkdir -p /root/work && for i in $(seq 1 %d); do head -c 1048576 /dev/urandom > /root/work/f$i; done", changedMB)

	fmt.Printf("sandgate lifecycle bench — %s\n\n", benchkit.Machine())
	fmt.Fprintf(os.Stderr, "building a %d MB template in a sandbox...\n", mb)
	if _, err := m.Create(ctx, "builder", appliance.CreateOptions{}); err != nil {
		return err
	}
	// The sandbox's image holds none of the host's /var/tmp: the
	// generator goes in as a file, into /tmp (not saved with the layer).
	builder, err := m.Sandbox("builder")
	if err != nil {
		return err
	}
	gf, err := os.Open(gentree)
	if err != nil {
		return err
	}
	_, err = builder.WriteFile(ctx, "/tmp/gentree", gf, agent.WriteOptions{Perm: 0o755, MaxBytes: 1 << 30})
	gf.Close()
	if err != nil {
		return fmt.Errorf("copying the tree generator into the sandbox: %w", err)
	}
	if err := sh("builder", fmt.Sprintf("/tmp/gentree -dir /opt/agents -mb %d -small %d", mb, small)); err != nil {
		return err
	}
	t0 := time.Now()
	if err := m.SaveTemplate(ctx, "builder", "agents"); err != nil {
		return err
	}
	saveTemplate := time.Since(t0)

	// A full layer's save against tar | zstd -1 of the same tree.
	upper := filepath.Join(state, "builder", "upper")
	t0 = time.Now()
	if out, err := exec.Command("sh", "-c", "tar -C "+upper+" -cf - . | zstd -1 -q -c > "+filepath.Join(dir, "baseline.tar.zst")).CombinedOutput(); err != nil {
		return fmt.Errorf("tar | zstd -1: %v: %s", err, out)
	}
	baseline := time.Since(t0)
	fi, _ := os.Stat(filepath.Join(dir, "baseline.tar.zst"))
	t0 = time.Now()
	if err := m.Suspend(ctx, "builder"); err != nil {
		return err
	}
	fullSave := time.Since(t0)
	full, _ := m.Get(ctx, "builder")
	fmt.Printf("template: %d MB tree saved as a template in %s\n", mb, saveTemplate.Round(time.Millisecond))
	fmt.Printf("full layer suspended in %s (%d bytes) against tar | zstd -1 in %s (%d bytes): %.2fx\n\n",
		fullSave.Round(time.Millisecond), full.LayerBytes, baseline.Round(time.Millisecond), fi.Size(), baseline.Seconds()/fullSave.Seconds())
	if err := m.Destroy(ctx, "builder"); err != nil {
		return err
	}

	// Creates: from the image and from the template (the first one from
	// the template imports it on this host, once: measured apart).
	t0 = time.Now()
	if _, err := m.Create(ctx, "first", appliance.CreateOptions{Template: "agents"}); err != nil {
		return err
	}
	fmt.Printf("first create from the template on this host (imports it once): %s\n", time.Since(t0).Round(time.Millisecond))
	m.Destroy(ctx, "first")
	var fromImage, fromTemplate []time.Duration
	for i := range creates {
		for _, tpl := range []string{"", "agents"} {
			id := fmt.Sprintf("c%d-%t", i, tpl != "")
			t0 := time.Now()
			if _, err := m.Create(ctx, id, appliance.CreateOptions{Template: tpl}); err != nil {
				return err
			}
			d := time.Since(t0)
			if tpl == "" {
				fromImage = append(fromImage, d)
			} else {
				fromTemplate = append(fromTemplate, d)
			}
			if err := m.Destroy(ctx, id); err != nil {
				return err
			}
		}
	}
	pi, pt := benchkit.Pct(fromImage, 50), benchkit.Pct(fromTemplate, 50)
	fmt.Printf("create p50: from the image %s, from the %d MB template %s: %.2fx\n\n", pi.Round(time.Millisecond), mb, pt.Round(time.Millisecond), pt.Seconds()/pi.Seconds())

	// Suspend and resume of a sandbox made from the template that changed
	// 10 MB.
	var sus, resm []time.Duration
	var size int64
	for i := range creates {
		id := fmt.Sprintf("s%d", i)
		if _, err := m.Create(ctx, id, appliance.CreateOptions{Template: "agents"}); err != nil {
			return err
		}
		if err := sh(id, change); err != nil {
			return err
		}
		t0 := time.Now()
		if err := m.Suspend(ctx, id); err != nil {
			return err
		}
		sus = append(sus, time.Since(t0))
		in, _ := m.Get(ctx, id)
		size = in.LayerBytes
		t0 = time.Now()
		if _, err := m.Resume(ctx, id, appliance.ResumeOptions{}); err != nil {
			return err
		}
		resm = append(resm, time.Since(t0))
		if err := sh(id, "test -s /root/work/f1 && test -d /opt/agents"); err != nil {
			return fmt.Errorf("after resume: %w", err)
		}
		m.Destroy(ctx, id)
	}
	fmt.Printf("suspend p50 %s (target < 1 s), resume p50 %s (target < 1 s), of a sandbox that changed %d MB of the template\n",
		benchkit.Pct(sus, 50).Round(time.Millisecond), benchkit.Pct(resm, 50).Round(time.Millisecond), changedMB)
	fmt.Printf("suspended object %d bytes for %d MB changed: %.2fx the changed bytes (the template's %d MB are not saved again)\n\n",
		size, changedMB, float64(size)/float64(changedMB<<20), mb)

	// Suspend of such a sandbox whose audit holds 100k events (recorded
	// as steady traffic would be: the service writes full segments as
	// they fill), against one with none, alternately.
	if err := auditSuspend(ctx, svc, m, sh, change, creates); err != nil {
		return err
	}

	// SaveAll of several such sandboxes, as on SIGTERM.
	for i := range saveAll {
		id := fmt.Sprintf("all%d", i)
		if _, err := m.Create(ctx, id, appliance.CreateOptions{Template: "agents"}); err != nil {
			return err
		}
		if err := sh(id, change); err != nil {
			return err
		}
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	t0 = time.Now()
	r := m.SaveAll(sctx)
	took := time.Since(t0)
	if len(r.Failed) > 0 {
		return fmt.Errorf("SaveAll: %v", r.Failed)
	}
	fmt.Printf("SaveAll of %d sandboxes (each %d MB changed on the template) in %s (target < 5 s, half of Cloud Run's SIGTERM grace)\n",
		len(r.Saved), changedMB, took.Round(time.Millisecond))
	return nil
}

// auditEvents is how many audit events the suspend with an audit records.
const auditEvents = 100_000

// auditSuspend measures what a sandbox's audit adds to its suspend: rounds
// of two sandboxes made from the template, each changing the same bytes,
// one with auditEvents events recorded first, suspended one after the
// other (which goes first alternates). A suspend leaves its audit's last
// write to the journals' goroutine, so beside the suspend's own time it
// reports the time until the store holds the whole audit.
func auditSuspend(ctx context.Context, svc *service.Service, m *appliance.Manager, sh func(id, script string) error, change string, rounds int) error {
	var with, without, withStored, ratios []time.Duration
	var held int
	for i := range rounds {
		order := []int{auditEvents, 0}
		if i%2 == 1 {
			order = []int{0, auditEvents}
		}
		var pair [2]time.Duration
		for _, events := range order {
			id := fmt.Sprintf("a%d-%d", i, events)
			if _, err := m.Create(ctx, id, appliance.CreateOptions{Template: "agents"}); err != nil {
				return err
			}
			if err := sh(id, change); err != nil {
				return err
			}
			if err := recordEvents(svc.Audit, id, events); err != nil {
				return err
			}
			held = max(held, svc.Audit.HeldBytes(id))
			// As after traffic spread over hours: the full segments are
			// in the store and their garbage collected, the one being
			// filled held (the recording's own aftermath is not the
			// suspend's cost).
			for deadline := time.Now().Add(time.Minute); svc.Audit.HeldBytes(id) >= 512<<10; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					return fmt.Errorf("the audit of %s is not written to the store", id)
				}
			}
			runtime.GC()
			t0 := time.Now()
			if err := m.Suspend(ctx, id); err != nil {
				return err
			}
			took := time.Since(t0)
			for deadline := time.Now().Add(time.Minute); svc.Audit.HeldBytes(id) > 0; time.Sleep(100 * time.Microsecond) {
				if time.Now().After(deadline) {
					return fmt.Errorf("the audit of %s is not written to the store a minute after its suspend", id)
				}
			}
			stored := time.Since(t0)
			if events > 0 {
				with, withStored, pair[0] = append(with, took), append(withStored, stored), took
			} else {
				without, pair[1] = append(without, took), took
			}
			if page, err := m.AuditEvents(ctx, id, audit.Query{Limit: 1, Since: time.Now().Add(-time.Hour)}); err != nil || events > 0 && len(page.Lines) == 0 {
				return fmt.Errorf("the audit of %s after its suspend: %v", id, err)
			}
			m.Destroy(ctx, id)
		}
		ratios = append(ratios, time.Duration(float64(time.Second)*pair[0].Seconds()/pair[1].Seconds()))
	}
	pw, po, ps := benchkit.Pct(with, 50), benchkit.Pct(without, 50), benchkit.Pct(withStored, 50)
	fmt.Printf("suspend p50 with %dk audit events %s, without %s: %.3fx (target < 1.05; rounds' own ratios %.2f–%.2f; at most %d KiB of events were still held at a suspend)\n",
		auditEvents/1000, pw.Round(time.Millisecond), po.Round(time.Millisecond), pw.Seconds()/po.Seconds(),
		benchkit.Pct(ratios, 0).Seconds(), benchkit.Pct(ratios, 100).Seconds(), held>>10)
	fmt.Printf("  until the store holds its whole audit: p50 %s, %.3fx the suspend without events\n\n", ps.Round(time.Millisecond), ps.Seconds()/po.Seconds())
	return nil
}

// recordEvents records n routed-request events of sandbox id into js, as
// steady traffic would: in batches, each let be written (its full
// segments) before the next.
func recordEvents(js *audit.Journals, id string, n int) error {
	hosts := []string{"api.anthropic.com", "registry.npmjs.org", "github.com", "pypi.org", "objects.githubusercontent.com"}
	cmds := []string{"claude -p fix the failing test", "npm install", "git fetch origin", "pip install -r requirements.txt"}
	start := time.Now().Add(-time.Duration(n) * time.Millisecond)
	for i := range n {
		h := hosts[i%len(hosts)]
		js.Record(audit.Event{
			Time: start.Add(time.Duration(i) * time.Millisecond), Sandbox: id, Kind: audit.Route, Allow: true, Code: "allowed_host",
			Reason: h + " matched allowed host rule " + h, Host: h, Port: 443, PID: 1000 + i%50, Cmd: cmds[i%len(cmds)],
			Method: "GET", Path: fmt.Sprintf("/v1/objects/%d", i), Rule: "allowedHosts:" + h, Addr: fmt.Sprintf("104.16.%d.%d:443", i%200, i%250),
			Status: 200, BytesIn: int64(i % 1000), BytesOut: int64(i * 37 % 100000), Duration: time.Duration(i%5000) * time.Microsecond * 7,
			DNSTime: time.Duration(i%100) * time.Microsecond,
		})
		if i%1000 == 999 {
			for deadline := time.Now().Add(time.Minute); js.HeldBytes(id) > 600<<10; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					return fmt.Errorf("the audit of %s is not written to the store", id)
				}
			}
		}
	}
	return nil
}
