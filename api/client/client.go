// Package client is the Go client of a sandgate service: what the AI SDK
// harness's HarnessV1NetworkSandboxSession gives TypeScript platforms, in
// Go. A Client talks to one service; Create and Resume give a *Session, one
// sandbox: its commands and files, its ports, its network policy and
// credentials, its lifecycle. Session.Restricted is the part a tool may
// have: files and commands only.
//
// Contexts stand in for abort signals, io.Reader and io.Writer for web
// streams, and errors are values to branch on with errors.Is and
// errors.As: ErrSandboxNotFound, ErrAuthentication, *ServiceError and the
// rest (errors.go). A command's non-zero exit is a value, never an error.
//
// On the wire it speaks protocol 1 of ai-sdk-sandbox-cloud-run, the
// routes the TypeScript client uses, plus sandgate's own under /v1 (files
// and workspace tars streamed, resumable output, the whole network policy,
// fork, modules, audit, the TCP bridge, templates listed). Every call
// carries the protocol header, the service token when one is given, and
// an identity token from a TokenSource when the service sits behind Cloud
// Run's IAM.
package client

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api"
)

const (
	headerProtocol  = api.HeaderProtocol
	protocolVersion = "1"
)

// Client is a connection to one sandgate service. It is safe for
// concurrent use; make one per service and keep it.
type Client struct {
	base    *url.URL // scheme and host, and a path prefix without a trailing slash
	token   string
	ident   *tokenCache // nil: no identity token
	hc      *http.Client
	retries int

	// shards are the services sharing one store, primary the base's
	// (WithShards); each sandbox's calls go to the one running it.
	primary *shard
	identOf TokenSource // what each shard's identity tokens come from
	smu     sync.Mutex
	shards  []*shard          // guarded by smu
	owners  map[string]*shard // learned from HeaderOwner, by sandbox

	tmu    sync.Mutex
	builds map[string]*templateBuild // templates being built, by id
}

// Option configures a Client.
type Option func(*options)

type options struct {
	token    string
	ident    TokenSource
	identSet bool
	hc       *http.Client
	retries  int
	shards   []string
}

// WithShards gives the URLs of the other services sharing the first's
// store (its shards; deploy/README.md). Each sandbox's calls go straight to
// the shard running it: chosen by rendezvous hashing of its name over all
// of them, corrected by the shard that answers (which names the owner in
// x-sandgate-owner). Any shard forwards a call to the owner anyway, so
// this saves a hop; calls that name no sandbox go to the first URL.
func WithShards(urls ...string) Option {
	return func(o *options) { o.shards = append(o.shards, urls...) }
}

// WithToken gives the service token (the service's SANDBOX_SERVICE_TOKEN),
// sent on every call. Without it none is sent.
func WithToken(token string) Option { return func(o *options) { o.token = token } }

// WithIdentity gives the source of the identity token sent as
// "Authorization: Bearer" (what Cloud Run's IAM checks before the call
// reaches the service): GcloudIdentity, MetadataIdentity, a TokenFunc, or
// nil for none. Without this option a service on *.run.app gets
// GcloudIdentity() and any other none.
func WithIdentity(ts TokenSource) Option {
	return func(o *options) { o.ident, o.identSet = ts, true }
}

// WithHTTPClient makes the Client send its calls with hc (its Transport,
// proxies, TLS settings). hc must not time out whole requests: command
// output and followed audit events stream for as long as they last.
func WithHTTPClient(hc *http.Client) Option { return func(o *options) { o.hc = hc } }

// WithRetries sets how many times a call that is safe to repeat is tried
// again after a failure that may pass (a connection refused or reset, a
// 502, 503 or 504), with exponential backoff; default 3, 0 for none. Only
// calls that change nothing or are idempotent are repeated, and any call
// whose connection was refused before anything was sent.
func WithRetries(n int) Option { return func(o *options) { o.retries = max(n, 0) } }

