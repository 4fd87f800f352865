package appliance

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/snapshot/store"
)

// A sandbox's sessions are written only over what this service last read
// or wrote of them: once another shard wrote them (it took the sandbox
// while this one was cut off), this one's writes are refused and the
// other's stand; read again, they are written on.
func TestSessionsFenced(t *testing.T) {
	for _, kind := range storeKinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			st := newStore(t, kind)
			r := newManagerRig(t, st, nil)
			r.create("x", CreateOptions{})
			if err := r.m.CreateSession(ctx, "x", "mine", Session{Dir: "/root"}); err != nil {
				t.Fatal(err)
			}
			theirs := `{"sessions":{"theirs":{"cwd":"/tmp"}}}`
			if _, err := st.Put(ctx, sessionsKey("x"), strings.NewReader(theirs), store.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := r.m.CreateSession(ctx, "x", "late", Session{}); !errors.Is(err, ErrRecordChanged) {
				t.Fatalf("a session written over another shard's: %v, want ErrRecordChanged", err)
			}
			if err := r.m.DeleteSession(ctx, "x", "mine"); !errors.Is(err, ErrNotFound) {
				t.Errorf("deleting a session the other shard's write removed: %v, want ErrNotFound", err)
			}
			if data, _, err := st.Read(ctx, sessionsKey("x"), 1<<20); err != nil || string(data) != theirs {
				t.Fatalf("the store's sessions after the refusals: %q %v, want the other shard's", data, err)
			}
			if s, err := r.m.Session(ctx, "x", "theirs"); err != nil || s.Dir != "/tmp" {
				t.Fatalf("the other shard's session: %+v %v", s, err)
			}
			if err := r.m.CreateSession(ctx, "x", "after", Session{Env: map[string]string{"A": "1"}}); err != nil {
				t.Fatalf("a session written over what was read again: %v", err)
			}
			if err := r.m.DeleteSession(ctx, "x", "theirs"); err != nil {
				t.Fatal(err)
			}
			if err := r.m.DeleteSession(ctx, "x", "after"); err != nil {
				t.Fatal(err)
			}
			if _, _, err := st.Read(ctx, sessionsKey("x"), 1<<20); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("no sessions left, yet their object: %v", err)
			}
		})
	}
}
