package main

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
)

// snapshotCommand builds `sandgate snapshot pack|unpack|inspect`.
func snapshotCommand() *cli.Command {
	return &cli.Command{
		Name:  "snapshot",
		Usage: "pack, unpack and inspect filesystem layers",
		Subcommands: []*cli.Command{{
			Name:      "pack",
			Usage:     "save DIR (an overlay upper or a plain tree) as a compressed layer",
			ArgsUsage: "DIR",
			Description: `Writes the layer to --out, a file path, file:///path or gs://bucket/object,
atomically, and its manifest beside it as <out>.manifest.json. Prints the
manifest (without its file index).`,
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "out", Usage: "write the layer to `DEST`: FILE, file:///path or gs://bucket/object (required)"},
				&cli.StringFlag{Name: "compression", Value: "zstd", Usage: "compress with `ALGORITHM`: zstd or gzip"},
				&cli.IntFlag{Name: "level", Usage: "compression `LEVEL` (zstd 1-4, gzip 1-9; 0 = fastest)"},
				&cli.StringFlag{Name: "base", Usage: "write only what differs from the base layer described by `MANIFEST` (FILE or URL)"},
				&cli.BoolFlag{Name: "index", Usage: "record a file index in the manifest (needed by --base later)"},
				&cli.BoolFlag{Name: "no-clobber", Usage: "fail if --out already exists"},
				&cli.StringFlag{Name: "parent", Usage: "`DIGEST` of the template layer this one was made from"},
				&cli.StringFlag{Name: "image-id", EnvVars: []string{"SANDBOX_IMAGE_ID"}, Usage: "image `ID` recorded in the manifest"},
				&cli.StringFlag{Name: "sandbox-id", Usage: "sandbox `ID` recorded in the manifest"},
			},
			OnUsageError: usageError,
			Action:       runSnapshotPack,
		}, {
			Name:      "unpack",
			Usage:     "apply a layer to a directory",
			ArgsUsage: "FILE|URL",
			Description: `Verifies the layer against its stored digest and, when present, its
manifest, then applies it to --into: a fresh directory is renamed into place,
an existing one is merged into. A refused layer changes nothing.`,
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "into", Usage: "apply the layer to `DIR` (required)"},
				&cli.StringFlag{Name: "mode", Value: "tree", Usage: "apply in `MODE` upper (keep overlay whiteouts) or tree (whiteouts delete what they name)"},
				&cli.BoolFlag{Name: "trusted", Usage: "allow setuid/setgid bits and file capabilities"},
				&cli.Int64Flag{Name: "max-bytes", Usage: "refuse a layer of more than `BYTES` uncompressed (0 = 64 GiB)"},
			},
			OnUsageError: usageError,
			Action:       runSnapshotUnpack,
		}, {
			Name:         "inspect",
			Usage:        "print a layer's manifest and entries",
			ArgsUsage:    "FILE|URL",
			Flags:        []cli.Flag{&cli.BoolFlag{Name: "entries", Value: true, Usage: "list entries (--entries=false for the manifest only)"}},
			OnUsageError: usageError,
			Action:       runSnapshotInspect,
		}},
	}
}

// openLocation splits a layer location into a store and an object name:
// gs://bucket/a/b.tar.zst is object a/b.tar.zst in the bucket; a path or
// file:///dir/b.tar.zst is object b.tar.zst in the directory store dir.
func openLocation(ctx context.Context, loc string) (store.Store, string, error) {
	if rest, ok := strings.CutPrefix(loc, "gs://"); ok {
		bucket, name, _ := strings.Cut(rest, "/")
		if bucket == "" || store.CheckName(name) != nil {
			return nil, "", badInput("%q: want gs://bucket/object", loc)
		}
		s, err := store.OpenGCS(ctx, bucket, "")
		return s, name, err
	}
	p := loc
	if rest, ok := strings.CutPrefix(loc, "file://"); ok {
		p = rest
		if !strings.HasPrefix(p, "/") {
			return nil, "", badInput("%q: want file:///absolute/path", loc)
		}
	} else if strings.Contains(loc, "://") {
		return nil, "", badInput("%q: want a path, file:///path or gs://bucket/object", loc)
	}
	name := filepath.Base(p)
	if p == "" || store.CheckName(name) != nil {
		return nil, "", badInput("%q: the file name must not be empty or start with '.'", loc)
	}
	s, err := store.NewDir(filepath.Dir(p))
	return s, name, err
}

