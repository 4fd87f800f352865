package client

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/sandgate/sandgate/api"
)

// Command is a command to run in a sandbox: `/bin/sh -c Command`.
type Command struct {
	// Command is a shell command line.
	Command string
	// WorkingDirectory is where it runs; a relative one is resolved
	// against the sandbox's working directory, which is the default.
	WorkingDirectory string
	// Env sets variables on top of what every command gets (PATH, HOME,
	// the proxy variables, the base URLs...). Names are letters, digits
	// and _, not starting with a digit.
	Env map[string]string
	// Stdin, when set, is the command's standard input, streamed; its end
	// closes the command's. Without it the command's stdin is empty.
	Stdin io.Reader
	// Stdout and Stderr, when set, receive the command's output as it
	// arrives, as in os/exec; then the Process's reader of that stream is
	// nil, and Run's Result holds nothing of it.
	Stdout, Stderr io.Writer
}

// Result is what Run returns: a non-zero exit code is a result, not an
// error.
type Result struct {
	ExitCode int
	Stdout   []byte
	Stderr   []byte
}

// Network policy modes.
const (
	ModeAllowAll = "allow-all"
	ModeDenyAll  = "deny-all"
	ModeCustom   = "custom"
)

// NetworkPolicy is the AI SDK harness's network policy: allow-all,
// deny-all, or custom: the hosts and address ranges a sandbox may reach.
// DeniedCIDRs win over both allow lists. Private addresses stay refused
// whatever it says.
type NetworkPolicy struct {
	Mode         string   `json:"mode"`
	AllowedHosts []string `json:"allowedHosts,omitempty"`
	AllowedCIDRs []string `json:"allowedCIDRs,omitempty"`
	DeniedCIDRs  []string `json:"deniedCIDRs,omitempty"`
	// Intercept names hosts whose HTTPS the service terminates (with its
	// own CA, which its sandboxes trust) so that credential swaps and
	// modules apply to tunnels too, not only to base-URL routes
	// (sandgate's own). It allows nothing by itself.
	Intercept []string `json:"intercept,omitempty"`
}

func (p NetworkPolicy) check() error {
	switch p.Mode {
	case ModeAllowAll, ModeDenyAll:
		if len(p.AllowedHosts)+len(p.AllowedCIDRs)+len(p.DeniedCIDRs) > 0 {
			return fmt.Errorf("network policy %s takes no hosts or CIDRs: use mode %q to list them", p.Mode, ModeCustom)
		}
		if p.Mode == ModeDenyAll && len(p.Intercept) > 0 {
			return fmt.Errorf("network policy %s reaches no host, so it intercepts none", p.Mode)
		}
	case ModeCustom:
	default:
		return fmt.Errorf("network policy mode %q: want %q, %q or %q", p.Mode, ModeAllowAll, ModeDenyAll, ModeCustom)
	}
	return nil
}

// StringMatcher matches a string exactly, by prefix, or by a regular
// expression found anywhere in it. Make one with Exact, StartsWith or
// Regex.
type StringMatcher struct {
	kind, value string
}

// Exact matches s exactly.
func Exact(s string) *StringMatcher { return &StringMatcher{"exact", s} }

// StartsWith matches strings that begin with s.
func StartsWith(s string) *StringMatcher { return &StringMatcher{"startsWith", s} }

// Regex matches strings in which the regular expression re is found.
func Regex(re string) *StringMatcher { return &StringMatcher{"regex", re} }

// MarshalJSON writes {"exact": s}, {"startsWith": s} or {"regex": re}.
func (m StringMatcher) MarshalJSON() ([]byte, error) {
	if m.kind == "" {
		return nil, errors.New("an empty StringMatcher: make one with Exact, StartsWith or Regex")
	}
	return json.Marshal(map[string]string{m.kind: m.value})
}

// UnmarshalJSON reads what MarshalJSON writes.
func (m *StringMatcher) UnmarshalJSON(b []byte) error {
	var v map[string]string
	if err := json.Unmarshal(b, &v); err != nil || len(v) != 1 {
		return fmt.Errorf("a string matcher is one of {exact}, {startsWith}, {regex}: %s", b)
	}
	for k, s := range v {
		if k != "exact" && k != "startsWith" && k != "regex" {
			return fmt.Errorf("a string matcher is one of {exact}, {startsWith}, {regex}, not {%q}", k)
		}
		m.kind, m.value = k, s
	}
	return nil
}

