package agent

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/snapshot"
)

func TestFileRoundTrip(t *testing.T) {
	l := startLink(t, ClientOptions{})
	ctx := testCtx(t)
	dir := t.TempDir()
	p := filepath.Join(dir, "a", "b", "c.bin")
	content := make([]byte, 3<<20+17) // several frames and windows
	rand.Read(content)
	n, err := l.c.WriteFile(ctx, p, bytes.NewReader(content), WriteOptions{Perm: 0o640})
	if err != nil || n != int64(len(content)) {
		t.Fatalf("WriteFile = %d, %v", n, err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("written file: %v %v, want mode 0640", fi, err)
	}
	r, fi, err := l.c.ReadFile(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(r)
	r.Close()
	if err != nil || !bytes.Equal(got, content) || fi.Size() != int64(len(content)) {
		t.Errorf("ReadFile: %d bytes (stat %d), err %v; want the %d bytes written", len(got), fi.Size(), err, len(content))
	}
	st, err := l.c.Stat(ctx, p)
	if err != nil || st.Size() != int64(len(content)) || st.Mode().Perm() != 0o640 || st.IsDir() || st.Name() != "c.bin" {
		t.Errorf("Stat = %+v, %v", st, err)
	}
	// An empty file, replacing the old one.
	if _, err := l.c.WriteFile(ctx, p, strings.NewReader(""), WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); len(b) != 0 {
		t.Errorf("the empty write left %d bytes", len(b))
	}
	// Leftover temporary files would show up here.
	ents, _ := os.ReadDir(filepath.Dir(p))
	if len(ents) != 1 {
		t.Errorf("directory holds %d entries after writes, want 1", len(ents))
	}
}

func TestFileNotFoundAndErrors(t *testing.T) {
	l := startLink(t, ClientOptions{})
	ctx := testCtx(t)
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing")
	if _, _, err := l.c.ReadFile(ctx, missing); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ReadFile(missing) = %v, want fs.ErrNotExist", err)
	}
	if _, err := l.c.Stat(ctx, missing); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stat(missing) = %v, want fs.ErrNotExist", err)
	}
	if err := l.c.Remove(ctx, missing, false); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Remove(missing) = %v, want fs.ErrNotExist", err)
	}
	if err := l.c.Remove(ctx, missing, true); err != nil {
		t.Errorf("recursive Remove(missing) = %v, want nil as rm -rf", err)
	}
	_, _, err := l.c.ReadFile(ctx, dir)
	if err == nil || errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ReadFile(dir) = %v, want an error other than not-found", err)
	}
	if _, _, err := l.c.ReadFile(ctx, "relative/path"); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("ReadFile(relative) = %v, want fs.ErrInvalid", err)
	}
	if err := l.c.Remove(ctx, "/", true); !errors.Is(err, ErrRefused) {
		t.Errorf("Remove(/, recursive) = %v, want ErrRefused", err)
	}
}

func TestMkdirAndRemove(t *testing.T) {
	l := startLink(t, ClientOptions{})
	ctx := testCtx(t)
	dir := t.TempDir()
	deep := filepath.Join(dir, "x", "y", "z")
	if err := l.c.Mkdir(ctx, deep, 0o700); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(deep); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Errorf("Mkdir: %v %v", fi, err)
	}
	if err := l.c.Mkdir(ctx, deep, 0); err != nil {
		t.Errorf("Mkdir of an existing directory = %v, want nil (mkdir -p)", err)
	}
	if err := l.c.Remove(ctx, filepath.Join(dir, "x"), false); err == nil {
		t.Error("non-recursive Remove of a non-empty directory succeeded")
	}
	if err := l.c.Remove(ctx, filepath.Join(dir, "x"), true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "x")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("tree still there: %v", err)
	}
}

