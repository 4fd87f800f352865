package snapshot

import (
	"bytes"
	"strings"
	"testing"
)

func TestManifestRoundTripAndStrictness(t *testing.T) {
	m := &Manifest{FormatVersion: FormatVersion, Compression: Zstd, Digest: "sha256:ab", Files: []FileInfo{{Path: "a", Type: "file"}}}
	var buf bytes.Buffer
	if _, err := m.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	got, err := ReadManifest(&buf)
	if err != nil || got.Digest != m.Digest || len(got.Files) != 1 {
		t.Fatalf("got %+v, %v", got, err)
	}
	if _, err := ReadManifest(strings.NewReader(`{"formatVersion":1,"digets":"x"}`)); err == nil || !strings.Contains(err.Error(), "digets") {
		t.Fatalf("unknown field: %v, want an error naming it", err)
	}
	if _, err := ReadManifest(strings.NewReader(`{"formatVersion":2}`)); err == nil {
		t.Fatal("accepted formatVersion 2")
	}
	if got, want := SnapshotObjectName("sb", Gzip), "snapshots/sb.tar.gz"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if got, want := TemplateObjectName("img", "d", Zstd), "templates/img/d.tar.zst"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}
