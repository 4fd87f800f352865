package appliance

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gcstest"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
)

// The audit segments in both stores: written by Journals, listed and read
// back in order, removed with their sandbox, swept past their retention.
func TestAuditStore(t *testing.T) {
	ctx := context.Background()
	dir, err := store.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	_, client := gcstest.Start(t, "audit")
	for name, st := range map[string]store.Store{"dir": dir, "gcs": store.NewGCS(client, "audit", "p")} {
		t.Run(name, func(t *testing.T) {
			as := NewAuditStore(st)
			js, err := audit.NewJournals(audit.JournalsConfig{Writer: as, SegmentBytes: 2048, MaxSegments: 100, FlushEvery: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			for _, id := range []string{"a", "b"} {
				js.Open(id)
				for i := range 30 {
					js.Record(audit.Event{Sandbox: id, Kind: audit.Connect, Host: id + ".example.com", Port: i})
				}
				if err := js.Seal(ctx, id); err != nil {
					t.Fatal(err)
				}
			}
			js.Close(ctx)
			segs, err := as.segments(ctx, "a")
			if err != nil || len(segs) < 2 {
				t.Fatalf("%d segments of a (%v); want several of 2 KiB", len(segs), err)
			}
			p, err := audit.Select(ctx, segs, audit.Query{})
			if err != nil {
				t.Fatal(err)
			}
			var ports []int
			for _, l := range p.Lines {
				var e audit.Event
				if err := e.UnmarshalJSON(l); err != nil || e.Sandbox != "a" {
					t.Fatalf("%s: %v", l, err)
				}
				ports = append(ports, e.Port)
			}
			if want := slices.Collect(func(yield func(int) bool) {
				for i := range 30 {
					yield(i)
				}
			}); !slices.Equal(ports, want) {
				t.Errorf("a's events read back as %v", ports)
			}
			if err := as.WriteSegment(ctx, "a", "../x", []byte("x")); err == nil {
				t.Error("a segment named ../x was written")
			}

			if err := as.remove(ctx, "a"); err != nil {
				t.Fatal(err)
			}
			if segs, _ := as.segments(ctx, "a"); len(segs) != 0 {
				t.Errorf("after remove a has %d segments", len(segs))
			}
			if n, err := as.sweep(ctx, time.Now().Add(-time.Hour)); n != 0 || err != nil {
				t.Errorf("a sweep of what is older than an hour removed %d (%v)", n, err)
			}
			if n, err := as.sweep(ctx, time.Now().Add(time.Hour)); n == 0 || err != nil {
				t.Errorf("a sweep of everything removed %d (%v)", n, err)
			}
			if segs, _ := as.segments(ctx, "b"); len(segs) != 0 {
				t.Errorf("after the sweep b has %d segments", len(segs))
			}
		})
	}
}
