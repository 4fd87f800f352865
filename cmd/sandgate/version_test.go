package main

import (
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
)

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"version"}} {
		code, out, errOut := runCLI(t, args...)
		lines := strings.Split(out, "\n")
		if code != 0 || errOut != "" || len(lines) != 4 || !strings.HasPrefix(lines[0], "sandgate version ") ||
			lines[1] != "go version "+runtime.Version()+" "+runtime.GOOS+"/"+runtime.GOARCH || !strings.HasPrefix(lines[2], "commit ") {
			t.Errorf("sandgate %v = %d, %q, %q; want the version, Go version and commit lines", args, code, out, errOut)
		}
	}
	if code, _, errOut := runCLI(t, "version", "extra"); code != exitBadInput || !strings.Contains(errOut, "takes no arguments") {
		t.Errorf("version extra = %d %q; want 2", code, errOut)
	}
}

func TestVersionText(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/sandgate/sandgate", Version: "v0.3.0"},
		Settings: []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "27b2466d"}, {Key: "vcs.time", Value: "2026-12-01T10:00:00Z"}, {Key: "vcs.modified", Value: "true"}}}
	want := "sandgate version v0.3.0\ngo version go1.26.8 " + runtime.GOOS + "/" + runtime.GOARCH + "\ncommit 27b2466d (2026-12-01T10:00:00Z, modified)\n"
	if got := versionText(bi); got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	bi.Settings = nil // built with -buildvcs=false
	if got := versionText(bi); !strings.HasSuffix(got, "\ncommit unknown (built without VCS information, e.g. with -buildvcs=false)\n") {
		t.Errorf("without VCS information: %q", got)
	}
	if got := versionText(nil); !strings.HasPrefix(got, "sandgate version unknown\ngo version "+runtime.Version()) || !strings.Contains(got, "commit unknown") {
		t.Errorf("without build information: %q", got)
	}
	// Set at link time (the image's build): they win.
	linkVersion, linkCommit = "v1.2.3", "abc123"
	defer func() { linkVersion, linkCommit = "", "" }()
	bi.Main.Version = "(devel)"
	if got := versionText(bi); !strings.HasPrefix(got, "sandgate version v1.2.3\n") || !strings.HasSuffix(got, "\ncommit abc123\n") {
		t.Errorf("with a link-time version and commit: %q", got)
	}
}

// TestBareCommandIsUsage: "sandgate" alone printed help and exited 0, as if
// it had done what was asked. It prints help on stderr and exits 2, and so
// do an unknown command and help for one.
func TestBareCommandIsUsage(t *testing.T) {
	code, out, errOut := runCLI(t)
	if code != exitBadInput || out != "" || !strings.Contains(errOut, "USAGE:") || !strings.Contains(errOut, "--version") {
		t.Errorf("sandgate = %d, %q, %q; want 2 and help on stderr", code, out, errOut)
	}
	for _, args := range [][]string{{"nope"}, {"help", "nope"}, {"--nope"}} {
		if code, _, errOut := runCLI(t, args...); code != exitBadInput {
			t.Errorf("sandgate %v = %d %q; want 2", args, code, errOut)
		}
	}
	if code, out, _ := runCLI(t, "--help"); code != 0 || !strings.Contains(out, "USAGE:") {
		t.Errorf("sandgate --help = %d %q; want 0 and help on stdout", code, out)
	}
}
