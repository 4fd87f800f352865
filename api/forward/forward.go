// Package forward sends a request for a sandbox another shard runs to that
// shard, so that any shard answers any request: the front of the HTTP
// service when several share one store (appliance/cluster).
//
// A request naming a sandbox (/v1/sandboxes/{name}/...) goes to the shard
// holding the sandbox's lease: served here when that is this shard or
// nobody (a suspended sandbox is resumed by whichever shard is asked, or,
// when that one is full, by a shard with room), forwarded otherwise, streams, exec frames, port tunnels and the TCP
// bridge included. A create goes here while this shard has room, else to
// a shard that has. A forwarded request carries HeaderForwarded and is
// never forwarded again. Every answer about a sandbox says which shard
// served it (HeaderOwner).
//
// The store says where a shard is, and whoever can write the store can say
// anything: a request goes only to a peer among Config.Peers, only for a
// caller the service here would serve (Config.Authenticate), and carries
// this shard's own credentials (Config.Credentials), never the client's.
package forward

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance/cluster"
)

// Headers of the forwarding (see package api).
const (
	HeaderOwner     = api.HeaderOwner
	HeaderForwarded = api.HeaderForwarded
)

// Locator says where sandboxes run: *appliance.Manager.
type Locator interface {
	// Owner is the shard running sandbox id, local when it is this one
	// or none.
	Owner(ctx context.Context, id string) (shard cluster.Shard, local bool, err error)
	// Runs says whether sandbox id is this shard's now (starting,
	// running or being saved).
	Runs(id string) bool
	// Place is where a new sandbox should start: here (local), else on
	// one of others, in order.
	Place(ctx context.Context) (others []cluster.Shard, local bool)
	// Shard is this shard's id and URL.
	Shard() (id, url string)
}

// Config is a front's.
type Config struct {
	Locator Locator
	// Next serves what is served here: the HTTP service.
	Next http.Handler
	// Peers are the shards a request may be forwarded to; the zero value
	// admits loopback peers only. A sandbox whose owner is not among them
	// is answered 502, naming the owner and the fix; a create or a
	// resume that needs room goes to none of them.
	Peers Peers
	// Authenticate, when set, answers a request whose caller the service
	// here would refuse (a missing or wrong service token or bridge key),
	// as it would, and reports whether it may go on: nothing is forwarded
	// for a caller this shard would not serve itself.
	Authenticate func(w http.ResponseWriter, r *http.Request) bool
	// Credentials, when set, gives a forwarded request this shard's own
	// credentials for the peer at peerURL: its service token, its bridge
	// key, on Cloud Run an identity token for the peer. The client's are
	// removed first (clientCredentials) and never travel.
	Credentials func(ctx context.Context, req *http.Request, peerURL string) error
	// CacheFor is how long a sandbox's owner is remembered (default 1s):
	// owners change only when a shard stops or dies.
	CacheFor time.Duration
	Logger   *slog.Logger
}

// Front is the forwarding front.
type Front struct {
	cfg   Config
	log   *slog.Logger
	self  string // this shard's HeaderOwner value
	id    string
	proxy *httputil.ReverseProxy
	hc    *http.Client // forwarded creates

	mu     sync.Mutex
	owners map[string]owned
}

type owned struct {
	shard cluster.Shard
	local bool
	until time.Time
}

// peerKey carries a forwarded request's peer through the reverse proxy.
type peerKey struct{}

// New makes a front.
func New(cfg Config) *Front {
	if cfg.CacheFor <= 0 {
		cfg.CacheFor = time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	id, u := cfg.Locator.Shard()
	f := &Front{cfg: cfg, log: cfg.Logger, id: id, self: u, owners: map[string]owned{},
		hc: &http.Client{Timeout: 10 * time.Minute, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	if f.self == "" {
		f.self = id
	}
	f.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			peer := pr.In.Context().Value(peerKey{}).(*url.URL)
			pr.SetURL(peer)
			pr.Out.Host = peer.Host
			if err := f.credentials(pr.Out, peer); err != nil {
				f.log.Warn("forwarding: no credentials for the peer", "peer", peer.String(), "err", err)
			}
		},
		// A sandbox suspended or destroyed there is nobody's: its next
		// request is served where it arrives.
		ModifyResponse: func(resp *http.Response) error {
			if r := resp.Request; r != nil && (r.Method == http.MethodDelete && strings.Count(strings.TrimPrefix(strings.TrimPrefix(r.URL.Path, "/v1/sandboxes/"), "/v1/sandbox/"), "/") == 0 ||
				r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/suspend")) {
				f.forget(sandboxOf(r))
			}
			return nil
		},
		FlushInterval: -1, // exec frames and streams as they come
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			peer := r.Context().Value(peerKey{}).(*url.URL)
			f.forget(sandboxOf(r))
			f.log.Warn("forwarding to the shard that runs the sandbox failed", "peer", peer.String(), "path", r.URL.Path, "err", err)
			w.Header().Set("Retry-After", "1")
			writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("the shard running this sandbox (%s) did not answer: %v; retry (if it is gone, another shard resumes the sandbox once its lease expires)", peer.Host, err))
		},
		ErrorLog: slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelDebug),
	}
	return f
}

