package localbox

import (
	"bufio"
	"bytes"
	"cmp"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/sandgate/sandgate/snapshot"
)

// allocated is what path takes on its file system, in bytes (st_blocks).
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// loopBacking lists the files the host's loop devices are attached to.
func loopBacking(t *testing.T) []string {
	t.Helper()
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		if b, err := os.ReadFile(f); err == nil {
			out = append(out, strings.TrimSpace(string(b)))
		}
	}
	return out
}

// mountsUnder lists the host's mount points under dir.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 4 && strings.HasPrefix(unescapeMount(fields[4]), dir+"/") {
			out = append(out, fields[4])
		}
	}
	return out
}

// A sandbox writing without end used to fill the host's disk: its layer
// had no quota. With one, its writes fail with ENOSPC at the quota, the
// host holds no more than the quota for it, df in the sandbox shows its
// own size, an apparent size beyond the quota (a sparse file) is fine, and
// delete leaves no mount, loop device or image behind.
func TestDiskQuotaStopsWritesAtQuota(t *testing.T) {
	for _, userns := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+cmp.Or(userns, "auto"), func(t *testing.T) {
			m := newRuntime(t)
			const quota = 32 << 20
			runDetached(t, m, "q", func(o *RunOptions) { o.Disk = quota; o.UserNS = userns })
			_, out, _ := sh(t, m, "q", "dd if=/dev/zero of=/root/big bs=1M count=100 2>&1; stat -c %s /root/big")
			if !strings.Contains(out, "No space left on device") {
				t.Fatalf("writing past the quota: %q", out)
			}
			lines := strings.Fields(out)
			if n, err := strconv.ParseInt(lines[len(lines)-1], 10, 64); err != nil || n > quota || n < quota/2 {
				t.Errorf("the file written until the disk was full has %s bytes, want nearly the %d-byte quota", lines[len(lines)-1], quota)
			}
			if code, out, errOut := sh(t, m, "q", "df -B1 --output=size / | tail -1"); code != 0 {
				t.Errorf("df: %d %s", code, errOut)
			} else if n, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64); err != nil || n > quota {
				t.Errorf("df / in the sandbox says its size is %q, want at most the quota %d", out, quota)
			}
			dir := m.sandboxDir("q")
			if a := allocated(t, filepath.Join(dir, layerImage)); a > quota {
				t.Errorf("the sandbox's layer takes %d bytes of the host, over its %d-byte quota", a, quota)
			}
			// Holes are free: an apparent size beyond the quota is fine.
			if code, _, errOut := sh(t, m, "q", "rm /root/big && truncate -s 4G /root/sparse && echo x >> /root/sparse && test $(stat -c %s /root/sparse) = 4294967298"); code != 0 {
				t.Errorf("a sparse file larger than the quota: %d %s", code, errOut)
			}
			// /tmp is a tmpfs (memory), not the layer.
			if code, _, errOut := sh(t, m, "q", "dd if=/dev/zero of=/tmp/t bs=1M count=40 2>&1"); code != 0 {
				t.Errorf("/tmp beyond the disk quota: %d %s", code, errOut)
			}
			if err := m.Delete(testCtx(t), "q", true); err != nil {
				t.Fatal(err)
			}
			if ms := mountsUnder(t, m.dir); len(ms) > 0 {
				t.Errorf("mounts left after delete: %v", ms)
			}
			for _, b := range loopBacking(t) {
				if strings.HasPrefix(b, dir+"/") {
					t.Errorf("loop device still attached to %s", b)
				}
			}
			if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the sandbox's directory after delete: %v", err)
			}
		})
	}
}

