package appliance

import (
	"errors"
	"strconv"
	"strings"
	"testing"
)

// dfSize is the size of / as df in sandbox id sees it.
func (r *mrig) dfSize(id string) int64 {
	r.t.Helper()
	code, out := r.sh(id, "df -B1 --output=size / | tail -1")
	n, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if code != 0 || err != nil {
		r.t.Fatalf("df in %s: %d %q", id, code, out)
	}
	return n
}

// A sandbox's writable layer had no quota: writing without end filled the
// host's disk. The service's default disk limit, or a sandbox's own, is
// now its quota: past it its writes fail with ENOSPC, and it keeps it
// across a suspend.
func TestSandboxWritesStopAtItsDiskLimit(t *testing.T) {
	t.Parallel() // waits on sandboxes and the store more than it works
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.Limits.Disk = 24 << 20 })
	r.create("dflt", CreateOptions{})
	r.create("own", CreateOptions{Limits: Limits{Disk: 48 << 20}})
	if code, out := r.sh("dflt", "dd if=/dev/zero of=/root/big bs=1M count=100 2>&1"); code == 0 || !strings.Contains(out, "No space left on device") {
		t.Errorf("writing 100 MiB under the default 24 MiB limit: %d %q, want ENOSPC", code, out)
	}
	if n := r.dfSize("dflt"); n > 24<<20 {
		t.Errorf("the default limit: df says %d bytes", n)
	}
	if n := r.dfSize("own"); n <= 24<<20 || n > 48<<20 {
		t.Errorf("its own limit of 48 MiB: df says %d bytes", n)
	}
	if err := r.m.Suspend(r.ctx(), "own"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.m.Resume(r.ctx(), "own", ResumeOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := r.dfSize("own"); n <= 24<<20 || n > 48<<20 {
		t.Errorf("its own limit after a resume: df says %d bytes", n)
	}
}

// A 4 GiB sparse file with a little data in the middle cost 0 bytes in
// the sandbox, then its suspend burned both cores for 23 s and its resume
// wrote 4 GiB to the host. It is saved as the little it holds, and
// resumed with the same content at almost no allocated bytes, under a
// disk limit far below its apparent size.
func TestSparseFileSurvivesSuspendAndResume(t *testing.T) {
	t.Parallel() // waits on sandboxes and the store more than it works
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("sp", CreateOptions{Limits: Limits{Disk: 64 << 20}})
	if code, out := r.sh("sp", "truncate -s 4G /root/sparse && printf middle | dd of=/root/sparse bs=1 seek=2147483648 conv=notrunc 2>&1"); code != 0 {
		t.Fatalf("making the sparse file: %d %s", code, out)
	}
	if err := r.m.Suspend(r.ctx(), "sp"); err != nil {
		t.Fatal(err)
	}
	in, err := r.m.Get(r.ctx(), "sp")
	if err != nil {
		t.Fatal(err)
	}
	if in.State != Suspended || in.LayerBytes <= 0 || in.LayerBytes > 1<<20 {
		t.Fatalf("suspended: %s, its snapshot %d bytes; want a small one", in.State, in.LayerBytes)
	}
	if _, err := r.m.Resume(r.ctx(), "sp", ResumeOptions{}); err != nil {
		t.Fatal(err)
	}
	code, out := r.sh("sp", "stat -c '%s %b %B' /root/sparse; dd if=/root/sparse bs=1 skip=2147483648 count=6 2>/dev/null; echo; dd if=/root/sparse bs=1M skip=2047 count=2 2>/dev/null | tr -d '\\0' | wc -c")
	f := strings.Fields(out)
	if code != 0 || len(f) != 5 {
		t.Fatalf("the resumed file: %d %q", code, out)
	}
	blocks, _ := strconv.ParseInt(f[1], 10, 64)
	unit, _ := strconv.ParseInt(f[2], 10, 64)
	if f[0] != "4294967296" || f[3] != "middle" || f[4] != "6" {
		t.Errorf("the resumed file: size %s, data %q, %s non-zero bytes around it; want 4294967296, \"middle\", 6", f[0], f[3], f[4])
	}
	if blocks*unit > 64<<10 {
		t.Errorf("the resumed file takes %d bytes of disk, want its holes kept", blocks*unit)
	}
}

// A snapshot whose layer does not fit the disk limit it resumes under (the
// service's default was lowered since) is refused with an error naming
// the limit and the fix, and stays suspended, whole, to resume once the
// limit is raised.
func TestResumeOverDiskLimitSaysWhy(t *testing.T) {
	t.Parallel() // waits on sandboxes and the store more than it works
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("full", CreateOptions{})
	if code, out := r.sh("full", "head -c 8388608 /dev/urandom > /root/data && echo kept > /root/small"); code != 0 {
		t.Fatal(code, out)
	}
	if err := r.m.Suspend(r.ctx(), "full"); err != nil {
		t.Fatal(err)
	}
	r.m.Close(r.ctx())
	r.cfg.Limits.Disk = 4 << 20
	r.m = r.open()
	_, err := r.m.Resume(r.ctx(), "full", ResumeOptions{})
	if !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "disk quota of 4m") || !strings.Contains(err.Error(), "SANDGATE_SANDBOX_DISK") {
		t.Fatalf("resume under a 4 MiB limit of an 8 MiB layer: %v, want ErrBadInput naming the limit and the fix", err)
	}
	if st := r.state("full"); st != Suspended {
		t.Fatalf("after the refused resume: %s, want suspended", st)
	}
	r.m.Close(r.ctx())
	r.cfg.Limits.Disk = 64 << 20
	r.m = r.open()
	if _, err := r.m.Resume(r.ctx(), "full", ResumeOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, out := r.sh("full", "cat /root/small; stat -c %s /root/data"); out != "kept\n8388608\n" {
		t.Errorf("resumed under a larger limit: %q", out)
	}
}