// New makes a Client of the service at serviceURL ("https://sandgate-
// abc.a.run.app", "http://127.0.0.1:8080"). It does not call the service:
// Preflight does.
func New(serviceURL string, opts ...Option) (*Client, error) {
	o := options{retries: 3}
	for _, opt := range opts {
		opt(&o)
	}
	u, err := parseServiceURL(serviceURL)
	if err != nil {
		return nil, err
	}
	c := &Client{base: u, token: o.token, hc: o.hc, retries: o.retries, builds: map[string]*templateBuild{}, owners: map[string]*shard{}}
	if c.hc == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 16
		c.hc = &http.Client{Transport: t}
	}
	ts := o.ident
	if !o.identSet && strings.HasSuffix(strings.ToLower(u.Hostname()), ".run.app") {
		ts = GcloudIdentity()
	}
	c.identOf = ts
	c.ident = c.identFor(u)
	c.primary = &shard{base: u, ident: c.ident}
	c.shards = []*shard{c.primary}
	for _, su := range o.shards {
		u, err := parseServiceURL(su)
		if err != nil {
			return nil, fmt.Errorf("shard: %w", err)
		}
		if c.shardOf(u) == nil {
			c.shards = append(c.shards, &shard{base: u, ident: c.identFor(u)})
		}
	}
	return c, nil
}

// URL is the service's URL.
func (c *Client) URL() string { return c.base.String() }

// The routes the client calls, "METHOD /path" with {parameters} as the
// service's OpenAPI document writes them. Preflight checks each.
const (
	routeHealth         = "GET /health"
	routeOpenAPI        = "GET /v1/openapi.json"
	routeCreate         = "POST /v1/sandboxes"
	routeList           = "GET /v1/sandboxes"
	routeGet            = "GET /v1/sandboxes/{name}"
	routeResume         = "POST /v1/sandboxes/{name}/resume"
	routeSuspend        = "POST /v1/sandboxes/{name}/suspend"
	routeDestroy        = "DELETE /v1/sandboxes/{name}"
	routeExec           = "POST /v1/sandboxes/{name}/exec"
	routeWait           = "GET /v1/sandboxes/{name}/processes/{pid}"
	routeOutput         = "GET /v1/sandboxes/{name}/processes/{pid}/output"
	routeKill           = "DELETE /v1/sandboxes/{name}/processes/{pid}"
	routeKillAll        = "DELETE /v1/sandboxes/{name}/processes"
	routeAddTransforms  = "POST /v1/sandboxes/{name}/transformations"
	routeSetTransforms  = "PUT /v1/sandboxes/{name}/transformations"
	routeNetwork        = "PUT /v1/sandboxes/{name}/network"
	routeSaveTemplate   = "POST /v1/sandboxes/{name}/template"
	routeTemplates      = "GET /v1/templates"
	routeTemplate       = "GET /v1/templates/{id}"
	routeDeleteTemplate = "DELETE /v1/templates/{id}"
	routeFork           = "POST /v1/sandboxes/{name}/fork"
	routeReadFile       = "GET /v1/sandboxes/{name}/files/{path}"
	routeWriteFile      = "PUT /v1/sandboxes/{name}/files/{path}"
	routeWorkspaceOut   = "GET /v1/sandboxes/{name}/workspace"
	routeWorkspaceIn    = "PUT /v1/sandboxes/{name}/workspace"
	routeModules        = "PUT /v1/sandboxes/{name}/modules"
	routeAudit          = "GET /v1/sandboxes/{name}/audit"
	routeTCP            = "GET /v1/sandboxes/{name}/tcp/{port}"
	routePTY            = "GET /v1/sandboxes/{name}/pty"
	routePorts          = "GET /v1/sandboxes/{name}/ports/{port}" // the port tunnel (PortEndpoint)
)

// Routes lists every route the client calls, "METHOD /path".
func Routes() []string {
	return []string{routeHealth, routeOpenAPI, routeCreate, routeList, routeGet, routeResume, routeSuspend, routeDestroy,
		routeExec, routeWait, routeOutput, routeKill, routeKillAll, routeAddTransforms, routeSetTransforms, routeNetwork,
		routeSaveTemplate, routeTemplates, routeTemplate, routeDeleteTemplate, routeFork, routeReadFile, routeWriteFile,
		routeWorkspaceOut, routeWorkspaceIn, routeModules, routeAudit, routeTCP, routePTY, routePorts}
}

// namePattern is protocol 1's rule for sandbox and template names.
var namePattern = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

func checkName(what, name string) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("invalid %s name %q: use 1 to 63 lowercase letters, digits and dashes, not starting with a dash", what, name)
	}
	return nil
}

// NewSandboxID is a fresh sandbox name, "ai-sdk-<8 hex>", as the
// TypeScript client makes one.
func NewSandboxID() string {
	var b [4]byte
	rand.Read(b[:])
	return "ai-sdk-" + hex.EncodeToString(b[:])
}

