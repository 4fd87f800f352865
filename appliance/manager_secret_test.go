package appliance

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/transforms"
)

// maskedSecret is a credential the test itself never holds in the clear
// for longer than a call: what a heap dump finds is the service's.
type maskedSecret struct{ masked, pad []byte }

func newMaskedSecret() *maskedSecret {
	raw := make([]byte, 16)
	rand.Read(raw)
	m := &maskedSecret{masked: make([]byte, 16), pad: make([]byte, 16)}
	rand.Read(m.pad)
	for i := range raw {
		m.masked[i] = raw[i] ^ m.pad[i]
		raw[i] = 0
	}
	return m
}

// reveal returns the secret, freshly made: "sk-heap-canary-" and 32 hex
// digits.
func (m *maskedSecret) reveal() []byte {
	raw := make([]byte, 16)
	for i := range raw {
		raw[i] = m.masked[i] ^ m.pad[i]
	}
	out := append([]byte("sk-heap-canary-"), hex.EncodeToString(raw)...)
	clear(raw)
	return out
}

// rules are the credential rules of the test's egress rig with the masked
// secret as X-Api-Key.
func (m *maskedSecret) rules(t *testing.T) []transforms.Rule {
	t.Helper()
	rules, err := transforms.ParseRules([]byte(`[{"match":{"host":"api.example.com"},"transform":{"headers":{"X-Api-Key":{"env":"TEST_KEY","placeholder":"sandgate-placeholder-key"}}}}]`),
		func(string) (string, bool) { return string(m.reveal()), true })
	if err != nil {
		t.Fatal(err)
	}
	return rules
}

// holdsSecret is the manager's own view: does a sandbox it knows, or the
// stopped one given, hold a credential rule or a module?
func holdsSecret(m *Manager, stopped *Sandbox) error {
	check := func(sb *Sandbox) error {
		if n := sb.relay.Transforms().Len(); n > 0 {
			return fmt.Errorf("sandbox %s (%p) still holds %d credential rules", sb.id, sb, n)
		}
		if n := sb.relay.Transforms().Held(); n > 0 {
			return fmt.Errorf("sandbox %s (%p) still holds %d credentials its rules held", sb.id, sb, n)
		}
		if sb.relay.Modules() != nil {
			return fmt.Errorf("sandbox %s (%p) still holds its modules", sb.id, sb)
		}
		return nil
	}
	if err := check(stopped); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, b := range m.boxes {
		if sb := b.live.Load(); sb != nil && b.getState() != Running {
			if err := check(sb); err != nil {
				return err
			}
		}
	}
	return nil
}

// TestNoSecretAfterStop: a sandbox's credentials (and those its rules held
// before a rotation) leave the service's memory when it stops, by every
// path: idle suspend, SaveAll (what shutdown runs) and destroy. The manager's own objects say so, and a
// heap dump of the whole process, taken after, holds no copy.
func TestNoSecretAfterStop(t *testing.T) {
	if testing.Short() {
		t.Skip("heap dump")
	}
	secret, rotated := newMaskedSecret(), newMaskedSecret()
	discard := slog.New(slog.DiscardHandler)
	idle := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.IdleSuspend, c.Logger = 300*time.Millisecond, discard })
	busy := newManagerRig(t, newStore(t, "dir"), func(c *ManagerConfig) { c.Logger = discard })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// use creates id with the secret's rules and sends a request through
	// its base URL, so that the proxy swaps the secret in (and scrubs it
	// from the answer).
	use := func(r *mrig, id string) *Sandbox {
		t.Helper()
		sb, err := r.m.Create(ctx, id, CreateOptions{Network: NetworkSpec{Policy: ptr(r.pol), BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}},
			Rules: secret.rules(t)})
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		st, err := sb.Run(ctx, agent.Cmd{Args: []string{"/bin/sh", "-c", "curl -sS -H 'X-Api-Key: sandgate-placeholder-key' $ANTHROPIC_BASE_URL/v1/x"}, Stdout: &out, Stderr: &out})
		if err != nil || !st.Success() || out.String() != "upstream saw GET /v1/x" {
			t.Fatalf("%s: the request through its base URL: %v %v %q", id, st, err, out.String())
		}
		return sb
	}

	// Idle suspend.
	sb := use(idle, "sleepy")
	deadline := time.Now().Add(time.Minute)
	for idle.state("sleepy") != Suspended {
		if time.Now().After(deadline) {
			t.Fatalf("not suspended after a minute idle (state %q)", idle.state("sleepy"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := holdsSecret(idle.m, sb); err != nil {
		t.Errorf("after an idle suspend: %v", err)
	}

	// SaveAll, after a rotation: the secret retired is dropped too.
	sb = use(busy, "saved")
	if err := busy.m.SetRules(ctx, "saved", rotated.rules(t), false); err != nil {
		t.Fatal(err)
	}
	if res := busy.m.SaveAll(ctx); len(res.Failed) > 0 || len(res.Saved) != 1 {
		t.Fatalf("SaveAll: %+v", res)
	}
	if busy.state("saved") != Suspended {
		t.Fatalf("after SaveAll: %q", busy.state("saved"))
	}
	if err := holdsSecret(busy.m, sb); err != nil {
		t.Errorf("after SaveAll: %v", err)
	}

	// Destroy.
	sb = use(busy, "gone")
	if err := busy.m.Destroy(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	if err := holdsSecret(busy.m, sb); err != nil {
		t.Errorf("after destroy: %v", err)
	}
	sb = nil

	// The heap dump: what the upstreams saw is the test's, not the
	// service's; forgotten first.
	for _, r := range []*mrig{idle, busy} {
		r.mu.Lock()
		clear(r.seen)
		r.seen, r.kept = nil, ""
		r.mu.Unlock()
	}
	// A value the test holds on the heap: the dump must show it, or it
	// shows nothing.
	sentinel := []byte("heap-dump-sentinel-" + rand.Text())
	dump := filepath.Join(t.TempDir(), "heap")
	f, err := os.Create(dump)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		runtime.GC() // sync.Pool's victims go in the second
	}
	debug.WriteHeapDump(f.Fd())
	f.Close()
	b, err := os.ReadFile(dump)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*maskedSecret{secret, rotated} {
		want := s.reveal()
		if i := bytes.Index(b, want); i >= 0 {
			lo, hi := max(0, i-200), min(len(b), i+len(want)+200)
			t.Errorf("a heap dump of the service, its sandboxes stopped, holds a secret at offset %d of %d:\n%q", i, len(b), b[lo:hi])
		}
	}
	if !bytes.Contains(b, sentinel) {
		t.Errorf("the heap dump lacks a value the test holds: it cannot be trusted to show the secret")
	}
	runtime.KeepAlive(sentinel)
}
