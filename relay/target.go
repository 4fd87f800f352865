package relay

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/sandgate/sandgate/netpolicy"
)

// RoutePrefix starts every base-URL route: http://127.0.0.1:3128/https/<host>/<path>.
const RoutePrefix = "/https/"

// PlainRoutePrefix starts the route of an http base URL: forwarded only to
// an address the operator opened (see netpolicy.DecideArgs.Plain).
const PlainRoutePrefix = "/http/"

type targetKind int

const (
	kindConnect targetKind = iota + 1 // CONNECT host:port
	kindRoute                         // /https/<host>[:port]/<path>?<query> (or /http/)
)

// target is a parsed request-target.
type target struct {
	kind targetKind
	host string // as the sandbox spelled it (brackets removed); judged by netpolicy
	port int    // 0 when not given
	// plain: an http route (/http/<host>/...), sent without TLS.
	plain bool
	// rest is, for a route, the path and query to send upstream, beginning
	// with "/" (a route with nothing after the host sends "/").
	rest string
	// icpt is set for a request inside an intercepted connection: what
	// the connection was judged for.
	icpt *interception
}

// parseTarget reads a request's method and request-target (the raw second
// word of its request line). It decides nothing: errors are *Error values
// saying what the sandbox sent wrong.
func parseTarget(method, requestURI string) (target, error) {
	if method == http.MethodConnect {
		host, port, err := netpolicy.SplitHostPort(requestURI)
		if err != nil {
			return target{}, badRequest("CONNECT target %q: %v", requestURI, err)
		}
		if port == 0 {
			return target{}, badRequest("CONNECT target %q has no port: write host:443", requestURI)
		}
		if strings.Trim(host, "[]") == "" {
			return target{}, badRequest("CONNECT target %q has no host", truncate(requestURI, 100))
		}
		return target{kind: kindConnect, host: strings.Trim(host, "[]"), port: port}, nil
	}
	lower := strings.ToLower(requestURI)
	switch {
	case strings.HasPrefix(lower, "http://"):
		return target{}, &Error{Status: http.StatusForbidden, Code: CodePlainHTTP,
			Reason: "plain http:// is refused: sandgate carries only HTTPS, so traffic cannot be read or altered on the way; use an https:// URL (sent through CONNECT) or a base-URL route /https/<host>/<path>"}
	case strings.HasPrefix(lower, "https://"):
		return target{}, &Error{Status: http.StatusBadRequest, Code: CodeBadRequest,
			Reason: "absolute https:// request-targets are not proxied: send CONNECT host:443 for a tunnel, or request /https/<host>/<path> for a base-URL route"}
	case !strings.HasPrefix(requestURI, RoutePrefix) && !strings.HasPrefix(requestURI, PlainRoutePrefix):
		// Protocol 1 §7: anything that is not a route is 403.
		return target{}, &Error{Status: http.StatusForbidden, Code: CodeNoRoute,
			Reason: fmt.Sprintf("no route for %q: base-URL routes look like /https/<host>/<path>", truncate(requestURI, 100))}
	}
	prefix := RoutePrefix
	if strings.HasPrefix(requestURI, PlainRoutePrefix) {
		prefix = PlainRoutePrefix
	}
	after := requestURI[len(prefix):]
	end := strings.IndexAny(after, "/?")
	if end < 0 {
		end = len(after)
	}
	hostport, rest := after[:end], after[end:]
	if hostport == "" {
		return target{}, badRequest("route %q names no host: write /https/<host>/<path>", truncate(requestURI, 100))
	}
	host, port, err := netpolicy.SplitHostPort(hostport)
	if err != nil {
		return target{}, badRequest("route host %q: %v", truncate(hostport, 100), err)
	}
	if strings.Trim(host, "[]") == "" {
		return target{}, badRequest("route %q names no host: write /https/<host>/<path>", truncate(requestURI, 100))
	}
	switch {
	case rest == "":
		rest = "/"
	case rest[0] == '?':
		rest = "/" + rest
	}
	if strings.ContainsAny(rest, " \t\r\n\x00") {
		return target{}, badRequest("route path contains whitespace or control characters")
	}
	return target{kind: kindRoute, host: strings.Trim(host, "[]"), port: port, rest: rest, plain: prefix == PlainRoutePrefix}, nil
}

// pathOnly returns rest without its query, for audit events.
func pathOnly(rest string) string {
	if i := strings.IndexByte(rest, '?'); i >= 0 {
		return rest[:i]
	}
	return rest
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