// readManifestAt reads a manifest from a path or URL.
func readManifestAt(ctx context.Context, loc string) (*snapshot.Manifest, error) {
	s, name, err := openLocation(ctx, loc)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return getManifest(ctx, s, name)
}

func getManifest(ctx context.Context, s store.Store, name string) (*snapshot.Manifest, error) {
	rc, err := s.Get(ctx, name)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return snapshot.ReadManifest(rc)
}

func runSnapshotPack(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return badInput("snapshot pack takes one DIR, got %d arguments", len(args))
	}
	if c.String("out") == "" {
		return badInput("snapshot pack: --out FILE|URL is required")
	}
	dir := args[0]
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return badInput("snapshot pack: %q is not a directory", dir)
	}
	comp, err := snapshot.ParseCompression(c.String("compression"))
	if err != nil || comp == snapshot.None {
		return badInput("--compression %q: want zstd or gzip", c.String("compression"))
	}
	opts := snapshot.PackOptions{
		Compression: comp, Level: c.Int("level"), Index: c.Bool("index"),
		Parent: c.String("parent"), ImageID: c.String("image-id"), SandboxID: c.String("sandbox-id"),
	}
	ctx := c.Context
	if b := c.String("base"); b != "" {
		if opts.Base, err = readManifestAt(ctx, b); err != nil {
			return badInput("--base %q: %v", b, err)
		}
	}
	st, name, err := openLocation(ctx, c.String("out"))
	if err != nil {
		return err
	}
	defer st.Close()

	bar := newProgress(c.App.ErrWriter, "pack", func() int64 { return treeSize(dir) })
	opts.Progress = bar.set
	pr, pw := io.Pipe()
	type packed struct {
		m   *snapshot.Manifest
		err error
	}
	done := make(chan packed, 1)
	var digest string // set before the pipe closes, read by Put after EOF
	go func() {
		m, err := snapshot.Pack(ctx, dir, pw, opts)
		if err == nil {
			digest = m.Digest
		}
		pw.CloseWithError(err)
		done <- packed{m, err}
	}()
	info, err := st.Put(ctx, name, pr, store.PutOptions{
		IfNotExist: c.Bool("no-clobber"),
		Digest:     func() string { return digest },
	})
	pr.CloseWithError(errors.New("store stopped reading"))
	res := <-done
	bar.finish()
	switch {
	case errors.Is(err, store.ErrPreconditionFailed):
		return badInput("--out %q already exists (--no-clobber)", c.String("out"))
	case res.err != nil:
		return res.err // the store saw it as its source failing
	case err != nil:
		return err
	}
	if info.Digest != "" && info.Digest != res.m.Digest {
		return fmt.Errorf("store recorded %s, pack wrote %s: %w", info.Digest, res.m.Digest, snapshot.ErrDigestMismatch)
	}
	pmr, pmw := io.Pipe()
	go func() { _, err := res.m.WriteTo(pmw); pmw.CloseWithError(err) }()
	if _, err := st.Put(ctx, snapshot.ManifestName(name), pmr, store.PutOptions{}); err != nil {
		return fmt.Errorf("write manifest: %w", err)
	}
	summary := *res.m
	summary.Files = nil
	_, err = summary.WriteTo(c.App.Writer)
	return err
}

func runSnapshotUnpack(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return badInput("snapshot unpack takes one FILE|URL, got %d arguments", len(args))
	}
	if c.String("into") == "" {
		return badInput("snapshot unpack: --into DIR is required")
	}
	mode, err := snapshot.ParseMode(c.String("mode"))
	if err != nil {
		return badInput("--mode: %v", err)
	}
	if mode == snapshot.ModeUpper && os.Geteuid() != 0 {
		return badInput("--mode upper needs root (whiteouts are device nodes)")
	}
	ctx := c.Context
	st, name, err := openLocation(ctx, args[0])
	if err != nil {
		return err
	}
	defer st.Close()
	opts := snapshot.ApplyOptions{Mode: mode, Trusted: c.Bool("trusted"), MaxBytes: c.Int64("max-bytes")}
	m, err := getManifest(ctx, st, snapshot.ManifestName(name))
	switch {
	case err == nil:
		opts.Digest, opts.TarDigest = m.Digest, m.TarDigest
	case !errors.Is(err, store.ErrNotFound):
		return fmt.Errorf("manifest: %w", err)
	}
	info, err := st.Stat(ctx, name)
	if err != nil {
		return err
	}
	rc, err := st.Get(ctx, name)
	if err != nil {
		return err
	}
	defer rc.Close()
	bar := newProgress(c.App.ErrWriter, "unpack", func() int64 { return info.Size })
	opts.Progress = bar.set
	res, err := snapshot.Unpack(ctx, rc, c.String("into"), opts)
	bar.finish()
	if err != nil {
		return err
	}
	fmt.Fprintf(c.App.Writer, "applied %d entries (%s, %d bytes, %s) to %s\n",
		res.Entries, res.Compression, res.Size, res.Digest, c.String("into"))
	return nil
}

