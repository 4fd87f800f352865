package appliance

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// ModuleSource is one of a sandbox's own WebAssembly transform modules as
// given: its name, its bytes and its configuration. The manager keeps it
// in the store (its bytes by digest, the rest in the sandbox's record), so
// the modules come back when it resumes; a running sandbox holds only their
// compiled form, not their bytes.
type ModuleSource struct {
	Name   string `json:"name"`
	Wasm   []byte `json:"-"`
	Config []byte `json:"config,omitempty"`
	// Open, when Wasm is nil, opens the module's bytes (a file an upload
	// was spooled to): read once to load it, and once more to store it.
	Open func() (io.ReadCloser, error) `json:"-"`
}

func (s ModuleSource) open() (io.ReadCloser, error) {
	if s.Open != nil {
		return s.Open()
	}
	return io.NopCloser(bytes.NewReader(s.Wasm)), nil
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

func moduleKey(digest string) string {
	return "modules/" + strings.TrimPrefix(digest, "sha256:") + ".wasm"
}

// heldModule is one of a sandbox's modules as the manager keeps it: its
// reference (its bytes are in the store by digest) and its size.
type heldModule struct {
	ref   moduleRef
	bytes int
}

// loadModules compiles a sandbox's modules, in order, from the store, into
// a chain (nil for none); on failure nothing stays loaded.
func (m *Manager) loadModules(ctx context.Context, held []heldModule) (*wasm.Chain, error) {
	if len(held) == 0 {
		return nil, nil
	}
	if m.cfg.Modules == nil {
		return nil, ErrNoModules
	}
	var mods []*wasm.Module
	for i, h := range held {
		mod, err := m.loadStored(ctx, h.ref)
		if err != nil {
			closeModules(ctx, mods)
			return nil, fmt.Errorf("modules[%d] (%s): %w", i, h.ref.Name, err)
		}
		mods = append(mods, mod)
	}
	return wasm.NewChain(mods...), nil
}

// loadStored loads module r from the store, checking it against its
// digest.
func (m *Manager) loadStored(ctx context.Context, r moduleRef) (*wasm.Module, error) {
	rc, err := m.st.Get(ctx, moduleKey(r.Digest))
	if err != nil {
		return nil, fmt.Errorf("%w: module %s (%s): %v", ErrStore, r.Name, r.Digest, err)
	}
	defer rc.Close()
	mod, err := m.cfg.Modules.LoadReader(ctx, r.Name, rc, r.Config)
	if err != nil {
		return nil, err
	}
	if mod.Digest() != r.Digest {
		mod.Close(ctx)
		return nil, fmt.Errorf("%w: module %s is not what its record names (%s)", ErrStore, r.Name, r.Digest)
	}
	return mod, nil
}

// loadSources compiles srcs, in order, into a chain, and puts their bytes
// in the store (once per digest); on failure nothing stays loaded.
func (m *Manager) loadSources(ctx context.Context, srcs []ModuleSource) (*wasm.Chain, []heldModule, error) {
	if len(srcs) == 0 {
		return nil, nil, nil
	}
	var mods []*wasm.Module
	var held []heldModule
	fail := func(err error) (*wasm.Chain, []heldModule, error) {
		closeModules(ctx, mods)
		return nil, nil, err
	}
	for i, src := range srcs {
		if src.Name == "" {
			return fail(fmt.Errorf("%w: modules[%d]: a module needs a name", ErrBadInput, i))
		}
		rc, err := src.open()
		if err != nil {
			return fail(fmt.Errorf("modules[%d] (%s): %w", i, src.Name, err))
		}
		mod, err := m.cfg.Modules.LoadReader(ctx, src.Name, rc, src.Config)
		rc.Close()
		if err != nil {
			return fail(fmt.Errorf("modules[%d] (%s): %w", i, src.Name, err))
		}
		mods = append(mods, mod)
		if err := m.storeModule(ctx, src, mod.Digest()); err != nil {
			return fail(err)
		}
		held = append(held, heldModule{ref: moduleRef{Name: src.Name, Digest: mod.Digest(), Config: slices.Clone(src.Config)}, bytes: mod.Size()})
	}
	return wasm.NewChain(mods...), held, nil
}

// storeSources puts srcs' bytes in the store (once per digest), for a
// sandbox about to start with them.
func (m *Manager) storeSources(ctx context.Context, srcs []ModuleSource) ([]heldModule, error) {
	var held []heldModule
	for i, src := range srcs {
		if src.Name == "" {
			return nil, fmt.Errorf("%w: modules[%d]: a module needs a name", ErrBadInput, i)
		}
		rc, err := src.open()
		if err != nil {
			return nil, fmt.Errorf("modules[%d] (%s): %w", i, src.Name, err)
		}
		h := sha256.New() // the digest wasm.Module.Digest gives
		n, err := io.Copy(h, rc)
		rc.Close()
		if err != nil {
			return nil, fmt.Errorf("modules[%d] (%s): %w", i, src.Name, err)
		}
		d := "sha256:" + hex.EncodeToString(h.Sum(nil))
		if err := m.storeModule(ctx, src, d); err != nil {
			return nil, err
		}
		held = append(held, heldModule{ref: moduleRef{Name: src.Name, Digest: d, Config: slices.Clone(src.Config)}, bytes: int(n)})
	}
	return held, nil
}

// storeModule puts src's bytes in the store under digest d, unless they
// are there.
func (m *Manager) storeModule(ctx context.Context, src ModuleSource, d string) error {
	key := moduleKey(d)
	if _, err := m.st.Stat(ctx, key); err == nil {
		return nil
	} else if !errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("%w: %v", ErrStore, err)
	}
	rc, err := src.open()
	if err != nil {
		return fmt.Errorf("module %s: %w", src.Name, err)
	}
	defer rc.Close()
	if _, err := m.st.Put(ctx, key, rc, store.PutOptions{IfNotExist: true}); err != nil && !errors.Is(err, store.ErrPreconditionFailed) {
		return fmt.Errorf("%w: saving module %s: %v", ErrStore, src.Name, err)
	}
	return nil
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
// nothing. A service without a module runtime answers ErrNoModules. The
// runtime loads a bounded number of modules at once (wasm.Config
// MaxConcurrentLoads, MaxLoadQueue: past it wasm.ErrLoadBusy) and
// refuses one over its size cap (wasm.ErrModuleTooLarge).
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
	chain, held, err := m.loadSources(ctx, srcs)
	if err != nil {
		return err
	}
	old := sb.relay.Modules()
	sb.relay.SetModules(chain)
	if old != nil {
		old.Close(ctx)
	}
	b.modules = held
	if err := m.journal(b); err != nil {
		m.log.Warn("recording the sandbox's modules for restart recovery failed; if the service crashes it is saved without them", "sandbox", id, "err", err)
	}
	return nil
}

// moduleInfos describes held.
func moduleInfos(held []heldModule) []ModuleInfo {
	out := []ModuleInfo{}
	for _, h := range held {
		out = append(out, ModuleInfo{Name: h.ref.Name, Digest: h.ref.Digest, Bytes: h.bytes})
	}
	return out
}

// saveModules returns the references of a sandbox's modules for its
// record: their bytes went to the store when they were given.
func (m *Manager) saveModules(_ context.Context, held []heldModule) ([]moduleRef, error) {
	var refs []moduleRef
	for _, h := range held {
		refs = append(refs, h.ref)
	}
	return refs, nil
}

// fetchModules finds the modules a record names in the store (their sizes;
// their bytes are read, and checked against their digests, when they are
// loaded).
func (m *Manager) fetchModules(ctx context.Context, refs []moduleRef) ([]heldModule, error) {
	var out []heldModule
	for _, r := range refs {
		in, err := m.st.Stat(ctx, moduleKey(r.Digest))
		if err != nil {
			return nil, fmt.Errorf("%w: module %s (%s): %v", ErrStore, r.Name, r.Digest, err)
		}
		out = append(out, heldModule{ref: r, bytes: int(in.Size)})
	}
	return out, nil
}
