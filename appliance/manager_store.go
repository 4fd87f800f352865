package appliance

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms"
)

// The store, as the manager lays it out:
//
//	snapshots/<id>.json                      the record of suspended sandbox <id> (or,
//	                                         spent, the last good state of a running one)
//	snapshots/<id>/<generation>.tar.zst      its layer (+ .manifest.json beside it)
//	templates/<ns>/<name>.json               the record of template <name>
//	templates/<ns>/<name>/<generation>.tar.zst  its layer (+ manifest, with a file index)
//
// A layer is written under a new generation and its record replaced only
// once the layer and its manifest are complete: a save cut short leaves the
// previous record, and the layer it names, as they were (the stray
// generation is removed by the next Recover). A record names its layer's
// digest, which Load checks the layer against; a layer saved as a delta
// onto a template names that template's layer (Base), which is kept as
// long as a record names it, whatever happens to the template's own
// record.

func snapshotRecordKey(id string) string { return "snapshots/" + id + ".json" }

// legacyKey is where the reference service of protocol 1
// (ai-sdk-sandbox-cloud-run) keeps a suspended sandbox in the same bucket:
// a gzipped tar of its writable layer, as the sandbox CLI's tar writes it.
// sandgate adopts such a sandbox: it is suspended, resumes from that
// layer, is saved in sandgate's own format at its next save (the old
// object removed once the new one is written), and destroy removes it.
func legacyKey(id string) string { return "snapshots/" + id + ".tar.gz" }

func (m *Manager) templateRecordKey(name string) string {
	return "templates/" + m.ns + "/" + name + ".json"
}

// TemplateNamespace is the namespace of a service's templates: a digest of
// sandgate's version and the image id, so that a template made on another
// image (or by another version) is never used.
func TemplateNamespace(version, imageID string) string {
	sum := sha256.Sum256([]byte("sandgate-template-namespace\x00" + version + "\x00" + imageID))
	return hex.EncodeToString(sum[:8])
}

// generation names a new layer object: sortable by time, unique.
func generation() string {
	var rnd [4]byte
	rand.Read(rnd[:])
	return time.Now().UTC().Format("20060102T150405.000000000Z") + "-" + hex.EncodeToString(rnd[:])
}

// record is what the store keeps of a suspended sandbox or a template.
type record struct {
	Layer  string `json:"layer"`  // key of the layer object
	Digest string `json:"digest"` // its sha256, as its manifest records
	Size   int64  `json:"size"`   // its bytes
	// Base and BaseDigest name the template layer this layer is a delta
	// onto; empty for a full layer.
	Base       string    `json:"base,omitempty"`
	BaseDigest string    `json:"baseDigest,omitempty"`
	Template   string    `json:"template,omitempty"` // the template's name, for people
	Created    time.Time `json:"created"`            // the sandbox's creation (templates: the save)
	Saved      time.Time `json:"saved"`
	// Spent marks a snapshot the sandbox was resumed from: it runs now,
	// and this is its last good state, kept until its next save replaces
	// it, so that a service (or an instance) that dies without saving
	// loses only what changed since.
	Spent bool `json:"spent,omitempty"`
	// Modules are the sandbox's own WebAssembly modules, loaded again
	// when it resumes.
	Modules []moduleRef `json:"modules,omitempty"`
	// Limits are the sandbox's own limits (CreateOptions.Limits), applied
	// again, over the service's defaults, when it resumes.
	Limits Limits `json:"limits,omitzero"`
	// Held are the credentials the sandbox's rules hold and have held,
	// sealed (see manager_held.go): scrubbed again when it resumes.
	Held []transforms.SealedSecret `json:"held,omitempty"`

	// legacy: not a record in the store but the reference service's
	// object at legacyKey (Layer), which has no digest to check.
	legacy bool
	// gen is the generation of the record as read or written.
	gen int64

	// Network is where the sandbox may go, as its caller last said it
	// (never a credential: the credential rules stay in memory), so that
	// it wakes with it; nil when none was recorded (a record of an older
	// sandgate, or the reference service's object).
	Network *savedNetwork `json:"network,omitempty"`
	// Reason says who suspended it: its caller (it stays suspended until
	// resumed), or the service on its own (it wakes on its next call);
	// "" when not known (an older record: its caller's). A spent record's
	// sandbox was running when its shard stopped, which is the service's
	// doing too.
	Reason SuspendReason `json:"reason,omitempty"`
}

