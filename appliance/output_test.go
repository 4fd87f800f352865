package appliance

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// write writes n bytes of output to p on channel ch, in writes of size
// each (a chatty command writes a line at a time).
func write(p *Process, ch, n, size int) {
	line := bytes.Repeat([]byte("x"), size)
	for n > 0 {
		k := min(n, size)
		p.Output(ch).Write(line[:k])
		n -= k
	}
}

// Forty short chatty commands raised serve from 67 MB to 536 MB: every
// finished command kept its whole window for ten minutes, with no bound on
// them all. Past the budget, the oldest finished command's output goes
// first, and a stream resuming there is told so, and what is left.
func TestFinishedOutputOverTheBudgetDroppedOldestFirst(t *testing.T) {
	const window, budget = 256 << 10, 1 << 20
	b := newOutputBudget(budget)
	var procs []*Process
	for i := range 20 {
		p := newProcess(window, b)
		write(p, Stdout, 200<<10, 4<<10)
		p.finish(i)
		procs = append(procs, p)
		if got := b.kept(); got > budget {
			t.Fatalf("after %d commands the service keeps %d bytes of output; the budget is %d", i+1, got, budget)
		}
	}
	// The newest five fit whole (5×200 KiB ≤ 1 MiB); the oldest are gone.
	for i, p := range procs[15:] {
		if err := p.Available(0); err != nil {
			t.Errorf("command %d (among the newest): %v", 15+i, err)
		}
	}
	err := procs[0].Available(0)
	if !errors.Is(err, ErrOutputDropped) {
		t.Fatalf("the oldest command's output: got %v, want ErrOutputDropped", err)
	}
	for _, want := range []string{"output budget", "1048576 bytes", "none of it is kept any more", "exited with code 0", procs[0].ID()} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
	// A stream resuming there is refused with the same words, not handed
	// what came later.
	_, err = procs[0].Follow(context.Background(), 0, func(int, []byte) error {
		t.Error("a stream past dropped output was handed bytes")
		return nil
	}, func() {})
	if !errors.Is(err, ErrOutputDropped) {
		t.Errorf("Follow from a dropped offset: %v", err)
	}
	if start, end := procs[0].Range(); start != end || end != 200<<10 {
		t.Errorf("the dropped command's range is %d..%d, want %d..%d (its offsets stay)", start, end, 200<<10, 200<<10)
	}
}

// Many running commands cannot hold more than the budget between them:
// each keeps an equal share of it while they run.
func TestRunningCommandsShareTheOutputBudget(t *testing.T) {
	const window, budget = 8 << 20, 1 << 20
	b := newOutputBudget(budget)
	var procs []*Process
	for range 16 {
		procs = append(procs, newProcess(window, b))
	}
	for _, p := range procs {
		write(p, Stdout, 512<<10, 32<<10)
	}
	if got := b.kept(); got > budget {
		t.Fatalf("16 running commands keep %d bytes of output; the budget is %d", got, budget)
	}
	// The last to write keeps its share, its latest bytes, and a resume
	// before them says what is left.
	last := procs[len(procs)-1]
	start, end := last.Range()
	if end-start != budget/16 {
		t.Errorf("a running command keeps %d bytes, want its share %d", end-start, budget/16)
	}
	err := last.Available(0)
	if !errors.Is(err, ErrOutputDropped) || !strings.Contains(err.Error(), "still kept: resume from offset") {
		t.Errorf("resume before the share: %v", err)
	}
}

// A stream attached to a running command never loses a byte it has not
// read to the budget: the command is held back instead.
func TestOutputBudgetNeverDropsWhatAStreamHasNotRead(t *testing.T) {
	const window, budget = 8 << 20, 256 << 10
	b := newOutputBudget(budget)
	others := []*Process{newProcess(window, b), newProcess(window, b), newProcess(window, b)}
	p := newProcess(window, b)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var got int64
	done := make(chan error, 1)
	go func() {
		_, err := p.Follow(ctx, 0, func(_ int, d []byte) error {
			got += int64(len(d))
			return nil
		}, func() {})
		done <- err
	}()
	for i := 0; ; i++ { // attached before the first byte
		p.mu.Lock()
		n := len(p.followers)
		p.mu.Unlock()
		if n == 1 {
			break
		}
		if i == 10000 {
			t.Fatal("the stream did not attach")
		}
		time.Sleep(time.Millisecond)
	}
	for _, o := range others {
		write(o, Stdout, 128<<10, 8<<10)
	}
	write(p, Stdout, 2<<20, 8<<10)
	p.finish(0)
	if err := <-done; err != nil {
		t.Fatalf("the stream following the command: %v", err)
	}
	if got != 2<<20 {
		t.Errorf("the stream got %d bytes, want all %d", got, 2<<20)
	}
}

// A chatty command's output, written a byte at a time, costs its bytes:
// not a slice (and an allocation) per write.
func TestChattyOutputKeptInFewChunks(t *testing.T) {
	p := newProcess(1<<20, newOutputBudget(DefaultOutputBudget))
	for range 200_000 {
		p.Output(Stdout).Write([]byte("y"))
		p.Output(Stderr).Write([]byte("\n"))
	}
	p.mu.Lock()
	chunks, kept := len(p.chunks), p.kept
	p.mu.Unlock()
	if kept != 400_000 {
		t.Fatalf("kept %d bytes, want 400000", kept)
	}
	// Alternating channels cannot share a chunk; whole runs of one can.
	if chunks > 400_000 {
		t.Fatalf("%d chunks", chunks)
	}
	q := newProcess(1<<20, nil)
	for range 400_000 {
		q.Output(Stdout).Write([]byte("y"))
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if want := 400_000/chunkBytes + 1; len(q.chunks) > want {
		t.Errorf("400000 one-byte writes are kept in %d chunks, want at most %d", len(q.chunks), want)
	}
}

// A sandbox that stops lets go of its commands' output at once (it was
// kept, and counted, until ProcessRetention before).
func TestReleasedProcessOutputLeavesTheBudget(t *testing.T) {
	b := newOutputBudget(DefaultOutputBudget)
	p, q := newProcess(1<<20, b), newProcess(1<<20, b)
	write(p, Stdout, 100<<10, 1<<10)
	write(q, Stdout, 100<<10, 1<<10)
	q.finish(0)
	p.release()
	q.release()
	p.finish(137) // its command ends after its sandbox went
	if got := b.kept(); got != 0 {
		t.Errorf("released commands still count %d bytes", got)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.live) != 0 || b.done.Len() != 0 {
		t.Errorf("released commands still listed: %d running, %d finished", len(b.live), b.done.Len())
	}
	if err := p.Available(0); err == nil || !strings.Contains(err.Error(), "its sandbox stopped running") {
		t.Errorf("resume of a released command: %v", err)
	}
}
