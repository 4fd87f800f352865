package bridge

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/transforms"
)

// Tunnel is the contract's answer to POST …/tunnel/{port}. sandgate's
// tunnel is the service itself: url is this service's
// /v1/sandbox/{id}/tunnel/{port}/, which carries HTTP (and WebSocket
// upgrades) to 127.0.0.1:{port} in the sandbox for a caller with the key.
type Tunnel struct {
	ID        string `json:"id"`
	Port      int    `json:"port"`
	URL       string `json:"url"`
	Hostname  string `json:"hostname"`
	CreatedAt string `json:"createdAt"`
	Name      string `json:"name,omitempty"`
}

// tunnelDialWait bounds the dial a tunnel makes into the sandbox.
const tunnelDialWait = 30 * time.Second

// strippedHeaders never reach a server in the sandbox: the caller's
// credentials and what a front end added.
var strippedHeaders = []string{
	"Authorization", "Proxy-Authorization", "X-Serverless-Authorization", "X-Ai-Sdk-Sandbox-Token",
	"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "Traceparent", "X-Cloud-Trace-Context",
}

// createTunnel checks that something listens on the port in the sandbox
// and answers where to reach it. The tunnel keeps no state: the route
// below works for any port of a running sandbox, for a caller with the
// key (unlike the contract's public tunnels).
func (b *Bridge) createTunnel(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	port, err := parsePort(r.PathValue("port"))
	if err != nil {
		return err
	}
	name, err := tunnelName(r.Body)
	if err != nil {
		return err
	}
	if err := b.ensure(r.Context(), id, true); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), tunnelDialWait)
	defer cancel()
	c, err := b.b.DialPort(ctx, id, port)
	if err != nil {
		return fmt.Errorf("nothing answers on port %d in the sandbox: %w", port, err)
	}
	c.Close()
	base := requestBase(r)
	writeJSON(w, http.StatusOK, Tunnel{
		ID: id + "-" + strconv.Itoa(port), Port: port, Name: name,
		URL:      base.String() + "/v1/sandbox/" + id + "/tunnel/" + strconv.Itoa(port) + "/",
		Hostname: base.Hostname(), CreatedAt: now(),
	})
	return nil
}

// tunnelName reads the optional {"name"} of a tunnel request: a DNS label.
func tunnelName(body io.Reader) (string, error) {
	data, err := io.ReadAll(io.LimitReader(body, maxJSON))
	if err != nil {
		return "", invalid("Could not read request body: %v", err)
	}
	if strings.TrimSpace(string(data)) == "" {
		return "", nil
	}
	var o map[string]json.RawMessage
	if err := json.Unmarshal(data, &o); err != nil {
		var v any
		if json.Unmarshal(data, &v) == nil {
			return "", nil // valid JSON of another shape: no name, as the contract reads it
		}
		return "", invalid("Invalid JSON body")
	}
	raw, has := o["name"]
	if !has || string(raw) == "null" {
		return "", nil
	}
	var name string
	if json.Unmarshal(raw, &name) != nil {
		return "", invalid("name must be a string when provided")
	}
	if len(name) > 63 || !tunnelNamePat.MatchString(name) {
		return "", invalid("name must be a DNS label: 1 to 63 lowercase letters, digits and '-', not starting or ending with '-'")
	}
	return name, nil
}

// requestBase is the scheme and host the caller reached this service at.
func requestBase(r *http.Request) *url.URL {
	scheme := "http"
	if r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https") {
		scheme = "https"
	}
	return &url.URL{Scheme: scheme, Host: r.Host}
}