// SuspendReason is who suspended a sandbox, and so whether its next call
// wakes it (Manager.Wake).
type SuspendReason string

// Why a sandbox is suspended.
const (
	// SuspendedByCaller: a call asked for it (protocol 1's suspend,
	// `sandgate suspend`); it stays suspended until resumed.
	SuspendedByCaller SuspendReason = "caller"
	// SuspendedIdle: idle for ManagerConfig.IdleSuspend.
	SuspendedIdle SuspendReason = "idle"
	// SuspendedShutdown: the service stopped (SIGTERM) and saved it.
	SuspendedShutdown SuspendReason = "shutdown"
	// SuspendedRecovery: a service that restarted found it left running
	// by its crashed predecessor, and saved it.
	SuspendedRecovery SuspendReason = "recovery"
	// SuspendedShardLost: it was running on a shard that stopped without
	// saving it (it crashed, or lost the store): it is at its last
	// checkpoint or resume. Said of a spent record, never stored.
	SuspendedShardLost SuspendReason = "shard-lost"
)

// Wakes says whether a sandbox suspended for this reason is resumed by
// the next call that needs it running: the service suspended it on its
// own. One its caller suspended, or suspended for a reason not known,
// stays suspended until resumed.
func (r SuspendReason) Wakes() bool {
	switch r {
	case SuspendedIdle, SuspendedShutdown, SuspendedRecovery, SuspendedShardLost:
		return true
	}
	return false
}

// reason is why the record's sandbox is suspended.
func (r *record) reason() SuspendReason {
	if r.Spent {
		return SuspendedShardLost
	}
	return r.Reason
}

// savedNetwork is a NetworkSpec as a record keeps it: what the caller said
// (the service's own hosts and base URLs are added anew when it applies).
type savedNetwork struct {
	AllowedHosts []string          `json:"allowedHosts,omitempty"`
	Policy       *netpolicy.Policy `json:"policy,omitempty"`
	BaseURLs     map[string]string `json:"baseUrls,omitempty"`
}

// saveNetwork is spec as a record keeps it.
func saveNetwork(spec NetworkSpec) *savedNetwork {
	return &savedNetwork{AllowedHosts: slices.Clone(spec.AllowedHosts), Policy: spec.Policy, BaseURLs: maps.Clone(spec.BaseURLs)}
}

// spec is the network a record kept; none kept is the zero spec (the
// service's hosts and base URLs alone).
func (n *savedNetwork) spec() NetworkSpec {
	if n == nil {
		return NetworkSpec{}
	}
	return NetworkSpec{AllowedHosts: slices.Clone(n.AllowedHosts), Policy: n.Policy, BaseURLs: maps.Clone(n.BaseURLs)}
}

// baseRecord is the template layer a snapshot is a delta onto, or nil.
func (r *record) baseRecord() *record {
	if r.Base == "" {
		return nil
	}
	return &record{Layer: r.Base, Digest: r.BaseDigest, Template: r.Template}
}

func (r *record) info(id string) Info {
	inf := Info{ID: id, State: Suspended, Created: r.Created, LayerBytes: r.Size, Template: r.Template, SuspendedBy: r.reason()}
	for _, mr := range r.Modules {
		inf.Modules = append(inf.Modules, ModuleInfo{Name: mr.Name, Digest: mr.Digest})
	}
	return inf
}

// suspended is the snapshot of sandbox id: its record, or else the
// reference service's object for it (a legacy record); neither is
// store.ErrNotFound.
func (m *Manager) suspended(ctx context.Context, id string) (*record, error) {
	rec, err := m.readRecord(ctx, snapshotRecordKey(id))
	if !errors.Is(err, store.ErrNotFound) {
		return rec, err
	}
	in, serr := m.st.Stat(ctx, legacyKey(id))
	if errors.Is(serr, store.ErrNotFound) {
		return nil, err
	}
	if serr != nil {
		return nil, fmt.Errorf("%w: reading %s: %v", ErrStore, legacyKey(id), serr)
	}
	return &record{Layer: legacyKey(id), Size: in.Size, Created: in.Modified, Saved: in.Modified, legacy: true}, nil
}