// KeyValueMatcher matches a header or query parameter: the key and the
// value, each when given.
type KeyValueMatcher struct {
	Key   *StringMatcher `json:"key,omitempty"`
	Value *StringMatcher `json:"value,omitempty"`
}

// Match says which requests a RequestTransformation applies to: every
// matcher given must hold. Host is required.
type Match struct {
	Host        string            `json:"host"`
	Path        *StringMatcher    `json:"path,omitempty"`
	Method      []string          `json:"method,omitempty"`
	Headers     []KeyValueMatcher `json:"headers,omitempty"`
	QueryString []KeyValueMatcher `json:"queryString,omitempty"`
}

// Transform is what a RequestTransformation does: set these headers.
type Transform struct {
	Headers map[string]string `json:"headers"`
}

// RequestTransformation is the AI SDK harness's request transformation:
// on a request from the sandbox that Match matches, the service sets the
// headers of Transform, outside the sandbox. Put a real credential in
// Transform and give the sandbox a placeholder: the credential never
// enters it, and an upstream that echoes it back gets it scrubbed to the
// placeholder on the way in.
type RequestTransformation struct {
	Match     Match     `json:"match"`
	Transform Transform `json:"transform"`
}

// Module is a WebAssembly transform module (http-wasm) a sandbox's
// routed requests go through, before the credential swap.
type Module struct {
	Name   string `json:"name"`
	Wasm   []byte `json:"wasm"` // the module's bytes (base64 on the wire)
	Config string `json:"config,omitempty"`
}

// SandboxInfo describes a sandbox, running or suspended. It marshals to
// JSON exactly as the service describes a sandbox (GET
// /v1/sandboxes/{name}): one shape for one thing, whoever prints it.
type SandboxInfo struct {
	Name       string    `json:"name"`
	State      string    `json:"state"` // starting, running, suspending, suspended
	Created    time.Time `json:"created"`
	LastActive time.Time `json:"lastActive,omitzero"` // zero if unknown
	// LayerBytes is what its writable layer takes: on disk while it runs
	// (where the sandbox CLI tells), its compressed snapshot when
	// suspended.
	LayerBytes int64  `json:"layerBytes"`
	Template   string `json:"template,omitempty"`
	// OpenPorts are the ports with a tunnel or bridge connection open now.
	OpenPorts []int             `json:"ports,omitempty"`
	Policy    *NetworkPolicy    `json:"policy,omitempty"`
	BaseURLs  map[string]string `json:"baseUrls,omitempty"`
	// Modules are its own WebAssembly transform modules (never their
	// bytes).
	Modules          []ModuleInfo `json:"modules,omitempty"`
	Home             string       `json:"home"`
	WorkingDirectory string       `json:"workingDirectory"`
	// Shard is the shard running it, when several services share one
	// store (WithShards).
	Shard string `json:"shard,omitempty"`
	// SuspendedBy says who suspended it (suspended sandboxes): "caller"
	// (it stays suspended until resumed), or the service on its own
	// ("idle", "shutdown", "recovery", "shard-lost"), when its next call
	// wakes it.
	SuspendedBy string `json:"suspendedBy,omitempty"`
	// Limits are what it may take: its own (CreateOptions.Limits) over
	// the service's defaults.
	Limits *Limits `json:"limits,omitempty"`
	// Usage is what it uses now: running sandboxes, where the service can
	// read it (not on Google's sandbox CLI); nil otherwise.
	Usage *Usage `json:"usage,omitempty"`
}

// Wakes says whether a suspended sandbox's next call wakes it: the
// service suspended it on its own. One its caller suspended, or one
// suspended by an older service, stays suspended until resumed.
func (i SandboxInfo) Wakes() bool {
	switch i.SuspendedBy {
	case "idle", "shutdown", "recovery", "shard-lost":
		return i.State == "suspended"
	}
	return false
}