// parseServiceURL checks a service's URL.
func parseServiceURL(serviceURL string) (*url.URL, error) {
	u, err := url.Parse(serviceURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("service URL %q: want http:// or https:// and a host, such as https://sandgate-abc.a.run.app", serviceURL)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return nil, fmt.Errorf("service URL %q: want no query, fragment or user", serviceURL)
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	u.RawPath = ""
	return u, nil
}

// shard is one of the services a client sends calls to.
type shard struct {
	base  *url.URL
	ident *tokenCache // nil: no identity token
}

// identFor is the identity-token cache for the service at u: tokens for
// its own audience (Cloud Run's IAM checks it).
func (c *Client) identFor(u *url.URL) *tokenCache {
	ts := c.identOf
	if ts == nil {
		return nil
	}
	if a, ok := ts.(audienced); ok {
		ts = a.withAudience(u.Scheme + "://" + u.Host)
	}
	return &tokenCache{src: ts, now: time.Now}
}

// shardOf is the known shard at u's scheme and host, nil if none (the
// caller holds smu, or is New).
func (c *Client) shardOf(u *url.URL) *shard {
	for _, s := range c.shards {
		if s.base.Scheme == u.Scheme && strings.EqualFold(s.base.Host, u.Host) {
			return s
		}
	}
	return nil
}

// target is the shard sandbox id's calls go to: the one that last said it
// runs it, else the one rendezvous hashing picks; the first for none.
func (c *Client) target(id string) *shard {
	c.smu.Lock()
	defer c.smu.Unlock()
	if id == "" || len(c.shards) == 1 {
		return c.primary
	}
	if s := c.owners[id]; s != nil {
		return s
	}
	var best *shard
	var bestScore []byte
	for _, s := range c.shards {
		h := sha256.Sum256([]byte(id + "\x00" + s.base.String()))
		if best == nil || bytes.Compare(h[:], bestScore) > 0 {
			best, bestScore = s, h[:]
		}
	}
	return best
}

// learn notes the owner a shard named for the sandbox of call cl
// (HeaderOwner): its next calls go there. An owner not among the shards
// given joins them. Never from a tunnel's answer (the port tunnel, the TCP
// bridge): a server in the sandbox writes that one.
func (c *Client) learn(cl call, resp *http.Response) {
	if cl.route == routePorts || cl.route == routeTCP {
		return
	}
	id := cl.sandboxOf()
	owner := resp.Header.Get(api.HeaderOwner)
	if id == "" || owner == "" || owner == c.primary.base.String() && c.target(id) == c.primary {
		return
	}
	u, err := parseServiceURL(owner)
	if err != nil {
		return // a shard without a URL: its calls keep going where they went
	}
	c.smu.Lock()
	defer c.smu.Unlock()
	s := c.shardOf(u)
	if s == nil {
		s = &shard{base: u, ident: c.identFor(u)}
		c.shards = append(c.shards, s)
	}
	if len(c.owners) > 100000 {
		clear(c.owners)
	}
	c.owners[id] = s
}

// sandboxOf is the sandbox a call is about: its name parameter, or the
// name in a create's body; "" for none.
func (cl call) sandboxOf() string {
	_, p, _ := strings.Cut(cl.route, " ")
	if strings.HasPrefix(p, "/v1/sandboxes/{name}") && len(cl.args) > 0 {
		return cl.args[0]
	}
	if cl.route == routeCreate {
		if b, ok := cl.body.([]byte); ok {
			var v struct {
				Name string `json:"name"`
			}
			if json.Unmarshal(b, &v) == nil {
				return v.Name
			}
		}
	}
	return ""
}

// call is one request to the service.
type call struct {
	route string   // one of the route constants
	args  []string // its {parameters}, in order
	query url.Values
	// body is nil, []byte (JSON, or raw when raw is set: repeatable), or
	// an io.Reader (streamed once: never repeated).
	body any
	raw  bool // body is not JSON: no content type
	// idempotent calls are repeated after failures that may pass.
	idempotent bool
	// ok lists statuses besides 2xx that the caller handles itself.
	ok []int
	// header adds request headers.
	header http.Header
}

// path fills the route's parameters: {path} is a file path, its slashes
// kept and each segment escaped.
func (cl call) path() (method, p string) {
	method, p, _ = strings.Cut(cl.route, " ")
	args := cl.args
	for len(args) > 0 {
		i := strings.Index(p, "{")
		j := strings.Index(p, "}")
		if i < 0 || j < i {
			break
		}
		v := args[0]
		if p[i:j+1] == "{path}" {
			segs := strings.Split(strings.TrimPrefix(v, "/"), "/")
			for k, s := range segs {
				segs[k] = url.PathEscape(s)
			}
			v = strings.Join(segs, "/")
		} else {
			v = url.PathEscape(v)
		}
		p = p[:i] + v + p[j+1:]
		args = args[1:]
	}
	return method, p
}

// String is the request as errors name it: "POST /v1/sandboxes/box/exec".
func (cl call) String() string {
	m, p := cl.path()
	return m + " " + p
}

func (cl call) accepts(status int) bool {
	if status >= 200 && status < 300 {
		return true
	}
	for _, s := range cl.ok {
		if s == status {
			return true
		}
	}
	return false
}

// jsonBody encodes v for a call.
func jsonBody(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("client: encoding a request body: %v", err)) // our own types: a bug
	}
	return b
}