// A layer that does not fit the quota is refused at run, naming the
// quota and the fix, and leaves nothing; a fork keeps the quota; tar reads
// the layer from its file system.
func TestDiskQuotaImportAndFork(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "src", nil)
	if code, _, errOut := sh(t, m, "src", "head -c 8388608 /dev/urandom > /root/data && echo small > /root/small"); code != 0 {
		t.Fatal(code, errOut)
	}
	var layer bytes.Buffer
	if _, err := m.Tar(testCtx(t), "src", &layer, snapshot.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "layer.tar.zst")
	if err := os.WriteFile(f, layer.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := m.Run(testCtx(t), RunOptions{Config: Config{ID: "small", Write: true, Disk: 4 << 20, Cmd: []string{"sleep", "infinity"}}, ImportTar: f})
	if !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "disk quota of 4m") || !strings.Contains(err.Error(), "larger quota") {
		t.Fatalf("importing an 8 MiB layer under a 4 MiB quota: %v, want ErrBadInput naming the quota and the fix", err)
	}
	if _, err := os.Stat(m.sandboxDir("small")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused run left its directory: %v", err)
	}
	if ms := mountsUnder(t, m.dir); len(ms) > 0 {
		t.Errorf("a refused run left mounts: %v", ms)
	}
	runDetached(t, m, "big", func(o *RunOptions) { o.Disk = 64 << 20; o.ImportTar = f })
	if _, out, _ := sh(t, m, "big", "cat /root/small; stat -c %s /root/data"); out != "small\n8388608\n" {
		t.Errorf("the imported layer: %q", out)
	}
	var out bytes.Buffer
	if _, err := m.Tar(testCtx(t), "big", &out, snapshot.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	if names := layerNames(t, bytes.NewReader(out.Bytes())); !names["root/data"] || !names["root/small"] || names["lost+found"] || names["work"] {
		t.Errorf("tar of a sandbox with a quota: %v", names)
	}
	p, err := m.Fork(testCtx(t), "big", "fork", Stdio{})
	if err != nil {
		t.Fatal(err)
	}
	p.Detach()
	if _, out, _ := sh(t, m, "fork", "df -B1 --output=size / | tail -1; cat /root/small"); !strings.HasSuffix(out, "small\n") {
		t.Errorf("the fork: %q", out)
	} else if n, _ := strconv.ParseInt(strings.TrimSpace(strings.Split(out, "\n")[0]), 10, 64); n <= 0 || n > 64<<20 {
		t.Errorf("the fork's disk is %q bytes, want its source's 64 MiB quota", out)
	}
}

// A sparse file a sandbox had just written lost its data in tar: ext4
// beneath the overlay reported a hole over data not yet written back
// (SEEK_DATA), so only the holes were saved. Its data is kept, and its
// holes, under a quota smaller than its apparent size.
func TestTarKeepsFreshDataOfSparseFile(t *testing.T) {
	m := newRuntime(t)
	runDetached(t, m, "a", func(o *RunOptions) { o.Disk = 64 << 20 })
	if code, _, errOut := sh(t, m, "a", "truncate -s 4G /root/sparse && printf middle | dd of=/root/sparse bs=1 seek=2147483648 conv=notrunc"); code != 0 {
		t.Fatal(errOut)
	}
	var layer bytes.Buffer
	if _, err := m.Tar(testCtx(t), "a", &layer, snapshot.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	if layer.Len() > 64<<10 {
		t.Errorf("the layer is %d bytes: the holes were saved as data", layer.Len())
	}
	f := filepath.Join(t.TempDir(), "layer.tar.zst")
	os.WriteFile(f, layer.Bytes(), 0o600)
	runDetached(t, m, "b", func(o *RunOptions) { o.Disk = 64 << 20; o.ImportTar = f })
	_, out, _ := sh(t, m, "b", "stat -c %s /root/sparse; dd if=/root/sparse bs=1 skip=2147483648 count=6 2>/dev/null")
	if out != "4294967296\nmiddle" {
		t.Errorf("the sparse file in a sandbox made from the layer: %q", out)
	}
	if a := allocated(t, filepath.Join(m.sandboxDir("b"), layerMount, upperDir, "root", "sparse")); a > 64<<10 {
		t.Errorf("it takes %d bytes of disk: its holes were written", a)
	}
}
