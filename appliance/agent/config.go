package agent

import (
	"fmt"
	"maps"
	"net/netip"
	"net/url"
	"os"
	"path"
	"slices"
	"strings"
	"syscall"
)

// Defaults for Config fields left zero.
const (
	DefaultRelayAddr = "127.0.0.1:3128"
	DefaultPath      = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	DefaultHome      = "/root"
)

// DefaultBaseURLs are the base-URL variables every command gets, rewritten
// to relay routes, and the upstream each points at when the command does not
// set it. Config.BaseURLs adds to them.
func DefaultBaseURLs() map[string]string {
	return map[string]string{
		"ANTHROPIC_BASE_URL": "https://api.anthropic.com",
		"OPENAI_BASE_URL":    "https://api.openai.com/v1",
	}
}

// KillScope says which processes KillAll stops.
type KillScope string

const (
	// KillSandbox (the default, and what production uses) stops every
	// process the agent can see except itself, its ancestors and PID 1 of
	// its PID namespace (which holds the sandbox open). Inside a sandbox's
	// PID namespace that is everything the sandbox runs. The agent refuses
	// it in the host's initial PID namespace, where it would stop the host.
	KillSandbox KillScope = "sandbox"
	// KillDescendants stops only the agent's descendants: the commands it
	// started and whatever they started (orphans included, when the agent
	// is a child subreaper, as `sandgate agent` is). For tests and for an
	// agent run outside a sandbox.
	KillDescendants KillScope = "descendants"
)

// Config is the agent's configuration. The service sends it in the hello
// exchange; nothing of it appears on a command line. The zero value means
// every default.
type Config struct {
	// RelayAddr is the loopback IP:port the agent's relay listener binds
	// inside the sandbox; default 127.0.0.1:3128. Port 0 picks a free port
	// (for tests); commands are told the address actually bound.
	RelayAddr string `json:"relayAddr,omitempty"`
	// Path and Home are every command's PATH and HOME unless the command
	// sets its own; defaults DefaultPath and /root.
	Path string `json:"path,omitempty"`
	Home string `json:"home,omitempty"`
	// BaseURLs adds base-URL variables to DefaultBaseURLs (or changes their
	// upstream): variable name → https URL. An empty URL declares a
	// variable that is rewritten only when a command sets it.
	BaseURLs map[string]string `json:"baseUrls,omitempty"`
	// OnlyBaseURLs makes BaseURLs the whole set: DefaultBaseURLs are not
	// added (a service configured with other base URLs, or none).
	OnlyBaseURLs bool `json:"onlyBaseUrls,omitempty"`
	// KillScope: see KillSandbox (the default) and KillDescendants.
	KillScope KillScope `json:"killScope,omitempty"`
	// DNS is the loopback IP:port of the agent's DNS responder (UDP and
	// TCP): "127.0.0.1:53" in a sandbox, whose resolv.conf names it (see
	// dns.go). Empty: no responder.
	DNS string `json:"dns,omitempty"`
	// TrustBundle is a CA bundle in the sandbox holding the service's
	// interception CA beside the usual roots: commands get SSL_CERT_FILE,
	// REQUESTS_CA_BUNDLE and GIT_SSL_CAINFO pointing at it, and
	// NODE_EXTRA_CA_CERTS at TrustCA (or, without one, at it), when the
	// file exists in the sandbox. Empty: none of these.
	TrustBundle string `json:"trustBundle,omitempty"`
	TrustCA     string `json:"trustCa,omitempty"`
}

// resolved is a validated Config with its defaults applied.
type resolved struct {
	relayAddr netip.AddrPort // as requested; the bound one is in serverState
	path      string
	home      string
	baseURLs  map[string]string
	killScope KillScope
	dns       string // "" for none
	trust     trustFiles
}

// trustFiles are the CA files commands are pointed at (Config.TrustBundle,
// TrustCA).
type trustFiles struct{ bundle, ca string }

// initialPIDNamespaceIno is the inode of the kernel's initial PID namespace
// (PROC_PID_INIT_INO): an agent there is on the host, not in a sandbox.
const initialPIDNamespaceIno = 0xEFFFFFFC

