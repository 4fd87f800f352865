package client

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"strings"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/api"
)

// Restricted is the part of a sandbox a tool may have: its files and its
// commands, nothing that stops it, changes its network, exposes its ports
// or hands it credentials. It is the same sandbox as the Session it came
// from, and the processes it starts are that session's (Stop kills them).
// Safe for concurrent use.
type Restricted struct {
	sb *sandbox
}

// Description is the text a harness gives an agent about the sandbox.
func (r *Restricted) Description() string {
	return fmt.Sprintf("sandgate sandbox %q: a Linux machine of its own; commands run with /bin/sh in %s, home %s, and files written there persist while it exists (it may be suspended between turns and resumed with its files).\n"+
		"It has no network of its own: HTTPS reaches only the hosts it is allowed, through sandgate's egress proxy (HTTPS_PROXY is set), and credentials it is given are placeholders that the proxy swaps for the real ones outside the sandbox.",
		r.sb.id, r.sb.workDir, r.sb.home)
}

// DefaultWorkingDirectory is where commands run and relative paths
// resolve.
func (r *Restricted) DefaultWorkingDirectory() string { return r.sb.workDir }

// Run runs a command to its end and returns its exit code and output. A
// non-zero exit is a result; the error is a failure to run it or to learn
// how it ended. Cancelling ctx kills the command.
func (r *Restricted) Run(ctx context.Context, cmd Command) (Result, error) {
	var out, errb bytes.Buffer
	if cmd.Stdout == nil {
		cmd.Stdout = &out
	}
	if cmd.Stderr == nil {
		cmd.Stderr = &errb
	}
	p, err := r.sb.spawn(ctx, cmd)
	if err != nil {
		return Result{ExitCode: -1}, err
	}
	code, err := p.Wait(ctx)
	return Result{ExitCode: code, Stdout: out.Bytes(), Stderr: errb.Bytes()}, err
}

// Spawn starts a command and returns at once: its output streams from
// the Process's readers (or to the Command's writers) as it is written,
// and Wait gives its exit code. Cancelling ctx kills it. A stream that
// breaks (a dropped connection) is resumed from the byte it reached: no
// output and no exit code is lost while the service keeps them (what was
// left of Command.Stdin is: the command's stdin ends there).
func (r *Restricted) Spawn(ctx context.Context, cmd Command) (*Process, error) {
	return r.sb.spawn(ctx, cmd)
}

// ReadFile streams a file of the sandbox; the caller closes it. A missing
// file is an error matching fs.ErrNotExist, a directory one matching
// syscall.EISDIR.
func (r *Restricted) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	p := r.sb.resolve(name)
	resp, err := r.sb.c.do(ctx, call{route: routeReadFile, args: []string{r.sb.id, p}, idempotent: true})
	if err != nil {
		return nil, r.sb.fileError("open", p, err)
	}
	return resp.Body, nil
}

// ReadTextFile reads a whole file as text.
func (r *Restricted) ReadTextFile(ctx context.Context, name string) (string, error) {
	rc, err := r.ReadFile(ctx, name)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", r.sb.resolve(name), err)
	}
	return string(b), nil
}

// ReadTextLines reads lines start to end of a file, 1-based and inclusive
// (end 0: to the end), joined with "\n" as they were: lines 2 to 3 of
// "a\nb\nc\n" are "b\nc". A range past the end gives what there is.
func (r *Restricted) ReadTextLines(ctx context.Context, name string, start, end int) (string, error) {
	if start < 1 || (end != 0 && end < start) {
		return "", fmt.Errorf("lines %d to %d: want 1 <= start <= end, or end 0 for the rest", start, end)
	}
	text, err := r.ReadTextFile(ctx, name)
	if err != nil {
		return "", err
	}
	lines := strings.Split(text, "\n")
	from, to := min(start-1, len(lines)), len(lines)
	if end != 0 {
		to = min(end, len(lines))
	}
	return strings.Join(lines[from:to], "\n"), nil
}

