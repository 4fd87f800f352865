package bridge

import (
	"bytes"
	"encoding/json"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/sandgate/sandgate/appliance/sandboxcli"
)

// Workspace is the directory the contract confines paths to: a file
// route's path, an exec's cwd, a session's, hydrate and persist.
const Workspace = "/workspace"

// maxJSON bounds a JSON request body.
const maxJSON = 1 << 20

// The contract's rules for names.
var (
	sandboxIDPattern = regexp.MustCompile(`^[a-z2-7]{1,128}$`)
	sessionIDPattern = regexp.MustCompile(`^[a-zA-Z0-9._-]{1,128}$`)
	tunnelNamePat    = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`)
)

// checkSandboxID is the contract's rule for a sandbox id (lowercase
// base32, 1 to 128 characters) within sandgate's own (at most 63: an id is
// a sandbox's host name).
func checkSandboxID(id string) error {
	if !sandboxIDPattern.MatchString(id) {
		return invalid("Invalid sandbox ID format: want 1 to 128 characters of a-z and 2-7")
	}
	if len(id) > sandboxcli.MaxIDLength {
		return invalid("Invalid sandbox ID format: sandgate's sandbox ids are at most %d characters, this one has %d", sandboxcli.MaxIDLength, len(id))
	}
	return nil
}

// sessionHeader is a request's Session-Id ("" for none): the contract's
// rule, and never "..".
func sessionHeader(r *http.Request) (string, error) {
	v := r.Header.Values("Session-Id")
	switch {
	case len(v) == 0:
		return "", nil
	case len(v) > 1:
		return "", invalid("Invalid session ID format: Session-Id is sent %d times", len(v))
	}
	if err := checkSessionID(v[0]); err != nil {
		return "", err
	}
	return v[0], nil
}

func checkSessionID(s string) error {
	if !sessionIDPattern.MatchString(s) || strings.Contains(s, "..") {
		return invalid("Invalid session ID format: want 1 to 128 letters, digits, '.', '_' or '-', without '..'")
	}
	return nil
}

// resolveWorkspace resolves p as the contract does, lexically: a relative
// p is taken from /workspace, "." and empty segments are dropped and ".."
// removes the segment before it; the result must be /workspace or below
// it. A NUL byte is refused.
func resolveWorkspace(p string) (string, bool) {
	if strings.IndexByte(p, 0) >= 0 {
		return "", false
	}
	if !strings.HasPrefix(p, "/") {
		p = Workspace + "/" + p
	}
	var out []string
	for _, seg := range strings.Split(p, "/") {
		switch seg {
		case "", ".":
		case "..":
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
		default:
			out = append(out, seg)
		}
	}
	res := "/" + strings.Join(out, "/")
	if res != Workspace && !strings.HasPrefix(res, Workspace+"/") {
		return "", false
	}
	return res, true
}

// execBody is an exec request, checked.
type execBody struct {
	argv    []string
	timeout time.Duration // 0: none
	cwd     string        // "": the session's, else /workspace
}

// parseExecBody checks an exec request as the contract does: argv a
// non-empty array (strings, or numbers as written), timeout_ms used when
// it is a number, cwd when it is a string (403 unless it resolves inside
// /workspace); other fields are ignored.
func parseExecBody(data []byte) (execBody, error) {
	var e execBody
	var o map[string]json.RawMessage
	if err := json.Unmarshal(data, &o); err != nil {
		var arr []json.RawMessage
		if json.Unmarshal(data, &arr) == nil {
			return e, invalid("argv must be a non-empty array")
		}
		return e, invalid("Invalid JSON body")
	}
	var argv []json.RawMessage
	if raw, ok := o["argv"]; !ok || json.Unmarshal(raw, &argv) != nil || len(argv) == 0 || argv == nil {
		return e, invalid("argv must be a non-empty array")
	}
	for i, raw := range argv {
		raw = bytes.TrimSpace(raw)
		var s string
		switch {
		case len(raw) > 0 && raw[0] == '"':
			if json.Unmarshal(raw, &s) != nil {
				return e, invalid("argv[%d] must be a string", i)
			}
		case len(raw) > 0 && (raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9'):
			s = string(raw)
		default:
			return e, invalid("argv[%d] must be a string", i)
		}
		if strings.IndexByte(s, 0) >= 0 {
			return e, invalid("argv[%d] holds a NUL byte", i)
		}
		e.argv = append(e.argv, s)
	}
	if raw, ok := o["timeout_ms"]; ok {
		var ms float64
		if json.Unmarshal(raw, &ms) == nil && ms >= 1 {
			e.timeout = time.Duration(min(ms, float64(365*24*time.Hour/time.Millisecond))) * time.Millisecond
		}
	}
	if raw, ok := o["cwd"]; ok {
		var cwd string
		if json.Unmarshal(raw, &cwd) == nil && bytes.TrimSpace(raw)[0] == '"' {
			res, ok := resolveWorkspace(cwd)
			if !ok {
				return e, fail(http.StatusForbidden, codeInvalid, "cwd must resolve to a location within /workspace")
			}
			e.cwd = res
		}
	}
	return e, nil
}

// shellArgs runs argv as the contract's bash would resolve it (builtins,
// functions, then PATH) but with no quoting to get wrong: the words go to
// /bin/sh as its positional parameters, and "$@" is the command.
func shellArgs(argv []string) []string {
	return append([]string{"/bin/sh", "-c", `"$@"`, "sh"}, argv...)
}

// parseExcludes checks persist's ?excludes=: comma-separated paths
// relative to /workspace, empty items dropped, none holding "..".
func parseExcludes(q string) ([]string, error) {
	var out []string
	for _, item := range strings.Split(q, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if strings.Contains(item, "..") {
			return nil, invalid(`exclude paths must not contain ".."`)
		}
		if strings.IndexByte(item, 0) >= 0 {
			return nil, invalid("exclude paths must not hold a NUL byte")
		}
		item = strings.Trim(strings.TrimPrefix(item, "./"), "/")
		for strings.HasPrefix(item, "./") {
			item = strings.TrimPrefix(item, "./")
		}
		if item == "" || item == "." {
			continue
		}
		out = append(out, item)
	}
	return out, nil
}

// parsePort is a tunnel's port: 1024 to 65535, as the contract allows.
func parsePort(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1024 || n > 65535 || strconv.Itoa(n) != s {
		return 0, invalid("Invalid port: want 1024 to 65535")
	}
	return n, nil
}
