package appliance

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// ModuleSource is one of a sandbox's own WebAssembly transform modules as
// given: its name, its bytes and its configuration. The manager keeps it
// with the sandbox (its bytes in the store by digest, the rest in its
// record), so the modules come back when it resumes.
type ModuleSource struct {
	Name   string `json:"name"`
	Wasm   []byte `json:"-"`
	Config []byte `json:"config,omitempty"`
}

// ModuleInfo describes a loaded module (Info.Modules): never its bytes.
type ModuleInfo struct {
	Name   string `json:"name"`
	Digest string `json:"digest"`
	Bytes  int    `json:"bytes"`
}

// moduleRef is a module in a record: its bytes are the store object
// modules/<digest>.wasm.
type moduleRef struct {
	Name   string `json:"name"`
	Digest string `json:"digest"`
	Config []byte `json:"config,omitempty"`
}

// ErrNoModules: the service runs no WebAssembly modules
// (ManagerConfig.Modules is nil).
var ErrNoModules = errors.New("this service runs no WebAssembly modules")

func moduleDigest(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func moduleKey(digest string) string {
	return "modules/" + strings.TrimPrefix(digest, "sha256:") + ".wasm"
}

// loadModules compiles srcs, in order, into a chain (nil for none); on
// failure nothing stays loaded.
func (m *Manager) loadModules(ctx context.Context, srcs []ModuleSource) (*wasm.Chain, error) {
	if len(srcs) == 0 {
		return nil, nil
	}
	if m.cfg.Modules == nil {
		return nil, ErrNoModules
	}
	var mods []*wasm.Module
	for i, src := range srcs {
		if src.Name == "" {
			closeModules(ctx, mods)
			return nil, fmt.Errorf("%w: modules[%d]: a module needs a name", ErrBadInput, i)
		}
		mod, err := m.cfg.Modules.Load(ctx, src.Name, src.Wasm, src.Config)
		if err != nil {
			closeModules(ctx, mods)
			return nil, fmt.Errorf("modules[%d] (%s): %w", i, src.Name, err)
		}
		mods = append(mods, mod)
	}
	return wasm.NewChain(mods...), nil
}

func closeModules(ctx context.Context, mods []*wasm.Module) {
	for _, mod := range mods {
		mod.Close(ctx)
	}
}

// SetModules replaces running sandbox id's own WebAssembly modules (none
// removes them): loaded and checked as `sandgate wasm check` does, run
// after the service's and before the credential swap, kept with the
// sandbox when it is suspended and loaded again when it resumes, and
// closed when it stops running. A module that does not load changes
// nothing. A service without a module runtime answers ErrNoModules.
func (m *Manager) SetModules(ctx context.Context, id string, srcs []ModuleSource) error {
	if m.cfg.Modules == nil {
		return ErrNoModules // even for none: a caller asks to learn whether it may
	}
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	sb := b.live.Load()
	if sb == nil {
		return fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
	}
	chain, err := m.loadModules(ctx, srcs)
	if err != nil {
		return err
	}
	old := sb.relay.Modules()
	sb.relay.SetModules(chain)
	if old != nil {
		old.Close(ctx)
	}
	b.modules = cloneSources(srcs)
	if err := m.journal(b); err != nil {
		m.log.Warn("recording the sandbox's modules for restart recovery failed; if the service crashes it is saved without them", "sandbox", id, "err", err)
	}
	return nil
}

func cloneSources(srcs []ModuleSource) []ModuleSource {
	if len(srcs) == 0 {
		return nil
	}
	out := make([]ModuleSource, len(srcs))
	copy(out, srcs)
	return out
}

// moduleInfos describes srcs.
func moduleInfos(srcs []ModuleSource) []ModuleInfo {
	out := []ModuleInfo{}
	for _, s := range srcs {
		out = append(out, ModuleInfo{Name: s.Name, Digest: moduleDigest(s.Wasm), Bytes: len(s.Wasm)})
	}
	return out
}

// saveModules puts the modules' bytes in the store (once per digest) and
// returns their references for a record.
func (m *Manager) saveModules(ctx context.Context, srcs []ModuleSource) ([]moduleRef, error) {
	var refs []moduleRef
	for _, s := range srcs {
		d := moduleDigest(s.Wasm)
		key := moduleKey(d)
		if _, err := m.st.Stat(ctx, key); errors.Is(err, store.ErrNotFound) {
			_, err := m.st.Put(ctx, key, bytes.NewReader(s.Wasm), store.PutOptions{IfNotExist: true})
			if err != nil && !errors.Is(err, store.ErrPreconditionFailed) {
				return nil, fmt.Errorf("%w: saving module %s: %v", ErrStore, s.Name, err)
			}
		} else if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrStore, err)
		}
		refs = append(refs, moduleRef{Name: s.Name, Digest: d, Config: s.Config})
	}
	return refs, nil
}

// fetchModules reads the modules a record names back from the store,
// checking each against its digest.
func (m *Manager) fetchModules(ctx context.Context, refs []moduleRef) ([]ModuleSource, error) {
	var out []ModuleSource
	for _, r := range refs {
		rc, err := m.st.Get(ctx, moduleKey(r.Digest))
		if err != nil {
			return nil, fmt.Errorf("%w: module %s (%s): %v", ErrStore, r.Name, r.Digest, err)
		}
		b, err := io.ReadAll(io.LimitReader(rc, 256<<20))
		rc.Close()
		if err != nil {
			return nil, fmt.Errorf("%w: module %s: %v", ErrStore, r.Name, err)
		}
		if moduleDigest(b) != r.Digest {
			return nil, fmt.Errorf("%w: module %s is not what its record names (%s)", ErrStore, r.Name, r.Digest)
		}
		out = append(out, ModuleSource{Name: r.Name, Wasm: b, Config: r.Config})
	}
	return out, nil
}
