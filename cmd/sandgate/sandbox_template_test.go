package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The template verbs end to end: a layer made in one sandbox becomes a
// template, a sandbox runs on it, and the template cannot be removed until
// that sandbox is gone.
func TestSandboxTemplateCLI(t *testing.T) {
	t.Parallel() // a process of its own, waiting more than working
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups, loop devices): run the tests as root")
	}
	state := t.TempDir()
	t.Cleanup(func() {
		for _, id := range []string{"maker", "user"} {
			sandboxCLI(t, state, nil, "delete", "--force", id)
		}
		sandboxCLI(t, state, nil, "template", "rm", "tpl")
	})
	must := func(want string, args ...string) string {
		t.Helper()
		code, out, errOut := sandboxCLI(t, state, nil, args...)
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("sandbox %v: %d %q %q, want %q", args, code, out, errOut, want)
		}
		return out
	}
	must("", "run", "maker", "--detach", "--write", "--", "sleep", "infinity")
	must("", "exec", "maker", "--", "sh", "-c", "mkdir -p /opt/t && echo from-template > /opt/t/f")
	layer := filepath.Join(t.TempDir(), "layer.tar.zst")
	must("", "tar", "maker", "--file", layer, "--compression", "zstd")
	must("tpl\n", "template", "import", "tpl", "--file", layer)
	must("tpl\n", "template", "ls")
	must("", "run", "user", "--detach", "--write", "--template", "tpl", "--", "sleep", "infinity")
	must("from-template\n", "exec", "user", "--", "cat", "/opt/t/f")
	if code, _, errOut := sandboxCLI(t, state, nil, "template", "rm", "tpl"); code == 0 || !strings.Contains(errOut, "user") {
		t.Errorf("rm of a template in use: %d %q, want a refusal naming the sandbox", code, errOut)
	}
	must("", "delete", "--force", "user")
	must("", "template", "rm", "tpl")
	if out := must("", "template", "ls"); out != "" {
		t.Errorf("template ls after rm: %q", out)
	}
}
