// Package api is the wire of sandgate's HTTP service: protocol 1 of
// ai-sdk-sandbox-cloud-run (the routes, headers, bodies and exec frames its
// TypeScript client speaks) and sandgate's own routes beside it under /v1.
// The server is api/server; the Go client is api/client.
package api

import (
	"io"
	"net/http"
	"strings"
	"time"
)

// ProtocolVersion is the protocol the service speaks and the client sends.
const ProtocolVersion = 1

// Headers of every request and response.
const (
	// HeaderProtocol carries the protocol version: the client sends it on
	// every call, the service on every reply.
	HeaderProtocol = "X-Ai-Sdk-Sandbox-Protocol"
	// HeaderToken carries the service token, when the service has one.
	HeaderToken = "X-Ai-Sdk-Sandbox-Token"
	// HeaderProcessID names the process an exec response streams.
	HeaderProcessID = "X-Process-Id"
	// HeaderLayerDigest is the sha256 of a workspace tar, as a trailer
	// of the response that streams it ("sha256:<hex>").
	HeaderLayerDigest = "X-Sandgate-Sha256"
	// HeaderOwner names the shard (its URL, or its id when it has none)
	// that runs a sandbox, on every answer about one when several
	// services share a store: a client sends the sandbox's next calls
	// there.
	HeaderOwner = "X-Sandgate-Owner"
	// HeaderForwarded marks a request one shard sent another (its value
	// the sender's id): served where it arrives, never forwarded again.
	HeaderForwarded = "X-Sandgate-Forwarded"
)

// ServiceHeader reports whether a header is one this service or its
// clients give a meaning to: every x-sandgate-* (the owner a client
// follows, the digest it checks), protocol 1's x-ai-sdk-sandbox-* and
// x-process-id. Only the service sets them: an answer it relays from a
// server in a sandbox (a port tunnel's) carries none of the sandbox's
// (StripServiceHeaders), so that no sandbox can send a client elsewhere
// or speak for the service.
func ServiceHeader(name string) bool {
	n := strings.ToLower(name)
	return strings.HasPrefix(n, "x-sandgate-") || strings.HasPrefix(n, "x-ai-sdk-sandbox-") || n == "x-process-id"
}

// StripServiceHeaders removes every ServiceHeader from h.
func StripServiceHeaders(h http.Header) {
	for k := range h {
		if ServiceHeader(k) {
			delete(h, k)
		}
	}
}

// StripAnswer removes every ServiceHeader from an answer the service
// relays from a server in a sandbox: from its header, and from its
// trailer as announced and as it arrives after the body.
func StripAnswer(resp *http.Response) {
	StripServiceHeaders(resp.Header)
	if resp.Trailer != nil {
		StripServiceHeaders(resp.Trailer)
		resp.Body = &trailerStripper{ReadCloser: resp.Body, resp: resp}
	}
}

// trailerStripper strips the trailer an answer's reader fills in once the
// body has been read whole.
type trailerStripper struct {
	io.ReadCloser
	resp *http.Response
}

func (t *trailerStripper) Read(p []byte) (int, error) {
	n, err := t.ReadCloser.Read(p)
	if err == io.EOF {
		StripServiceHeaders(t.resp.Trailer)
	}
	return n, err
}

func (t *trailerStripper) Close() error {
	err := t.ReadCloser.Close()
	StripServiceHeaders(t.resp.Trailer)
	return err
}

// MaxJSONBody bounds a JSON request body (and exec's first line).
const MaxJSONBody = 1 << 20

// MediaProgress is the media type a caller accepts (Accept) to be told a
// long route's progress (suspend, resume, a template's save): the answer
// is 200 and JSON lines, ProgressLine each.
const MediaProgress = "application/x-ndjson"

// ProgressLine is one line of a long route's progress: Progress while it
// runs; last, its outcome: the status the route would have answered, and
// its body (Result) or its error.
type ProgressLine struct {
	Progress *Progress `json:"progress,omitempty"`
	Status   int       `json:"status,omitempty"`
	Result   any       `json:"result,omitempty"`
	Error    string    `json:"error,omitempty"`
}

// Progress is how far a long route's step has come: "save" (tar bytes
// packed, of about Total, what the layer takes on disk) or "fetch"
// (compressed bytes of the snapshot read, of Total). Total is 0 when
// unknown.
type Progress struct {
	Step  string `json:"step"`
	Bytes int64  `json:"bytes"`
	Total int64  `json:"total,omitempty"`
}

// Description is what create and resume answer: the sandbox's name, home
// and working directory.
type Description struct {
	Name             string `json:"name"`
	Home             string `json:"home"`
	WorkingDirectory string `json:"workingDirectory"`
	// Network is sandgate's own, in the answer of a resume that asked to
	// keep the sandbox's network ("keepNetwork"): what it runs with now.
	Network *KeptNetwork `json:"network,omitempty"`
}

