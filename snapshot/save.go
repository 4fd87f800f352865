package snapshot

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"strings"

	"github.com/sandgate/sandgate/snapshot/store"
)

// Source is what Save saves: a directory (DirSource) or a layer stream
// (StreamSource). The zero Source is refused.
type Source struct {
	dir string
	r   io.Reader
}

// DirSource is a directory to pack: an overlay upper or a plain tree.
func DirSource(dir string) Source { return Source{dir: dir} }

// StreamSource is a layer tar stream to re-encode (any compression, or
// none): for example what a sandbox CLI's `tar` verb wrote. Save reads it
// to EOF; it does not close it.
func StreamSource(r io.Reader) Source { return Source{r: r} }

func (s Source) String() string {
	if s.r != nil {
		return "stream"
	}
	return s.dir
}

// SaveOptions configures Save. The zero value saves a full zstd layer
// (level 1, no file index) and replaces what the key held.
type SaveOptions struct {
	// PackOptions say how the layer is written: compression, level, file
	// index, the base of a delta (Base: a template's manifest, packed with
	// Index), provenance (Parent, ImageID, SandboxID) and progress.
	PackOptions
	// NoClobber makes Save fail with store.ErrPreconditionFailed, writing
	// nothing, when the key already holds an object.
	NoClobber bool
}

// Save packs src as a layer into st under key, then writes its manifest
// beside it (ManifestName(key)), and returns the manifest.
//
// The layer streams into the store in one pass (digests are computed on
// the way, and the store records the same digest with the object); the
// store's recorded digest is cross-checked against the pack's. The
// manifest, which carries the layer's digest and size, is written only
// after the layer is complete, and Load trusts a layer only when its bytes
// hash to the digest its manifest records. So an interrupted Save never
// leaves a layer that a later Load would trust: a put cut short leaves the
// previous object (or none) and the previous manifest; a crash between the
// layer and its manifest pairs a new layer with the previous manifest (or
// with none), which Load refuses (ErrDigestMismatch, or store.ErrNotFound
// for a layer without a manifest). What the key held
// before is then lost: Save replaces in place.
func Save(ctx context.Context, src Source, st store.Store, key string, opts SaveOptions) (*Manifest, error) {
	if src.dir == "" && src.r == nil {
		return nil, errors.New("save: no source: use DirSource or StreamSource")
	}
	if err := store.CheckName(key); err != nil {
		return nil, fmt.Errorf("save: %w", err)
	}
	if err := store.CheckName(ManifestName(key)); err != nil {
		return nil, fmt.Errorf("save: %w", err)
	}
	if src.dir != "" {
		if fi, err := os.Stat(src.dir); err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("save: source %q is not a directory", src.dir)
		}
	}
	pr, pw := io.Pipe()
	type packed struct {
		m   *Manifest
		err error
	}
	done := make(chan packed, 1)
	var digest string // set before the pipe closes; read by Put after EOF
	go func() {
		var m *Manifest
		var err error
		if src.r != nil {
			m, err = PackStream(ctx, src.r, pw, opts.PackOptions)
		} else {
			m, err = Pack(ctx, src.dir, pw, opts.PackOptions)
		}
		if err == nil {
			digest = m.Digest
		}
		pw.CloseWithError(err)
		done <- packed{m, err}
	}()
	info, err := st.Put(ctx, key, pr, store.PutOptions{
		IfNotExist: opts.NoClobber,
		Digest:     func() string { return digest },
	})
	pr.CloseWithError(errStoreStopped)
	res := <-done
	switch {
	case res.err != nil && !errors.Is(res.err, errStoreStopped):
		return nil, fmt.Errorf("save %s: %w", key, res.err) // the store saw it as its source failing
	case err != nil:
		return nil, fmt.Errorf("save: %w", err)
	case res.err != nil:
		return nil, fmt.Errorf("save %s: %w", key, res.err)
	}
	m := res.m
	if (info.Digest != "" && info.Digest != m.Digest) || info.Size != m.Size {
		return nil, fmt.Errorf("save %s: the store recorded %s (%d bytes), the pack wrote %s (%d bytes): %w",
			key, info.Digest, info.Size, m.Digest, m.Size, ErrDigestMismatch)
	}
	mr, mw := io.Pipe()
	go func() { _, err := m.WriteTo(mw); mw.CloseWithError(err) }()
	_, err = st.Put(ctx, ManifestName(key), mr, store.PutOptions{})
	mr.Close()
	if err != nil {
		return nil, fmt.Errorf("save %s: write its manifest: %w", key, err)
	}
	return m, nil
}

// errStoreStopped ends a pack whose store stopped reading (it failed).
var errStoreStopped = errors.New("the store stopped reading")

// Layer is a layer being read back from a store by Load: its manifest and
// a reader of its bytes that checks them against the manifest.
type Layer struct {
	// Manifest is the layer's manifest as stored beside it. For a delta
	// (Manifest.Base set), apply the layer onto its base, or fold the two
	// with MergeLayers.
	Manifest *Manifest
	rc       io.ReadCloser
	key      string
	h        hash.Hash
	n        int64
	err      error
}