// WriteFile streams content into a file of the sandbox, making its parent
// directories; the file is replaced only once all of it arrived.
func (r *Restricted) WriteFile(ctx context.Context, name string, content io.Reader) error {
	p := r.sb.resolve(name)
	var body any = content
	if b, ok := content.(*bytes.Reader); ok && b.Len() < 1<<20 { // small: can be sent again
		buf := make([]byte, b.Len())
		b.Read(buf)
		body = buf
	}
	_, err := r.sb.c.doJSON(ctx, call{route: routeWriteFile, args: []string{r.sb.id, p}, body: body, raw: true, idempotent: true}, nil)
	if err != nil {
		return r.sb.fileError("write", p, err)
	}
	return nil
}

// WriteTextFile writes text to a file of the sandbox, making its parent
// directories.
func (r *Restricted) WriteTextFile(ctx context.Context, name, text string) error {
	p := r.sb.resolve(name)
	_, err := r.sb.c.doJSON(ctx, call{route: routeWriteFile, args: []string{r.sb.id, p}, body: []byte(text), raw: true, idempotent: true}, nil)
	if err != nil {
		return r.sb.fileError("write", p, err)
	}
	return nil
}

// fileError turns a files route's error into what it means: a missing
// file (fs.ErrNotExist), a directory (syscall.EISDIR), or a sandbox that
// is not running.
func (sb *sandbox) fileError(op, p string, err error) error {
	switch statusOf(err) {
	case http.StatusNotFound:
		// Both a missing file and a sandbox that is not running are 404:
		// ask which.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		in, ierr := sb.c.info(ctx, sb.id)
		switch {
		case errors.Is(ierr, ErrSandboxNotFound):
			return categorize(ErrSandboxNotFound, err, "sandbox %q is not running", sb.id)
		case ierr == nil && in.State != "running":
			return categorize(ErrSandboxNotRunning, err, "sandbox %q is %s", sb.id, in.State)
		}
		return &fs.PathError{Op: op, Path: p, Err: fs.ErrNotExist}
	case http.StatusBadRequest:
		var se *ServiceError
		if errors.As(err, &se) && strings.Contains(se.Message, "is a directory") {
			return &fs.PathError{Op: op, Path: p, Err: syscall.EISDIR}
		}
	}
	return err
}

// ExportWorkspace writes the sandbox's working directory to w as a tar
// and returns its digest ("sha256:<hex>"), checked against the one the
// service sends after it: a tar that does not match, or that comes
// without one (cut short), is ErrIntegrity, and what w received must
// then be thrown away.
func (r *Restricted) ExportWorkspace(ctx context.Context, w io.Writer) (string, error) {
	resp, err := r.sb.c.do(ctx, call{route: routeWorkspaceOut, args: []string{r.sb.id}, idempotent: true})
	if err != nil {
		if statusOf(err) == http.StatusNotFound {
			return "", categorize(ErrSandboxNotFound, err, "sandbox %q is not running", r.sb.id)
		}
		return "", err
	}
	defer resp.Body.Close()
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(w, h), resp.Body); err != nil {
		return "", fmt.Errorf("workspace tar of %s: %w", r.sb.id, err)
	}
	got := "sha256:" + hex.EncodeToString(h.Sum(nil))
	want := resp.Trailer.Get(api.HeaderLayerDigest)
	switch {
	case want == "":
		return "", fmt.Errorf("%w: the workspace tar of %s came without its digest (%s): it was cut short", ErrIntegrity, r.sb.id, api.HeaderLayerDigest)
	case want != got:
		return "", fmt.Errorf("%w: the workspace tar of %s hashes to %s, the service says %s", ErrIntegrity, r.sb.id, got, want)
	}
	return got, nil
}

// ImportWorkspace unpacks a tar (bare, gzip or zstd) into the sandbox's
// working directory; the service refuses entries that would escape it.
func (r *Restricted) ImportWorkspace(ctx context.Context, tar io.Reader) error {
	_, err := r.sb.c.doJSON(ctx, call{route: routeWorkspaceIn, args: []string{r.sb.id}, body: tar, raw: true}, nil)
	if err != nil && statusOf(err) == http.StatusNotFound {
		return categorize(ErrSandboxNotFound, err, "sandbox %q is not running", r.sb.id)
	}
	return err
}