// do sends a call and returns the response, whose status is 2xx or one of
// cl.ok; the caller closes its body. Any other status is an error: a
// *ServiceError, categorised where its meaning is known (401/403, 501, a
// protocol mismatch). Calls that are safe to repeat are repeated after
// failures that may pass, with backoff.
func (c *Client) do(ctx context.Context, cl call) (*http.Response, error) {
	refreshed := false
	for attempt := 0; ; attempt++ {
		req, err := c.request(ctx, cl)
		if err != nil {
			return nil, err
		}
		repeatable := cl.body == nil || req.GetBody != nil
		resp, err := c.hc.Do(req)
		if err != nil {
			if cerr := context.Cause(ctx); ctx.Err() != nil {
				return nil, fmt.Errorf("%s: %w", cl, cerr)
			}
			safe := repeatable && (cl.idempotent || refusedBeforeSending(err))
			if safe && attempt < c.retries {
				if err := sleepCtx(ctx, backoff(attempt, 0)); err != nil {
					return nil, fmt.Errorf("%s: %w", cl, err)
				}
				continue
			}
			return nil, fmt.Errorf("%s: %w", cl, err)
		}
		if v, ok := resp.Header[http.CanonicalHeaderKey(headerProtocol)]; ok && (len(v) != 1 || v[0] != protocolVersion) {
			drain(resp)
			return nil, &ProtocolError{Request: cl.String(), Client: protocolVersion, Service: strings.Join(v, ",")}
		}
		c.learn(cl, resp)
		if cl.accepts(resp.StatusCode) {
			return resp, nil
		}
		fromFront := resp.Header.Get(headerProtocol) == ""
		switch {
		case (resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden) && fromFront && c.ident != nil && !refreshed && repeatable:
			// The front end refused the identity token: it may have
			// expired early (clock skew); fetch a new one, once.
			drain(resp)
			if id := c.target(cl.sandboxOf()).ident; id != nil {
				id.invalidate()
			}
			refreshed = true
			attempt--
			continue
		case (resp.StatusCode == http.StatusBadGateway || resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusGatewayTimeout) &&
			cl.idempotent && repeatable && attempt < c.retries:
			wait := retryAfter(resp)
			drain(resp)
			if err := sleepCtx(ctx, backoff(attempt, wait)); err != nil {
				return nil, fmt.Errorf("%s: %w", cl, err)
			}
			continue
		}
		return nil, c.errorOf(cl, resp)
	}
}

// request builds one attempt of a call, with the protocol header, the
// service token and the identity token.
func (c *Client) request(ctx context.Context, cl call) (*http.Request, error) {
	method, p := cl.path()
	sh := c.target(cl.sandboxOf())
	target := sh.base.String() + p // p is escaped already
	if len(cl.query) > 0 {
		target += "?" + cl.query.Encode()
	}
	var body io.Reader
	switch b := cl.body.(type) {
	case nil:
	case []byte:
		body = bytes.NewReader(b)
	case io.Reader:
		body = b
	default:
		panic(fmt.Sprintf("client: body of type %T", cl.body))
	}
	req, err := http.NewRequestWithContext(ctx, method, target, body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", cl, err)
	}
	if _, isReader := cl.body.(io.Reader); isReader {
		req.GetBody = nil // streamed: never sent twice
	}
	for k, v := range cl.header {
		req.Header[k] = v
	}
	if cl.body != nil && !cl.raw {
		req.Header.Set("Content-Type", "application/json")
	}
	if err := c.authorizeFor(ctx, sh, req.Header); err != nil {
		return nil, fmt.Errorf("%s: %w", cl, err)
	}
	return req, nil
}

