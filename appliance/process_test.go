package appliance

import (
	"context"
	"testing"
	"time"
)

// A finished command kept its agent stream (and the buffers of its link)
// for the ten minutes it is known: about 200 KB each, so a thousand short
// commands held 200 MB beside their output. What stays of it is its
// output and exit code.
func TestFinishedProcessLetsGoOfItsStream(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	r.create("short-cmds", CreateOptions{})
	p, err := r.m.Exec(r.ctx(), "short-cmds", ExecRequest{Args: []string{"/bin/sh", "-c", "echo done"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(r.ctx(), time.Minute)
	defer cancel()
	if code, ok := p.Wait(ctx); !ok || code != 0 {
		t.Fatalf("exit %d, %v", code, ok)
	}
	if p.agent.Load() != nil {
		t.Error("a finished process still holds its agent stream")
	}
	if start, end := p.Range(); end-start != int64(len("done\n")) {
		t.Errorf("its output is %d..%d, want the 5 bytes it wrote", start, end)
	}
}
