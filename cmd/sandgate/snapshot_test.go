package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/snapshot"
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
	srv, client := gcstest.Start(t, "layers")
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
	if code != 0 || !strings.Contains(stdout, `"compression": "zstd"`) || !strings.Contains(stdout, "verified: sha256 and tar sha256 against its manifest") {
		t.Fatalf("inspect: exit %d\n%s", code, stdout)
	}
	// Without its manifest the object is still checked against what the
	// store recorded.
	if err := client.Bucket("layers").Object("snapshots/sb-9.tar.zst.manifest.json").Delete(context.Background()); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := runCLI(t, "snapshot", "inspect", url)
	if code != 0 || !strings.Contains(stdout, "verified: sha256 against the store") || stderr != "" {
		t.Fatalf("inspect without a manifest: exit %d\n%s%s", code, stdout, stderr)
	}
}

// userLayers writes, into a fresh directory, layers a user might hold:
// what 'sandgate sandbox tar' writes with and without --compression zstd
// (the same Pack the sandbox runtime calls), a gzip one, and one made by
// a zstd tool that checksums its frames. None has a manifest or the
// digest attribute a store records.
func userLayers(t *testing.T) (dir string, files map[string]string) {
	t.Helper()
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "root"), 0o755)
	os.WriteFile(filepath.Join(src, "root", "f"), []byte("kept"), 0o644)
	dir = t.TempDir()
	files = map[string]string{}
	for _, c := range []snapshot.Compression{snapshot.None, snapshot.Zstd, snapshot.Gzip} {
		var b bytes.Buffer
		if _, err := snapshot.Pack(context.Background(), src, &b, snapshot.PackOptions{Compression: c}); err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, "layer"+c.Ext())
		os.WriteFile(p, b.Bytes(), 0o644)
		files[string(c)] = p
	}
	bare, _ := os.ReadFile(files["none"])
	enc, _ := zstd.NewWriter(nil, zstd.WithEncoderCRC(true))
	p := filepath.Join(dir, "checked.tar.zst")
	os.WriteFile(p, enc.EncodeAll(bare, nil), 0o644)
	enc.Close()
	files["zstd-crc"] = p
	return dir, files
}

