// Command probe exercises every function of the guest library against a
// real host, for wasm-examples' end-to-end test: it reports what it sees
// of the request (as the new request body, so that the upstream receives
// the report), changes every part of the request it can, and rewrites the
// response. Values longer than the library's first-try buffer (the config,
// a header, the URI, the sandbox id) prove that it retries with the length
// the host reports.
package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/sandgate/sandgate/transforms/wasm/guest"
	"github.com/sandgate/sandgate/transforms/wasm/guest/sandgate"
)

// Report is what the probe saw of one request. The test decodes the same
// shape.
type Report struct {
	Config     string              `json:"config"`
	Features   string              `json:"features"`
	Method     string              `json:"method"`
	URI        string              `json:"uri"`
	Protocol   string              `json:"protocol"`
	SourceAddr string              `json:"source_addr"`
	SandboxID  string              `json:"sandbox_id"`
	Names      []string            `json:"names"`
	Values     map[string][]string `json:"values"`
	HasAbsent  bool                `json:"has_absent"`
	BodySHA256 string              `json:"body_sha256"`
	BodyLen    int                 `json:"body_len"`
}

// reqCtx is what handle_request hands to handle_response.
const reqCtx = 0x5eed

var features guest.Features

func main() {}

func init() {
	features = guest.EnableFeatures(guest.FeatureBufferRequest | guest.FeatureBufferResponse)
	guest.HandleRequest(handleRequest)
	guest.HandleResponse(handleResponse)
}

func handleRequest(req guest.Request, resp guest.Response) (bool, uint32) {
	uri := req.URI()
	if strings.HasPrefix(uri, "/probe/answer") {
		// Answer without the upstream: the ABI's next=0 with a response.
		resp.SetStatusCode(418)
		resp.Header().Set("x-probe", "answered")
		resp.Body().WriteString("answered by the probe")
		return false, 0
	}
	h := req.Header()
	r := Report{
		Config:     string(guest.Config()),
		Features:   features.String(),
		Method:     req.Method(),
		URI:        uri,
		Protocol:   req.ProtocolVersion(),
		SourceAddr: req.SourceAddr(),
		SandboxID:  sandgate.SandboxID(),
		Names:      h.Names(),
		Values:     map[string][]string{},
		HasAbsent:  h.Has("x-probe-absent"),
	}
	slices.Sort(r.Names)
	for _, n := range r.Names {
		r.Values[n] = h.Values(n)
	}
	body, err := io.ReadAll(req.Body())
	if err != nil {
		panic(err)
	}
	sum := sha256.Sum256(body)
	r.BodySHA256, r.BodyLen = hex.EncodeToString(sum[:]), len(body)

	req.SetMethod("POST")
	sep := "?"
	if strings.Contains(uri, "?") {
		sep = "&"
	}
	req.SetURI(uri + sep + "probe=1")
	h.Set("x-probe-long", strings.Repeat("v", 5000))
	h.Add("x-probe-multi", "1")
	h.Add("x-probe-multi", "2")
	h.Del("x-probe-remove")
	out, _ := json.Marshal(r)
	req.Body().Write(out)
	sandgate.AuditNote("probe saw " + strconv.Itoa(len(r.Names)) + " headers")
	guest.Log(guest.LogInfo, "probe: request rewritten")
	return true, reqCtx
}

func handleResponse(ctx uint32, _ guest.Request, resp guest.Response, isError bool) {
	if isError {
		return
	}
	if ctx != reqCtx {
		panic("probe: handle_response got reqCtx " + strconv.Itoa(int(ctx)))
	}
	status := resp.StatusCode()
	body, err := io.ReadAll(resp.Body())
	if err != nil {
		panic(err)
	}
	h := resp.Header()
	names := h.Names()
	slices.Sort(names)
	h.Set("x-probe-status", strconv.Itoa(status))
	h.Set("x-probe-upstream-names", strings.Join(names, ","))
	h.Set("x-probe-upstream", h.Get("x-upstream"))
	resp.SetStatusCode(203)
	resp.Body().WriteString("probe:")
	resp.Body().Write(body)
}
