package localbox

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/snapshot"
)

// TestDefaultImageShowsNothingElseOfTheHost plants canaries where a host
// keeps its own (/root, /home, /var/tmp, /srv, /opt, and a file in /etc
// that the image does not copy) and looks for them from a sandbox of the
// default image; the programs and libraries it does show must work.
func TestDefaultImageShowsNothingElseOfTheHost(t *testing.T) {
	m := newRuntime(t)
	marker := "SANDGATE-IMAGE-CANARY-" + filepath.Base(t.TempDir())
	var planted []string
	for _, d := range []string{"/root", "/home", "/var/tmp", "/srv", "/opt", "/etc"} {
		p := filepath.Join(d, "sandgate-canary-"+filepath.Base(t.TempDir()))
		if err := os.WriteFile(p, []byte(marker), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(p) })
		planted = append(planted, p)
	}
	runDetached(t, m, "img", nil)
	var script strings.Builder
	for _, p := range planted {
		script.WriteString("test -e " + p + " && echo SEEN " + p + "\n")
	}
	script.WriteString(`for f in shadow gshadow ssh sudoers machine-id; do test -e /etc/$f && echo "SEEN /etc/$f"; done
timeout 60 grep -r -s -l -F ` + marker + ` /root /home /var /srv /opt /mnt /run /etc /tmp 2>/dev/null | sed 's/^/FOUND /'
grep -q '^agent:x:1000:1000:' /etc/passwd || echo "BROKEN: /etc/passwd"
grep -q 127.0.0.1 /etc/hosts && grep -q img /etc/hosts || echo "BROKEN: /etc/hosts"
test "$(hostname)" = img || echo "BROKEN: hostname"
sh -c 'echo ok' >/dev/null || echo "BROKEN: sh"
echo 1 | awk '{print}' >/dev/null || echo "BROKEN: awk (Debian's alternatives)"
ls /etc/ssl/certs >/dev/null || echo "BROKEN: CA certificates"
for d in /root /home /srv /opt /mnt; do test -z "$(ls -A $d)" || echo "BROKEN: $d is not empty"; done
echo installed > /usr/local/sandgate-test && mkdir -p /workspace && echo work > /workspace/w && echo secret > /root/r
echo checked`)
	code, out, errOut := sh(t, m, "img", script.String())
	if code != 0 || !strings.HasSuffix(out, "checked\n") {
		t.Fatalf("exit %d, %q, %q", code, out, errOut)
	}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line != "checked" {
			t.Error(line)
		}
	}
	// What the sandbox wrote, in /usr too, is in its layer, and nothing of
	// the image's own making (its /etc, its mount points) is.
	var buf bytes.Buffer
	if _, err := m.Tar(testCtx(t), "img", &buf, snapshot.PackOptions{Compression: snapshot.None}); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names[strings.TrimSuffix(h.Name, "/")] = true
	}
	for _, want := range []string{"usr/local/sandgate-test", "workspace/w", "root/r"} {
		if !names[want] {
			t.Errorf("the layer lacks %s: %v", want, names)
		}
	}
	for name := range names {
		if strings.HasPrefix(name, "etc/") || name == "proc" || name == "dev" || name == "sys" || name == "tmp" {
			t.Errorf("the layer holds %s, which the image made", name)
		}
	}
}

// TestMaskedWhateverTheImage runs a sandbox on the host's whole root (a
// configured image) with a hidden directory and a hidden file under it:
// both are seen empty; the rest of the image is seen as it is.
func TestMaskedWhateverTheImage(t *testing.T) {
	m := newRuntime(t)
	base, err := os.MkdirTemp("/var/tmp", "sandgate-mask-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	hiddenDir, hiddenFile, shown := filepath.Join(base, "store"), filepath.Join(base, "audit.log"), filepath.Join(base, "shown")
	for _, p := range []string{hiddenDir, shown} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p, "f"), []byte("canary"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(hiddenFile, []byte("canary"), 0o644); err != nil {
		t.Fatal(err)
	}
	runDetached(t, m, "masked", func(o *RunOptions) {
		o.Rootfs = "/"
		o.Masks = []string{hiddenDir, hiddenFile}
	})
	code, out, errOut := sh(t, m, "masked", `ls -A `+hiddenDir+`; cat `+hiddenFile+`; cat `+shown+`/f; echo; ls -A `+m.StateDir()+` 2>/dev/null; true`)
	if code != 0 || out != "canary\n" {
		t.Errorf("exit %d, %q (%s); want only the file not hidden (canary)", code, out, errOut)
	}
	// An image inside a hidden path cannot be masked: refused.
	_, err = m.Run(testCtx(t), RunOptions{Config: Config{ID: "inside", Rootfs: hiddenDir, Masks: []string{base}, Cmd: []string{"true"}}})
	if !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "lies inside") {
		t.Errorf("an image inside a hidden path: %v; want ErrBadInput", err)
	}
	if err := CheckImage(m.StateDir(), []string{filepath.Dir(m.StateDir())}); !errors.Is(err, ErrBadInput) {
		t.Errorf("an image inside a hidden directory: CheckImage says %v", err)
	}
}
