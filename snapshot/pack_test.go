package snapshot

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPackRefusesWhatALayerCannotMean checks that uppers using
// redirect_dir or metacopy, and real device nodes, are refused by name,
// while inode bookkeeping attributes are dropped.
func TestPackRefusesWhatALayerCannotMean(t *testing.T) {
	skipUnlessRoot(t)
	for _, tc := range []struct {
		name, want string
		make       func(dir string) error
	}{
		{"redirect", "redirect_dir=off", func(dir string) error {
			os.Mkdir(filepath.Join(dir, "moved"), 0o755)
			return unix.Setxattr(filepath.Join(dir, "moved"), "trusted.overlay.redirect", []byte("/orig"), 0)
		}},
		{"metacopy", "metacopy=off", func(dir string) error {
			os.WriteFile(filepath.Join(dir, "f"), nil, 0o644)
			return unix.Setxattr(filepath.Join(dir, "f"), "trusted.overlay.metacopy", nil, 0)
		}},
		{"device", "device node 1:3", func(dir string) error {
			return unix.Mknod(filepath.Join(dir, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3)))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := tc.make(dir); err != nil {
				t.Fatal(err)
			}
			_, err := Pack(context.Background(), dir, &bytes.Buffer{}, PackOptions{})
			if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrUnsupported mentioning %q", err, tc.want)
			}
		})
	}
	t.Run("origin-dropped", func(t *testing.T) {
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644)
		unix.Setxattr(filepath.Join(dir, "f"), "trusted.overlay.origin", []byte{0, 1}, 0)
		data, _ := packDir(t, dir, PackOptions{})
		dst := filepath.Join(t.TempDir(), "d")
		if _, err := Unpack(context.Background(), bytes.NewReader(data), dst, ApplyOptions{Mode: ModeUpper}); err != nil {
			t.Fatal(err)
		}
		if _, err := getXattr(filepath.Join(dst, "f"), "trusted.overlay.origin"); err == nil {
			t.Fatal("trusted.overlay.origin was carried into the layer")
		}
	})
}

// TestTrustedAllowsSetuid checks the Trusted escape hatch.
func TestTrustedAllowsSetuid(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "su"), []byte("x"), 0o755)
	os.Chmod(filepath.Join(dir, "su"), 0o755|os.ModeSetuid)
	data, _ := packDir(t, dir, PackOptions{})
	if _, err := Unpack(context.Background(), bytes.NewReader(data), filepath.Join(t.TempDir(), "a"), ApplyOptions{}); !errors.Is(err, ErrRefused) {
		t.Fatalf("untrusted: %v, want ErrRefused", err)
	}
	dst := filepath.Join(t.TempDir(), "b")
	if _, err := Unpack(context.Background(), bytes.NewReader(data), dst, ApplyOptions{Trusted: true}); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(filepath.Join(dst, "su")); st.Mode()&os.ModeSetuid == 0 {
		t.Fatalf("mode %v lost setuid", st.Mode())
	}
}