// KeptNetwork is the network a Resume without one kept
// (Session.KeptNetwork): the sandbox's last, or, when none was kept with
// it (a snapshot of an older sandgate, or of the reference service), the
// service's allowed hosts and base URLs alone (Kept false).
type KeptNetwork struct {
	Kept     bool
	Policy   *NetworkPolicy
	BaseURLs map[string]string
}

// Usage is what a running sandbox uses of the host now (the service's
// api.Usage): CPU seconds, memory now and at its peak, what its writable
// layer allocates and may allocate, processes and threads. A field not
// known is zero.
type Usage = api.Usage

// Limits bound what one sandbox may take (sandgate's own, at create). A
// zero field means the service's default, which the service settings set
// (SANDGATE_SANDBOX_CPU, SANDGATE_SANDBOX_MEMORY, ...).
type Limits struct {
	// CPU is how many cores' worth of time its processes may use
	// together, e.g. 0.5 or 2; past it they are throttled.
	CPU float64
	// CPUWeight is its share of the cores when sandboxes contend for
	// them, 1 to 10000 (100 is an equal share).
	CPUWeight int
	// Memory is the bytes its processes, /tmp and /dev/shm may hold.
	Memory int64
	// Pids is how many processes and threads it may have at once.
	Pids int
	// Disk is the bytes its writable layer may allocate.
	Disk int64
	// Lifetime is the longest it may exist from its creation, running
	// or suspended; KeepSuspended how long it is kept while suspended.
	Lifetime, KeepSuspended time.Duration
}

// limitsWire is Limits as the service reads and writes them: sizes in
// bytes, durations as Go durations ("24h0m0s"), zero fields left out.
type limitsWire struct {
	CPU           float64 `json:"cpu,omitempty"`
	CPUWeight     int     `json:"cpuWeight,omitempty"`
	Memory        int64   `json:"memory,omitempty"`
	Pids          int     `json:"pids,omitempty"`
	Disk          int64   `json:"disk,omitempty"`
	Lifetime      string  `json:"lifetime,omitempty"`
	KeepSuspended string  `json:"keepSuspended,omitempty"`
}

// MarshalJSON writes the service's shape.
func (l Limits) MarshalJSON() ([]byte, error) {
	w := limitsWire{CPU: l.CPU, CPUWeight: l.CPUWeight, Memory: l.Memory, Pids: l.Pids, Disk: l.Disk}
	if l.Lifetime != 0 {
		w.Lifetime = l.Lifetime.String()
	}
	if l.KeepSuspended != 0 {
		w.KeepSuspended = l.KeepSuspended.String()
	}
	return json.Marshal(w)
}

// UnmarshalJSON reads what MarshalJSON writes.
func (l *Limits) UnmarshalJSON(b []byte) error {
	var w limitsWire
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*l = Limits{CPU: w.CPU, CPUWeight: w.CPUWeight, Memory: w.Memory, Pids: w.Pids, Disk: w.Disk}
	for _, d := range []struct {
		s   string
		dst *time.Duration
	}{{w.Lifetime, &l.Lifetime}, {w.KeepSuspended, &l.KeepSuspended}} {
		if d.s == "" {
			continue
		}
		v, err := time.ParseDuration(d.s)
		if err != nil {
			return fmt.Errorf("limits: %w", err)
		}
		*d.dst = v
	}
	return nil
}

// ModuleInfo describes one of a sandbox's own modules: its name, the
// sha256 of its bytes ("sha256:<hex>") and their size (0 when not known:
// a suspended sandbox's).
type ModuleInfo struct {
	Name   string `json:"name"`
	Digest string `json:"digest"`
	Bytes  int    `json:"bytes,omitempty"`
}

// TemplateInfo describes a template of the service's namespace. It
// marshals as the service lists one (GET /v1/templates).
type TemplateInfo struct {
	ID         string    `json:"id"`
	Created    time.Time `json:"created"`
	LayerBytes int64     `json:"layerBytes"` // its layer in the store, compressed
}

// Endpoint is how to reach a port of a sandbox from outside: a URL, and
// the headers the connection must carry.
type Endpoint struct {
	URL    string
	Header http.Header
}
