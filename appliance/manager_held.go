package appliance

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms"
)

// Held credentials. A sandbox's rules may change (SetRules, or other rules
// at a resume), and an upstream may hand back a key it was sent before the
// change: every secret a sandbox's rules have held goes on being scrubbed
// from the answers of the hosts its rules targeted, for the sandbox's whole
// life (transforms: held secrets). The running sandbox's RuleSet holds them;
// its record (and its journal entry, for a restart of this service) keeps
// them sealed under the service's seal key (ManagerConfig.SealKey), so that
// the RuleSet it resumes with, here or on another shard, holds them again.
// The box keeps the sealed list of what its RuleSet holds (b.held), written
// with every save; a change of rules that makes the sandbox hold another
// secret is written to its record first (if it has one), so a crash that
// follows loses none. Destroy ends it, with the record.

// SealKeyFile is the file in the work directory that keeps the seal key a
// manager makes when ManagerConfig.SealKey is empty.
const SealKeyFile = "seal.key"

// openSealKey is the seal key of cfg: its SealKey, or else one kept in the
// work directory (made if absent), or, without a work directory, one made
// in memory.
func openSealKey(cfg ManagerConfig, work string) (*transforms.SealKey, error) {
	if len(cfg.SealKey) > 0 {
		return transforms.NewSealKey(cfg.SealKey)
	}
	material := make([]byte, 32)
	rand.Read(material)
	if cfg.WorkDir == "" {
		return transforms.NewSealKey(material)
	}
	path := filepath.Join(work, SealKeyFile)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	switch {
	case err == nil:
		_, werr := f.Write(material)
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			os.Remove(path)
			return nil, fmt.Errorf("appliance: writing the seal key %s: %w", path, werr)
		}
	case errors.Is(err, fs.ErrExist):
		if material, err = os.ReadFile(path); err != nil {
			return nil, fmt.Errorf("appliance: reading the seal key: %w", err)
		}
	default:
		return nil, fmt.Errorf("appliance: making the seal key: %w", err)
	}
	k, err := transforms.NewSealKey(material)
	if err != nil {
		return nil, fmt.Errorf("appliance: the seal key %s: %w; remove it to make another (the credentials it sealed can then no longer be scrubbed here)", path, err)
	}
	return k, nil
}

// unsealHeld gives rs, the rules sandbox id starts with, the secrets its
// rules held before (sealed for id), and returns what the box keeps: all
// it holds now, sealed. Secrets this service cannot unseal are logged: rs
// refuses their hosts. Rules that would make it hold more than
// transforms.MaxHeldSecrets are refused (ErrBadInput).
func (m *Manager) unsealHeld(id string, rs *transforms.RuleSet, sealed []transforms.SealedSecret) ([]transforms.SealedSecret, error) {
	if err := rs.Unseal(m.seal, id, sealed); err != nil {
		m.log.Error(fmt.Sprintf("sandbox %s: %v", id, err), "sandbox", id)
	}
	if n := rs.Held(); n > transforms.MaxHeldSecrets {
		return nil, tooManyHeld(id, n)
	}
	return rs.Seal(m.seal, id), nil
}

// checkHeld refuses (as unsealHeld would) to start sandbox id with rules
// over sealed when it would hold too many credentials: for a fork, before
// the sandbox CLI copies anything.
func (m *Manager) checkHeld(id string, rules []transforms.Rule, sealed []transforms.SealedSecret) error {
	rs := transforms.NewRuleSet(rules...)
	defer rs.Forget()
	rs.Unseal(m.seal, id, sealed) // what does not open still counts
	if n := rs.Held(); n > transforms.MaxHeldSecrets {
		return tooManyHeld(id, n)
	}
	return nil
}

// tooManyHeld refuses rules that would make sandbox id hold n credentials.
func tooManyHeld(id string, n int) error {
	return fmt.Errorf("%w: sandbox %q would have held %d credentials, and each stays scrubbed for its life: %d is the most; give it rules with the credentials it holds already, or destroy it and start another", ErrBadInput, id, n, transforms.MaxHeldSecrets)
}

// resealHeld returns the secrets sandbox src's rules held, sealed for dst
// (a fork of src holds what src held). Those this service cannot unseal
// stay as they are: dst cannot unseal them either, and refuses their
// hosts.
func (m *Manager) resealHeld(src, dst string, sealed []transforms.SealedSecret) []transforms.SealedSecret {
	if len(sealed) == 0 {
		return nil
	}
	rs := transforms.NewRuleSet()
	rs.Unseal(m.seal, src, sealed) // what it cannot open is written back as read
	return rs.Seal(m.seal, dst)
}

// heldChanged reports whether b holds a secret, or a host of one, that a
// does not.
func heldChanged(a, b []transforms.SealedSecret) bool {
	return !slices.EqualFunc(a, b, func(x, y transforms.SealedSecret) bool {
		return x.Name == y.Name && x.Key == y.Key && slices.Equal(x.Hosts, y.Hosts)
	})
}

// writeHeld writes held, what sandbox b's rules are about to hold, to its
// journal entry and, if it has one, its record (conditional on the
// generation this service last read or wrote: a sandbox another shard runs
// now is not written, and the change is refused).
func (m *Manager) writeHeld(ctx context.Context, b *box, held []transforms.SealedSecret) error {
	prev := b.held
	b.held = held
	if err := m.journal(b); err != nil {
		m.log.Warn("recording the sandbox's held credentials for restart recovery failed", "sandbox", b.id, "err", err)
	}
	if b.recGen == 0 {
		return nil
	}
	rec, err := m.readRecord(ctx, snapshotRecordKey(b.id))
	switch {
	case errors.Is(err, store.ErrNotFound):
		err = fmt.Errorf("%w: %w (%s)", ErrStore, ErrRecordChanged, snapshotRecordKey(b.id))
	case err == nil && rec.gen != b.recGen:
		err = fmt.Errorf("%w: %w (%s)", ErrStore, ErrRecordChanged, snapshotRecordKey(b.id))
	case err == nil:
		rec.Held = held
		err = m.writeRecordIf(ctx, snapshotRecordKey(b.id), rec, b.recGen)
	}
	if err != nil {
		b.held = prev
		if jerr := m.journal(b); jerr != nil {
			m.log.Warn("recording the sandbox's held credentials for restart recovery failed", "sandbox", b.id, "err", jerr)
		}
		return fmt.Errorf("sandbox %s: keeping its credentials scrubbed after the change needs its record: %w (its rules are unchanged)", b.id, err)
	}
	b.recGen = rec.gen
	return nil
}
