package forward

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strings"
)

// Peers are the shards a request may be forwarded to, and with it this
// shard's credentials. A shard's URL comes from its heartbeat in the
// store, and whoever can write the store can write any URL there: a peer
// is proven by being listed here, never by the store's word.
//
// An entry is an origin, http(s)://host[:port]; its host may begin with
// "*." for any one DNS label there (the pods of a Kubernetes headless
// service: http://*.sandgate-shards.ns.svc.cluster.local:8080). The zero
// Peers lists none and admits loopback peers only (several shards on one
// host): a loopback address is this host's, which nothing in the store
// can move elsewhere.
type Peers struct {
	entries []peerEntry
}

// peerEntry is one origin, its host lowercased without a trailing dot, its
// port explicit; wild says host is the suffix a label precedes.
type peerEntry struct {
	scheme, host, port string
	wild               bool
}

func (e peerEntry) String() string {
	h := e.host
	if e.wild {
		h = "*." + h
	}
	return e.scheme + "://" + net.JoinHostPort(h, e.port)
}

// ParsePeers reads the entries of SANDGATE_SHARD_PEERS; empty ones are
// skipped. A malformed entry is an error naming it.
func ParsePeers(entries []string) (Peers, error) {
	var p Peers
	for _, raw := range entries {
		if raw = strings.TrimSpace(raw); raw == "" {
			continue
		}
		u, err := url.Parse(strings.TrimSuffix(raw, "/"))
		if err != nil || u.Host == "" || u.User != nil || u.Path != "" || u.RawQuery != "" || u.Fragment != "" {
			return Peers{}, fmt.Errorf("%q: want an origin, http(s)://host[:port], such as https://sandgate-1-123456789.europe-west1.run.app", raw)
		}
		e, err := originOf(u)
		if err != nil {
			return Peers{}, fmt.Errorf("%q: %v", raw, err)
		}
		if rest, ok := strings.CutPrefix(e.host, "*."); ok {
			if rest == "" || strings.Contains(rest, "*") || !strings.Contains(rest, ".") {
				return Peers{}, fmt.Errorf("%q: a wildcard is one leading \"*.\" before a domain of two labels or more", raw)
			}
			if rest == "run.app" || strings.HasSuffix(rest, ".run.app") {
				return Peers{}, fmt.Errorf("%q: anyone's Cloud Run service has a URL under run.app: list each shard's URL instead", raw)
			}
			e.host, e.wild = rest, true
		} else if strings.Contains(e.host, "*") {
			return Peers{}, fmt.Errorf("%q: a wildcard is one leading \"*.\"", raw)
		}
		p.entries = append(p.entries, e)
	}
	return p, nil
}

// originOf is u's origin: scheme and host lowercased, the host without a
// trailing dot, the port explicit.
func originOf(u *url.URL) (peerEntry, error) {
	e := peerEntry{scheme: strings.ToLower(u.Scheme), host: strings.TrimSuffix(strings.ToLower(u.Hostname()), "."), port: u.Port()}
	switch {
	case e.scheme != "http" && e.scheme != "https":
		return e, errors.New("want an http or https URL")
	case e.host == "":
		return e, errors.New("no host")
	case e.port == "" && e.scheme == "http":
		e.port = "80"
	case e.port == "":
		e.port = "443"
	}
	return e, nil
}

// String lists the entries, or says that loopback peers alone are
// admitted.
func (p Peers) String() string {
	if len(p.entries) == 0 {
		return "none set: loopback peers only"
	}
	s := make([]string, len(p.entries))
	for i, e := range p.entries {
		s[i] = e.String()
	}
	return strings.Join(s, ",")
}

// ErrPeer: a shard's URL is not among this shard's peers.
var ErrPeer = errors.New("not among this shard's peers")

// Allow returns nil when a request may be forwarded to the peer at u, and
// otherwise an error (ErrPeer) saying why.
func (p Peers) Allow(u *url.URL) error {
	o, err := originOf(u)
	if err != nil || u.User != nil {
		return fmt.Errorf("%w: %q is not an http(s) origin", ErrPeer, u.Redacted())
	}
	if len(p.entries) == 0 {
		if a, err := netip.ParseAddr(o.host); (err == nil && a.Unmap().IsLoopback()) || o.host == "localhost" {
			return nil
		}
		return fmt.Errorf("%w (SANDGATE_SHARD_PEERS is not set: only loopback peers are)", ErrPeer)
	}
	for _, e := range p.entries {
		if e.scheme != o.scheme || e.port != o.port {
			continue
		}
		if !e.wild && e.host == o.host {
			return nil
		}
		if label, ok := strings.CutSuffix(o.host, "."+e.host); e.wild && ok && label != "" && !strings.Contains(label, ".") {
			return nil
		}
	}
	return fmt.Errorf("%w (SANDGATE_SHARD_PEERS: %s)", ErrPeer, p)
}
