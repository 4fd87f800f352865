package bridge

import (
	"crypto/rand"
	"encoding/base32"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/sandgate/sandgate/appliance"
)

// newSandboxID is the contract's id: 16 random bytes, lowercase base32
// without padding (26 characters of a-z and 2-7).
func newSandboxID() string {
	var b [16]byte
	rand.Read(b[:])
	return strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b[:]))
}

// create mints an id and starts its sandbox at once (the contract's
// bridge only mints the id; starting now lets a full service say so here,
// and makes the sandbox count in the pool statistics). The body is
// ignored, as there; a caller that wants an id of its own just uses it.
func (b *Bridge) create(w http.ResponseWriter, r *http.Request) error {
	io.Copy(io.Discard, io.LimitReader(r.Body, maxJSON))
	id := newSandboxID()
	if _, err := b.b.Create(r.Context(), id, appliance.CreateOptions{Network: b.cfg.Network, Agent: b.agent(id), Dirs: b.dirs(id)}); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]string{"id": id})
	return nil
}

// destroy removes the sandbox, running or suspended, with its snapshot
// and sessions: 204, also for an id that has neither.
func (b *Bridge) destroy(w http.ResponseWriter, r *http.Request) error {
	if err := b.b.Destroy(r.Context(), r.PathValue("id")); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// running says whether the sandbox runs now: always 200. Unlike the
// contract's bridge it starts nothing to answer: a suspended or unknown
// id is false, and its next use resumes or creates it.
func (b *Bridge) running(w http.ResponseWriter, r *http.Request) error {
	in, err := b.b.Get(r.Context(), r.PathValue("id"))
	writeJSON(w, http.StatusOK, map[string]bool{"running": err == nil && in.State == appliance.Running})
	return nil
}

// createSession records a session: {"id"?, "cwd"?, "env"?}, kept with the
// sandbox (it outlives a suspend and a resume). A body that is no JSON
// object counts as {}, as in the contract.
func (b *Bridge) createSession(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	data, err := io.ReadAll(io.LimitReader(r.Body, maxJSON+1))
	if err != nil || len(data) > maxJSON {
		return fail(http.StatusBadGateway, codeSession, "session create failed: the body could not be read or is over %d bytes", maxJSON)
	}
	name, s, err := parseSessionBody(data)
	if err != nil {
		return err
	}
	if name == "" {
		name = "session-" + time.Now().UTC().Format("20060102T150405.000000000")
	}
	if s.Dir == "" {
		s.Dir = Workspace // the contract's container starts a session's shell there
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	if err := b.b.CreateSession(r.Context(), id, name, s); err != nil {
		if errors.Is(err, appliance.ErrExists) {
			return fail(http.StatusBadGateway, codeSession, "session create failed: %v", err)
		}
		return err
	}
	writeJSON(w, http.StatusOK, map[string]string{"id": name})
	return nil
}

// parseSessionBody reads a session request: id and cwd strings, env an
// object of strings. A body that is not a JSON object is {}.
func parseSessionBody(data []byte) (string, appliance.Session, error) {
	var s appliance.Session
	var o map[string]json.RawMessage
	if json.Unmarshal(data, &o) != nil {
		return "", s, nil
	}
	refuse := func(format string, args ...any) error {
		return fail(http.StatusBadGateway, codeSession, "session create failed: "+format, args...)
	}
	var name string
	if raw, ok := o["id"]; ok && string(raw) != "null" {
		if json.Unmarshal(raw, &name) != nil || checkSessionID(name) != nil {
			return "", s, refuse("id must be 1 to 128 letters, digits, '.', '_' or '-', without '..' (what Session-Id carries)")
		}
	}
	if raw, ok := o["cwd"]; ok && string(raw) != "null" {
		var cwd string
		if json.Unmarshal(raw, &cwd) != nil {
			return "", s, refuse("cwd must be a string")
		}
		res, ok := resolveWorkspace(cwd)
		if !ok {
			return "", s, refuse("cwd must resolve to a location within /workspace")
		}
		s.Dir = res
	}
	if raw, ok := o["env"]; ok && string(raw) != "null" {
		var env map[string]*string
		if json.Unmarshal(raw, &env) != nil {
			return "", s, refuse("env must be an object whose values are strings")
		}
		s.Env = map[string]string{}
		for k, v := range env {
			if v == nil {
				return "", s, refuse("env.%s must be a string", k)
			}
			if strings.IndexByte(k, 0) >= 0 || strings.IndexByte(*v, 0) >= 0 {
				return "", s, refuse("env holds a NUL byte")
			}
			s.Env[k] = *v
		}
	}
	return name, s, nil
}

// deleteSession removes a session: 200 {"success", "sessionId",
// "timestamp"}; one the sandbox does not have is the contract's 502.
func (b *Bridge) deleteSession(w http.ResponseWriter, r *http.Request) error {
	id, sid := r.PathValue("id"), r.PathValue("sid")
	if err := b.ensure(r.Context(), id, false); err != nil {
		if errors.Is(err, appliance.ErrNotFound) {
			return fail(http.StatusBadGateway, codeSession, "session delete failed: sandbox %q has no session %q", id, sid)
		}
		return err
	}
	if err := b.b.DeleteSession(r.Context(), id, sid); err != nil {
		if errors.Is(err, appliance.ErrNotFound) {
			return fail(http.StatusBadGateway, codeSession, "session delete failed: %v", err)
		}
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "sessionId": sid, "timestamp": now()})
	return nil
}

// PoolStats is GET /v1/pool/stats's answer, from the manager's counts:
// sandgate keeps no warm pool (warm 0), assigned is every sandbox running
// in the service, maxInstances how many may run at once.
type PoolStats struct {
	Warm     int `json:"warm"`
	Assigned int `json:"assigned"`
	Total    int `json:"total"`
	Config   struct {
		WarmTarget      int `json:"warmTarget"`
		RefreshInterval int `json:"refreshInterval"`
	} `json:"config"`
	MaxInstances *int `json:"maxInstances"`
}

func (b *Bridge) poolStats(w http.ResponseWriter, r *http.Request) error {
	c, err := b.b.Capacity(r.Context())
	if err != nil {
		return err
	}
	st := PoolStats{Assigned: c.Running, Total: c.Running, MaxInstances: &c.MaxRunning}
	writeJSON(w, http.StatusOK, st)
	return nil
}

// poolNoop answers prime and shutdown-prewarmed: there is no warm pool to
// prime or stop (a sandbox starts in about a tenth of a second).
func (b *Bridge) poolNoop(w http.ResponseWriter, r *http.Request) error {
	ok(w)
	return nil
}

// mount and unmount: sandgate mounts no buckets; the contract's failure.
func (b *Bridge) mount(w http.ResponseWriter, r *http.Request) error {
	return fail(http.StatusBadGateway, codeMount, "mount failed: bucket mounts are not supported by sandgate: a sandbox reaches storage through its egress policy (allow the bucket's host, and give the credential as a transformation)")
}

func (b *Bridge) unmount(w http.ResponseWriter, r *http.Request) error {
	return fail(http.StatusBadGateway, codeUnmount, "unmount failed: No active mount found (sandgate mounts no buckets)")
}

func (b *Bridge) openAPI(w http.ResponseWriter, r *http.Request) error {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Ai-Sdk-Sandbox-Protocol", "1") // as every answer of the rest of the service
	w.Write(b.doc)
	return nil
}