// dropLegacy removes the reference service's object of sandbox id, if
// any: once a record of sandgate's own is written, or when it is destroyed.
func (m *Manager) dropLegacy(ctx context.Context, id string) error {
	if err := m.st.Delete(ctx, legacyKey(id)); err != nil && !errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("%w: removing %s: %v", ErrStore, legacyKey(id), err)
	}
	return nil
}

// fetchLegacy copies the reference service's layer of a sandbox (a
// gzipped tar, made by tar, with no digest recorded) to a temporary file:
// as it is stored, or decompressed when bare (for a CLI that imports bare
// tars only). Having no digest, it is verified by its own framing as it is
// copied: the gzip's checksum and length, and the tar read to its end. A
// damaged one is an error (snapshot.ErrDigestMismatch) that changes
// nothing: the object stays.
func (m *Manager) fetchLegacy(ctx context.Context, key string, bare bool) (string, func(), error) {
	rc, err := m.st.Get(ctx, key)
	if err != nil {
		return "", nil, fmt.Errorf("%w: reading %s: %v", ErrStore, key, err)
	}
	defer rc.Close()
	ext := snapshot.Gzip.Ext()
	if bare {
		ext = snapshot.None.Ext()
	}
	file, cleanup, err := m.tempFile("legacy-*" + ext)
	if err != nil {
		return "", nil, err
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0o600)
	if err == nil {
		err = copyLegacyLayer(f, store.AcceptUnrecorded(rc), bare)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		cleanup()
		if errors.Is(err, errLegacyFraming) {
			return "", nil, fmt.Errorf("%w: the reference service's snapshot %s is damaged (%v); it has no digest of its own, and its gzip or tar framing is broken: nothing was changed, and it stays where it is (destroy the sandbox to remove it)", snapshot.ErrDigestMismatch, key, err)
		}
		return "", nil, fmt.Errorf("%w: reading %s: %v", ErrStore, key, err)
	}
	return file, cleanup, nil
}

// errLegacyFraming marks a legacy layer whose gzip or tar framing is
// broken, as opposed to a store that failed to read it.
var errLegacyFraming = errors.New("broken framing")

// copyLegacyLayer copies a gzipped tar from src to dst, as it is or
// decompressed (bare), reading it whole as a gzip stream (its checksum and
// length checked at its end) and as a tar (every header and every entry's
// content, to its end).
func copyLegacyLayer(dst io.Writer, src io.Reader, bare bool) error {
	rd := &sourceErr{r: src} // the store's failures, told from the framing's
	var in io.Reader = rd
	if !bare {
		in = io.TeeReader(rd, dst)
	}
	zr, err := gzip.NewReader(in)
	if err != nil {
		return framingError(rd, "not a gzip stream: %v", err)
	}
	var tarIn io.Reader = zr
	if bare {
		tarIn = io.TeeReader(zr, dst)
	}
	tr := tar.NewReader(tarIn)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return framingError(rd, "its tar: %v", err)
		}
		if _, err := io.Copy(io.Discard, tr); err != nil {
			return framingError(rd, "its tar, entry %q: %v", hdr.Name, err)
		}
	}
	// What follows the tar's end, to the gzip stream's end (its checksum),
	// and anything after it: the file gets the whole object.
	if _, err := io.Copy(io.Discard, tarIn); err != nil {
		return framingError(rd, "its gzip stream: %v", err)
	}
	if _, err := io.Copy(io.Discard, in); err != nil {
		return framingError(rd, "after its gzip stream: %v", err)
	}
	return nil
}

// framingError is the store's own failure when reading src failed, else a
// broken framing (errLegacyFraming).
func framingError(src *sourceErr, format string, args ...any) error {
	if src.err != nil {
		return src.err
	}
	return fmt.Errorf("%w: %s", errLegacyFraming, fmt.Sprintf(format, args...))
}

