package server

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"path"
	"strconv"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/transforms"
)

// What the credential guard names when it refuses a file or a tar.
const (
	whereFilePath    = "the file's path"
	whereFileContent = "the file's content"
	whereTar         = "the workspace tar (a file's content, an entry's name or link target, or a PAX record)"
)

// guardedFilePath is filePath, a path holding a credential of the sandbox
// refused first (the path goes into the sandbox, and errors quote it).
func (s *Server) guardedFilePath(r *http.Request) (string, error) {
	if err := s.guardOf(r.PathValue("name")).Check(whereFilePath, "/"+r.PathValue("path")); err != nil {
		return "", err
	}
	return filePath(r)
}

// filePath is the absolute path of a files route: /v1/sandboxes/{name}/
// files/{path...} names /path in the sandbox.
func filePath(r *http.Request) (string, error) {
	p := "/" + r.PathValue("path")
	if path.Clean(p) != p || p == "/" {
		return "", badRequest("file path %q: want a clean absolute path to a file, such as /workspace/notes.txt", p)
	}
	return p, nil
}

// running finds a route's running sandbox and marks a call in progress.
func (s *Server) running(w http.ResponseWriter, r *http.Request) (*appliance.Sandbox, func(), bool) {
	name := r.PathValue("name")
	sb, err := s.m.Sandbox(name)
	if err != nil {
		writeError(w, errNoSandbox(name))
		return nil, nil, false
	}
	return sb, sb.Use(), true
}

// readFile streams a file out of the sandbox, without a size cap or a
// shell. A missing file is 404; a directory is refused.
func (s *Server) readFile(w http.ResponseWriter, r *http.Request) {
	p, err := s.guardedFilePath(r)
	if err != nil {
		writeError(w, err)
		return
	}
	sb, done, ok := s.running(w, r)
	if !ok {
		return
	}
	defer done()
	fi, err := sb.Stat(r.Context(), p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		writeError(w, errorf(http.StatusNotFound, "no file %s in sandbox %q", p, r.PathValue("name")))
		return
	case err != nil:
		writeError(w, err)
		return
	case fi.IsDir():
		writeError(w, badRequest("%s is a directory: read files one by one, or the whole working directory as a tar from /v1/sandboxes/%s/workspace", p, r.PathValue("name")))
		return
	}
	rc, fi, err := sb.ReadFile(r.Context(), p)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			err = errorf(http.StatusNotFound, "no file %s in sandbox %q", p, r.PathValue("name"))
		}
		writeError(w, err)
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	if fi != nil && fi.Mode().IsRegular() {
		w.Header().Set("Content-Length", strconv.FormatInt(fi.Size(), 10))
	}
	w.WriteHeader(http.StatusOK)
	io.Copy(w, rc)
}

// writeFile streams the request body into a file of the sandbox (parents
// made); the file is replaced only once the whole body arrived.
func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) {
	p, err := s.guardedFilePath(r)
	if err != nil {
		writeError(w, err)
		return
	}
	sb, done, ok := s.running(w, r)
	if !ok {
		return
	}
	defer done()
	if fi, err := sb.Stat(r.Context(), p); err == nil && fi.IsDir() {
		writeError(w, badRequest("%s is a directory", p))
		return
	}
	// The content passes the credential guard on its way: the agent writes
	// it to a temporary name and renames it only once the whole body came,
	// so a refused write leaves the path as it was, and no byte of the
	// secret, which the guard never lets through, reaches the sandbox.
	body := s.guardOf(r.PathValue("name")).Reader(r.Body, whereFileContent)
	if _, err := sb.WriteFile(r.Context(), p, body, agent.WriteOptions{}); err != nil {
		writeError(w, credentialFirst(err))
		return
	}
	noContent(w)
}

// credentialFirst is the guard's own error when err (the agent's, wrapping
// what the source said) is a refused credential: its message then starts
// with the phrase a client looks for.
func credentialFirst(err error) error {
	var ce *transforms.CredentialError
	if errors.As(err, &ce) {
		return ce
	}
	return err
}

// workspaceOut streams the working directory as a tar, with its sha256 as
// a trailer, so a caller can prove what it received.
func (s *Server) workspaceOut(w http.ResponseWriter, r *http.Request) {
	sb, done, ok := s.running(w, r)
	if !ok {
		return
	}
	defer done()
	w.Header().Set("Content-Type", "application/x-tar")
	w.Header().Set("Trailer", api.HeaderLayerDigest)
	h := sha256.New()
	err := sb.TarOut(r.Context(), sandboxDir(s.cfg.WorkDir, r.PathValue("name")), io.MultiWriter(w, h))
	if err != nil {
		// The status is sent: a missing trailer tells the caller the tar
		// is not whole.
		s.log.Info("workspace tar cut short", "sandbox", r.PathValue("name"), "err", err)
		return
	}
	w.Header().Set(api.HeaderLayerDigest, "sha256:"+hex.EncodeToString(h.Sum(nil)))
}

// workspaceIn unpacks a tar (bare, gzip or zstd) into the working
// directory, through the agent's safe extraction.
//
// A sandbox that holds credentials gets the tar through the credential
// guard: the service decompresses it itself and passes on the bare tar an
// entry at a time, each header only once its name, link target and PAX
// records passed and the contents as they pass, so no byte of a secret
// goes in. The agent's extraction is all or nothing (it stages the tree
// beside the working directory and moves it in only once the stream ended
// whole), and a refused stream is cut without its end: what came before
// the refused entry is staged, then removed, and never applied.
func (s *Server) workspaceIn(w http.ResponseWriter, r *http.Request) {
	sb, done, ok := s.running(w, r)
	if !ok {
		return
	}
	defer done()
	var src io.Reader = r.Body
	if g := s.guardOf(r.PathValue("name")); !g.Empty() {
		dec, err := snapshot.Decompress(r.Body)
		if err != nil {
			writeError(w, badRequest("the workspace tar: %v", err))
			return
		}
		defer dec.Close()
		src = &sourceErr{r: g.TarReader(dec, whereTar)}
	}
	if err := sb.TarIn(r.Context(), sandboxDir(s.cfg.WorkDir, r.PathValue("name")), src, agent.TarOptions{}); err != nil {
		if se, ok := src.(*sourceErr); ok && se.err != nil && !errors.Is(se.err, transforms.ErrCredential) {
			// The service's own reading of the tar (its decompression,
			// its parser) refused it: bad input.
			err = badRequest("the workspace tar: %v (nothing was applied)", se.err)
		}
		writeError(w, credentialFirst(err))
		return
	}
	noContent(w)
}

// sourceErr notes how its reader failed, to tell the request's bytes
// refused from the agent failing.
type sourceErr struct {
	r   io.Reader
	err error
}

func (s *sourceErr) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		s.err = err
	}
	return n, err
}
