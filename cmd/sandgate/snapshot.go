package main

import (
	"archive/tar"
	"bufio"
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
			Description: `Applies the layer to --into once the whole of it verified: a fresh
directory is renamed into place, an existing one is merged into. A refused
layer changes nothing. A FILE (a path or file:///path: any layer, such as
'sandgate sandbox tar' output) is checked against --digest and the manifest
beside it (FILE.manifest.json) when there is one; a gs:// object also
against the digest its store recorded. It says what was verified, and when
no digest was.`,
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "into", Usage: "apply the layer to `DIR` (required)"},
				&cli.StringFlag{Name: "digest", Usage: "the `sha256:HEX` the layer file must hash to"},
				&cli.StringFlag{Name: "mode", Value: "tree", Usage: "apply in `MODE` upper (keep overlay whiteouts) or tree (whiteouts delete what they name)"},
				&cli.BoolFlag{Name: "trusted", Usage: "allow setuid/setgid bits and file capabilities"},
				&cli.Int64Flag{Name: "max-bytes", Usage: "refuse a layer of more than `BYTES` uncompressed (0 = 64 GiB)"},
			},
			OnUsageError: usageError,
			Action:       runSnapshotUnpack,
		}, {
			Name:      "inspect",
			Usage:     "print a layer's manifest and entries",
			ArgsUsage: "FILE|URL",
			Description: `Reads the whole layer and verifies it as unpack does before printing
anything: the manifest (if any), the entries, the measured digests, and
what was verified.`,
			Flags: []cli.Flag{
				&cli.BoolFlag{Name: "entries", Value: true, Usage: "list entries (--entries=false for the manifest only)"},
				&cli.StringFlag{Name: "digest", Usage: "the `sha256:HEX` the layer file must hash to"},
			},
			OnUsageError: usageError,
			Action:       runSnapshotInspect,
		}},
	}
}

// openLocation opens the store holding the layer object at loc (see
// store.OpenObject); a location it cannot read is the caller's mistake.
func openLocation(ctx context.Context, loc string) (store.Store, string, error) {
	s, name, err := store.OpenObject(ctx, loc)
	if errors.Is(err, store.ErrBadLocation) || errors.Is(err, store.ErrBadName) {
		return nil, "", badInput("%v", err)
	}
	return s, name, err
}

// readManifestAt reads a manifest from a path or URL. A path is the
// user's own file, read as it is (see openLayerInput).
func readManifestAt(ctx context.Context, loc string) (*snapshot.Manifest, error) {
	if p, local, err := store.LocalPath(loc); err != nil {
		return nil, badInput("%v", err)
	} else if local {
		return snapshot.ReadManifestFile(p)
	}
	s, name, err := openLocation(ctx, loc)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return snapshot.ReadStoredManifest(ctx, s, name)
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
	m, err := snapshot.Save(ctx, snapshot.DirSource(dir), st, name, snapshot.SaveOptions{PackOptions: opts, NoClobber: c.Bool("no-clobber")})
	bar.finish()
	if errors.Is(err, store.ErrPreconditionFailed) {
		return badInput("--out %q already exists (--no-clobber)", c.String("out"))
	}
	if err != nil {
		return err
	}
	summary := *m
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
	in, err := openLayerInput(ctx, args[0], c.String("digest"))
	if err != nil {
		return err
	}
	defer in.Close()
	opts := snapshot.ApplyOptions{Mode: mode, Trusted: c.Bool("trusted"), MaxBytes: c.Int64("max-bytes"),
		Digest: in.digest, TarDigest: in.tarDigest}
	bar := newProgress(c.App.ErrWriter, "unpack", func() int64 { return in.size })
	opts.Progress = bar.set
	res, err := snapshot.Unpack(ctx, in.r, c.String("into"), opts)
	bar.finish()
	if err != nil {
		return err
	}
	fmt.Fprintf(c.App.Writer, "applied %d entries (%s, %d bytes, %s) to %s\n",
		res.Entries, res.Compression, res.Size, res.Digest, c.String("into"))
	in.report(c, res)
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
	in, err := openLayerInput(ctx, args[0], c.String("digest"))
	if err != nil {
		return err
	}
	defer in.Close()
	// Entries are listed only once the layer has verified: spooled until then.
	var list func(*tar.Header) error
	var spool *os.File
	var sw *bufio.Writer
	if c.Bool("entries") {
		if spool, err = os.CreateTemp("", "sandgate-inspect-*"); err != nil {
			return err
		}
		os.Remove(spool.Name())
		defer spool.Close()
		sw = bufio.NewWriter(spool)
		list = func(h *tar.Header) error {
			_, err := fmt.Fprintln(sw, describeEntry(h))
			return err
		}
	}
	res, err := snapshot.Inspect(ctx, in.r, list)
	if err == nil {
		err = in.check(res)
	}
	if err != nil {
		return err
	}
	w := c.App.Writer
	if in.manifest != nil {
		m := *in.manifest
		m.Files = nil
		m.WriteTo(w)
	}
	if spool != nil {
		if err := sw.Flush(); err != nil {
			return err
		}
		if _, err := spool.Seek(0, io.SeekStart); err != nil {
			return err
		}
		if _, err := io.Copy(w, spool); err != nil {
			return err
		}
	}
	fmt.Fprintf(w, "measured: compression=%s size=%d digest=%s tarSize=%d tarDigest=%s entries=%d\n",
		res.Compression, res.Size, res.Digest, res.TarSize, res.TarDigest, res.Entries)
	in.report(c, res)
	return nil
}