// copyLegacy copies the reference service's object of a suspended sandbox
// to dst's, once its framing is verified: dst is then such a sandbox too.
func (m *Manager) copyLegacy(ctx context.Context, src *record, dst string) error {
	file, cleanup, err := m.fetchLegacy(ctx, src.Layer, false)
	if err != nil {
		return err
	}
	defer cleanup()
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := m.st.Put(ctx, legacyKey(dst), f, store.PutOptions{IfNotExist: true}); err != nil {
		return fmt.Errorf("%w: copying %s: %v", ErrStore, src.Layer, err)
	}
	return nil
}

// readRecord reads the record under key, with its generation; a missing
// one is store.ErrNotFound.
func (m *Manager) readRecord(ctx context.Context, key string) (*record, error) {
	b, in, err := m.st.Read(ctx, key, 1<<20)
	if errors.Is(err, store.ErrNotFound) {
		return nil, err
	}
	if err != nil {
		return nil, fmt.Errorf("%w: reading %s: %v", ErrStore, key, err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var r record
	if err := dec.Decode(&r); err != nil || r.Layer == "" || r.Digest == "" {
		return nil, fmt.Errorf("%w: %s is not a sandgate record (%v)", ErrStore, key, err)
	}
	r.gen = in.Generation
	return &r, nil
}

// writeRecord replaces the record under key, whatever it holds (a
// template's: any shard may save one).
func (m *Manager) writeRecord(ctx context.Context, key string, r *record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	in, err := m.st.Put(ctx, key, bytes.NewReader(b), store.PutOptions{})
	if err != nil {
		return fmt.Errorf("%w: writing %s: %v", ErrStore, key, err)
	}
	r.gen = in.Generation
	return nil
}

// ErrRecordChanged: a sandbox's record changed under this service since it
// last read or wrote it: another shard runs the sandbox now (it took the
// lease while this one could not renew), and this one's state of it is
// stale. The write is refused: the other's state stands.
var ErrRecordChanged = errors.New("the sandbox's record changed under this service: another shard runs it now")

// writeRecordIf writes a sandbox's record only if it is still at
// generation gen (0: only if there is none), so that a service that lost a
// sandbox to another shard (fenced) never overwrites the new owner's
// state. r's generation becomes the new one.
func (m *Manager) writeRecordIf(ctx context.Context, key string, r *record, gen int64) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	opts := store.PutOptions{IfGenerationMatch: gen, IfNotExist: gen == 0}
	in, err := m.st.Put(ctx, key, bytes.NewReader(b), opts)
	if errors.Is(err, store.ErrPreconditionFailed) {
		return fmt.Errorf("%w: %w (%s)", ErrStore, ErrRecordChanged, key)
	}
	if err != nil {
		return fmt.Errorf("%w: writing %s: %v", ErrStore, key, err)
	}
	r.gen = in.Generation
	return nil
}

// deleteRecord removes a record, if it is still the one read (its
// generation), then the layer it names. Without the record the layer is
// unreachable; if removing it fails, Recover does.
func (m *Manager) deleteRecord(ctx context.Context, key string, r *record) error {
	var err error
	if r.gen != 0 {
		err = m.st.DeleteIf(ctx, key, r.gen)
	} else {
		err = m.st.Delete(ctx, key)
	}
	switch {
	case errors.Is(err, store.ErrPreconditionFailed):
		return fmt.Errorf("%w: %w (%s)", ErrStore, ErrRecordChanged, key)
	case err != nil && !errors.Is(err, store.ErrNotFound):
		return fmt.Errorf("%w: removing %s: %v", ErrStore, key, err)
	}
	m.deleteLayer(ctx, r.Layer)
	return nil
}

// deleteLayer removes a layer object and its manifest, logging failures
// (Recover removes what is left).
func (m *Manager) deleteLayer(ctx context.Context, key string) {
	for _, k := range []string{key, snapshot.ManifestName(key)} {
		if err := m.st.Delete(ctx, k); err != nil && !errors.Is(err, store.ErrNotFound) {
			m.log.Warn("removing a layer object failed; the next start removes it", "object", k, "err", err)
		}
	}
}

// tempFile is a file in the work directory, removed by the returned func.
func (m *Manager) tempFile(pattern string) (string, func(), error) {
	f, err := os.CreateTemp(m.work, pattern)
	if err != nil {
		return "", nil, err
	}
	f.Close()
	return f.Name(), func() { os.Remove(f.Name()) }, nil
}

// exportLayer streams sandbox id's writable layer out of the sandbox CLI.
// Close it when read: it says whether the CLI finished well.
func (m *Manager) exportLayer(ctx context.Context, id string) (io.ReadCloser, error) {
	r, err := m.l.TarStream(ctx, id, m.work)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: exporting its layer: %w", id, err)
	}
	return r, nil
}