// TestWriteCap: a write over its cap fails with ErrTooLarge and leaves the
// file as it was; so does a write whose source fails.
func TestWriteCapAndFailedSource(t *testing.T) {
	l := startLink(t, ClientOptions{})
	ctx := testCtx(t)
	p := filepath.Join(t.TempDir(), "f")
	os.WriteFile(p, []byte("old"), 0o644)
	big := bytes.NewReader(make([]byte, 8<<20))
	_, err := l.c.WriteFile(ctx, p, big, WriteOptions{MaxBytes: 1 << 20})
	if !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "MaxBytes") {
		t.Errorf("over the cap: %v, want ErrTooLarge naming the option", err)
	}
	// Exactly at the cap is fine.
	if n, err := l.c.WriteFile(ctx, p+"2", bytes.NewReader(make([]byte, 1<<20)), WriteOptions{MaxBytes: 1 << 20}); err != nil || n != 1<<20 {
		t.Errorf("at the cap: %d %v", n, err)
	}
	src := io.MultiReader(bytes.NewReader(make([]byte, 100<<10)), errReader{})
	if _, err := l.c.WriteFile(ctx, p, src, WriteOptions{}); err == nil || !strings.Contains(err.Error(), "source broke") {
		t.Errorf("failing source: %v", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "old" {
		t.Errorf("file after refused writes = %q, want %q", b, "old")
	}
	if ents, _ := os.ReadDir(filepath.Dir(p)); len(ents) != 2 {
		t.Errorf("%d entries after refused writes, want 2 (no temporary files left)", len(ents))
	}
	// The link is still usable.
	if _, err := l.c.Ping(ctx); err != nil {
		t.Error(err)
	}
}

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errors.New("source broke") }