// layerInput is a layer named on the command line, open for reading, with
// what it can be checked against.
type layerInput struct {
	r    io.ReadCloser
	size int64 // bytes, for the progress bar
	// manifest is the layer's manifest when it has one: beside a local
	// file, or beside the object in a store.
	manifest *snapshot.Manifest
	// digest and tarDigest are what the layer must hash to ("" unknown),
	// and checkedBy says whose they are.
	digest, tarDigest string
	checkedBy         string
	// storeDigest: the store verifies a digest it recorded with the object.
	storeDigest bool
	name        string
}

func (in *layerInput) Close() error { return in.r.Close() }

// openLayerInput opens the layer at loc. A path or file:// location is
// the user's own file (the output of 'sandgate sandbox tar', a copy made
// with cp): it is read as it is, checked against --digest and against a
// manifest beside it when there is one, never refused for lacking the
// digest attribute a sandgate store records. A gs:// location is an object
// in a store, read through it (the store verifies what it recorded) and,
// when it has a manifest, through snapshot.Load.
func openLayerInput(ctx context.Context, loc, digestFlag string) (*layerInput, error) {
	want := ""
	if digestFlag != "" {
		d, err := snapshot.ParseDigest(digestFlag)
		if err != nil {
			return nil, badInput("--digest: %v", err)
		}
		want = d
	}
	in := &layerInput{name: loc}
	// agree records a digest the layer must have, refusing up front two
	// sources that disagree.
	agree := func(d, tarDigest, by string) error {
		if d == "" {
			return nil
		}
		if in.digest != "" && in.digest != d {
			return fmt.Errorf("%s: %s records %s, %s says %s: %w", loc, by, d, in.checkedBy, in.digest, snapshot.ErrDigestMismatch)
		}
		if in.digest == "" {
			in.checkedBy = by
		} else {
			in.checkedBy += " and " + by
		}
		in.digest = d
		if tarDigest != "" {
			in.tarDigest = tarDigest
		}
		return nil
	}
	if err := agree(want, "", "--digest"); err != nil {
		return nil, err
	}
	path, local, err := store.LocalPath(loc)
	if err != nil {
		return nil, badInput("%v", err)
	}
	if local {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		fi, err := f.Stat()
		if err != nil || !fi.Mode().IsRegular() {
			f.Close()
			return nil, badInput("%q is not a regular file", loc)
		}
		in.r, in.size = f, fi.Size()
		m, err := snapshot.ReadManifestFile(snapshot.ManifestName(path))
		switch {
		case err == nil:
			in.manifest = m
			if err := agree(m.Digest, m.TarDigest, "the manifest beside it"); err != nil {
				f.Close()
				return nil, err
			}
		case !errors.Is(err, fs.ErrNotExist):
			f.Close()
			return nil, fmt.Errorf("the manifest beside %s: %w (remove it, or pass --digest)", loc, err)
		}
		return in, nil
	}
	st, name, err := openLocation(ctx, loc)
	if err != nil {
		return nil, err
	}
	closeStore := st.Close
	defer func() {
		if closeStore != nil {
			closeStore()
		}
	}()
	l, err := snapshot.Load(ctx, st, name)
	switch {
	case err == nil:
		in.manifest, in.storeDigest = l.Manifest, true
		in.r, in.size = closers{l, st}, l.Manifest.Size
		closeStore = nil
		if err := agree(l.Manifest.Digest, l.Manifest.TarDigest, "its manifest"); err != nil {
			in.Close()
			return nil, err
		}
		return in, nil
	case !errors.Is(err, store.ErrNotFound):
		return nil, err
	}
	// No manifest: what the store recorded, and --digest, are all there is.
	info, err := st.Stat(ctx, name)
	if err != nil {
		return nil, err
	}
	if info.Digest != "" {
		if err := agree(info.Digest, "", "the store"); err != nil {
			return nil, err
		}
		in.storeDigest = true
	}
	rc, err := st.Get(ctx, name)
	if err != nil {
		return nil, err
	}
	in.r, in.size = closers{rc, st}, info.Size
	closeStore = nil
	return in, nil
}

