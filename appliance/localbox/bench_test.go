package localbox

import (
	"context"
	"fmt"
	"testing"
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
