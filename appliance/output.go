package appliance

import (
	"container/list"
	"sync"
	"sync/atomic"
)

// DefaultOutputBudget is how much output the service keeps of all commands
// together (ManagerConfig.OutputBudget): eight commands' whole windows
// (DefaultOutputBytes). A stream that follows a command as it runs never
// loses a byte to it (the command is held back instead); the budget bounds
// only what is kept for streams that start late or resume, so the service's
// memory stays of the order of its own (tens of MB) whatever the number of
// commands a tenant runs.
const DefaultOutputBudget = 8 * DefaultOutputBytes

// minOutputShare is the least window a running command keeps however
// many share the budget: below it, a stream that resumes after a blip
// would find nothing. With more than OutputBudget/minOutputShare commands
// running at once (4096 for the default), they keep that much each.
const minOutputShare = 16 << 10

// outputBudget bounds the output kept of every command of a service. Each
// process keeps at most its window (OutputBytes); all of them together at
// most limit: when more is kept, the output of the commands that finished
// first is dropped first, and then the windows of running commands shrink
// to an equal share of the budget. Output a stream attached to a process
// has not read yet is never dropped: its writer is held back instead.
//
// A limit of 0 or less keeps account without a bound; a nil *outputBudget
// keeps none (NewProcess's processes).
type outputBudget struct {
	limit int64
	total atomic.Int64 // bytes kept, all processes
	// shareNow is a running process's window now: limit over the running
	// processes, at least minOutputShare.
	shareNow atomic.Int64
	dropped  atomic.Int64 // bytes dropped for the budget, ever

	mu   sync.Mutex
	live map[*Process]struct{} // running, not released
	done list.List             // finished, of *Process, in the order they finished
}

func newOutputBudget(limit int64) *outputBudget {
	b := &outputBudget{limit: limit, live: map[*Process]struct{}{}}
	b.reshare()
	return b
}

func (b *outputBudget) share() int {
	if b == nil {
		return int(^uint(0) >> 1)
	}
	return int(b.shareNow.Load())
}

func (b *outputBudget) reshare() {
	if b.limit <= 0 {
		b.shareNow.Store(int64(^uint(0) >> 1))
		return
	}
	b.shareNow.Store(max(minOutputShare, b.limit/int64(max(1, len(b.live)))))
}

func (b *outputBudget) add(n int64) {
	if b != nil && n != 0 {
		b.total.Add(n)
	}
}

// started counts p among the running processes.
func (b *outputBudget) started(p *Process) {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.live[p] = struct{}{}
	p.live = true
	b.reshare()
}

// finished moves p from the running processes to the end of the finished.
func (b *outputBudget) finished(p *Process) {
	if b == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !p.live {
		return // released first
	}
	delete(b.live, p)
	p.live = false
	b.reshare()
	p.elem = b.done.PushBack(p)
}

// released forgets p, whose freed bytes are no longer kept.
func (b *outputBudget) released(p *Process, freed int64) {
	if b == nil {
		return
	}
	b.total.Add(-freed)
	b.mu.Lock()
	defer b.mu.Unlock()
	if p.live {
		delete(b.live, p)
		p.live = false
		b.reshare()
	}
	if p.elem != nil {
		b.done.Remove(p.elem)
		p.elem = nil
	}
}

// enforce drops output until what is kept is within the budget: the
// finished processes' first, oldest first, then what running ones keep
// over their share.
func (b *outputBudget) enforce() {
	if b == nil || b.limit <= 0 || b.total.Load() <= b.limit {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for e := b.done.Front(); e != nil && b.total.Load() > b.limit; {
		next := e.Next()
		p := e.Value.(*Process)
		if b.drop(p, 0) {
			b.done.Remove(e)
			p.elem = nil
		}
		e = next
	}
	share := int(b.shareNow.Load())
	for p := range b.live {
		if b.total.Load() <= b.limit {
			break
		}
		b.drop(p, share)
	}
}

// drop trims p to keep bytes (what its streams have not read stays); it
// reports whether nothing of p is kept any more. Under b.mu.
func (b *outputBudget) drop(p *Process, keep int) bool {
	p.mu.Lock()
	freed := p.trimLocked(keep, dropBudget)
	empty := p.kept == 0
	if freed > 0 {
		p.cond.Broadcast()
	}
	p.mu.Unlock()
	b.total.Add(-int64(freed))
	b.dropped.Add(int64(freed))
	return empty
}

// kept is the bytes kept now, all processes.
func (b *outputBudget) kept() int64 { return b.total.Load() }