// Load opens the layer saved under key in st. It reads the manifest,
// checks the object's size (and the digest the store recorded, when it
// did) against it before reading a byte of the layer, and returns a Layer
// whose reads are verified at EOF against the manifest's digest and size:
// the last Read returns ErrDigestMismatch instead of io.EOF when the
// bytes differ. Consume a Layer to EOF before trusting what was read
// (Unpack and Apply do). A missing layer or manifest is store.ErrNotFound;
// the caller closes the Layer.
func Load(ctx context.Context, st store.Store, key string) (*Layer, error) {
	if err := store.CheckName(key); err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}
	m, err := readStoredManifest(ctx, st, ManifestName(key))
	if errors.Is(err, store.ErrNotFound) {
		if _, serr := st.Stat(ctx, key); serr == nil {
			return nil, fmt.Errorf("load %s: the layer has no manifest (a save that did not complete, or an object Save did not write): %w", key, store.ErrNotFound)
		}
		return nil, fmt.Errorf("load %s: %w", key, store.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("load %s: manifest: %w", key, err)
	}
	if !validDigest(m.Digest) {
		return nil, fmt.Errorf("load %s: its manifest records no valid digest (%q): %w", key, m.Digest, ErrDigestMismatch)
	}
	info, err := st.Stat(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", key, err)
	}
	if info.Size != m.Size || (info.Digest != "" && info.Digest != m.Digest) {
		return nil, fmt.Errorf("load %s: the layer (%s, %d bytes) does not match its manifest (%s, %d bytes): an interrupted or concurrent save: %w",
			key, info.Digest, info.Size, m.Digest, m.Size, ErrDigestMismatch)
	}
	rc, err := st.Get(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", key, err)
	}
	return &Layer{Manifest: m, rc: rc, key: key, h: sha256.New()}, nil
}

// Read reads the layer's compressed bytes; see Load for how they are
// verified.
func (l *Layer) Read(p []byte) (int, error) {
	if l.err != nil {
		return 0, l.err
	}
	n, err := l.rc.Read(p)
	l.h.Write(p[:n])
	l.n += int64(n)
	if l.n > l.Manifest.Size {
		l.err = fmt.Errorf("load %s: more than the %d bytes its manifest records: %w", l.key, l.Manifest.Size, ErrDigestMismatch)
		return n, l.err
	}
	if err == io.EOF {
		if got := "sha256:" + hex.EncodeToString(l.h.Sum(nil)); l.n != l.Manifest.Size || got != l.Manifest.Digest {
			l.err = fmt.Errorf("load %s: read %s (%d bytes), its manifest records %s (%d bytes): %w",
				l.key, got, l.n, l.Manifest.Digest, l.Manifest.Size, ErrDigestMismatch)
			return n, l.err
		}
	}
	if err != nil {
		l.err = err
	}
	return n, err
}

// Close releases the layer's reader.
func (l *Layer) Close() error { return l.rc.Close() }

// Apply unpacks the layer into dir (see Unpack), checking both digests
// the manifest records; opts.Digest and opts.TarDigest are overridden.
// Nothing is applied unless the whole layer verified.
func (l *Layer) Apply(ctx context.Context, dir string, opts ApplyOptions) (*ApplyResult, error) {
	opts.Digest, opts.TarDigest = l.Manifest.Digest, l.Manifest.TarDigest
	return Unpack(ctx, l, dir, opts)
}

// readStoredManifest reads the manifest object name from st.
func readStoredManifest(ctx context.Context, st store.Store, name string) (*Manifest, error) {
	rc, err := st.Get(ctx, name)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	m, err := ReadManifest(rc)
	if err != nil {
		return nil, err
	}
	// Read to EOF so the store verifies the manifest object itself.
	if _, err := io.Copy(io.Discard, rc); err != nil {
		return nil, err
	}
	return m, nil
}

// ReadStoredManifest reads the manifest stored as object name in st (for
// example ManifestName(key) of a template, to pack deltas against it).
// The store verifies the manifest object's own digest.
func ReadStoredManifest(ctx context.Context, st store.Store, name string) (*Manifest, error) {
	m, err := readStoredManifest(ctx, st, name)
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w", name, err)
	}
	return m, nil
}

// ParseDigest checks a sha256 digest as a user writes it, "sha256:<hex>"
// or the 64 hex digits alone (what sha256sum prints), and returns it as
// "sha256:<hex>" in lower case.
func ParseDigest(s string) (string, error) {
	d := strings.ToLower(strings.TrimSpace(s))
	if !strings.HasPrefix(d, "sha256:") {
		d = "sha256:" + d
	}
	if !validDigest(d) {
		return "", fmt.Errorf("digest %q: want sha256:<64 hex digits> (what sha256sum prints)", s)
	}
	return d, nil
}

func validDigest(d string) bool {
	hexPart, ok := strings.CutPrefix(d, "sha256:")
	if !ok || len(hexPart) != 64 {
		return false
	}
	_, err := hex.DecodeString(hexPart)
	return err == nil && strings.ToLower(hexPart) == hexPart
}
