package client

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/sandgate/sandgate/api"
)

// A tunnel's answer is written by a server in the sandbox: an owner it
// names is never followed (the client would send the sandbox's calls, and
// its tokens, there). An owner named on a call's answer is.
func TestOwnerFromATunnelIsNotFollowed(t *testing.T) {
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(api.HeaderProtocol, "1")
		w.Header().Set(api.HeaderOwner, "http://owner.invalid:1")
		w.WriteHeader(http.StatusOK)
	}))
	defer hs.Close()
	c, err := New(hs.URL, WithRetries(0))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, route := range []string{routePorts, routeTCP} {
		resp, err := c.do(ctx, call{route: route, args: []string{"box", "4000"}})
		if err != nil {
			t.Fatal(err)
		}
		drain(resp)
		if got := c.target("box"); got != c.primary || len(c.shards) != 1 {
			t.Fatalf("after %s: the box's calls go to %s (%d shards known), want %s", route, got.base, len(c.shards), c.primary.base)
		}
	}
	resp, err := c.do(ctx, call{route: routeGet, args: []string{"box"}})
	if err != nil {
		t.Fatal(err)
	}
	drain(resp)
	if got := c.target("box"); got.base.Host != "owner.invalid:1" {
		t.Errorf("after a call's answer: the box's calls go to %s, want the owner it named", got.base)
	}
}