// check compares what Inspect measured with the digests the layer must
// have (Unpack does this itself).
func (in *layerInput) check(res *snapshot.ApplyResult) error {
	if in.digest != "" && res.Digest != in.digest {
		return fmt.Errorf("%s: sha256 %s, %s says %s: %w", in.name, res.Digest, in.checkedBy, in.digest, snapshot.ErrDigestMismatch)
	}
	if in.tarDigest != "" && res.TarDigest != in.tarDigest {
		return fmt.Errorf("%s: tar sha256 %s, %s says %s: %w", in.name, res.TarDigest, in.checkedBy, in.tarDigest, snapshot.ErrDigestMismatch)
	}
	return nil
}

// report says what was verified: on stdout, and on stderr when no digest
// at all was checked.
func (in *layerInput) report(c *cli.Context, res *snapshot.ApplyResult) {
	var checks []string
	switch {
	case in.digest != "" && in.tarDigest != "":
		checks = append(checks, "sha256 and tar sha256 against "+in.checkedBy)
	case in.digest != "":
		checks = append(checks, "sha256 against "+in.checkedBy)
	}
	switch res.StreamChecksum {
	case "crc32":
		checks = append(checks, "gzip CRC-32")
	case "xxhash64":
		checks = append(checks, "zstd frame checksums")
	}
	if len(checks) > 0 {
		fmt.Fprintf(c.App.Writer, "verified: %s\n", strings.Join(checks, "; "))
	}
	if in.digest == "" {
		why := "it has no manifest beside it and no --digest was given"
		if res.StreamChecksum == "" {
			why += ", and its " + string(res.Compression) + " stream carries no checksum of its own"
		}
		fmt.Fprintf(c.App.ErrWriter, "sandgate: no digest was checked: %s; pass --digest sha256:<hex> to check one\n", why)
	}
}

// closers closes a reader and then the store it came from.
type closers struct {
	io.ReadCloser
	st store.Store
}

func (c closers) Close() error {
	err := c.ReadCloser.Close()
	if serr := c.st.Close(); err == nil {
		err = serr
	}
	return err
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
	if p.total <= 0 { // the size is not known: no ETA either
		fmt.Fprintf(p.w, "\r%s  %s  %s/s   ", p.verb, human(p.done), human(int64(rate)))
		return
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
