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
)

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
	p, err := filePath(r)
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
	p, err := filePath(r)
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
	if _, err := sb.WriteFile(r.Context(), p, r.Body, agent.WriteOptions{}); err != nil {
		writeError(w, err)
		return
	}
	noContent(w)
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
func (s *Server) workspaceIn(w http.ResponseWriter, r *http.Request) {
	sb, done, ok := s.running(w, r)
	if !ok {
		return
	}
	defer done()
	if err := sb.TarIn(r.Context(), sandboxDir(s.cfg.WorkDir, r.PathValue("name")), r.Body, agent.TarOptions{}); err != nil {
		writeError(w, err)
		return
	}
	noContent(w)
}
