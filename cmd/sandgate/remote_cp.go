package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/api/client"
)

// cpEnd is one side of cp: a path here, or in a sandbox.
type cpEnd struct{ sandbox, path string }

var sandboxPrefix = regexp.MustCompile(`^([a-z0-9][a-z0-9-]{0,62}):(.*)$`)

func parseCpEnd(s string) cpEnd {
	if m := sandboxPrefix.FindStringSubmatch(s); m != nil {
		return cpEnd{sandbox: m[1], path: m[2]}
	}
	return cpEnd{path: s}
}

// progressMin is the transfer size from which the progress bar shows.
const progressMin = 4 << 20

// transferBar is the progress bar of snapshot.go, shown on a terminal for
// a transfer once it passes progressMin.
type transferBar struct {
	p     *progress
	drawn bool
}

func newTransferBar(c *cli.Context, verb string, total int64) *transferBar {
	return &transferBar{p: newProgress(c.App.ErrWriter, verb, func() int64 { return total })}
}

func (b *transferBar) set(n int64) {
	if n >= progressMin {
		b.drawn = true
		b.p.set(n)
	}
}

func (b *transferBar) finish() {
	if b.drawn {
		b.p.finish()
	}
}

// countingReader reports the bytes read so far.
type countingReader struct {
	r    io.Reader
	n    int64
	note func(int64)
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	c.note(c.n)
	return n, err
}

// countingWriter reports the bytes written so far.
type countingWriter struct {
	w    io.Writer
	n    int64
	note func(int64)
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	c.note(c.n)
	return n, err
}

func runCp(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 2 {
		return badInput("cp takes SRC and DST, one of them NAME:PATH")
	}
	src, dst := parseCpEnd(args[0]), parseCpEnd(args[1])
	switch {
	case src.sandbox != "" && dst.sandbox != "":
		return badInput("cp copies between this machine and a sandbox: copy here first, then on")
	case src.sandbox == "" && dst.sandbox == "":
		return badInput("cp: one of SRC and DST must be NAME:PATH, a path in sandbox NAME")
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	name := src.sandbox + dst.sandbox
	s, err := cl.Attach(c.Context, name)
	if err != nil {
		return err
	}
	if dst.sandbox != "" {
		return copyIn(c, s, src.path, dst.path)
	}
	return copyOut(c, s, src.path, dst.path)
}

// inSandbox makes a sandbox path absolute.
func inSandbox(s *client.Session, p string) string {
	if p == "" {
		return s.DefaultWorkingDirectory()
	}
	if !path.IsAbs(p) {
		p = path.Join(s.DefaultWorkingDirectory(), p)
	}
	return path.Clean(p)
}

// script is the command line running shell script body with $0 = arg.
func script(body, arg string) string {
	return "sh -c " + shellQuote(body) + " " + shellQuote(arg)
}

// probe says what is at p in the sandbox: "dir", "file" or "none", and
// its size in bytes (about, for a directory).
func probe(ctx context.Context, s *client.Session, p string) (string, int64, error) {
	res, err := s.Run(ctx, client.Command{Command: script(`if [ -d "$0" ]; then echo dir $(( $(du -sk "$0" 2>/dev/null | cut -f1) * 1024 )); elif [ -e "$0" ]; then echo file $(wc -c < "$0"); else echo none; fi`, p)})
	if err != nil {
		return "", 0, err
	}
	f := strings.Fields(string(res.Stdout))
	if res.ExitCode != 0 || len(f) == 0 {
		return "", 0, fmt.Errorf("looking at %s in sandbox %s: exit %d: %s", p, s.ID(), res.ExitCode, bytes.TrimSpace(res.Stderr))
	}
	var size int64
	if len(f) > 1 {
		size, _ = strconv.ParseInt(f[1], 10, 64)
	}
	return f[0], size, nil
}

// runTar runs a tar command in the sandbox, failing on a non-zero exit
// with its stderr.
func runTar(ctx context.Context, s *client.Session, cmd client.Command) error {
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	p, err := s.Spawn(ctx, cmd)
	if err != nil {
		return err
	}
	code, err := p.Wait(ctx)
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("tar in sandbox %s exited %d: %s (directories are copied with the sandbox's tar)", s.ID(), code, bytes.TrimSpace(stderr.Bytes()))
	}
	return nil
}

const untarScript = `mkdir -p "$0" && exec tar -x -f - -C "$0"`