// sandboxOf is the sandbox a request names, "" for none: protocol 1's and
// sandgate's /v1/sandboxes/{name}/..., and the Cloudflare bridge's
// /v1/sandbox/{id}/....
func sandboxOf(r *http.Request) string {
	rest, ok := strings.CutPrefix(r.URL.Path, "/v1/sandboxes/")
	if !ok {
		if rest, ok = strings.CutPrefix(r.URL.Path, "/v1/sandbox/"); !ok {
			return ""
		}
	}
	name, _, _ := strings.Cut(rest, "/")
	return name
}

// isCreate says whether r creates a sandbox (protocol 1's create, or the
// bridge's).
func isCreate(r *http.Request) bool {
	p := strings.TrimSuffix(r.URL.Path, "/")
	return r.Method == http.MethodPost && (p == "/v1/sandboxes" || p == "/v1/sandbox")
}

func (f *Front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get(HeaderForwarded) != "" {
		f.local(w, r)
		return
	}
	if isCreate(r) {
		f.create(w, r)
		return
	}
	id := sandboxOf(r)
	if id == "" {
		f.cfg.Next.ServeHTTP(w, r)
		return
	}
	shard, local, err := f.owner(r.Context(), id)
	if err != nil {
		f.log.Warn("could not tell which shard runs the sandbox; serving here", "sandbox", id, "err", err)
	}
	if local && err == nil && !f.cfg.Locator.Runs(id) {
		// Nobody runs it (suspended, or unknown): it is resumed where it
		// is asked while this shard has room, else where there is.
		if others, room := f.cfg.Locator.Place(r.Context()); !room {
			if others = f.proven(others); len(others) > 0 {
				f.forward(w, r, others[0])
				return
			}
		}
	}
	if local || err != nil {
		f.local(w, r)
		return
	}
	f.forward(w, r, shard)
}

// clientCredentials are the headers a client authenticates with: none of
// them goes to another shard (a wrong one is the client's secret, a right
// one is this shard's to send).
var clientCredentials = []string{"Authorization", "Proxy-Authorization", "X-Serverless-Authorization", api.HeaderToken}

// credentials makes out, a request bound for peer, carry this shard's
// credentials instead of the client's, and the forwarding mark.
func (f *Front) credentials(out *http.Request, peer *url.URL) error {
	for _, h := range clientCredentials {
		out.Header.Del(h)
	}
	out.Header.Set(HeaderForwarded, f.id)
	if f.cfg.Credentials == nil {
		return nil
	}
	return f.cfg.Credentials(out.Context(), out, peer.String())
}

// authenticated says whether r's caller may have r forwarded; when not,
// Authenticate has answered.
func (f *Front) authenticated(w http.ResponseWriter, r *http.Request) bool {
	return f.cfg.Authenticate == nil || f.cfg.Authenticate(w, r)
}

// proven are the shards of ss a request may go to (Peers); each other one
// is logged, once per call.
func (f *Front) proven(ss []cluster.Shard) []cluster.Shard {
	var out []cluster.Shard
	for _, s := range ss {
		if _, err := f.peer(s); err != nil {
			f.log.Warn("a shard with room is not among this shard's peers: nothing goes there", "shard", s.ID, "err", err)
			continue
		}
		out = append(out, s)
	}
	return out
}

// peer is shard's URL when requests may go there: well formed, and among
// Peers.
func (f *Front) peer(shard cluster.Shard) (*url.URL, error) {
	peer, err := url.Parse(shard.URL)
	if err != nil || (peer.Scheme != "http" && peer.Scheme != "https") || peer.Host == "" {
		return nil, fmt.Errorf("shard %s at %q: not an http(s)://host[:port] URL", shard.ID, shard.URL)
	}
	if err := f.cfg.Peers.Allow(peer); err != nil {
		return nil, fmt.Errorf("shard %s at %s: %w", shard.ID, peer.Redacted(), err)
	}
	return peer, nil
}

