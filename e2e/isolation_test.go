package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/servetest"
)

// TestSandboxSeesNothingOfTheHost is the attack that found a sandbox
// reading other tenants' suspended layers: with serve's state and snapshot
// directories on the host's file system (under /var/tmp, not /tmp, which a
// sandbox's own tmpfs would hide anyway), a victim writes a marker and is
// suspended, and another sandbox looks for it, for serve's files and for
// canaries the host keeps in /root, /home and /var/tmp.
//
// With the default image none of the host's is seen. With a configured
// image (SANDGATE_ROOTFS=/, and Google's CLI, whose sandboxes see the
// container's whole root), the image is the operator's to choose: its
// files are seen, but never serve's own (masked, or covered).
func TestSandboxSeesNothingOfTheHost(t *testing.T) {
	if ok, why := servetest.CanRun(); !ok {
		t.Skip(why)
	}
	n := nonce()
	marker := "SANDGATE-CANARY-" + n
	var hostCanaries []string
	for _, d := range []string{"/root", "/home", "/var/tmp"} {
		p := filepath.Join(d, "sandgate-canary-"+n)
		if err := os.WriteFile(p, []byte(marker+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(p) })
		hostCanaries = append(hostCanaries, p)
	}
	for _, mode := range []struct {
		name, rootfs string
		google       bool
	}{
		{name: "default-image"},
		{name: "rootfs-slash", rootfs: "/"},
		{name: "google-cli", google: true},
	} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			f := newFixtures(t)
			dir, err := os.MkdirTemp("/var/tmp", "sandgate-e2e-isolation-")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) }) // after serve stopped (cleanups run last first)
			token := "e2e-service-token-" + nonce()
			cli := ""
			if mode.google {
				cli = gobuild.GoogleCLI(t)
			}
			env := serveEnv(f, dir, token, cli)
			if mode.rootfs != "" {
				env = append(env, "SANDGATE_ROOTFS="+mode.rootfs)
			}
			srv := startServe(t, env)
			c := newClient(t, srv.url, token, "e2e-identity-token-"+nonce())
			tg := &target{name: mode.name, c: c, f: f, srv: srv, nonce: nonce()}
			// serve's own places, each with a canary of the host's.
			state, store := filepath.Join(dir, "state"), filepath.Join(dir, "store")
			for _, p := range []string{filepath.Join(state, "canary"), filepath.Join(store, "canary")} {
				if err := os.WriteFile(p, []byte(marker+"\n"), 0o600); err != nil {
					t.Fatal(err)
				}
			}

			victim := tg.create(t, c, client.CreateOptions{ID: tg.sandboxName(t, "victim")})
			run(t, victim, fmt.Sprintf(`echo %s > private.txt && mkdir -p "$HOME/.ssh" && echo %s > "$HOME/.ssh/id_ed25519"`, marker, marker))
			if err := victim.Stop(ctx(t)); err != nil {
				t.Fatalf("suspend the victim: %v", err)
			}
			attacker := tg.create(t, c, client.CreateOptions{ID: tg.sandboxName(t, "attacker")})

			// Files must be empty or absent (a masked file is an empty one),
			// directories empty or absent (a masked one is an empty one).
			files := []string{filepath.Join(dir, "audit.log"), filepath.Join(state, "canary"), filepath.Join(store, "canary")}
			dirs := []string{state, store, filepath.Join(state, "sandboxes"), filepath.Join(state, "work"), filepath.Join(store, "snapshots")}
			places := "/root /home /var /srv /opt /mnt /run /etc /tmp /usr/local /workspace"
			if mode.rootfs == "" && !mode.google {
				files = append(files, hostCanaries...)
			} else {
				places = "/workspace " + state + " " + store // the image is the operator's: only serve's places
			}
			var script strings.Builder
			for _, p := range files {
				fmt.Fprintf(&script, "if [ -s %q ]; then echo 'SEEN %s'; fi\n", p, p)
			}
			for _, p := range dirs {
				fmt.Fprintf(&script, "if [ -n \"$(ls -A %q 2>/dev/null)\" ]; then echo 'LISTED %s'; fi\n", p, p)
			}
			fmt.Fprintf(&script, "timeout 60 grep -r -s -l -F %s %s 2>/dev/null | sed 's/^/FOUND /'\n", marker, places)
			// Controls: the checks can see what they look for.
			fmt.Fprintf(&script, "echo %s > /tmp/control && grep -r -s -l -F %s /tmp >/dev/null || echo 'BROKEN CONTROL: grep'\n", marker, marker)
			script.WriteString("[ -s /etc/passwd ] || echo 'BROKEN CONTROL: test -s'\n")
			script.WriteString("rm -f /tmp/control; echo checked\n")
			out := run(t, attacker, script.String())
			if !strings.HasSuffix(out, "checked\n") {
				t.Fatalf("the checks did not finish: %q", out)
			}
			for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
				if line != "checked" {
					t.Errorf("from another sandbox: %s", line)
				}
			}
			// The victim's files are its own again once it resumes.
			r, err := c.Resume(ctx(t), victim.ID(), client.ResumeOptions{})
			if err != nil {
				t.Fatalf("resume the victim: %v", err)
			}
			if got := run(t, r, "cat private.txt"); got != marker+"\n" {
				t.Errorf("the victim's file after resume: %q", got)
			}
		})
	}
}
