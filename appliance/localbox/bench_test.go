package localbox

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/sandgate/sandgate/snapshot"
)

// BenchmarkRunDetach measures `run --detach` until the first command has
// run in the new sandbox (an exec of true), deletes excluded.
func BenchmarkRunDetach(b *testing.B) {
	m := newRuntime(b)
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		id := fmt.Sprintf("bench-%d", i)
		runThenTrue(b, m, id, 0)
		b.StopTimer()
		if err := m.Delete(ctx, id, true); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

// runThenTrue runs sandbox id detached, with a disk quota of disk bytes
// (0: none), and its first command, true, to its end.
func runThenTrue(b *testing.B, m *Runtime, id string, disk int64) {
	ctx := context.Background()
	p, err := m.Run(ctx, RunOptions{Config: Config{ID: id, Write: true, Disk: disk, Cmd: []string{"sleep", "infinity"}}})
	if err != nil {
		b.Fatal(err)
	}
	p.Detach()
	e, err := m.Exec(ctx, id, ExecOptions{Cmd: []string{"true"}})
	if err != nil {
		b.Fatal(err)
	}
	if code, err := e.Wait(); code != 0 || err != nil {
		b.Fatal(code, err)
	}
}

// BenchmarkExecTrue measures an `exec true` round trip in a running
// sandbox: request, fork in the sandbox, exit code back.
func BenchmarkExecTrue(b *testing.B) {
	m := newRuntime(b)
	runDetached(b, m, "bench", nil)
	ctx := context.Background()
	for b.Loop() {
		p, err := m.Exec(ctx, "bench", ExecOptions{Cmd: []string{"true"}})
		if err != nil {
			b.Fatal(err)
		}
		if code, err := p.Wait(); code != 0 || err != nil {
			b.Fatal(code, err)
		}
	}
}

// median is the middle of ds (sorted in place).
func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// reportPair reports the medians of two alternating measurements and
// their ratio: taken in turns, both see the same load.
func reportPair(b *testing.B, nameA, nameB string, a, c []time.Duration) {
	ma, mb := median(a), median(c)
	b.ReportMetric(float64(ma.Nanoseconds()), "ns/"+nameA)
	b.ReportMetric(float64(mb.Nanoseconds()), "ns/"+nameB)
	b.ReportMetric(float64(mb)/float64(ma), nameB+"/"+nameA)
}

// BenchmarkRunDetachDisk measures a create (BenchmarkRunDetach: run
// --detach until the first command ran) without a disk quota and with one
// (10g, the service's default: a sparse copy of the blank of that size,
// made before the timing, loop-mounted), in turns, so that their ratio is
// what the quota costs a create on a machine however loaded.
func BenchmarkRunDetachDisk(b *testing.B) {
	m := newRuntime(b)
	ctx := context.Background()
	const quota = 10 << 30
	if err := m.CheckDisk(ctx, quota); err != nil { // makes the blank
		b.Fatal(err)
	}
	create := func(id string, disk int64) time.Duration {
		start := time.Now()
		runThenTrue(b, m, id, disk)
		d := time.Since(start)
		if err := m.Delete(ctx, id, true); err != nil {
			b.Fatal(err)
		}
		return d
	}
	var none, quotaed []time.Duration
	for i := 0; b.Loop(); i++ {
		if i%2 == 0 {
			none = append(none, create(fmt.Sprintf("n%d", i), 0))
			quotaed = append(quotaed, create(fmt.Sprintf("q%d", i), quota))
		} else {
			quotaed = append(quotaed, create(fmt.Sprintf("q%d", i), quota))
			none = append(none, create(fmt.Sprintf("n%d", i), 0))
		}
	}
	reportPair(b, "create", "create-10g", none, quotaed)
}

// BenchmarkSuspendSparse measures what a suspend does with a sandbox's
// layer — `tar` of its upper (bare) re-encoded as a zstd layer
// (snapshot.PackStream), as the service saves it — for an empty sandbox
// and for one holding a 4 GiB sparse file with a little data in the
// middle, in turns (their ratio is what the file costs a suspend); with
// the size of that layer and what a resume from it allocates for the file
// (its st_blocks after `run --import-tar`).
func BenchmarkSuspendSparse(b *testing.B) {
	m := newRuntime(b)
	ctx := context.Background()
	runDetached(b, m, "empty", func(o *RunOptions) { o.Disk = 64 << 20 })
	runDetached(b, m, "sparse", func(o *RunOptions) { o.Disk = 64 << 20 })
	if code, _, errOut := sh(b, m, "sparse", "truncate -s 4G /root/sparse && printf middle | dd of=/root/sparse bs=1 seek=2147483648 conv=notrunc 2>/dev/null"); code != 0 {
		b.Fatal(errOut)
	}
	dir := b.TempDir()
	save := func(id string) (time.Duration, int64) {
		start := time.Now()
		pr, pw := io.Pipe()
		go func() {
			_, err := m.Tar(ctx, id, pw, snapshot.PackOptions{Compression: snapshot.None})
			pw.CloseWithError(err)
		}()
		f, err := os.Create(filepath.Join(dir, id+".tar.zst"))
		if err != nil {
			b.Fatal(err)
		}
		man, err := snapshot.PackStream(ctx, pr, f, snapshot.PackOptions{})
		f.Close()
		if err != nil {
			b.Fatal(err)
		}
		return time.Since(start), man.Size
	}
	var empty, sparse []time.Duration
	var size int64
	for i := 0; b.Loop(); i++ {
		order := []string{"empty", "sparse"}
		if i%2 == 1 {
			order = []string{"sparse", "empty"}
		}
		for _, id := range order {
			d, n := save(id)
			if id == "empty" {
				empty = append(empty, d)
			} else {
				sparse, size = append(sparse, d), n
			}
		}
	}
	reportPair(b, "suspend-empty", "suspend-sparse4g", empty, sparse)
	b.ReportMetric(float64(size), "layer-bytes-sparse4g")
	b.StopTimer()
	runDetached(b, m, "resumed", func(o *RunOptions) { o.Disk = 64 << 20; o.ImportTar = filepath.Join(dir, "sparse.tar.zst") })
	_, out, _ := sh(b, m, "resumed", "stat -c '%b %B' /root/sparse")
	var blocks, unit int64
	fmt.Sscan(out, &blocks, &unit)
	b.ReportMetric(float64(blocks*unit), "resume-alloc-bytes")
}

// BenchmarkDiskLayer measures what a disk quota adds to a create and a
// delete alone: a sandbox's file system made from the blank (a sparse copy,
// a loop device, a mount), then unmounted and removed.
func BenchmarkDiskLayer(b *testing.B) {
	m := newRuntime(b)
	ctx := context.Background()
	const quota = 10 << 30
	if err := m.CheckDisk(ctx, quota); err != nil {
		b.Fatal(err)
	}
	for i := 0; b.Loop(); i++ {
		dir := filepath.Join(m.dir, fmt.Sprintf("layer-%d", i))
		if err := os.Mkdir(dir, 0o700); err != nil {
			b.Fatal(err)
		}
		if err := m.makeLayer(ctx, dir, quota); err != nil {
			b.Fatal(err)
		}
		if err := unmountLayer(dir); err != nil {
			b.Fatal(err)
		}
		if err := os.RemoveAll(dir); err != nil {
			b.Fatal(err)
		}
	}
}
