package appliance

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
)

// CheckTemplateName reports whether name can name a template (the rule of
// sandbox ids).
func CheckTemplateName(name string) error { return sandboxcli.CheckTemplateName(name) }

// SaveTemplate saves running sandbox id's files as template name in this
// service's namespace, replacing a template of that name; the sandbox
// keeps running. A template is a full layer (a sandbox made from another
// template is folded onto it) with a file index, so sandboxes made from
// it save only what differs.
func (m *Manager) SaveTemplate(ctx context.Context, id, name string) (err error) {
	start := time.Now()
	var size int64
	defer func() {
		m.done("template", id, start, err, func() []any { return []any{"template", name, "bytes", size} })
	}()
	if err := CheckTemplateName(name); err != nil {
		return err
	}
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	if b.live.Load() == nil {
		return fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
	}
	layer, err := m.exportLayer(ctx, id)
	if err != nil {
		return err
	}
	if b.base != nil && m.l.Templates() {
		// The sandbox's layer is a delta onto its template: fold it.
		if layer, err = m.foldOnto(ctx, b.base, layer); err != nil {
			return err
		}
	}
	key := "templates/" + m.ns + "/" + name + "/" + generation() + ".tar.zst"
	man, err := m.saveLayer(ctx, layer, key, id, nil, true)
	if err != nil {
		return err
	}
	size = man.Size
	now := time.Now().UTC()
	rec := &record{Layer: key, Digest: man.Digest, Size: man.Size, Template: name, Created: now, Saved: now}
	unlock := m.nameLock("template/" + name)
	defer unlock()
	old, err := m.readRecord(ctx, m.templateRecordKey(name))
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return err
	}
	if err := m.writeRecord(ctx, m.templateRecordKey(name), rec); err != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return err
	}
	if old != nil {
		m.dropTemplateLayer(ctx, old)
	}
	return nil
}

// foldOnto streams the delta layer folded onto base: one full layer. Its
// Close reports how the delta's source and the fold ended.
func (m *Manager) foldOnto(ctx context.Context, base *record, delta io.ReadCloser) (io.ReadCloser, error) {
	bl, err := snapshot.Load(ctx, m.st, base.Layer)
	if err != nil {
		delta.Close()
		return nil, fmt.Errorf("%w: the template layer: %v", ErrStore, err)
	}
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		_, err := snapshot.MergeLayers(ctx, bl, delta, pw, snapshot.MergeOptions{Compression: snapshot.None, TempDir: m.work})
		bl.Close()
		if cerr := delta.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			err = fmt.Errorf("folding the sandbox's layer onto its template: %w", err)
		}
		pw.CloseWithError(err)
		done <- err
	}()
	return &foldedLayer{PipeReader: pr, done: done}, nil
}

// foldedLayer is foldOnto's stream; Close waits for the fold.
type foldedLayer struct {
	*io.PipeReader
	done chan error
}

func (f *foldedLayer) Close() error {
	f.PipeReader.Close()
	return <-f.done
}

// TemplateExists reports whether template name is in this service's
// namespace.
func (m *Manager) TemplateExists(ctx context.Context, name string) (bool, error) {
	if err := CheckTemplateName(name); err != nil {
		return false, err
	}
	_, err := m.readRecord(ctx, m.templateRecordKey(name))
	if errors.Is(err, store.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

// templateRecord reads template name's record; a missing one is
// ErrNoTemplate.
func (m *Manager) templateRecord(ctx context.Context, name string) (*record, error) {
	if err := CheckTemplateName(name); err != nil {
		return nil, err
	}
	rec, err := m.readRecord(ctx, m.templateRecordKey(name))
	if errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("%w: %q (namespace %s)", ErrNoTemplate, name, m.ns)
	}
	return rec, err
}

// DeleteTemplate removes template name; a missing one is no error. Its
// layer stays while a suspended sandbox made from it needs it.
func (m *Manager) DeleteTemplate(ctx context.Context, name string) error {
	if err := CheckTemplateName(name); err != nil {
		return err
	}
	unlock := m.nameLock("template/" + name)
	defer unlock()
	rec, err := m.readRecord(ctx, m.templateRecordKey(name))
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := m.st.Delete(ctx, m.templateRecordKey(name)); err != nil && !errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("%w: %v", ErrStore, err)
	}
	m.dropTemplateLayer(ctx, rec)
	return nil
}

// dropTemplateLayer removes a template layer that no record names any
// more: not a snapshot (a delta onto it) and not a running sandbox made
// from it. One still named stays; Recover removes it once it is not.
func (m *Manager) dropTemplateLayer(ctx context.Context, rec *record) {
	if m.templateLayerInUse(ctx, rec.Layer) {
		return
	}
	m.deleteLayer(ctx, rec.Layer)
	name := localTemplateName(rec.Digest)
	if m.l.Templates() {
		if err := m.l.RemoveTemplate(ctx, name); err == nil || errors.Is(err, ErrNotFound) {
			m.setImported(name, false)
		}
	}
}

// templateLayerInUse reports whether a snapshot record or a running
// sandbox names the template layer key (an unreadable store counts as in
// use: nothing is removed on a doubt).
func (m *Manager) templateLayerInUse(ctx context.Context, key string) bool {
	m.mu.Lock()
	held := m.baseRefs[key] > 0
	m.mu.Unlock()
	if held {
		return true
	}
	recs, err := m.snapshotRecords(ctx)
	if err != nil {
		return true
	}
	for _, r := range recs {
		if r.Base == key {
			return true
		}
	}
	return false
}

// TemplateInfo describes a template of this service's namespace.
type TemplateInfo struct {
	Name       string
	Created    time.Time // when it was saved
	LayerBytes int64     // its layer, compressed
}

// ListTemplates lists the templates of this service's namespace, by name.
func (m *Manager) ListTemplates(ctx context.Context) ([]TemplateInfo, error) {
	prefix := "templates/" + m.ns + "/"
	infos, err := m.st.List(ctx, prefix)
	if err != nil {
		return nil, fmt.Errorf("%w: listing templates: %v", ErrStore, err)
	}
	var out []TemplateInfo
	for _, in := range infos {
		name, ok := strings.CutSuffix(strings.TrimPrefix(in.Name, prefix), ".json")
		if !ok || strings.Contains(name, "/") || CheckTemplateName(name) != nil {
			continue
		}
		rec, err := m.readRecord(ctx, in.Name)
		if errors.Is(err, store.ErrNotFound) { // deleted meanwhile
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, TemplateInfo{Name: name, Created: rec.Saved, LayerBytes: rec.Size})
	}
	slices.SortFunc(out, func(a, b TemplateInfo) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}