// resolve validates c where it is used: in the agent. Errors name the field
// and the fix.
func (c Config) resolve() (*resolved, error) {
	r := &resolved{path: c.Path, home: c.Home, killScope: c.KillScope}
	addr := c.RelayAddr
	if addr == "" {
		addr = DefaultRelayAddr
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().IsLoopback() {
		return nil, invalid("config relayAddr %q: want a loopback IP:port such as %s (a sandbox has no other network)", addr, DefaultRelayAddr)
	}
	r.relayAddr = ap
	if r.path == "" {
		r.path = DefaultPath
	}
	if strings.ContainsRune(r.path, 0) {
		return nil, invalid("config path contains a NUL byte")
	}
	if r.home == "" {
		r.home = DefaultHome
	}
	if !path.IsAbs(r.home) || strings.ContainsRune(r.home, 0) {
		return nil, invalid("config home %q: want an absolute path such as /root", r.home)
	}
	r.baseURLs = DefaultBaseURLs()
	if c.OnlyBaseURLs {
		r.baseURLs = map[string]string{}
	}
	for k, v := range c.BaseURLs {
		if !validEnvName(k) {
			return nil, invalid("config baseUrls: %q is not an environment variable name (letters, digits and _, not starting with a digit)", k)
		}
		if isProxyVar(k) || strings.EqualFold(k, "NO_PROXY") {
			return nil, invalid("config baseUrls: %s is a proxy variable, not a base URL", k)
		}
		if err := CheckBaseURL(k, v); err != nil {
			return nil, invalid("config baseUrls: %v", err)
		}
		r.baseURLs[k] = v
	}
	if c.DNS != "" {
		ap, err := netip.ParseAddrPort(c.DNS)
		if err != nil || !ap.Addr().IsLoopback() {
			return nil, invalid("config dns %q: want a loopback IP:port such as 127.0.0.1:53", c.DNS)
		}
		r.dns = ap.String()
	}
	for _, f := range []struct{ name, v string }{{"trustBundle", c.TrustBundle}, {"trustCa", c.TrustCA}} {
		if f.v != "" && (!path.IsAbs(f.v) || strings.ContainsRune(f.v, 0)) {
			return nil, invalid("config %s %q: want an absolute path", f.name, f.v)
		}
	}
	r.trust = trustFiles{bundle: c.TrustBundle, ca: c.TrustCA}
	switch r.killScope {
	case "":
		r.killScope = KillSandbox
	case KillSandbox, KillDescendants:
	default:
		return nil, invalid("config killScope %q: want %q or %q", r.killScope, KillSandbox, KillDescendants)
	}
	if r.killScope == KillSandbox && inInitialPIDNamespace() {
		return nil, refused("config killScope %q: this agent runs in the host's initial PID namespace, where killing every process would stop the host; run the agent inside a sandbox, or use killScope %q", KillSandbox, KillDescendants)
	}
	return r, nil
}

func inInitialPIDNamespace() bool {
	var st syscall.Stat_t
	if err := syscall.Stat("/proc/self/ns/pid", &st); err != nil {
		return false
	}
	return st.Ino == initialPIDNamespaceIno
}

// validEnvName reports whether s is a portable environment variable name.
func validEnvName(s string) bool {
	if s == "" || (s[0] >= '0' && s[0] <= '9') {
		return false
	}
	for _, c := range []byte(s) {
		if !(c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

var proxyVars = []string{"HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"}

func isProxyVar(k string) bool {
	return slices.ContainsFunc(proxyVars, func(p string) bool { return strings.EqualFold(p, k) })
}

// loopbackNoProxy are the NO_PROXY entries every command has: requests to
// the relay's own routes must go to it directly, not through it as a proxy.
var loopbackNoProxy = []string{"localhost", "127.0.0.1"}

// RouteBaseURL is the relay route of a base URL (protocol 1 §6), the one
// rule of sandgate for it: an http or https URL becomes
// http://<relay>/<scheme>/<host>[:port]<path>, its dot segments resolved,
// one trailing "/" of the path, the query and the fragment dropped
// (https://api.openai.com/v1/ → http://<relay>/https/api.openai.com/v1);
// a value that is not such a URL, or already points at the relay, is left
// as it is. Whether the route is then forwarded is the egress proxy's
// decision, per request (an http route only to an address the operator
// opened, a port other than 443 only as a base URL's own).
func RouteBaseURL(relay, value string) string {
	origin := "http://" + relay
	if value == origin || strings.HasPrefix(value, origin+"/") {
		return value
	}
	u, err := url.Parse(value)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Opaque != "" {
		return value
	}
	// As a URL parser does (new URL() in the reference): "/../evil.example"
	// must not become another host's route.
	u = u.ResolveReference(&url.URL{})
	return origin + "/" + u.Scheme + "/" + u.Host + strings.TrimSuffix(u.EscapedPath(), "/")
}

// CheckBaseURL refuses a base URL that could not be honoured: one that
// carries credentials (user:password@), which the route would drop
// silently. Credentials are added outside the sandbox, by transformations.
func CheckBaseURL(name, value string) error {
	u, err := url.Parse(value)
	if err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.User != nil {
		return refused("%s: a base URL cannot carry credentials (user:password@): the sandbox never holds one; add it outside the sandbox with a transformation rule", name)
	}
	return nil
}

// commandEnv builds a command's whole environment from the agent's
// defaults and what the command sets (KEY=VALUE entries; later entries win).
// See README.md, "A command's environment".
func (r *resolved) commandEnv(relay string, set []string) ([]string, error) {
	own := map[string]string{}
	for _, kv := range set {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.ContainsRune(kv, 0) {
			return nil, invalid("environment entry %q: want KEY=VALUE without NUL bytes", truncate(kv, 80))
		}
		own[k] = v
	}
	proxy := "http://" + relay
	env := map[string]string{
		"PATH":               r.path,
		"HOME":               r.home,
		"LANG":               "C.UTF-8",
		"NODE_USE_ENV_PROXY": "1", // Node.js 24's fetch honours the proxy variables
		"IS_SANDBOX":         "1",
		// Protocol 1 gives npm_config_side_effects_cache=false, a pnpm
		// setting: npm 11 (the image's) warns on every command about an
		// npm_config_ variable it does not know, and pnpm 11 reads its
		// own settings from pnpm_config_ variables only.
		"pnpm_config_side_effects_cache": "false",
	}
	for _, k := range proxyVars[:4] {
		env[k] = proxy
	}
	r.trust.addTo(env)
	for k, v := range own {
		if isProxyVar(k) {
			if strings.TrimSuffix(v, "/") != proxy {
				return nil, refused("%s=%q: a command cannot point the proxy elsewhere; the sandbox's only way out is the relay at %s, which every command already has; remove %s", k, truncate(v, 80), proxy, k)
			}
			env[k] = proxy
			continue
		}
		if strings.EqualFold(k, "NO_PROXY") {
			continue // merged below
		}
		if _, isBase := r.baseURLs[k]; isBase {
			continue // rewritten below
		}
		env[k] = v
	}
	var noProxy []string
	for _, k := range slices.Sorted(maps.Keys(own)) {
		if !strings.EqualFold(k, "NO_PROXY") {
			continue
		}
		for e := range strings.SplitSeq(own[k], ",") {
			if e = strings.TrimSpace(e); e != "" && !slices.Contains(noProxy, e) {
				noProxy = append(noProxy, e)
			}
		}
	}
	for _, e := range loopbackNoProxy {
		if !slices.Contains(noProxy, e) {
			noProxy = append(noProxy, e)
		}
	}
	env["NO_PROXY"] = strings.Join(noProxy, ",")
	env["no_proxy"] = env["NO_PROXY"]
	for k, def := range r.baseURLs {
		v, set := own[k]
		if !set {
			v = def
		}
		if v == "" {
			continue
		}
		if err := CheckBaseURL(k, v); err != nil {
			return nil, err
		}
		env[k] = RouteBaseURL(relay, v)
	}
	out := make([]string, 0, len(env))
	for _, k := range slices.Sorted(maps.Keys(env)) {
		out = append(out, k+"="+env[k])
	}
	return out, nil
}

// trustVars are the variables that name CA files, for OpenSSL and Go
// (SSL_CERT_FILE), Python's requests and git; NODE_EXTRA_CA_CERTS adds to
// Node's own roots.
var trustVars = []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO"}

// addTo points the trust variables at the files, those that exist in the
// sandbox (a variable naming a missing file would break every TLS client
// that reads it). A command's own value of one wins, as for any variable.
func (t trustFiles) addTo(env map[string]string) {
	exists := func(p string) bool {
		fi, err := os.Stat(p)
		return err == nil && fi.Mode().IsRegular()
	}
	if t.bundle == "" || !exists(t.bundle) {
		return
	}
	for _, k := range trustVars {
		env[k] = t.bundle
	}
	env["NODE_EXTRA_CA_CERTS"] = t.bundle
	if t.ca != "" && exists(t.ca) {
		env["NODE_EXTRA_CA_CERTS"] = t.ca
	}
}

// lookPath finds file in the command's own PATH (not the agent's).
func lookPath(file, pathEnv string) (string, error) {
	if strings.Contains(file, "/") {
		return file, nil
	}
	for dir := range strings.SplitSeq(pathEnv, ":") {
		if dir == "" {
			dir = "."
		}
		p := path.Join(dir, file)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", &Error{Code: codeNotFound, Message: fmt.Sprintf("executable %q not found in PATH=%s", file, pathEnv)}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
