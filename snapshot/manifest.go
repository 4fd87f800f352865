package snapshot

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"
)

// FormatVersion is the manifest format this package writes and reads.
const FormatVersion = 1

// Manifest describes one stored layer. It is written as JSON beside the
// layer object (see ManifestName) and is what resume, inspect and delta
// packing read.
type Manifest struct {
	FormatVersion int         `json:"formatVersion"`
	Compression   Compression `json:"compression"`
	Digest        string      `json:"digest"`    // sha256 of the compressed object, "sha256:<hex>"
	Size          int64       `json:"size"`      // bytes of the compressed object
	TarDigest     string      `json:"tarDigest"` // sha256 of the uncompressed tar stream
	TarSize       int64       `json:"tarSize"`   // bytes of the uncompressed tar stream
	Entries       int64       `json:"entries"`   // tar entries, whiteouts included
	// Parent is the digest of the template layer this one was made from, if any.
	Parent string `json:"parent,omitempty"`
	// Base is the digest of the layer this one is a delta against; empty
	// for a full layer. A delta must be merged onto Base to be complete.
	Base      string    `json:"base,omitempty"`
	ImageID   string    `json:"imageId,omitempty"`
	SandboxID string    `json:"sandboxId,omitempty"`
	Created   time.Time `json:"created"`
	// Files is the layer's file index, written when PackOptions.Index is
	// set. PackDelta needs it in the base layer's manifest.
	Files []FileInfo `json:"files,omitempty"`
}

// FileInfo is one entry of a layer's file index: enough to tell, without
// reading content, whether a path changed since the layer was packed.
type FileInfo struct {
	Path   string `json:"path"`
	Type   string `json:"type"` // file, dir, symlink, hardlink, fifo, whiteout, opaque
	Mode   uint32 `json:"mode"` // permission and setuid/setgid/sticky bits
	UID    int    `json:"uid"`
	GID    int    `json:"gid"`
	Size   int64  `json:"size,omitempty"`
	Mtime  int64  `json:"mtime"`            // Unix nanoseconds
	Link   string `json:"link,omitempty"`   // symlink target or hardlink first path
	SHA256 string `json:"sha256,omitempty"` // content of regular files, hex
	Xattrs string `json:"xattrs,omitempty"` // sha256 of the sorted xattrs, hex; empty if none
}

// ManifestName is where a layer object's manifest is stored: beside it.
func ManifestName(object string) string { return object + ".manifest.json" }

// SnapshotObjectName is the store name of a suspended sandbox's layer.
func SnapshotObjectName(sandboxID string, c Compression) string {
	return "snapshots/" + sandboxID + c.Ext()
}

// TemplateObjectName is the store name of a template layer.
func TemplateObjectName(imageID, recipeDigest string, c Compression) string {
	return "templates/" + imageID + "/" + recipeDigest + c.Ext()
}

// maxManifestBytes bounds how much JSON ReadManifest accepts.
const maxManifestBytes = 256 << 20

// ReadManifest decodes and checks a manifest; unknown fields are refused by
// name.
func ReadManifest(r io.Reader) (*Manifest, error) {
	dec := json.NewDecoder(io.LimitReader(r, maxManifestBytes))
	dec.DisallowUnknownFields()
	var m Manifest
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("manifest: %w", err)
	}
	if m.FormatVersion != FormatVersion {
		return nil, fmt.Errorf("manifest: formatVersion %d: this build reads %d", m.FormatVersion, FormatVersion)
	}
	return &m, nil
}

// ReadManifestFile reads a manifest from a local file.
func ReadManifestFile(name string) (*Manifest, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m, err := ReadManifest(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return m, nil
}

// WriteTo writes the manifest as indented JSON.
func (m *Manifest) WriteTo(w io.Writer) (int64, error) {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return 0, err
	}
	b = append(b, '\n')
	n, err := w.Write(b)
	return int64(n), err
}
