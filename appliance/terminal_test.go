package appliance

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
)

// A terminal whose client went away keeps the newest TerminalScrollback
// bytes of its output, however much it wrote: a client that comes back
// from the start is told how many it missed and reads exactly the rest.
func TestTerminalScrollbackKeepsTheNewest(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.TerminalGrace = 10 * time.Minute })
	r.create("box", CreateOptions{})
	ctx := r.ctx()
	term, err := r.m.OpenTerminal(ctx, "box", TerminalRequest{Args: []string{"seq", "1", "100000"}})
	if err != nil {
		t.Fatal(err)
	}
	term.Detach() // gone before it read a byte: nothing holds the command back
	if code, err := term.Wait(ctx); code != 0 || err != nil {
		t.Fatalf("exit %d %v", code, err)
	}
	var want strings.Builder
	for i := 1; i <= 100000; i++ {
		fmt.Fprintf(&want, "%d\r\n", i)
	}
	back, err := r.m.AttachTerminal(ctx, "box", term.ID(), 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(back)
	if err != nil {
		t.Fatal(err)
	}
	if skipped := back.Skipped(); skipped != int64(want.Len()-TerminalScrollback) || string(got) != want.String()[skipped:] {
		t.Errorf("came back to %d bytes, skipped %d; want the last %d of %d", len(got), skipped, TerminalScrollback, want.Len())
	}
	back.Close()
	if _, err := r.m.AttachTerminal(ctx, "box", term.ID(), 0, nil); !errors.Is(err, ErrNotFound) {
		t.Errorf("attaching to a terminal hung up: %v, want ErrNotFound", err)
	}
}
