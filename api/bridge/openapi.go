package bridge

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"slices"
)

//go:embed openapi.json
var openAPIDoc []byte

// Document is the bridge's own OpenAPI document: its routes alone.
func Document() []byte { return slices.Clone(openAPIDoc) }

// DocumentVersion is info.version of the document the service serves: the
// bridge contract's, whose major is also protocol 1's, so that a bridge
// client that reads the major finds 1 and a protocol 1 client is told
// nothing new.
const DocumentVersion = "1.0.0"

// MergeOpenAPI is the service's one document: sandgate's (protocol 1 and
// its own /v1) with the bridge's paths, components and tag added. The two
// sets of paths are disjoint but for GET /v1/openapi.json, served for
// either credential: its security lists both. Its info.version becomes
// DocumentVersion and its description says the rule. A name in both
// documents' components is an error.
func MergeOpenAPI(sandgate []byte) ([]byte, error) {
	var doc, br map[string]any
	if err := json.Unmarshal(sandgate, &doc); err != nil {
		return nil, fmt.Errorf("the service's OpenAPI document: %w", err)
	}
	if err := json.Unmarshal(openAPIDoc, &br); err != nil {
		return nil, fmt.Errorf("the bridge's OpenAPI document: %w", err)
	}
	paths, _ := doc["paths"].(map[string]any)
	if paths == nil {
		return nil, fmt.Errorf("the service's OpenAPI document has no paths")
	}
	for p, item := range br["paths"].(map[string]any) {
		old, dup := paths[p].(map[string]any)
		if !dup {
			paths[p] = item
			continue
		}
		if p != "/v1/openapi.json" {
			return nil, fmt.Errorf("path %s is in both documents", p)
		}
		get, _ := old["get"].(map[string]any)
		if get == nil {
			return nil, fmt.Errorf("the service's document has no GET /v1/openapi.json")
		}
		sec, _ := doc["security"].([]any)
		if s, ok := get["security"].([]any); ok {
			sec = s
		}
		bsec := item.(map[string]any)["get"].(map[string]any)["security"].([]any)
		get["security"] = append(slices.Clone(sec), bsec...)
		tags, _ := get["tags"].([]any)
		get["tags"] = append(slices.Clone(tags), "cloudflare-bridge")
		get["description"] = "The service's one document: protocol 1's routes, sandgate's own and the Cloudflare bridge's. Served for the service token, and for the bridge's key (`Authorization: Bearer`, or `?token=`)."
	}
	comps, _ := doc["components"].(map[string]any)
	if comps == nil {
		comps = map[string]any{}
		doc["components"] = comps
	}
	for kind, set := range br["components"].(map[string]any) {
		dst, _ := comps[kind].(map[string]any)
		if dst == nil {
			dst = map[string]any{}
			comps[kind] = dst
		}
		for name, v := range set.(map[string]any) {
			if _, dup := dst[name]; dup {
				return nil, fmt.Errorf("components.%s.%s is in both documents", kind, name)
			}
			dst[name] = v
		}
	}
	tags, _ := doc["tags"].([]any)
	doc["tags"] = append(tags, br["tags"].([]any)...)
	info, _ := doc["info"].(map[string]any)
	if info == nil {
		info = map[string]any{}
		doc["info"] = info
	}
	info["version"] = DocumentVersion
	desc, _ := info["description"].(string)
	info["description"] = desc + "\n\n**The Cloudflare sandbox bridge** (tag `cloudflare-bridge`): the routes under `/v1/sandbox` (singular) and `/v1/pool`, " +
		"with `Authorization: Bearer <SANDBOX_API_KEY>` instead of the service token and errors as `{\"error\", \"code\"}`. One document serves both: " +
		"`info.version` is the bridge contract's `1.0.0`, whose major is protocol 1's; the bridge's routes are those tagged `cloudflare-bridge`, the rest are protocol 1's and sandgate's. " +
		"Without a `SANDBOX_API_KEY` the bridge's routes refuse every request (401) and are not in this document."
	return json.Marshal(doc)
}
