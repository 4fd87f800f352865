// Package api is the wire of sandgate's HTTP service: protocol 1 of
// ai-sdk-sandbox-cloud-run (the routes, headers, bodies and exec frames its
// TypeScript client speaks) and sandgate's own routes beside it under /v1.
// The server is api/server; the Go client is api/client.
package api

import "time"

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
