package localbox

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/sandgate/sandgate/snapshot"
)

// templateLayer is a layer that adds /opt/tool/bin and hides the rootfs's
// /etc/hostname, as a template made in a sandbox would.
func templateLayer(t *testing.T) []byte {
	t.Helper()
	m := newRuntime(t)
	runDetached(t, m, "maker", nil)
	if code, _, errOut := sh(t, m, "maker", "mkdir -p /opt/tool && echo v1 > /opt/tool/bin && rm /etc/hostname"); code != 0 {
		t.Fatalf("making the template: %d %s", code, errOut)
	}
	var layer bytes.Buffer
	if _, err := m.Tar(testCtx(t), "maker", &layer, snapshot.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	return layer.Bytes()
}

// Two sandboxes share one template mounted beneath their own uppers: each
// sees it, writes only to its own upper, and exports only what it changed.
func TestTemplateSharedAsLowerLayer(t *testing.T) {
	layer := templateLayer(t)
	m := newRuntime(t)
	if err := m.ImportTemplate(testCtx(t), "tpl", bytes.NewReader(layer), TemplateSize{}); err != nil {
		t.Fatal(err)
	}
	if err := m.ImportTemplate(testCtx(t), "tpl", bytes.NewReader(layer), TemplateSize{}); !errors.Is(err, ErrExists) {
		t.Errorf("importing over a template: %v, want ErrExists", err)
	}
	if got, err := m.Templates(); err != nil || len(got) != 1 || got[0] != "tpl" {
		t.Errorf("Templates = %v, %v", got, err)
	}
	for _, id := range []string{"a", "b"} {
		runDetached(t, m, id, func(o *RunOptions) { o.Template = "tpl" })
		if code, out, errOut := sh(t, m, id, "cat /opt/tool/bin; test -e /etc/hostname || echo hidden; echo "+id+" > /opt/tool/bin; echo new > /root/"+id); code != 0 || out != "v1\nhidden\n" {
			t.Fatalf("%s sees the template: %d %q %q", id, code, out, errOut)
		}
	}
	if _, out, _ := sh(t, m, "a", "cat /opt/tool/bin; cat /root/a; test -e /root/b || echo no-b"); out != "a\nnew\nno-b\n" {
		t.Errorf("a's writes are its own: %q", out)
	}
	// The template on disk is untouched.
	if b, _ := os.ReadFile(filepath.Join(templateLower(m.dir, "tpl"), "opt/tool/bin")); string(b) != "v1\n" {
		t.Errorf("the template's file became %q", b)
	}
	var up bytes.Buffer
	if _, err := m.Tar(testCtx(t), "a", &up, snapshot.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	names := layerNames(t, bytes.NewReader(up.Bytes()))
	if !names["opt/tool/bin"] || !names["root/a"] || names["etc/.wh.hostname"] {
		t.Errorf("a's layer should hold its changes only: %v", names)
	}
	// A fork keeps the template.
	p, err := m.Fork(testCtx(t), "a", "c", Stdio{})
	if err != nil {
		t.Fatal(err)
	}
	p.Detach()
	if _, out, _ := sh(t, m, "c", "cat /opt/tool/bin; test -e /etc/hostname || echo hidden"); out != "a\nhidden\n" {
		t.Errorf("fork of a: %q", out)
	}
	// In use: not removable; once its sandboxes are gone, it is.
	if err := m.RemoveTemplate("tpl"); !errors.Is(err, ErrBusy) {
		t.Errorf("removing a template in use: %v, want ErrBusy", err)
	}
	for _, id := range []string{"a", "b", "c"} {
		if err := m.Delete(testCtx(t), id, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.RemoveTemplate("tpl"); err != nil {
		t.Fatal(err)
	}
	if err := m.RemoveTemplate("tpl"); !errors.Is(err, ErrNotFound) {
		t.Errorf("removing it again: %v, want ErrNotFound", err)
	}
	if _, err := m.Run(testCtx(t), RunOptions{Config: Config{ID: "d", Template: "tpl", Cmd: []string{"true"}}}); !errors.Is(err, ErrNotFound) {
		t.Errorf("run from a missing template: %v, want ErrNotFound", err)
	}
}

// Ids are unique within a state directory, cgroups on the whole host: two
// state directories (two services, two test runs) may each run "same".
func TestSameIDInTwoStateDirs(t *testing.T) {
	one, two := newRuntime(t), newRuntime(t)
	runDetached(t, one, "same", nil)
	runDetached(t, two, "same", nil)
	if err := one.Delete(testCtx(t), "same", true); err != nil {
		t.Fatal(err)
	}
	if code, out, _ := sh(t, two, "same", "echo alive"); code != 0 || out != "alive\n" {
		t.Errorf("the other state directory's sandbox after the first was deleted: %d %q", code, out)
	}
}