// deleteTunnel: 204, there being nothing to stop.
func (b *Bridge) deleteTunnel(w http.ResponseWriter, r *http.Request) error {
	if _, err := parsePort(r.PathValue("port")); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// tunnel carries a request (any method; a WebSocket upgrade too) to
// 127.0.0.1:{port} in a running sandbox (a suspended one is resumed),
// without the caller's credentials.
func (b *Bridge) tunnel(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	port, err := parsePort(r.PathValue("port"))
	if err != nil {
		return err
	}
	if err := b.ensure(r.Context(), id, false); err != nil {
		if errors.Is(err, appliance.ErrNotFound) {
			return fail(http.StatusBadGateway, codeTunnel, "tunnel failed: sandbox %q is neither running nor suspended", id)
		}
		return err
	}
	// The path on the server in the sandbox, as the caller escaped it
	// (a %2F stays one); decoded when the caller escaped the prefix too.
	target := &url.URL{Path: "/" + r.PathValue("rest")}
	prefix := "/v1/sandbox/" + id + "/tunnel/" + strconv.Itoa(port) + "/"
	if rest, ok := strings.CutPrefix(r.URL.EscapedPath(), prefix); ok {
		if u, err := url.Parse("/" + rest); err == nil && u.Path == target.Path {
			target = u
		}
	}
	g, err := b.b.PortGuard(id)
	if err != nil {
		return err
	}
	var failed error
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "127.0.0.1:"+strconv.Itoa(port)
			pr.Out.URL.Path, pr.Out.URL.RawPath = target.Path, target.RawPath
			pr.Out.URL.RawQuery = r.URL.RawQuery
			pr.Out.Host = pr.Out.URL.Host
			for _, h := range strippedHeaders {
				pr.Out.Header.Del(h)
			}
		},
		Transport: &guardedTransport{g: g, next: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				ctx, cancel := context.WithTimeout(ctx, tunnelDialWait)
				defer cancel()
				return b.b.DialPort(ctx, id, port)
			},
			DisableKeepAlives: true,
		}},
		ModifyResponse: func(resp *http.Response) error {
			api.StripAnswer(resp)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			failed = err
		},
		ErrorLog: slog.NewLogLogger(b.log.Handler(), slog.LevelDebug),
	}
	rp.ServeHTTP(w, r)
	var refused *transforms.CredentialError
	switch {
	case failed == nil:
		return nil
	case errors.As(failed, &refused):
		return refused // its message starts with the phrase a client looks for
	case r.Context().Err() != nil:
		return nil
	}
	return fmt.Errorf("port %d of the sandbox: %w", port, failed)
}

// guardedTransport carries a tunnel's request into the sandbox through
// its credential guard: the request line and headers (as they leave, the
// caller's credentials stripped) are searched before anything is dialled,
// the body as it streams. After an upgrade the bytes are the connection's
// own (a WebSocket client masks them) and are not searched. Informational
// answers (1xx) lose the service's headers as the final answer does.
type guardedTransport struct {
	g    appliance.PortGuard
	next http.RoundTripper
}

func (t *guardedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if err := t.g.Head(requestHead(req)); err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	// Hooks of the innermost trace run first: the proxy's own, which
	// copies a 1xx's headers to the caller, sees them stripped.
	out := req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		Got1xxResponse: func(_ int, h textproto.MIMEHeader) error {
			api.StripServiceHeaders(http.Header(h))
			return nil
		},
	}))
	if req.Body != nil && req.Body != http.NoBody {
		out.Body = guardedBody{Reader: t.g.Body(req.Body), Closer: req.Body}
	}
	return t.next.RoundTrip(out)
}

// guardedBody is a request body read through the guard, closed as itself.
type guardedBody struct {
	io.Reader
	io.Closer
}

// requestHead is what of req the server in the sandbox reads before its
// body: the request line, Host, and every header, one line each.
func requestHead(req *http.Request) string {
	var b strings.Builder
	b.WriteString(req.Method + " " + req.URL.RequestURI() + "\nHost: " + req.Host + "\n")
	req.Header.Write(&b)
	for _, te := range req.TransferEncoding {
		b.WriteString(te + "\n")
	}
	return b.String()
}
