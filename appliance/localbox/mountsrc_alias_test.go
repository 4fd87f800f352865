package localbox

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// checkMountSource once compared the source's path
// (readlink of /proc/self/fd/N) with "/" and the state directory: a bind
// mount of either elsewhere on the host has another path and the same
// content, and passed, handing the sandbox every sandbox's layers and
// control socket, or the host's root. The rules now compare identities
// (st_dev, st_ino) and places within the file system.

// bindAlias bind-mounts src at a new directory and returns it.
func bindAlias(t *testing.T, src string) string {
	t.Helper()
	alias := filepath.Join(t.TempDir(), "alias")
	if err := os.Mkdir(alias, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(src, alias, "", unix.MS_BIND, ""); err != nil {
		t.Skipf("bind mount: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(alias, unix.MNT_DETACH) })
	return alias
}

// refused fails the test unless openMountSource refuses source.
func refused(t *testing.T, source, state, what string) {
	t.Helper()
	fd, err := openMountSource(source, state)
	if err == nil {
		unix.Close(fd)
		t.Errorf("mount source %s (%s) is accepted", source, what)
		return
	}
	t.Logf("%s: %v", what, err)
}

func TestMountSourceAliasOfStateDir(t *testing.T) {
	needRoot(t)
	state := t.TempDir()
	alias := bindAlias(t, state)
	refused(t, alias, state, "a bind mount of the state directory "+state)
}

func TestMountSourceAliasOfHostRoot(t *testing.T) {
	needRoot(t)
	alias := bindAlias(t, "/")
	refused(t, alias, t.TempDir(), "a bind mount of the host's /")
}

func TestMountSourceAliasOfStateDirAncestor(t *testing.T) {
	needRoot(t)
	state := t.TempDir()
	alias := bindAlias(t, filepath.Dir(state))
	refused(t, alias, state, "a bind mount of the state directory's parent")
}

// TestMountSourceAliasInsideStateDir: a bind mount of a directory inside
// the state directory, and a file reached through a bind mount of it.
func TestMountSourceAliasInsideStateDir(t *testing.T) {
	needRoot(t)
	state := t.TempDir()
	sub := filepath.Join(state, "some-sandbox")
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sub, "state.json"), []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	refused(t, bindAlias(t, sub), state, "a bind mount of a directory inside the state directory")
	refused(t, filepath.Join(bindAlias(t, state), "some-sandbox", "state.json"), state, "a file inside the state directory, through a bind mount of it")
	refused(t, filepath.Join(bindAlias(t, sub), "state.json"), state, "a file inside the state directory, through a bind mount of its directory")

	// Positive controls: a directory and a file beside the state
	// directory, and a bind mount of one, are accepted.
	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(other, "f"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, src := range []string{other, filepath.Join(other, "f"), bindAlias(t, other)} {
		fd, err := openMountSource(src, state)
		if err != nil {
			t.Errorf("mount source %s (beside the state directory): %v", src, err)
			continue
		}
		unix.Close(fd)
	}
}
