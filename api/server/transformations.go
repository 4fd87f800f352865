package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"

	"github.com/sandgate/sandgate/transforms"
)

// transformation is one protocol 1 request transformation, as given:
// {match: {host, path?, method?, headers?, queryString?}, transform:
// {headers: {NAME: value}}}, where a value is a real credential.
type transformation struct {
	host    string
	match   json.RawMessage
	headers []header // transform.headers, in order
}

type header struct{ name, value string }

// parseTransformations checks protocol 1 §7.1's shape: a list whose items
// each have a string match.host and transform.headers of strings.
func parseTransformations(o object) ([]transformation, error) {
	raw, ok := o["transformations"]
	if !ok || len(bytes.TrimSpace(raw)) == 0 || bytes.TrimSpace(raw)[0] != '[' {
		return nil, badRequest("field \"transformations\" must be a list of {match, transform}")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, badRequest("field \"transformations\" must be a list: %v", err)
	}
	out := make([]transformation, 0, len(items))
	for i, item := range items {
		// Keys are read exactly as written (encoding/json would fold
		// their case): the rule parser reads them so too.
		var t map[string]json.RawMessage
		if json.Unmarshal(item, &t) != nil || t["match"] == nil {
			return nil, badRequest("transformations[%d]: want {match: {host, ...}, transform: {headers: {...}}}", i)
		}
		var m map[string]json.RawMessage
		var host string
		if json.Unmarshal(t["match"], &m) != nil || !isJSONString(m["host"]) || json.Unmarshal(m["host"], &host) != nil {
			return nil, badRequest("transformations[%d]: match.host must be a string", i)
		}
		var tr map[string]json.RawMessage
		if t["transform"] == nil || json.Unmarshal(t["transform"], &tr) != nil || len(bytes.TrimSpace(tr["headers"])) == 0 || bytes.TrimSpace(tr["headers"])[0] != '{' {
			return nil, badRequest("transformations[%d]: transform.headers must be an object of strings", i)
		}
		hs, err := orderedStrings(tr["headers"])
		if err != nil {
			return nil, badRequest("transformations[%d]: transform.headers must be an object of strings", i)
		}
		out = append(out, transformation{host: host, match: t["match"], headers: hs})
	}
	return out, nil
}

// isJSONString reports whether raw is a JSON string.
func isJSONString(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && t[0] == '"'
}

// isJSONArray and isJSONObject report whether raw is a JSON array or
// object (not null).
func isJSONArray(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && t[0] == '['
}

func isJSONObject(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && t[0] == '{'
}

// orderedStrings reads a JSON object of strings in document order.
func orderedStrings(raw json.RawMessage) ([]header, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if _, err := dec.Token(); err != nil {
		return nil, err
	}
	var out []header
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		var v *string // a null value is no string
		if err := dec.Decode(&v); err != nil {
			return nil, err
		}
		if v == nil {
			return nil, errors.New("a null value")
		}
		out = append(out, header{name: tok.(string), value: *v})
	}
	return out, nil
}

// schemePrefix is a credential's scheme: held secrets are compared
// without it (protocol 1 §8).
var schemePrefix = regexp.MustCompile(`(?i)^(bearer|basic|token)\s+`)

// heldSecret is a header value as a held secret: without its scheme, and
// only when 12 characters or more remain.
func heldSecret(value string) (scheme, secret string, ok bool) {
	scheme = schemePrefix.FindString(value)
	secret = value[len(scheme):]
	return scheme, secret, len(secret) >= 12
}

// rules turns transformations into sandgate's credential rules. A held
// secret becomes a secret of the rule (set on the way out, scrubbed back
// out of the answer): its placeholder is the value the rule's own header
// matcher requires for that header ({"exact": "aisdkhc_…"}, scheme
// removed), which is what the sandbox holds and so what it sees again when
// an upstream echoes the secret; a rule that matches that header by regex
// or prefix (or not at all) gets a fixed redaction marker. A value too
// short to be a held secret is a plain header value.
func rules(ts []transformation) ([]transforms.Rule, error) {
	if len(ts) == 0 {
		return nil, nil
	}
	env := map[string]string{}
	var list []json.RawMessage
	for i, t := range ts {
		set := map[string]any{}
		for j, h := range t.headers {
			scheme, secret, ok := heldSecret(h.value)
			if !ok {
				set[h.name] = h.value
				continue
			}
			name := fmt.Sprintf("SANDGATE_P1_%d_%d", i, j)
			env[name] = secret
			ph := placeholderFor(t.match, h.name, scheme)
			if ph == "" {
				ph = fmt.Sprintf("sandgate-redacted-%d-%d", i, j)
			}
			set[h.name] = map[string]string{"env": name, "prefix": scheme, "placeholder": ph}
		}
		item, err := json.Marshal(map[string]any{"match": t.match, "transform": map[string]any{"headers": set}})
		if err != nil {
			return nil, err
		}
		list = append(list, item)
	}
	data, err := json.Marshal(list)
	if err != nil {
		return nil, err
	}
	rs, err := transforms.ParseRules(data, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		return nil, err // a *RuleError: names the item and field, never the value
	}
	return rs, nil
}

// placeholderFor finds the exact value a rule's match.headers requires of
// header name, without scheme: the placeholder the sandbox holds.
func placeholderFor(match json.RawMessage, name, scheme string) string {
	var m struct {
		Headers []struct {
			Key   *struct{ Exact *string } `json:"key"`
			Value *struct{ Exact *string } `json:"value"`
		} `json:"headers"`
	}
	if json.Unmarshal(match, &m) != nil {
		return ""
	}
	for _, h := range m.Headers {
		if h.Key == nil || h.Key.Exact == nil || h.Value == nil || h.Value.Exact == nil || !strings.EqualFold(*h.Key.Exact, name) {
			continue
		}
		v := *h.Value.Exact
		if sch := schemePrefix.FindString(v); sch != "" && strings.EqualFold(strings.TrimSpace(sch), strings.TrimSpace(scheme)) {
			v = v[len(sch):]
		}
		return v
	}
	return ""
}

// transformationsRoute is POST (add) and PUT (replace): protocol 1's
// transformations become sandgate's credential rules, which the backend
// holds (in memory only) and applies.
func (s *Server) transformationsRoute(w http.ResponseWriter, r *http.Request, replace bool) error {
	name := r.PathValue("name")
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	o, err := readObject(r, 1<<20)
	if err != nil {
		return err
	}
	ts, err := parseTransformations(o)
	if err != nil {
		return err
	}
	rs, err := rules(ts)
	if err != nil {
		return err
	}
	if err := s.b.SetRules(r.Context(), name, rs, !replace); err != nil {
		return err
	}
	noContent(w)
	return nil
}

func (s *Server) addTransformations(w http.ResponseWriter, r *http.Request) error {
	return s.transformationsRoute(w, r, false)
}

func (s *Server) setTransformations(w http.ResponseWriter, r *http.Request) error {
	return s.transformationsRoute(w, r, true)
}