// KeptNetwork is the network a resume kept (Description.Network).
type KeptNetwork struct {
	// Kept is true when the sandbox has the network it last had (running,
	// or kept with its snapshot); false when none was kept (a snapshot of
	// an older sandgate, or of the reference service), so that it runs
	// with the service's allowed hosts and base URLs alone.
	Kept     bool              `json:"kept"`
	Policy   any               `json:"policy,omitempty"`
	BaseURLs map[string]string `json:"baseUrls,omitempty"`
}

// Health is GET /health's answer. OK is always true: the Cloudflare
// bridge's health answer ({"ok": true}) in the same body.
type Health struct {
	Status   string `json:"status"`
	Protocol int    `json:"protocol"`
	Version  string `json:"version"`
	OK       bool   `json:"ok"`
}

// Error is the body of every error reply.
type Error struct {
	Error string `json:"error"`
}

// ExecRequest is the first line of an exec request; the command's stdin
// follows it.
type ExecRequest struct {
	Command          string            `json:"command"`
	WorkingDirectory string            `json:"workingDirectory,omitempty"`
	Env              map[string]string `json:"env,omitempty"`
}

// ProcessState is the wait route's answer: an exit code, or still running.
type ProcessState struct {
	ExitCode *int `json:"exitCode,omitempty"`
	Running  bool `json:"running,omitempty"`
}

// Sandbox describes a sandbox (GET /v1/sandboxes, /v1/sandboxes/{name}).
type Sandbox struct {
	Name       string            `json:"name"`
	State      string            `json:"state"` // starting, running, suspending, suspended
	Created    time.Time         `json:"created"`
	LastActive *time.Time        `json:"lastActive,omitempty"`
	LayerBytes int64             `json:"layerBytes"`
	Template   string            `json:"template,omitempty"`
	Ports      []int             `json:"ports,omitempty"` // ports with a tunnel or bridge open now
	Policy     any               `json:"policy,omitempty"`
	BaseURLs   map[string]string `json:"baseUrls,omitempty"`
	// Modules are its own WebAssembly transform modules, as loaded (never
	// their bytes).
	Modules []Module `json:"modules,omitempty"`
	Home    string   `json:"home"`
	WorkDir string   `json:"workingDirectory"`
	// Shard is the shard running it, when several services share one
	// store (running sandboxes).
	Shard string `json:"shard,omitempty"`
	// SuspendedBy says who suspended it (suspended sandboxes): "caller"
	// (it stays suspended until resumed), or the service on its own,
	// "idle", "shutdown", "recovery" or "shard-lost" (its next call wakes
	// it).
	SuspendedBy string `json:"suspendedBy,omitempty"`
	// Limits are what it may take: its own, over the service's defaults
	// (an appliance.Limits on the service's side).
	Limits any `json:"limits,omitempty"`
	// Usage is what it uses now (running sandboxes, where the service
	// can read it); absent otherwise.
	Usage *Usage `json:"usage,omitempty"`
}

// Usage is what a running sandbox uses of the host now, read when asked.
// A field not known is absent (zero); DiskQuotaBytes is absent when it has
// no disk limit.
type Usage struct {
	CPUSeconds      float64 `json:"cpuSeconds,omitempty"`      // CPU time used since it started
	MemoryBytes     int64   `json:"memoryBytes,omitempty"`     // memory held now
	MemoryPeakBytes int64   `json:"memoryPeakBytes,omitempty"` // the most held since it started
	DiskBytes       int64   `json:"diskBytes,omitempty"`       // what its writable layer allocates
	DiskQuotaBytes  int64   `json:"diskQuotaBytes,omitempty"`  // what it may allocate
	Processes       int     `json:"processes,omitempty"`       // processes and threads now
}

// Module describes one of a sandbox's own WebAssembly modules: its name,
// the sha256 of its bytes, and their size (0 when not known: a suspended
// sandbox's).
type Module struct {
	Name   string `json:"name"`
	Digest string `json:"digest"`
	Bytes  int    `json:"bytes,omitempty"`
}

// ForkResult is what POST /v1/sandboxes/{name}/fork answers: the copy,
// running when its source was, suspended when its source was.
type ForkResult struct {
	Name             string `json:"name"`
	State            string `json:"state"`
	Home             string `json:"home"`
	WorkingDirectory string `json:"workingDirectory"`
}

// SandboxList is GET /v1/sandboxes's answer.
type SandboxList struct {
	Sandboxes []Sandbox `json:"sandboxes"`
}

// Template describes a template of the service's namespace (GET
// /v1/templates).
type Template struct {
	ID         string    `json:"id"`
	Created    time.Time `json:"created"`
	LayerBytes int64     `json:"layerBytes"`
}

// TemplateList is GET /v1/templates's answer.
type TemplateList struct {
	Templates []Template `json:"templates"`
}