// saveLayer saves the layer tar streamed by layer (closed here) under key:
// as it is, or as a delta onto base (a template layer with a file index)
// when the tar is a full layer made from it (Google's CLI: the template was
// imported into the sandbox's layer). Nothing is saved unless the stream's
// source ended well.
func (m *Manager) saveLayer(ctx context.Context, layer io.ReadCloser, key, id string, base *record, index bool) (*snapshot.Manifest, error) {
	opts := snapshot.SaveOptions{NoClobber: true, PackOptions: snapshot.PackOptions{
		Compression: snapshot.Zstd, ImageID: m.cfg.ImageID, SandboxID: id, Index: index,
		Progress: progressOf(ctx, StepSave, func() int64 { return m.l.UpperSize(id) }),
	}}
	if base != nil {
		opts.Parent = base.Digest
		if !m.l.Templates() {
			bm, err := snapshot.ReadStoredManifest(ctx, m.st, snapshot.ManifestName(base.Layer))
			if err != nil {
				return nil, fmt.Errorf("%w: the template layer's manifest: %v", ErrStore, err)
			}
			opts.Base = bm
		}
	}
	man, err := snapshot.Save(ctx, snapshot.StreamSource(layer), m.st, key, opts)
	if cerr := layer.Close(); err == nil && cerr != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return nil, fmt.Errorf("sandbox %s: exporting its layer: %w", id, cerr)
	}
	if err != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return nil, fmt.Errorf("%w: saving %s: %v", ErrStore, key, err)
	}
	return man, nil
}

// saveSnapshot exports a running sandbox's layer, saves it under a new
// generation and points its record at it, if the record is still the one
// this service last read or wrote. The record keeps its network and why
// it is suspended.
func (m *Manager) saveSnapshot(ctx context.Context, b *box, reason SuspendReason) (*record, error) {
	refs, err := m.saveModules(ctx, b.modules)
	if err != nil {
		return nil, err
	}
	rec, err := m.saveSnapshotOf(ctx, b.id, b.created, b.template, b.base, refs, b.recGen, recordMeta{Network: saveNetwork(b.spec), Reason: reason, Limits: b.limits, Held: b.held})
	if err != nil {
		return nil, err
	}
	b.recGen = rec.gen
	return rec, nil
}

// recordMeta is what a save keeps in the record beside the layer: the
// sandbox's network and why it is suspended.
type recordMeta struct {
	Network *savedNetwork
	Reason  SuspendReason
	Limits  Limits
	Held    []transforms.SealedSecret
}

// saveSnapshotOf saves sandbox id's layer as its snapshot. Its record is
// written only if it is at generation gen (0: only if there is none).
func (m *Manager) saveSnapshotOf(ctx context.Context, id string, created time.Time, template string, base *record, modules []moduleRef, gen int64, meta recordMeta) (*record, error) {
	layer, err := m.exportLayer(ctx, id)
	if err != nil {
		return nil, err
	}
	key := "snapshots/" + id + "/" + generation() + ".tar.zst"
	man, err := m.saveLayer(ctx, layer, key, id, base, false)
	if err != nil {
		return nil, err
	}
	rec := &record{Layer: key, Digest: man.Digest, Size: man.Size, Template: template, Created: created, Saved: time.Now().UTC(), Modules: modules,
		Network: meta.Network, Reason: meta.Reason, Limits: meta.Limits, Held: meta.Held}
	if base != nil {
		rec.Base, rec.BaseDigest = base.Layer, base.Digest
	}
	old, _ := m.readRecord(ctx, snapshotRecordKey(id))
	if err := m.writeRecordIf(ctx, snapshotRecordKey(id), rec, gen); err != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return nil, err
	}
	if old != nil && old.Layer != key && old.gen == gen {
		m.deleteLayer(ctx, old.Layer)
	}
	if err := m.dropLegacy(ctx, id); err != nil {
		m.log.Warn("saved in sandgate's format, but the reference service's old object could not be removed; destroy removes it", "sandbox", id, "err", err)
	}
	return rec, nil
}

