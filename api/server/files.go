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
)

// filePath is the absolute path of a files route: /v1/sandboxes/{name}/
// files/{path...} names /path in the sandbox.
func filePath(r *http.Request) (string, error) {
	p := "/" + r.PathValue("path")
	if path.Clean(p) != p || p == "/" {
		// Not quoted: what a caller sends may hold a credential, and only
		// the backend's guard may look at it.
		return "", badRequest("the file path is not clean (no //, . or .. segments, no trailing /): want an absolute path to a file, such as /workspace/notes.txt")
	}
	return p, nil
}

// readFile streams a file out of the sandbox, without a size cap or a
// shell. A missing file is 404; a directory is refused.
func (s *Server) readFile(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	p, err := filePath(r)
	if err != nil {
		return err
	}
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	fi, err := s.b.Stat(r.Context(), name, p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errorf(http.StatusNotFound, "no file %s in sandbox %q", p, name)
	case err != nil:
		return err
	case fi.IsDir():
		return badRequest("%s is a directory: read files one by one, or the whole working directory as a tar from /v1/sandboxes/%s/workspace", p, name)
	}
	rc, fi, err := s.b.ReadFile(r.Context(), name, p)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			err = errorf(http.StatusNotFound, "no file %s in sandbox %q", p, name)
		}
		return err
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	if fi != nil && fi.Mode().IsRegular() {
		w.Header().Set("Content-Length", strconv.FormatInt(fi.Size(), 10))
	}
	w.WriteHeader(http.StatusOK)
	io.Copy(w, rc)
	return nil
}

// writeFile streams the request body into a file of the sandbox (parents
// made); the file is replaced only once the whole body arrived, and what
// holds a credential of the sandbox is refused before any of it goes in.
func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	p, err := filePath(r)
	if err != nil {
		return err
	}
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	if fi, err := s.b.Stat(r.Context(), name, p); err == nil && fi.IsDir() {
		return badRequest("%s is a directory", p)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if _, err := s.b.WriteFile(r.Context(), name, p, r.Body); err != nil {
		return err
	}
	noContent(w)
	return nil
}

// workspaceOut streams the working directory as a tar, with its sha256 as
// a trailer, so a caller can prove what it received.
func (s *Server) workspaceOut(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/x-tar")
	w.Header().Set("Trailer", api.HeaderLayerDigest)
	h := sha256.New()
	if err := s.b.TarOut(r.Context(), name, sandboxDir(s.cfg.WorkDir, name), io.MultiWriter(w, h)); err != nil {
		// The status is sent: a missing trailer tells the caller the tar
		// is not whole.
		s.log.Info("workspace tar cut short", "sandbox", name, "err", err)
		return nil
	}
	w.Header().Set(api.HeaderLayerDigest, "sha256:"+hex.EncodeToString(h.Sum(nil)))
	return nil
}

// workspaceIn unpacks a tar (bare, gzip or zstd) into the working
// directory, all or nothing, through the agent's safe extraction (and,
// for a sandbox holding credentials, the credential guard).
func (s *Server) workspaceIn(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	if err := s.b.TarIn(r.Context(), name, sandboxDir(s.cfg.WorkDir, name), r.Body); err != nil {
		return err
	}
	noContent(w)
	return nil
}
