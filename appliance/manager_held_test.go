package appliance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/transforms"
)

// keyRules are the rig's credential rules with key as X-Api-Key.
func keyRules(t *testing.T, key string) []transforms.Rule {
	t.Helper()
	rules, err := transforms.ParseRules([]byte(`[{"match":{"host":"api.example.com"},"transform":{"headers":{"X-Api-Key":{"env":"TEST_KEY","placeholder":"sandgate-placeholder-key"}}}}]`),
		func(string) (string, bool) { return key, true })
	if err != nil {
		t.Fatal(err)
	}
	return rules
}

// newKey is a credential made at run time.
func newKey(prefix string) string {
	var b [12]byte
	rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// TestRotatedKeyScrubbedForTheSandboxsLife: after the sandbox's
// transformations were replaced, with a new secret or with none, an
// upstream that kept the earlier key handed it to the sandbox in clear;
// and a suspended sandbox resumed with other rules forgot its old ones
// altogether. Every key its rules have held stays masked in the answers of
// their host, across suspend and resume, on this shard and on another
// sharing the store and the seal key; the store holds none of them, not
// even a run of one; a shard without the seal key refuses the host rather
// than hand it back unscrubbed.
func TestRotatedKeyScrubbedForTheSandboxsLife(t *testing.T) {
	st := newStore(t, "dir")
	sealKey := []byte("the shards' seal key, 32 bytes or more")
	shard := func(id string, key []byte) *mrig {
		return newManagerRig(t, st, func(c *ManagerConfig) {
			c.Shard = ShardConfig{ID: id, URL: "http://" + id + ".test"}
			c.SealKey = key
		})
	}
	a := shard("a", sealKey)
	ctx := a.ctx()
	keyA, keyB, keyC := a.canary, newKey("sk-rotated-b-"), newKey("sk-rotated-c-")
	network := NetworkSpec{Policy: ptr(a.pol), BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}}
	keptIn := func(r *mrig, id string) string {
		t.Helper()
		_, out := r.sh(id, `curl -sS -H 'X-Api-Key: sandgate-placeholder-key' "$ANTHROPIC_BASE_URL/v1/kept"`)
		return out
	}
	kept := func(r *mrig) string { t.Helper(); return keptIn(r, "rot") }
	masked := "the key I hold: " + strings.Repeat(string(transforms.PartialMask), len(keyA))

	a.create("rot", CreateOptions{Network: network, Rules: keyRules(t, keyA)})
	if got := kept(a); got != "the key I hold: sandgate-placeholder-key" {
		t.Fatalf("before any change: %q", got)
	}
	if err := a.m.SetRules(ctx, "rot", keyRules(t, keyB), false); err != nil {
		t.Fatal(err)
	}
	if got := kept(a); got != masked {
		t.Errorf("after PUT with a new key: %q, want %q", got, masked)
	}
	if err := a.m.SetRules(ctx, "rot", nil, false); err != nil {
		t.Fatal(err)
	}
	if got := kept(a); got != masked {
		t.Errorf("after PUT with []: %q, want %q", got, masked)
	}
	// The guard refuses the retired key too.
	if _, err := a.m.Exec(ctx, "rot", ExecRequest{Args: []string{"echo", keyA[1:]}}); !errors.Is(err, transforms.ErrCredential) {
		t.Errorf("exec with the retired key: %v, want the guard's refusal", err)
	}

	// Suspended, resumed with no rules: still masked.
	if err := a.m.Suspend(ctx, "rot"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.m.Resume(ctx, "rot", ResumeOptions{Network: network}); err != nil {
		t.Fatal(err)
	}
	if got := kept(a); got != masked {
		t.Errorf("after suspend and resume: %q, want %q", got, masked)
	}
	// A new key while it has a record: the record holds it sealed at
	// once, before any save (a crash now loses none).
	if err := a.m.SetRules(ctx, "rot", keyRules(t, keyC), false); err != nil {
		t.Fatal(err)
	}
	rec, err := a.m.readRecord(ctx, snapshotRecordKey("rot"))
	if err != nil || len(rec.Held) != 3 {
		t.Fatalf("the record after a new key: %v, %+v", err, rec)
	}
	for _, h := range rec.Held {
		if h.Name != "TEST_KEY" || len(h.Hosts) != 1 || h.Hosts[0] != "api.example.com" {
			t.Errorf("held in the record: %+v", h)
		}
	}
	if err := a.m.Suspend(ctx, "rot"); err != nil {
		t.Fatal(err)
	}

	// Resumed on another shard over the same store, with the same seal
	// key; its upstream holds the first key too.
	b := shard("b", sealKey)
	b.mu.Lock()
	b.kept = keyA
	b.mu.Unlock()
	if _, err := b.m.Resume(ctx, "rot", ResumeOptions{Network: network}); err != nil {
		t.Fatal(err)
	}
	if got := kept(b); got != masked {
		t.Errorf("resumed on another shard: %q, want %q", got, masked)
	}
	if err := b.m.Suspend(ctx, "rot"); err != nil {
		t.Fatal(err)
	}

	// A shard without the seal key cannot scrub them: it refuses the host.
	c := shard("c", []byte("another seal key, also 32 bytes or more"))
	c.mu.Lock()
	c.kept = keyA
	c.mu.Unlock()
	if _, err := c.m.Resume(ctx, "rot", ResumeOptions{Network: network}); err != nil {
		t.Fatal(err)
	}
	if got := kept(c); strings.Contains(got, "the key I hold") || !strings.Contains(got, "credential_sealed") {
		t.Errorf("resumed on a shard without the seal key: %q, want the host refused", got)
	}
	if !strings.Contains(c.log.String(), "could not be unsealed") {
		t.Errorf("the shard without the seal key did not say so in its log")
	}
	if err := c.m.Suspend(ctx, "rot"); err != nil {
		t.Fatal(err)
	}
	// ... and writes them back as they were: b still can.
	if _, err := b.m.Resume(ctx, "rot", ResumeOptions{Network: network}); err != nil {
		t.Fatal(err)
	}
	if got := kept(b); got != masked {
		t.Errorf("back on a shard with the key: %q, want %q", got, masked)
	}
	// A fork holds what its source held: running, and suspended.
	if _, err := b.m.Fork(ctx, "rot", "rot-fork", ForkOptions{Network: &network}); err != nil {
		t.Fatal(err)
	}
	if got := keptIn(b, "rot-fork"); got != masked {
		t.Errorf("a fork of the running sandbox: %q, want %q", got, masked)
	}
	if err := b.m.Suspend(ctx, "rot-fork"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.m.Fork(ctx, "rot-fork", "rot-fork2", ForkOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.m.Resume(ctx, "rot-fork2", ResumeOptions{Network: network}); err != nil {
		t.Fatal(err)
	}
	if got := keptIn(b, "rot-fork2"); got != masked {
		t.Errorf("a fork of the suspended fork: %q, want %q", got, masked)
	}

	// No store object and no log holds a key, or a run of one.
	for _, key := range []string{keyA, keyB, keyC} {
		for i := 0; i+transforms.MinPartialRun <= len(key); i += 3 {
			if a.storeHolds(key[i : i+transforms.MinPartialRun]) {
				t.Errorf("the store holds bytes %d.. of a key", i)
			}
			for _, r := range []*mrig{a, b, c} {
				if strings.Contains(r.log.String(), key[i:i+transforms.MinPartialRun]) {
					t.Errorf("a manager's log holds bytes %d.. of a key", i)
				}
			}
		}
	}
	for _, id := range []string{"rot", "rot-fork", "rot-fork2"} {
		if err := b.m.Destroy(context.WithoutCancel(ctx), id); err != nil {
			t.Fatal(err)
		}
	}
}

// A sandbox holds at most transforms.MaxHeldSecrets credentials over its
// life: a change of rules past that is refused, leaving its rules as they
// were, and so is a resume with a new one; a resume with the credentials it
// holds already is not.
func TestHeldCredentialsBounded(t *testing.T) {
	r := newManagerRig(t, newStore(t, "dir"), nil)
	ctx := r.ctx()
	network := NetworkSpec{Policy: ptr(r.pol), BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}}
	keys := make([]string, transforms.MaxHeldSecrets+1)
	for i := range keys {
		keys[i] = newKey("sk-bounded-")
	}
	r.create("many", CreateOptions{Network: network, Rules: keyRules(t, keys[0])})
	for i := 1; i < transforms.MaxHeldSecrets; i++ {
		if err := r.m.SetRules(ctx, "many", keyRules(t, keys[i]), false); err != nil {
			t.Fatalf("rotation %d: %v", i, err)
		}
	}
	last := keys[transforms.MaxHeldSecrets-1]
	err := r.m.SetRules(ctx, "many", keyRules(t, keys[transforms.MaxHeldSecrets]), false)
	if !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), "256 is the most") {
		t.Fatalf("a credential past the bound: %v, want ErrBadInput", err)
	}
	if _, out := r.sh("many", `curl -sS -H 'X-Api-Key: sandgate-placeholder-key' "$ANTHROPIC_BASE_URL/v1/x"`); out != "upstream saw GET /v1/x" {
		t.Fatalf("after the refused change: %q", out)
	}
	if seen := r.seenByUpstream(); !strings.HasSuffix(seen[len(seen)-1], "key="+last) {
		t.Errorf("after the refused change the upstream got %q, want the credential it held", seen[len(seen)-1])
	}
	if err := r.m.Suspend(ctx, "many"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.m.Resume(ctx, "many", ResumeOptions{Network: network, Rules: keyRules(t, keys[transforms.MaxHeldSecrets])}); !errors.Is(err, ErrBadInput) {
		t.Fatalf("a resume with a credential past the bound: %v, want ErrBadInput", err)
	}
	if _, err := r.m.Resume(ctx, "many", ResumeOptions{Network: network, Rules: keyRules(t, last)}); err != nil {
		t.Fatalf("a resume with a credential it holds: %v", err)
	}
}