func sha256File(t *testing.T, p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// TestSnapshotCLIUserFiles: inspect and unpack read a file the user gives
// them as it is (no store's digest attribute is demanded), verify what can
// be verified, say plainly when no digest was checked, and never list
// entries of a layer that then fails its check.
func TestSnapshotCLIUserFiles(t *testing.T) {
	_, files := userLayers(t)
	for kind, p := range files {
		code, out, errOut := runCLI(t, "snapshot", "inspect", p)
		if code != 0 || !strings.Contains(out, "root/f") {
			t.Fatalf("%s: inspect exit %d: %s %s", kind, code, out, errOut)
		}
		if !strings.Contains(errOut, "no digest was checked") {
			t.Errorf("%s: inspect did not say no digest was checked: %q", kind, errOut)
		}
		into := filepath.Join(t.TempDir(), "into")
		code, out, errOut = runCLI(t, "snapshot", "unpack", p, "--into", into)
		if code != 0 || !strings.Contains(errOut, "no digest was checked") {
			t.Fatalf("%s: unpack exit %d: %s %s", kind, code, out, errOut)
		}
		if b, _ := os.ReadFile(filepath.Join(into, "root", "f")); string(b) != "kept" {
			t.Fatalf("%s: unpacked %q", kind, b)
		}

		// With the right digest: verified, and nothing on stderr.
		d := sha256File(t, p)
		code, out, errOut = runCLI(t, "snapshot", "inspect", "--digest", d, p)
		if code != 0 || !strings.Contains(out, "verified: sha256 against --digest") || errOut != "" {
			t.Errorf("%s: inspect --digest: exit %d: %s %q", kind, code, out, errOut)
		}
		// sha256sum's spelling (bare hex) is accepted too.
		into2 := filepath.Join(t.TempDir(), "into")
		if code, out, errOut := runCLI(t, "snapshot", "unpack", p, "--into", into2, "--digest", strings.TrimPrefix(d, "sha256:")); code != 0 || !strings.Contains(out, "verified: sha256 against --digest") || errOut != "" {
			t.Errorf("%s: unpack --digest: exit %d: %s %q", kind, code, out, errOut)
		}

		// With a wrong one: refused, no entry listed, nothing unpacked.
		wrong := "sha256:" + strings.Repeat("0", 64)
		code, out, errOut = runCLI(t, "snapshot", "inspect", p, "--digest", wrong)
		if code != exitFailure || out != "" || !strings.Contains(errOut, "digest mismatch") {
			t.Errorf("%s: inspect with a wrong digest: exit %d, stdout %q, stderr %q", kind, code, out, errOut)
		}
		into3 := filepath.Join(t.TempDir(), "into")
		if code, _, errOut := runCLI(t, "snapshot", "unpack", p, "--into", into3, "--digest", wrong); code != exitFailure || !strings.Contains(errOut, "digest mismatch") {
			t.Errorf("%s: unpack with a wrong digest: exit %d %q", kind, code, errOut)
		}
		if _, err := os.Stat(into3); err == nil {
			t.Errorf("%s: a refused unpack left its target", kind)
		}
	}

	// What the stream checked itself is said, and a bad frame refused.
	for kind, want := range map[string]string{"gzip": "verified: gzip CRC-32", "zstd-crc": "verified: zstd frame checksums"} {
		if code, out, errOut := runCLI(t, "snapshot", "inspect", files[kind]); code != 0 || !strings.Contains(out, want) || strings.Contains(errOut, "carries no checksum") {
			t.Errorf("%s: exit %d: %s %q", kind, code, out, errOut)
		}
	}
	if _, out, errOut := runCLI(t, "snapshot", "inspect", files["zstd"]); strings.Contains(out, "verified:") || !strings.Contains(errOut, "zstd stream carries no checksum of its own") {
		t.Errorf("sandgate's zstd (no frame checksums): %s %q", out, errOut)
	}
	b, _ := os.ReadFile(files["zstd-crc"])
	b[len(b)-1] ^= 0xff // the frame's checksum
	bad := filepath.Join(t.TempDir(), "bad.tar.zst")
	os.WriteFile(bad, b, 0o644)
	if code, out, _ := runCLI(t, "snapshot", "inspect", bad); code == 0 || out != "" {
		t.Errorf("a frame whose checksum fails: exit %d, stdout %q", code, out)
	}

	// Bad --digest is the caller's mistake.
	if code, _, errOut := runCLI(t, "snapshot", "inspect", files["zstd"], "--digest", "md5:abc"); code != exitBadInput || !strings.Contains(errOut, "--digest") {
		t.Errorf("bad --digest: exit %d %q", code, errOut)
	}
}

// TestSnapshotCLICopiedLayer: a layer 'snapshot pack' wrote, copied with
// cp (so without its digest attribute), is checked against the manifest
// copied beside it; without the manifest it is read, with a plain note.
func TestSnapshotCLICopiedLayer(t *testing.T) {
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "f"), []byte("copied"), 0o644)
	out := filepath.Join(t.TempDir(), "l.tar.zst")
	if code, _, stderr := runCLI(t, "snapshot", "pack", src, "--out", out); code != 0 {
		t.Fatal(stderr)
	}
	dst := t.TempDir()
	cp := func(from, to string) {
		b, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(to, b, 0o644)
	}
	alone := filepath.Join(dst, "alone.tar.zst")
	cp(out, alone)
	if code, stdout, stderr := runCLI(t, "snapshot", "inspect", alone); code != 0 || !strings.Contains(stdout, "f") || !strings.Contains(stderr, "no digest was checked") {
		t.Errorf("a copied layer without its manifest: exit %d: %s %q", code, stdout, stderr)
	}
	with := filepath.Join(dst, "with.tar.zst")
	cp(out, with)
	cp(out+".manifest.json", with+".manifest.json")
	code, stdout, stderr := runCLI(t, "snapshot", "inspect", "file://"+with)
	if code != 0 || !strings.Contains(stdout, "verified: sha256 and tar sha256 against the manifest beside it") || stderr != "" {
		t.Errorf("a copied layer with its manifest: exit %d: %s %q", code, stdout, stderr)
	}
	if code, _, stderr := runCLI(t, "snapshot", "inspect", with, "--digest", "sha256:"+strings.Repeat("1", 64)); code != exitFailure || !strings.Contains(stderr, "the manifest beside it records") {
		t.Errorf("--digest against a manifest that disagrees: exit %d %q", code, stderr)
	}
	b, _ := os.ReadFile(with)
	b[len(b)/2] ^= 0xff
	os.WriteFile(with, b, 0o644)
	if code, stdout, stderr := runCLI(t, "snapshot", "inspect", with); code == 0 || stdout != "" {
		t.Errorf("a damaged copy: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
}

// TestSnapshotCLISandboxTar: the real 'sandgate sandbox tar' output, bare
// and zstd, inspected and unpacked as a user's own files.
func TestSnapshotCLISandboxTar(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root (namespaces, overlayfs, cgroups): run the tests as root")
	}
	state := t.TempDir()
	t.Cleanup(func() { sandboxCLI(t, state, nil, "delete", "--force", "tarred") })
	if code, _, errOut := sandboxCLI(t, state, nil, "run", "tarred", "--write", "--", "sh", "-c", "echo made-inside > /root/f"); code != 0 {
		t.Fatalf("run: %d %q", code, errOut)
	}
	dir := t.TempDir()
	for _, args := range [][]string{{"--file=" + dir + "/a.tar"}, {"--file=" + dir + "/a.tar.zst", "--compression", "zstd"}} {
		if code, _, errOut := sandboxCLI(t, state, nil, append([]string{"tar", "tarred"}, args...)...); code != 0 {
			t.Fatalf("tar %v: %d %q", args, code, errOut)
		}
	}
	for _, f := range []string{"a.tar", "a.tar.zst"} {
		p := filepath.Join(dir, f)
		code, out, errOut := runCLI(t, "snapshot", "inspect", p)
		if code != 0 || !strings.Contains(out, "root/f") || !strings.Contains(errOut, "no digest was checked") {
			t.Errorf("inspect %s: exit %d: %s %q", f, code, out, errOut)
		}
		into := filepath.Join(t.TempDir(), "into")
		if code, _, errOut := runCLI(t, "snapshot", "unpack", p, "--into", into, "--digest", sha256File(t, p)); code != 0 {
			t.Errorf("unpack %s: exit %d %q", f, code, errOut)
		}
		if b, _ := os.ReadFile(filepath.Join(into, "root", "f")); string(b) != "made-inside\n" {
			t.Errorf("unpack %s: %q", f, b)
		}
	}
}