// local serves r here, saying so.
func (f *Front) local(w http.ResponseWriter, r *http.Request) {
	if sandboxOf(r) != "" || isCreate(r) {
		w.Header().Set(HeaderOwner, f.self)
	}
	f.cfg.Next.ServeHTTP(w, r)
}

// create serves a create here while this shard has room, else on the
// first of the others with room that takes it (a shard that filled since
// its last heartbeat answers 503: the next is tried). With no room
// anywhere, the service here answers 503.
func (f *Front) create(w http.ResponseWriter, r *http.Request) {
	others, local := f.cfg.Locator.Place(r.Context())
	if !local {
		others = f.proven(others)
	}
	if local || len(others) == 0 {
		f.local(w, r)
		return
	}
	if !f.authenticated(w, r) {
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxCreateBody+1))
	if err != nil || len(body) > maxCreateBody {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("reading the request: %v (at most %d bytes)", err, maxCreateBody))
		return
	}
	for _, s := range others {
		peer, err := f.peer(s)
		if err != nil {
			continue // proven above; a URL does not change
		}
		resp, err := f.send(r, peer, body)
		if err != nil {
			f.log.Warn("forwarding a create to a shard with room failed; trying the next", "shard", s.ID, "err", err)
			continue
		}
		if resp.StatusCode == http.StatusServiceUnavailable {
			resp.Body.Close()
			continue // full since its heartbeat
		}
		defer resp.Body.Close()
		for k, v := range resp.Header {
			w.Header()[k] = v
		}
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	f.local(w, r)
}

// maxCreateBody bounds a create's body, which a forwarded create buffers.
const maxCreateBody = 1 << 20

// send sends a copy of r, with body, to peer.
func (f *Front) send(r *http.Request, peer *url.URL, body []byte) (*http.Response, error) {
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host, out.Host = peer.Scheme, peer.Host, peer.Host
	out.Body, out.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	if err := f.credentials(out, peer); err != nil {
		return nil, err
	}
	return f.hc.Do(out)
}

// owner is who runs sandbox id, remembered for CacheFor.
func (f *Front) owner(ctx context.Context, id string) (cluster.Shard, bool, error) {
	f.mu.Lock()
	o, ok := f.owners[id]
	f.mu.Unlock()
	if ok && time.Now().Before(o.until) {
		return o.shard, o.local, nil
	}
	shard, local, err := f.cfg.Locator.Owner(ctx, id)
	if err != nil {
		return shard, local, err
	}
	if !local && shard.URL == "" {
		return shard, false, fmt.Errorf("sandbox %s runs on shard %s, which gave no URL (SANDGATE_SHARD_URL)", id, shard.ID)
	}
	f.mu.Lock()
	if len(f.owners) > 10000 {
		clear(f.owners)
	}
	f.owners[id] = owned{shard: shard, local: local, until: time.Now().Add(f.cfg.CacheFor)}
	f.mu.Unlock()
	return shard, local, nil
}

// forget drops what is remembered of id's owner.
func (f *Front) forget(id string) {
	if id == "" {
		return
	}
	f.mu.Lock()
	delete(f.owners, id)
	f.mu.Unlock()
}

// forward sends r to shard, for a caller the service here would serve, if
// the shard is among Peers.
func (f *Front) forward(w http.ResponseWriter, r *http.Request, shard cluster.Shard) {
	if !f.authenticated(w, r) {
		return
	}
	peer, err := f.peer(shard)
	if err != nil {
		f.forget(sandboxOf(r))
		f.log.Warn("not forwarding: the shard that runs the sandbox is not a proven peer", "sandbox", sandboxOf(r), "err", err)
		writeError(w, http.StatusBadGateway, fmt.Sprintf("sandbox %s runs on %v: no request goes there. If it is a shard of this service, add its URL to SANDGATE_SHARD_PEERS on every shard; if it is not, something wrote its heartbeat and lease into the store (the lease holds until that heartbeat expires)", sandboxOf(r), err))
		return
	}
	// Streams in both directions (exec's stdin beside its output).
	http.NewResponseController(w).EnableFullDuplex()
	f.proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), peerKey{}, peer)))
}

func writeError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set(api.HeaderProtocol, "1")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(api.Error{Error: msg})
}