func copyIn(c *cli.Context, s *client.Session, src, dst string) error {
	ctx := c.Context
	target := inSandbox(s, dst)
	if src == "-" {
		return runTar(ctx, s, client.Command{Command: script(untarScript, target), Stdin: c.App.Reader, Stdout: io.Discard})
	}
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	kind, _, err := probe(ctx, s, target)
	if err != nil {
		return err
	}
	if kind == "dir" || strings.HasSuffix(dst, "/") {
		target = path.Join(target, filepath.Base(src))
	}
	if !fi.IsDir() {
		f, err := os.Open(src)
		if err != nil {
			return err
		}
		defer f.Close()
		bar := newTransferBar(c, "cp", fi.Size())
		defer bar.finish()
		if err := s.WriteFile(ctx, target, &countingReader{r: f, note: bar.set}); err != nil {
			return err
		}
		if mode := fi.Mode().Perm(); mode != 0o644 {
			res, err := s.Run(ctx, client.Command{Command: "chmod " + strconv.FormatUint(uint64(mode), 8) + " " + shellQuote(target)})
			if err != nil || res.ExitCode != 0 {
				return fmt.Errorf("chmod %s: %v %s", target, err, res.Stderr)
			}
		}
		return nil
	}
	bar := newTransferBar(c, "cp", treeSize(src))
	defer bar.finish()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(src, &countingWriter{w: pw, note: bar.set})) }()
	err = runTar(ctx, s, client.Command{Command: script(untarScript, target), Stdin: pr, Stdout: io.Discard})
	pr.CloseWithError(errors.New("cp ended"))
	return err
}

// writeTar writes the tree under dir as a tar, names relative to it.
func writeTar(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		} else if !fi.Mode().IsRegular() && !fi.IsDir() {
			return nil // sockets, devices, pipes: not copied
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			h.Name += "/"
		}
		h.Uname, h.Gname = "", ""
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

func copyOut(c *cli.Context, s *client.Session, src, dst string) error {
	ctx := c.Context
	from := inSandbox(s, src)
	if dst == "-" {
		return runTar(ctx, s, client.Command{Command: script(`cd "$(dirname "$0")" && exec tar -c -f - "$(basename "$0")"`, from), Stdout: c.App.Writer})
	}
	kind, size, err := probe(ctx, s, from)
	if err != nil {
		return err
	}
	if kind == "none" {
		return fmt.Errorf("%s:%s: %w", s.ID(), from, fs.ErrNotExist)
	}
	target := dst
	if fi, err := os.Stat(dst); (err == nil && fi.IsDir()) || strings.HasSuffix(dst, "/") {
		target = filepath.Join(dst, path.Base(from))
	}
	bar := newTransferBar(c, "cp", size)
	defer bar.finish()
	if kind == "file" {
		rc, err := s.ReadFile(ctx, from)
		if err != nil {
			return err
		}
		defer rc.Close()
		f, err := os.Create(target)
		if err != nil {
			return err
		}
		if _, err := io.Copy(f, &countingReader{r: rc, note: bar.set}); err != nil {
			f.Close()
			return err
		}
		return f.Close()
	}
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := untarSafe(&countingReader{r: pr, note: bar.set}, target)
		if err != nil {
			pr.CloseWithError(err) // a failed unpack ends the tar in the sandbox too
		} else {
			io.Copy(io.Discard, pr) // the archive's padding
		}
		done <- err
	}()
	err = runTar(ctx, s, client.Command{Command: script(`exec tar -c -f - -C "$0" .`, from), Stdout: pw})
	pw.CloseWithError(err)
	if uerr := <-done; uerr != nil {
		return uerr
	}
	return err
}

// untarSafe unpacks a tar from a sandbox (which its agent could have
// written anything into) into dir: nothing outside dir is written, no link
// leads out of it, and no setuid bit, device or pipe is made.
func untarSafe(r io.Reader, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("the tar from the sandbox: %w", err)
		}
		name := path.Clean(strings.TrimPrefix(h.Name, "/"))
		if name == "." {
			continue
		}
		if name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("the tar from the sandbox names %q, outside the directory: refused", h.Name)
		}
		mode := fs.FileMode(h.Mode).Perm()
		if dir := path.Dir(name); dir != "." {
			if err := root.MkdirAll(dir, 0o755); err != nil {
				return err
			}
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, 0o755); err != nil {
				return err
			}
			if err := root.Chmod(name, mode|0o700); err != nil {
				return err
			}
		case tar.TypeReg:
			root.Remove(name) // a link there is replaced, not written through
			f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, mode)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		case tar.TypeSymlink:
			root.Remove(name)
			if err := root.Symlink(h.Linkname, name); err != nil {
				return err
			}
		case tar.TypeLink:
			root.Remove(name)
			if err := root.Link(path.Clean(strings.TrimPrefix(h.Linkname, "./")), name); err != nil {
				return err
			}
		}
		// Anything else (devices, pipes) is not made.
	}
}