func runSnapshotInspect(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return badInput("snapshot inspect takes one FILE|URL, got %d arguments", len(args))
	}
	ctx := c.Context
	st, name, err := openLocation(ctx, args[0])
	if err != nil {
		return err
	}
	defer st.Close()
	w := c.App.Writer
	if m, err := getManifest(ctx, st, snapshot.ManifestName(name)); err == nil {
		m.Files = nil
		m.WriteTo(w)
	} else if !errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("manifest: %w", err)
	}
	rc, err := st.Get(ctx, name)
	if err != nil {
		return err
	}
	defer rc.Close()
	var list func(*tar.Header) error
	if c.Bool("entries") {
		list = func(h *tar.Header) error {
			_, err := fmt.Fprintln(w, describeEntry(h))
			return err
		}
	}
	res, err := snapshot.Inspect(ctx, rc, list)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "measured: compression=%s size=%d digest=%s tarSize=%d tarDigest=%s entries=%d\n",
		res.Compression, res.Size, res.Digest, res.TarSize, res.TarDigest, res.Entries)
	return nil
}

// describeEntry is one `ls -l`-like line for a tar entry.
func describeEntry(h *tar.Header) string {
	mode := fs.FileMode(h.Mode).Perm()
	typ := map[byte]byte{tar.TypeDir: 'd', tar.TypeSymlink: 'l', tar.TypeLink: 'h', tar.TypeFifo: 'p', tar.TypeChar: 'c', tar.TypeBlock: 'b'}[h.Typeflag]
	if typ == 0 {
		typ = '-'
	}
	line := fmt.Sprintf("%c%s %d/%d %10d %s %s", typ, mode.String()[1:], h.Uid, h.Gid, h.Size, h.ModTime.UTC().Format(time.RFC3339), h.Name)
	base := path.Base(strings.TrimSuffix(h.Name, "/"))
	switch {
	case h.Typeflag == tar.TypeSymlink:
		line += " -> " + h.Linkname
	case h.Typeflag == tar.TypeLink:
		line += " link to " + h.Linkname
	case base == ".wh..wh..opq":
		line += "  (opaque directory)"
	case strings.HasPrefix(base, ".wh."):
		line += "  (whiteout)"
	}
	return line
}

// treeSize adds up the sizes under dir, for the progress bar's ETA.
func treeSize(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if info, err := d.Info(); err == nil {
				n += info.Size() + 512
			}
		}
		return nil
	})
	return n
}

// progress draws "verb  done / total  rate  ETA" on a terminal and nothing
// otherwise. set may be called from the worker goroutine.
type progress struct {
	w     io.Writer
	verb  string
	total int64
	start time.Time
	mu    sync.Mutex
	last  time.Time
	done  int64
}

func newProgress(w io.Writer, verb string, total func() int64) *progress {
	f, ok := w.(*os.File)
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return &progress{}
	}
	return &progress{w: w, verb: verb, total: total(), start: time.Now()}
}

func (p *progress) set(n int64) {
	if p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done = n
	if time.Since(p.last) < 200*time.Millisecond {
		return
	}
	p.last = time.Now()
	p.draw()
}

func (p *progress) draw() {
	el := time.Since(p.start).Seconds()
	rate := float64(p.done) / max(el, 0.001)
	eta := "--"
	if p.total > p.done && rate > 0 {
		eta = time.Duration(float64(p.total-p.done) / rate * float64(time.Second)).Round(time.Second).String()
	}
	fmt.Fprintf(p.w, "\r%s  %s / %s  %s/s  ETA %s   ", p.verb, human(p.done), human(p.total), human(int64(rate)), eta)
}

func (p *progress) finish() {
	if p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.draw()
	fmt.Fprintln(p.w)
}

func human(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	d, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		d *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(d), "KMGTPE"[exp])
}
