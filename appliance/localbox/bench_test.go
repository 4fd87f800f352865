package localbox

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/sandgate/sandgate/snapshot"
)

// BenchmarkRunDetach measures `run --detach` until the first command has
// run in the new sandbox (an exec of true), deletes excluded.
func BenchmarkRunDetach(b *testing.B) {
	m := newRuntime(b)
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		id := fmt.Sprintf("bench-%d", i)
		p, err := m.Run(ctx, RunOptions{Config: Config{ID: id, Write: true, Cmd: []string{"sleep", "infinity"}}})
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
		b.StopTimer()
		if err := m.Delete(ctx, id, true); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
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

// BenchmarkRunDetachDisk is BenchmarkRunDetach without a disk quota and
// with one (10g, the service's default: a sparse copy of the blank of that
// size, made before the timing, loop-mounted), in one run so that their
// ratio is what the quota costs a create.
func BenchmarkRunDetachDisk(b *testing.B) {
	for _, disk := range []int64{0, 10 << 30} {
		b.Run("disk="+FormatSize(disk), func(b *testing.B) {
			m := newRuntime(b)
			ctx := context.Background()
			if disk > 0 {
				if err := m.CheckDisk(ctx, disk); err != nil { // makes the blank
					b.Fatal(err)
				}
			}
			for i := 0; b.Loop(); i++ {
				id := fmt.Sprintf("bench-%d", i)
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
				b.StopTimer()
				if err := m.Delete(ctx, id, true); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}

// BenchmarkSuspendSparse measures what a suspend does with a sandbox's
// layer — `tar` of its upper (bare) re-encoded as a zstd layer
// (snapshot.PackStream), as the service saves it — for an empty sandbox
// and for one holding a 4 GiB sparse file with a little data in the
// middle, in one run (their ratio is what the file costs a suspend);
// and what a resume then allocates for the file (alloc-bytes: the file's
// st_blocks after `run --import-tar` of the layer).
func BenchmarkSuspendSparse(b *testing.B) {
	for _, sparse := range []bool{false, true} {
		name := "empty"
		if sparse {
			name = "sparse-4g"
		}
		b.Run(name, func(b *testing.B) {
			m := newRuntime(b)
			ctx := context.Background()
			runDetached(b, m, "src", func(o *RunOptions) { o.Disk = 64 << 20 })
			if sparse {
				if code, _, errOut := sh(b, m, "src", "truncate -s 4G /root/sparse && printf middle | dd of=/root/sparse bs=1 seek=2147483648 conv=notrunc 2>/dev/null"); code != 0 {
					b.Fatal(errOut)
				}
			}
			layer := filepath.Join(b.TempDir(), "layer.tar.zst")
			var size int64
			for b.Loop() {
				pr, pw := io.Pipe()
				go func() {
					_, err := m.Tar(ctx, "src", pw, snapshot.PackOptions{Compression: snapshot.None})
					pw.CloseWithError(err)
				}()
				f, err := os.Create(layer)
				if err != nil {
					b.Fatal(err)
				}
				man, err := snapshot.PackStream(ctx, pr, f, snapshot.PackOptions{})
				f.Close()
				if err != nil {
					b.Fatal(err)
				}
				size = man.Size
			}
			b.ReportMetric(float64(size), "layer-bytes")
			b.StopTimer()
			runDetached(b, m, "dst", func(o *RunOptions) { o.Disk = 64 << 20; o.ImportTar = layer })
			if sparse {
				_, out, _ := sh(b, m, "dst", "stat -c '%b %B' /root/sparse")
				var blocks, unit int64
				fmt.Sscan(out, &blocks, &unit)
				b.ReportMetric(float64(blocks*unit), "alloc-bytes")
			}
		})
	}
}
