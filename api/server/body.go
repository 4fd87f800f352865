package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strings"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/netpolicy"
)

// object is a JSON request body checked field by field, protocol 1's way:
// at most api.MaxJSONBody bytes (413), empty counts as {}, not JSON or not
// an object is 400, a field of the wrong type is 400 naming the field.
// Unknown fields are ignored, as protocol 1 says, in its own bodies; the
// bodies of sandgate's own routes refuse them by name (only).
type object map[string]json.RawMessage

// only refuses a field other than known, naming it: in sandgate's own
// bodies a misspelt field ("allowHosts") is a mistake to say, not an
// absent field to ignore.
func (o object) only(what string, known ...string) error {
	for _, k := range slices.Sorted(maps.Keys(o)) {
		if !slices.Contains(known, k) {
			return badRequest("%s: unknown field %q (it takes %s)", what, k, quoteAll(known))
		}
	}
	return nil
}

// quoteAll is "a", "b" and "c".
func quoteAll(names []string) string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = `"` + n + `"`
	}
	if len(q) == 1 {
		return q[0]
	}
	return strings.Join(q[:len(q)-1], ", ") + " and " + q[len(q)-1]
}

// readObject reads and checks a JSON object body of at most limit bytes.
func readObject(r *http.Request, limit int64) (object, error) {
	data, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	if err != nil {
		return nil, badRequest("reading the request body: %v", err)
	}
	if int64(len(data)) > limit {
		return nil, errorf(http.StatusRequestEntityTooLarge, "the request body is over %d bytes", limit)
	}
	return parseObject(data)
}

// parseObject checks one JSON object (an exec line, a body).
func parseObject(data []byte) (object, error) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return object{}, nil
	}
	var o object
	if err := json.Unmarshal(data, &o); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return nil, badRequest("the body must be a JSON object")
		}
		return nil, badRequest("the body is not JSON: %v", err)
	}
	if o == nil { // null
		return nil, badRequest("the body must be a JSON object, not null")
	}
	return o, nil
}

// str is an optional string field ("" when absent).
func (o object) str(name string) (string, bool, error) {
	raw, ok := o[name]
	if !ok {
		return "", false, nil
	}
	var s string
	if len(bytes.TrimSpace(raw)) == 0 || bytes.TrimSpace(raw)[0] != '"' || json.Unmarshal(raw, &s) != nil {
		return "", true, badRequest("field %q must be a string", name)
	}
	return s, true, nil
}

// boolean is an optional true or false (false when absent).
func (o object) boolean(name string) (bool, error) {
	raw, ok := o[name]
	if !ok {
		return false, nil
	}
	var b *bool
	if json.Unmarshal(raw, &b) != nil || b == nil {
		return false, badRequest("field %q must be true or false", name)
	}
	return *b, nil
}

// required is a string field that must be there.
func (o object) required(name string) (string, error) {
	s, ok, err := o.str(name)
	if err != nil {
		return "", err
	}
	if !ok {
		return "", badRequest("field %q is required", name)
	}
	return s, nil
}

// list is an optional list of strings.
func (o object) list(name string) ([]string, bool, error) {
	raw, ok := o[name]
	if !ok {
		return nil, false, nil
	}
	var l []*string // a null item is no string (json leaves a string "" for it)
	if len(bytes.TrimSpace(raw)) == 0 || bytes.TrimSpace(raw)[0] != '[' || json.Unmarshal(raw, &l) != nil || slices.Contains(l, nil) {
		return nil, true, badRequest("field %q must be a list of strings", name)
	}
	out := make([]string, len(l))
	for i, p := range l {
		out[i] = *p
	}
	return out, true, nil
}

// strMap is an optional object of strings.
func (o object) strMap(name string) (map[string]string, bool, error) {
	raw, ok := o[name]
	if !ok {
		return nil, false, nil
	}
	var m map[string]*string // a null value is no string
	if len(bytes.TrimSpace(raw)) == 0 || bytes.TrimSpace(raw)[0] != '{' || json.Unmarshal(raw, &m) != nil || slices.Contains(slices.Collect(maps.Values(m)), nil) {
		return nil, true, badRequest("field %q must be an object whose values are strings", name)
	}
	out := make(map[string]string, len(m))
	for k, p := range m {
		out[k] = *p
	}
	return out, true, nil
}

// networkBody is the body create, resume and the network route share:
// each present field is type-checked whether or not the route uses it.
// policy is sandgate's: the whole harness policy, given instead of
// allowedHosts.
type networkBody struct {
	allowedHosts    []string
	hasAllowedHosts bool
	baseURLs        map[string]string
	template        string
	name            string
	policy          *netpolicy.Policy
	limits          appliance.Limits // sandgate's, on create only
}

func (o object) network() (networkBody, error) {
	var n networkBody
	var err error
	if n.allowedHosts, n.hasAllowedHosts, err = o.list("allowedHosts"); err != nil {
		return n, err
	}
	if n.baseURLs, _, err = o.strMap("baseUrls"); err != nil {
		return n, err
	}
	for k, v := range n.baseURLs {
		if err := agent.CheckBaseURL("baseUrls."+k, v); err != nil {
			return n, badRequest("%v", err)
		}
	}
	if n.template, _, err = o.str("template"); err != nil {
		return n, err
	}
	if n.name, _, err = o.str("name"); err != nil {
		return n, err
	}
	if raw, ok := o["policy"]; ok {
		if n.hasAllowedHosts {
			return n, badRequest(`give "allowedHosts" or "policy", not both (a policy lists its hosts in its own "allowedHosts")`)
		}
		p, err := netpolicy.ParsePolicy(raw)
		if err != nil {
			return n, badRequest("policy: %v", err)
		}
		n.policy = &p
	}
	if raw, ok := o["limits"]; ok {
		if err := json.Unmarshal(raw, &n.limits); err != nil {
			return n, badRequest("%v", err)
		}
		if err := n.limits.Check(); err != nil {
			return n, badRequest("%v", err)
		}
	}
	return n, nil
}

// spec is the body's network: the policy when given, else the hosts;
// base URLs with either.
func (n networkBody) spec() appliance.NetworkSpec {
	if n.policy != nil {
		return appliance.NetworkSpec{Policy: n.policy, BaseURLs: n.baseURLs}
	}
	return appliance.NetworkSpec{AllowedHosts: n.allowedHosts, BaseURLs: n.baseURLs}
}

// namePattern is protocol 1's rule for sandbox and template names.
var namePattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

func checkSandboxName(name string) error {
	if !namePattern.MatchString(name) {
		return badRequest("invalid sandbox name %q: use 1 to 63 lowercase letters, digits and dashes, not starting with a dash", name)
	}
	return nil
}

func checkTemplateName(name string) error {
	if !namePattern.MatchString(name) {
		return badRequest("invalid template name %q: use 1 to 63 lowercase letters, digits and dashes, not starting with a dash", name)
	}
	return nil
}