// authorize sets the headers every call and port connection to the first
// service carries.
func (c *Client) authorize(ctx context.Context, h http.Header) error {
	return c.authorizeFor(ctx, c.primary, h)
}

// authorizeFor sets the headers of a call to shard sh.
func (c *Client) authorizeFor(ctx context.Context, sh *shard, h http.Header) error {
	h.Set(headerProtocol, protocolVersion)
	if c.token != "" {
		h.Set(api.HeaderToken, c.token)
	}
	if sh.ident != nil {
		tok, err := sh.ident.token(ctx)
		if err != nil {
			return categorize(ErrAuthentication, err, "getting an identity token for %s: %v", sh.base.Host, err)
		}
		h.Set("Authorization", "Bearer "+tok)
	}
	return nil
}

// errorOf reads an error answer: its message, and what it means.
func (c *Client) errorOf(cl call, resp *http.Response) error {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	msg := strings.TrimSpace(string(b))
	var e api.Error
	if json.Unmarshal(b, &e) == nil && e.Error != "" {
		msg = e.Error
	}
	se := &ServiceError{Request: cl.String(), Status: resp.StatusCode, Message: msg}
	fromFront := resp.Header.Get(headerProtocol) == ""
	switch {
	case (resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden) && fromFront:
		if c.ident == nil {
			return categorize(ErrAuthentication, se, "the front end of %s refused a call without an identity token: it needs one (Cloud Run's IAM): give the client an identity source (gcloud's, or the metadata server's on Google Cloud)", c.base.Host)
		}
		return categorize(ErrAuthentication, se, "the front end of %s refused the identity token: grant the caller's account roles/run.invoker on the service (gcloud run services add-iam-policy-binding SERVICE --member=user:YOU --role=roles/run.invoker), and check that the identity token is for this service", c.base.Host)
	case resp.StatusCode == http.StatusUnauthorized:
		if c.token == "" {
			return categorize(ErrAuthentication, se, "the service wants its service token and none was given: give the client the service's SANDBOX_SERVICE_TOKEN")
		}
		return categorize(ErrAuthentication, se, "the service refused the service token: check that it is the service's SANDBOX_SERVICE_TOKEN")
	case resp.StatusCode == http.StatusForbidden:
		return categorize(ErrAuthentication, se, "the service refused the call: %s", msg)
	case resp.StatusCode == http.StatusNotImplemented:
		return categorize(ErrCapabilityUnsupported, se, "this service does not offer it")
	}
	return se
}

// refusedBeforeSending reports a connection that was never made: nothing
// of the request reached the service.
func refusedBeforeSending(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "dial"
}

// backoff is how long to wait before attempt+1: exponential from 100 ms,
// at most 2 s, with jitter; at least what the service asked (Retry-After),
// up to 5 s.
func backoff(attempt int, asked time.Duration) time.Duration {
	d := 100 * time.Millisecond << min(attempt, 5)
	d = min(d, 2*time.Second)
	d = d/2 + time.Duration(mrand.Int64N(int64(d/2)+1))
	return max(d, min(asked, 5*time.Second))
}

func retryAfter(resp *http.Response) time.Duration {
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
		return time.Duration(s) * time.Second
	}
	return 0
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// drain reads a little of a body and closes it, so that its connection
// can be used again.
func drain(resp *http.Response) {
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
}

// doJSON sends a call and decodes a JSON answer into out (when not nil).
func (c *Client) doJSON(ctx context.Context, cl call, out any) (int, error) {
	resp, err := c.do(ctx, cl)
	if err != nil {
		return 0, err
	}
	defer drain(resp)
	if out == nil || resp.StatusCode == http.StatusNoContent || !(resp.StatusCode >= 200 && resp.StatusCode < 300) {
		return resp.StatusCode, nil
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(out); err != nil {
		return resp.StatusCode, fmt.Errorf("%s: reading the answer: %w", cl, err)
	}
	return resp.StatusCode, nil
}
