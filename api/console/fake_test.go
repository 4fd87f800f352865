package console

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/relay/audit"
)

// fake is a Backend in memory: sandboxes by id, their rules, sessions and
// audit lines; what was asked of it.
type fake struct {
	mu       sync.Mutex
	boxes    map[string]appliance.Info
	rules    map[string][]appliance.RuleInfo
	sessions map[string]map[string]appliance.Session
	lines    map[string][][]byte
	shards   []cluster.Shard
	calls    []string
	resumed  appliance.ResumeOptions
	// follow, when set, carries lines a follower sends as they come (after
	// what AuditEvents lists), until the request ends.
	follow chan []byte
}

func newFake() *fake {
	return &fake{boxes: map[string]appliance.Info{}, rules: map[string][]appliance.RuleInfo{},
		sessions: map[string]map[string]appliance.Session{}, lines: map[string][][]byte{}}
}

func (f *fake) add(in appliance.Info) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if in.Shard == "" && in.State != appliance.Suspended {
		in.Shard = "here"
	}
	f.boxes[in.ID] = in
}

func (f *fake) record(id string, e audit.Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	e.Sandbox = id
	f.lines[id] = append(f.lines[id], audit.AppendJSON(nil, &e)[:len(audit.AppendJSON(nil, &e))-1])
}

func (f *fake) called() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

func (f *fake) get(id string) (appliance.Info, error) {
	in, ok := f.boxes[id]
	if !ok {
		return in, fmt.Errorf("%w: sandbox %q is neither running nor suspended", appliance.ErrNotFound, id)
	}
	return in, nil
}

func (f *fake) List(ctx context.Context) ([]appliance.Info, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []appliance.Info
	for _, in := range f.boxes {
		out = append(out, in)
	}
	slices.SortFunc(out, func(a, b appliance.Info) int { return compare(a.ID, b.ID) })
	return out, nil
}

func compare(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (f *fake) Get(ctx context.Context, id string) (appliance.Info, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.get(id)
}

func (f *fake) Resume(ctx context.Context, id string, opts appliance.ResumeOptions) (*appliance.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "resume "+id)
	in, err := f.get(id)
	if err != nil {
		return nil, err
	}
	in.State, in.Shard = appliance.Running, "here"
	f.boxes[id], f.resumed = in, opts
	return nil, nil
}

func (f *fake) Suspend(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "suspend "+id)
	if in, err := f.get(id); err == nil {
		in.State, in.Shard = appliance.Suspended, ""
		f.boxes[id] = in
	}
	return nil
}

func (f *fake) Destroy(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "destroy "+id)
	delete(f.boxes, id)
	delete(f.lines, id)
	return nil
}

func (f *fake) CredentialRules(id string) ([]appliance.RuleInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	in, err := f.get(id)
	if err != nil {
		return nil, err
	}
	if in.State != appliance.Running || in.Shard != "here" {
		return nil, fmt.Errorf("%w: sandbox %q is not running here", appliance.ErrNotRunning, id)
	}
	return f.rules[id], nil
}

func (f *fake) Sessions(ctx context.Context, id string) (map[string]appliance.Session, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.sessions[id], nil
}

func (f *fake) AuditEvents(ctx context.Context, id string, q audit.Query) (audit.Page, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.get(id); err != nil {
		return audit.Page{}, err
	}
	lines := slices.Clone(f.lines[id])
	seg := audit.Segment{Name: "20250101T000000Z", Lines: func(context.Context) ([]byte, error) {
		var b []byte
		for _, l := range lines {
			b = append(append(b, l...), '\n')
		}
		return b, nil
	}}
	return audit.Select(ctx, []audit.Segment{seg}, q)
}

func (f *fake) FollowAudit(ctx context.Context, id string, q audit.Query, send func(line []byte) error) error {
	p, err := f.AuditEvents(ctx, id, q)
	if err != nil {
		return err
	}
	if err := send(nil); err != nil {
		return nil
	}
	for _, l := range p.Lines {
		if err := send(l); err != nil {
			return nil
		}
	}
	f.mu.Lock()
	follow := f.follow
	f.mu.Unlock()
	if follow == nil {
		return nil // the stream ends (as for a destroyed sandbox)
	}
	for {
		select {
		case l := <-follow:
			if q.Match(l) {
				if err := send(l); err != nil {
					return nil
				}
			}
		case <-ctx.Done():
			return nil
		}
	}
}

func (f *fake) Shard() (string, string) { return "here", "http://here.test" }

func (f *fake) Shards(ctx context.Context) ([]cluster.Shard, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.shards), nil
}

var _ Backend = (*fake)(nil)

// at is a fixed clock for pages that show times.
var at = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)
