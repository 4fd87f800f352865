package localbox

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A sandbox's /proc/self/mountinfo (its init's and /proc/self/mounts too)
// showed the host's state directory in its overlays' options: lowerdir,
// upperdir and workdir named the sandbox's directory under it, the
// template's image and the scaffold. They name places in the sandbox's own
// scaffold now, relative to it, with or without a user namespace, from a
// template or not, beside a bind mount. The canary is the test's state
// directory.
func TestMountinfoShowsNoHostStatePath(t *testing.T) {
	layer := templateLayer(t)
	m := newRuntime(t)
	if err := m.ImportTemplate(testCtx(t), "tpl", bytes.NewReader(layer), TemplateSize{}); err != nil {
		t.Fatal(err)
	}
	shared := filepath.Join(t.TempDir(), "shared")
	if err := os.Mkdir(shared, 0o755); err != nil {
		t.Fatal(err)
	}
	canaries := []string{m.dir, templateLower(m.dir, "tpl")}
	for _, tc := range []struct {
		name string
		mod  func(*RunOptions)
	}{
		{"default", nil},
		{"no user namespace", func(o *RunOptions) { o.UserNS = UserNSOff }},
		{"template", func(o *RunOptions) { o.Template = "tpl" }},
		{"template, no user namespace", func(o *RunOptions) { o.Template, o.UserNS = "tpl", UserNSOff }},
		{"bind mount", func(o *RunOptions) {
			o.Mounts = []Mount{{Source: shared, Destination: "/mnt/shared", ReadOnly: true}}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := strings.NewReplacer(" ", "-", ",", "").Replace(tc.name)
			runDetached(t, m, id, tc.mod)
			code, out, errOut := sh(t, m, id, "cat /proc/self/mountinfo /proc/1/mountinfo /proc/self/mounts /proc/1/mounts")
			if code != 0 || !strings.Contains(out, " / / ") || !strings.Contains(out, "overlay") {
				t.Fatalf("reading mountinfo: %d %q %q", code, out, errOut)
			}
			for _, c := range append(canaries, m.sandboxDir(id)) {
				for _, line := range strings.Split(out, "\n") {
					if strings.Contains(line, c) {
						t.Errorf("a mount names the host's %s: %s", c, line)
					}
				}
			}
			if code, out, _ := sh(t, m, id, "echo ok > /root/written && cat /root/written"); code != 0 || out != "ok\n" {
				t.Errorf("the root is not writable: %d %q", code, out)
			}
		})
	}
}