// TestTarRoundTrip: a workspace seeded with TarIn comes back with TarOut.
func TestTarRoundTrip(t *testing.T) {
	l := startLink(t, ClientOptions{})
	ctx := testCtx(t)
	src := t.TempDir()
	files := map[string]string{
		"README.md":           "hello",
		"src/main.go":         "package main",
		"src/deep/x/y/z.txt":  strings.Repeat("z", 200<<10),
		"unicode-名前/ファイル.txt": "ok",
	}
	for name, body := range files {
		os.MkdirAll(filepath.Join(src, filepath.Dir(name)), 0o755)
		os.WriteFile(filepath.Join(src, name), []byte(body), 0o644)
	}
	os.Symlink("src/main.go", filepath.Join(src, "link"))
	var layer bytes.Buffer
	if _, err := snapshot.Pack(ctx, src, &layer, snapshot.PackOptions{}); err != nil { // zstd
		t.Fatal(err)
	}
	ws := filepath.Join(t.TempDir(), "workspace")
	if err := l.c.TarIn(ctx, ws, &layer, TarOptions{}); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := l.c.TarOut(ctx, ws, &out); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	tr := tar.NewReader(&out)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		switch h.Typeflag {
		case tar.TypeReg:
			b, _ := io.ReadAll(tr)
			got[h.Name] = string(b)
		case tar.TypeSymlink:
			got[h.Name] = "-> " + h.Linkname
		}
	}
	want := map[string]string{"link": "-> src/main.go"}
	for k, v := range files {
		want[k] = v
	}
	if len(got) != len(want) {
		t.Errorf("tar out holds %v, want %v", keys(got), keys(want))
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: got %d bytes %q…, want %d bytes", k, len(got[k]), truncate(got[k], 20), len(v))
		}
	}
	if err := l.c.TarOut(ctx, filepath.Join(ws, "README.md"), io.Discard); !errors.Is(err, fs.ErrInvalid) {
		t.Errorf("TarOut of a file = %v, want fs.ErrInvalid", err)
	}
	if err := l.c.TarOut(ctx, filepath.Join(ws, "nope"), io.Discard); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("TarOut of a missing dir = %v, want fs.ErrNotExist", err)
	}
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// TestHostileTarRefused: traversal, absolute names and writes through a
// symlink are refused as the snapshot package refuses them, and nothing
// lands in the workspace or outside it.
func TestHostileTarRefused(t *testing.T) {
	l := startLink(t, ClientOptions{})
	ctx := testCtx(t)
	root := t.TempDir()
	ws := filepath.Join(root, "ws")
	os.MkdirAll(ws, 0o755)
	os.WriteFile(filepath.Join(ws, "keep"), []byte("keep"), 0o644)
	cases := map[string][]tar.Header{
		"dotdot":   {{Name: "../escaped", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}},
		"absolute": {{Name: filepath.Join(root, "escaped"), Typeflag: tar.TypeReg, Mode: 0o644, Size: 1}},
		"symlink-then-write": {
			{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: root, Mode: 0o777},
			{Name: "evil/escaped", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1},
		},
		"setuid": {{Name: "suid", Typeflag: tar.TypeReg, Mode: 0o4755, Size: 1}},
	}
	for name, hdrs := range cases {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range hdrs {
			h.Format = tar.FormatPAX
			tw.WriteHeader(&h)
			if h.Size > 0 {
				tw.Write([]byte("x"))
			}
		}
		tw.Close()
		err := l.c.TarIn(ctx, ws, &b, TarOptions{})
		if !errors.Is(err, snapshot.ErrRefused) || !errors.Is(err, ErrRefused) {
			t.Errorf("%s: TarIn = %v, want a refusal", name, err)
		}
	}
	ents, _ := os.ReadDir(ws)
	if len(ents) != 1 || ents[0].Name() != "keep" {
		t.Errorf("workspace changed by refused tars: %v", ents)
	}
	if _, err := os.Stat(filepath.Join(root, "escaped")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("a refused tar wrote outside the workspace")
	}
	if ents, _ := os.ReadDir(root); len(ents) != 1 {
		t.Errorf("staging left beside the workspace: %v", ents)
	}
	// A tar over its cap is refused too.
	var big bytes.Buffer
	tw := tar.NewWriter(&big)
	tw.WriteHeader(&tar.Header{Name: "big", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1 << 20})
	tw.Write(make([]byte, 1<<20))
	tw.Close()
	if err := l.c.TarIn(ctx, ws, &big, TarOptions{MaxBytes: 64 << 10}); err == nil {
		t.Error("a tar over MaxBytes was applied")
	}
	// A tar whose source fails midway applies nothing.
	var good bytes.Buffer
	tw = tar.NewWriter(&good)
	tw.WriteHeader(&tar.Header{Name: "partial", Typeflag: tar.TypeReg, Mode: 0o644, Size: 300 << 10})
	tw.Write(make([]byte, 300<<10))
	tw.Close()
	src := io.MultiReader(io.LimitReader(&good, 200<<10), errReader{})
	if err := l.c.TarIn(ctx, ws, src, TarOptions{}); err == nil {
		t.Error("a tar whose source failed was reported applied")
	}
	if _, err := os.Stat(filepath.Join(ws, "partial")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("a tar whose source failed left a file behind")
	}
}

// TestReadFileCancel: a reader closed before the end, or cut by its
// context, releases the stream without hanging the agent.
func TestReadFileCancel(t *testing.T) {
	l := startLink(t, ClientOptions{})
	p := filepath.Join(t.TempDir(), "big")
	os.WriteFile(p, make([]byte, 16<<20), 0o644)
	for range 3 {
		r, _, err := l.c.ReadFile(testCtx(t), p)
		if err != nil {
			t.Fatal(err)
		}
		io.CopyN(io.Discard, r, 100<<10)
		r.Close()
	}
	ctx, cancel := context.WithCancel(testCtx(t))
	r, _, err := l.c.ReadFile(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	io.CopyN(io.Discard, r, 100<<10)
	cancel()
	if _, err := io.Copy(io.Discard, r); !errors.Is(err, context.Canceled) {
		t.Errorf("read after cancel = %v, want context.Canceled", err)
	}
	r.Close()
	if _, err := l.c.Ping(testCtx(t)); err != nil {
		t.Error(err)
	}
}
