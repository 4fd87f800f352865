package forward

import (
	"errors"
	"net/url"
	"strings"
	"testing"
)

// A peer is proven only by its origin among the listed ones: spellings
// that look like a listed or loopback origin, and are not, are refused.
func TestPeersAllow(t *testing.T) {
	listed, err := ParsePeers([]string{
		"https://sandgate-1-123.europe-west1.run.app/", "http://Shard-2.Example.COM.:8080",
		"http://*.sandgate-shards.ns.svc.cluster.local:8080", " ",
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		peers Peers
		url   string
		ok    bool
	}{
		{listed, "https://sandgate-1-123.europe-west1.run.app", true},
		{listed, "https://SANDGATE-1-123.europe-west1.run.app.:443", true},
		{listed, "http://sandgate-1-123.europe-west1.run.app", false},       // another scheme
		{listed, "https://sandgate-1-123.europe-west1.run.app:8443", false}, // another port
		{listed, "https://sandgate-1-123.europe-west1.run.app.evil.example", false},
		{listed, "https://evil-sandgate-1-123.europe-west1.run.app", false},
		{listed, "https://user@sandgate-1-123.europe-west1.run.app", false},
		{listed, "http://shard-2.example.com:8080", true},
		{listed, "http://shard-2.example.com", false},
		{listed, "http://sandgate-0.sandgate-shards.ns.svc.cluster.local:8080", true},
		{listed, "http://a.b.sandgate-shards.ns.svc.cluster.local:8080", false}, // two labels
		{listed, "http://sandgate-shards.ns.svc.cluster.local:8080", false},     // none
		{listed, "http://evilsandgate-shards.ns.svc.cluster.local:8080", false},
		{listed, "http://sandgate-0.sandgate-shards.ns.svc.cluster.local.evil.example:8080", false},
		{listed, "http://127.0.0.1:8080", false}, // listed peers: loopback is not implied
		{Peers{}, "http://127.0.0.1:8081", true},
		{Peers{}, "http://127.9.9.9:8081", true},
		{Peers{}, "http://[::1]:8081", true},
		{Peers{}, "http://[::ffff:127.0.0.1]:8081", true},
		{Peers{}, "http://localhost:8081", true},
		{Peers{}, "http://127.0.0.1.evil.example:8081", false},
		{Peers{}, "http://localhost.evil.example:8081", false},
		{Peers{}, "http://0x7f.0.0.1:8081", false},
		{Peers{}, "http://2130706433:8081", false},
		{Peers{}, "http://10.0.0.1:8081", false},
		{Peers{}, "https://sandgate-1-123.europe-west1.run.app", false},
		{Peers{}, "ftp://127.0.0.1", false},
	} {
		u, err := url.Parse(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		err = tc.peers.Allow(u)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrPeer)) {
			t.Errorf("peers %s, %s: %v, want allowed %v", tc.peers, tc.url, err, tc.ok)
		}
	}
}

// A malformed entry stops serve at start, naming it.
func TestParsePeersRefusesMalformedEntries(t *testing.T) {
	for _, e := range []string{
		"sandgate-1.example.com", "ftp://x.example.com", "https://x.example.com/path", "https://x.example.com?q",
		"https://user:pw@x.example.com", "https://*.run.app", "https://*.europe-west1.run.app", "http://*.com",
		"http://a.*.example.com", "http://*", "https://",
	} {
		if _, err := ParsePeers([]string{e}); err == nil || !strings.Contains(err.Error(), e) {
			t.Errorf("%q: %v, want an error naming it", e, err)
		}
	}
}