// fetchLayer copies the layer under key to a temporary file, checking it
// against digest (its manifest's, and the record's): as it is stored, or
// decompressed for a CLI that imports bare tars only (Google's).
func (m *Manager) fetchLayer(ctx context.Context, key, digest string) (string, func(), error) {
	l, err := snapshot.Load(ctx, m.st, key)
	if err != nil {
		return "", nil, fmt.Errorf("%w: %v", ErrStore, err)
	}
	defer l.Close()
	if l.Manifest.Digest != digest {
		return "", nil, fmt.Errorf("%w: %s is %s, its record says %s", snapshot.ErrDigestMismatch, key, l.Manifest.Digest, digest)
	}
	ext := filepath.Ext(key)
	if m.l.BareImports() {
		ext = snapshot.None.Ext()
	}
	file, cleanup, err := m.tempFile("fetch-*" + ext)
	if err != nil {
		return "", nil, err
	}
	var src io.Reader = l
	if report := progressOf(ctx, StepFetch, func() int64 { return l.Manifest.Size }); report != nil {
		src = &progressReader{r: l, report: report}
	}
	if err := copyLayer(file, src, m.l.BareImports()); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("%w: reading %s: %v", ErrStore, key, err)
	}
	return file, cleanup, nil
}

// copyLayer writes layer l to file, decompressed when bare. A decompressed
// layer is still read to its end, so that its digest is checked.
func copyLayer(file string, l io.Reader, bare bool) error {
	if !bare {
		return copyToFile(file, l)
	}
	dec, err := snapshot.Decompress(l)
	if err != nil {
		return err
	}
	defer dec.Close()
	if err := copyToFile(file, dec); err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, l)
	return err
}

func copyToFile(file string, r io.Reader) error {
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// mergeToFile folds a delta layer onto its template layer into one full
// layer in a temporary file: what Google's CLI imports (bare, see
// Launcher.BareImports).
func (m *Manager) mergeToFile(ctx context.Context, base *record, deltaKey, deltaDigest string) (string, func(), error) {
	bl, err := snapshot.Load(ctx, m.st, base.Layer)
	if err != nil {
		return "", nil, fmt.Errorf("%w: the template layer: %v", ErrStore, err)
	}
	defer bl.Close()
	dl, err := snapshot.Load(ctx, m.st, deltaKey)
	if err != nil {
		return "", nil, fmt.Errorf("%w: %v", ErrStore, err)
	}
	defer dl.Close()
	if bl.Manifest.Digest != base.Digest || dl.Manifest.Digest != deltaDigest {
		return "", nil, fmt.Errorf("%w: a layer does not match its record", snapshot.ErrDigestMismatch)
	}
	comp := snapshot.Zstd
	if m.l.BareImports() {
		comp = snapshot.None
	}
	file, cleanup, err := m.tempFile("merged-*" + comp.Ext())
	if err != nil {
		return "", nil, err
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		cleanup()
		return "", nil, err
	}
	_, err = snapshot.MergeLayers(ctx, bl, dl, f, snapshot.MergeOptions{Compression: comp, TempDir: m.work})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		cleanup()
		return "", nil, fmt.Errorf("merging the layer onto its template: %w", err)
	}
	return file, cleanup, nil
}

