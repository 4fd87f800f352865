package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/gcstest"
)

// TestSnapshotCLIRoundTrip packs a tree to a file, inspects it and unpacks
// it, through the real command tree; no progress bar is drawn because the
// writers are not terminals.
func TestSnapshotCLIRoundTrip(t *testing.T) {
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "d", "empty"), 0o755)
	os.WriteFile(filepath.Join(src, "d", "f.txt"), []byte("hello"), 0o640)
	os.Symlink("d/f.txt", filepath.Join(src, "ln"))
	out := filepath.Join(t.TempDir(), "layer.tar.zst")

	code, stdout, stderr := runCLI(t, "snapshot", "pack", "--out", out, "--index", "--sandbox-id", "sb-1", src)
	if code != 0 {
		t.Fatalf("pack exit %d: %s", code, stderr)
	}
	if stderr != "" {
		t.Errorf("pack wrote to stderr when not a terminal: %q", stderr)
	}
	if !strings.Contains(stdout, `"sandboxId": "sb-1"`) || strings.Contains(stdout, `"files"`) {
		t.Errorf("pack printed %s", stdout)
	}
	if _, err := os.Stat(out + ".manifest.json"); err != nil {
		t.Fatalf("manifest not written beside the layer: %v", err)
	}

	code, stdout, stderr = runCLI(t, "snapshot", "inspect", out)
	if code != 0 {
		t.Fatalf("inspect exit %d: %s", code, stderr)
	}
	for _, want := range []string{"d/f.txt", "ln -> d/f.txt", "d/empty/", "measured: compression=zstd"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("inspect output lacks %q:\n%s", want, stdout)
		}
	}

	into := filepath.Join(t.TempDir(), "into")
	code, _, stderr = runCLI(t, "snapshot", "unpack", "file://"+out, "--into", into)
	if code != 0 {
		t.Fatalf("unpack exit %d: %s", code, stderr)
	}
	if b, _ := os.ReadFile(filepath.Join(into, "d", "f.txt")); string(b) != "hello" {
		t.Fatalf("unpacked content %q", b)
	}

	// A corrupted layer is refused and nothing appears.
	b, _ := os.ReadFile(out)
	b[len(b)/2] ^= 0xff
	os.WriteFile(out, b, 0o644)
	into2 := filepath.Join(t.TempDir(), "into2")
	if code, _, _ = runCLI(t, "snapshot", "unpack", out, "--into", into2); code == 0 {
		t.Fatal("corrupted layer unpacked")
	}
	if _, err := os.Stat(into2); err == nil {
		t.Fatal("refused unpack left the target")
	}
}

func TestSnapshotCLIBadInput(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "l.tar.zst")
	for _, args := range [][]string{
		{"snapshot", "pack", dir},          // --out missing
		{"snapshot", "pack", "--out", out}, // DIR missing
		{"snapshot", "pack", "--out", out, "--compression", "lz4", dir},
		{"snapshot", "pack", "--out", "http://x/y", dir},
		{"snapshot", "pack", "--out", out, filepath.Join(dir, "missing")},
		{"snapshot", "unpack", out, "--into", dir, "--mode", "sideways"},
		{"snapshot", "inspect"},
	} {
		if code, _, stderr := runCLI(t, args...); code != exitBadInput {
			t.Errorf("%v: exit %d, want %d (%s)", args, code, exitBadInput, stderr)
		}
	}
	src := t.TempDir()
	if code, _, stderr := runCLI(t, "snapshot", "pack", "--out", out, src); code != 0 {
		t.Fatal(stderr)
	}
	if code, _, stderr := runCLI(t, "snapshot", "pack", "--no-clobber", "--out", out, src); code != exitBadInput || !strings.Contains(stderr, "already exists") {
		t.Errorf("no-clobber: exit %d %s", code, stderr)
	}
}

// TestProgressLine checks what the progress bar draws on a terminal, and
// that it is silent on anything else.
func TestProgressLine(t *testing.T) {
	var buf bytes.Buffer
	if p := newProgress(&buf, "pack", func() int64 { return 100 }); p.w != nil {
		t.Fatal("progress enabled on a non-terminal writer")
	}
	p := &progress{w: &buf, verb: "pack", total: 10 << 20, start: time.Now().Add(-2 * time.Second)}
	p.set(5 << 20)
	p.finish()
	out := buf.String()
	for _, want := range []string{"\rpack", "5.0 MiB / 10.0 MiB", "/s", "ETA 2s"} {
		if !strings.Contains(out, want) {
			t.Errorf("progress line %q lacks %q", out, want)
		}
	}
}

// TestSnapshotCLIGCS packs to and unpacks from gs:// URLs against the
// Cloud Storage emulator on loopback (STORAGE_EMULATOR_HOST), through the
// same code path as production.
func TestSnapshotCLIGCS(t *testing.T) {
	srv, _ := gcstest.Start(t, "layers")
	t.Setenv("STORAGE_EMULATOR_HOST", strings.TrimPrefix(srv.URL(), "http://"))
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "f"), []byte("in the cloud"), 0o644)
	url := "gs://layers/snapshots/sb-9.tar.zst"
	if code, _, stderr := runCLI(t, "snapshot", "pack", src, "--out", url, "--no-clobber"); code != 0 {
		t.Fatalf("pack: exit %d: %s", code, stderr)
	}
	if code, _, stderr := runCLI(t, "snapshot", "pack", src, "--out", url, "--no-clobber"); code != exitBadInput {
		t.Fatalf("second pack with --no-clobber: exit %d: %s", code, stderr)
	}
	into := filepath.Join(t.TempDir(), "into")
	if code, _, stderr := runCLI(t, "snapshot", "unpack", url, "--into", into); code != 0 {
		t.Fatalf("unpack: exit %d: %s", code, stderr)
	}
	if b, _ := os.ReadFile(filepath.Join(into, "f")); string(b) != "in the cloud" {
		t.Fatalf("unpacked %q", b)
	}
	code, stdout, _ := runCLI(t, "snapshot", "inspect", url)
	if code != 0 || !strings.Contains(stdout, `"compression": "zstd"`) {
		t.Fatalf("inspect: exit %d\n%s", code, stdout)
	}
}
