package client

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"

	"github.com/sandgate/sandgate/api"
)

// PreflightReport is what Preflight found.
type PreflightReport struct {
	URL      string
	Version  string // the service's implementation version
	Protocol int
	// Refused says what refused a call without credentials: "service
	// token" (the service), "front end" (Cloud Run's IAM), or "" when the
	// client has no credentials to give and the service is on loopback
	// (a local service without a token: the only open service preflight
	// accepts).
	Refused string
	// Routes is how many routes of the client the service's OpenAPI
	// document was checked for.
	Routes int
}

// Preflight checks that the service can be used, before anything is
// created: it answers protocol 1; it refuses a call without credentials
// (a service that lets one through is ErrOpenService, and must not be
// used: anyone who reaches it runs commands in its sandboxes), and takes
// this client's; and every route the client uses is in its OpenAPI
// document (else ErrCapabilityUnsupported naming them).
func (c *Client) Preflight(ctx context.Context) (PreflightReport, error) {
	rep := PreflightReport{URL: c.URL()}
	var h api.Health
	if _, err := c.doJSON(ctx, call{route: routeHealth, idempotent: true}, &h); err != nil {
		return rep, err
	}
	rep.Version, rep.Protocol = h.Version, h.Protocol
	if h.Status != "ok" || h.Protocol != api.ProtocolVersion {
		return rep, &ProtocolError{Request: routeHealth, Client: protocolVersion, Service: fmt.Sprint(h.Protocol)}
	}

	// A call without credentials must be refused.
	cl := call{route: routeList}
	req, err := c.request(ctx, cl)
	if err != nil {
		return rep, err
	}
	req.Header.Del(api.HeaderToken)
	req.Header.Del("Authorization")
	resp, err := c.hc.Do(req)
	if err != nil {
		return rep, fmt.Errorf("%s without credentials: %w", cl, err)
	}
	drain(resp)
	hasCreds := c.token != "" || c.ident != nil
	switch {
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		rep.Refused = "service token"
		if resp.Header.Get(headerProtocol) == "" {
			rep.Refused = "front end"
		}
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
		if !hasCreds && isLoopback(c.base.Hostname()) {
			break // a local service without a token, and a client that knows it
		}
		if !hasCreds {
			return rep, fmt.Errorf("%w: %s answered %s without any credential, and it is not on loopback: give it a service token (SANDBOX_SERVICE_TOKEN) or put it behind Cloud Run IAM", ErrOpenService, c.URL(), cl)
		}
		return rep, fmt.Errorf("%w: %s answered %s without the credentials this client was given: give it a service token (SANDBOX_SERVICE_TOKEN) or put it behind Cloud Run IAM (no --allow-unauthenticated)", ErrOpenService, c.URL(), cl)
	default:
		return rep, fmt.Errorf("%s without credentials: %d, want 401 or 403", cl, resp.StatusCode)
	}

	// And this client's credentials must be taken.
	if _, err := c.doJSON(ctx, call{route: routeList, idempotent: true}, nil); err != nil {
		return rep, err
	}

	// Every route the client calls is documented.
	resp, err = c.do(ctx, call{route: routeOpenAPI, idempotent: true})
	if err != nil {
		return rep, err
	}
	defer drain(resp)
	var doc struct {
		Paths map[string]map[string]json.RawMessage `json:"paths"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return rep, fmt.Errorf("%s: the OpenAPI document: %w", routeOpenAPI, err)
	}
	var missing []string
	for _, r := range Routes() {
		method, path, _ := strings.Cut(r, " ")
		rep.Routes++
		if _, ok := doc.Paths[path][strings.ToLower(method)]; !ok {
			missing = append(missing, r)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return rep, fmt.Errorf("%w: the service's OpenAPI document lacks routes this client calls: %s (an older sandgate?)", ErrCapabilityUnsupported, strings.Join(missing, ", "))
	}
	return rep, nil
}

func isLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