// copySnapshot copies a suspended sandbox's record and layer to dst: the
// layer's bytes (and so its digest) unchanged, under dst's own key.
func (m *Manager) copySnapshot(ctx context.Context, src *record, dst string) error {
	l, err := snapshot.Load(ctx, m.st, src.Layer)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrStore, err)
	}
	defer l.Close()
	key := "snapshots/" + dst + "/" + generation() + ".tar.zst"
	if _, err := m.st.Put(ctx, key, l, store.PutOptions{IfNotExist: true, Digest: func() string { return src.Digest }}); err != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return fmt.Errorf("%w: copying %s: %v", ErrStore, src.Layer, err)
	}
	man := *l.Manifest
	man.SandboxID = dst
	var buf bytes.Buffer
	if _, err := man.WriteTo(&buf); err != nil {
		return err
	}
	if _, err := m.st.Put(ctx, snapshot.ManifestName(key), &buf, store.PutOptions{}); err != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return fmt.Errorf("%w: %v", ErrStore, err)
	}
	rec := *src
	rec.Layer, rec.Created, rec.Saved, rec.Spent = key, time.Now().UTC(), time.Now().UTC(), false
	if err := m.writeRecordIf(ctx, snapshotRecordKey(dst), &rec, 0); err != nil {
		m.deleteLayer(context.WithoutCancel(ctx), key)
		return err
	}
	return nil
}

// suspendedIDs lists the ids with a snapshot record.
func (m *Manager) suspendedIDs(ctx context.Context) ([]string, error) {
	infos, err := m.st.List(ctx, "snapshots/")
	if err != nil {
		return nil, fmt.Errorf("%w: listing snapshots: %v", ErrStore, err)
	}
	var ids []string
	seen := map[string]bool{}
	for _, in := range infos {
		rest := strings.TrimPrefix(in.Name, "snapshots/")
		id, ok := strings.CutSuffix(rest, ".json")
		if !ok {
			id, ok = strings.CutSuffix(rest, ".tar.gz") // the reference service's
		}
		if ok && !strings.Contains(id, "/") && sandboxcli.CheckID(id) == nil && !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// snapshotRecords reads every snapshot record (for what they reference).
func (m *Manager) snapshotRecords(ctx context.Context) (map[string]*record, error) {
	ids, err := m.suspendedIDs(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]*record{}
	for _, id := range ids {
		r, err := m.readRecord(ctx, snapshotRecordKey(id)) // a legacy object is no record
		if errors.Is(err, store.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out[id] = r
	}
	return out, nil
}

// localTemplateName is the name under which `sandgate sandbox` keeps a
// template layer: from its digest, so one layer is imported once whatever
// templates name it.
func localTemplateName(digest string) string {
	h := strings.TrimPrefix(digest, "sha256:")
	return "t-" + h[:min(40, len(h))]
}

// ensureTemplate makes sure `sandgate sandbox` has the template layer
// base, importing it from the store the first time, and returns its name
// there.
func (m *Manager) ensureTemplate(ctx context.Context, base *record) (string, error) {
	name := localTemplateName(base.Digest)
	unlock := m.nameLock(name)
	defer unlock()
	if m.isImported(name) {
		return name, nil
	}
	file, cleanup, err := m.fetchLayer(ctx, base.Layer, base.Digest)
	if err != nil {
		return "", err
	}
	defer cleanup()
	if err := m.l.ImportTemplate(ctx, name, file); err != nil && !errors.Is(err, ErrExists) {
		return "", fmt.Errorf("importing the template layer: %w", err)
	}
	m.setImported(name, true)
	return name, nil
}

// nameLock serialises work on one name (a template): the first caller
// imports, the others wait for it, and other names go on.
func (m *Manager) nameLock(name string) (unlock func()) {
	m.tmu.Lock()
	l := m.tlocks[name]
	if l == nil {
		l = &nameLock{}
		m.tlocks[name] = l
	}
	l.refs++
	m.tmu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		m.tmu.Lock()
		if l.refs--; l.refs == 0 {
			delete(m.tlocks, name)
		}
		m.tmu.Unlock()
	}
}

type nameLock struct {
	mu   sync.Mutex
	refs int // guarded by Manager.tmu
}

func (m *Manager) isImported(name string) bool {
	m.tmu.Lock()
	defer m.tmu.Unlock()
	return m.imported[name]
}

func (m *Manager) setImported(name string, ok bool) {
	m.tmu.Lock()
	defer m.tmu.Unlock()
	if ok {
		m.imported[name] = true
	} else {
		delete(m.imported, name)
	}
}
