package service_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/forward"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
	"github.com/sandgate/sandgate/snapshot/store"
)

// recorder is an HTTP server that notes the headers of every request it
// gets and answers 200 as a shard would.
type recorder struct {
	*httptest.Server
	mu   sync.Mutex
	seen []http.Header
}

func newRecorder(t *testing.T) *recorder {
	rec := &recorder{}
	rec.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec.mu.Lock()
		h := r.Header.Clone()
		h.Set("X-Test-Path", r.URL.Path)
		rec.seen = append(rec.seen, h)
		rec.mu.Unlock()
		w.Header().Set(api.HeaderProtocol, "1")
		w.Write([]byte(`{}`))
	}))
	t.Cleanup(rec.Close)
	return rec
}

func (rec *recorder) requests() []http.Header {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]http.Header(nil), rec.seen...)
}

// plantShard writes, as anyone who can write the store can, a live
// heartbeat of shard id at url and leases naming it for sandboxes.
func plantShard(t *testing.T, st store.Store, id, url string, room int, sandboxes ...string) {
	t.Helper()
	ctx := context.Background()
	now := time.Now().UTC()
	put := func(name string, v any) {
		b, _ := json.Marshal(v)
		if _, err := st.Put(ctx, name, bytes.NewReader(b), store.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	put("shards/"+id+".json", map[string]any{"shard": id, "url": url, "epoch": "planted", "expires": now.Add(time.Hour), "renewed": now, "running": 0, "max": room})
	for _, sb := range sandboxes {
		put("leases/"+sb+".json", map[string]any{"sandbox": sb, "shard": id, "url": url, "epoch": "planted", "taken": now})
	}
}

// A heartbeat and leases planted in the store (its writer's word) name a
// server of the writer's: no request goes there, nor any credential, for a
// sandbox it claims to run or a create it has room for; the caller is told
// why and what to do. A shard among the peers gets requests, with this
// shard's credentials and never the client's: a caller this shard refuses
// has nothing forwarded.
func TestPlantedShardGetsNoRequestNorCredential(t *testing.T) {
	planted, peer := newRecorder(t), newRecorder(t)
	peers, err := forward.ParsePeers([]string{peer.URL})
	if err != nil {
		t.Fatal(err)
	}
	r := newRigOn(t, stacktest.Config{
		Bridge:  bridge.Config{Key: bridgeKey},
		Peers:   peers,
		Manager: func(mc *appliance.ManagerConfig) { mc.MaxRunning = 1 },
	}, nil)
	st := r.stack.Store
	plantShard(t, st, "planted", planted.URL, 1000, "box", "bridgebox")
	plantShard(t, st, "peer", peer.URL, 10, "peerbox", "peerbridgebox")
	send := func(method, path, body string, hdr ...string) (int, string) {
		return r.send(method, path, strings.NewReader(body), append([]string{api.HeaderProtocol, "1"}, hdr...)...)
	}
	token := []string{api.HeaderToken, r.token, "Authorization", "Bearer eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJjbGllbnQifQ.sig", "X-Serverless-Authorization", "Bearer client-identity"}
	key := []string{"Authorization", "Bearer " + bridgeKey}

	// The planted shard: nothing reaches it.
	for _, tc := range []struct {
		what, method, path string
		hdr                []string
	}{
		{"protocol 1", "GET", "/v1/sandboxes/box", token},
		{"an exec", "POST", "/v1/sandboxes/box/exec", token},
		{"the bridge", "GET", "/v1/sandbox/bridgebox/running", key},
	} {
		code, out := send(tc.method, tc.path, `{"command":"true"}`+"\n", tc.hdr...)
		if code != http.StatusBadGateway || !strings.Contains(out, "not among this shard's peers") || !strings.Contains(out, "SANDGATE_SHARD_PEERS") || !strings.Contains(out, planted.URL) {
			t.Errorf("%s, for a sandbox the planted shard claims: %d %s, want 502 naming it and the fix", tc.what, code, out)
		}
	}
	// A create when this shard is full: the planted shard has the most
	// room, and gets none of it; the peer gets it.
	r.create("one", nil)
	if code, out := send("POST", "/v1/sandboxes", `{"name":"two"}`, token...); code != 200 {
		t.Errorf("a create on a full shard: %d %s, want the peer's answer", code, out)
	}
	if got := planted.requests(); len(got) != 0 {
		t.Fatalf("the planted shard got %d requests: %v", len(got), got)
	}
	if got := peer.requests(); len(got) != 1 || got[0].Get("X-Test-Path") != "/v1/sandboxes" || got[0].Get(api.HeaderToken) != r.token || got[0].Get("Authorization") != "" {
		t.Errorf("the peer got %v, want the create with this shard's token alone", got)
	}

	// A peer: this shard's credentials, never the client's.
	for _, tc := range []struct {
		what, path string
		hdr        []string
		want       http.Header
	}{
		{"protocol 1", "/v1/sandboxes/peerbox", token, http.Header{api.HeaderToken: {r.token}}},
		{"the bridge", "/v1/sandbox/peerbridgebox/running", key, http.Header{"Authorization": {"Bearer " + bridgeKey}, api.HeaderToken: {r.token}}},
	} {
		before := len(peer.requests())
		if code, out := send("GET", tc.path, "", tc.hdr...); code != 200 {
			t.Fatalf("%s through a peer: %d %s", tc.what, code, out)
		}
		got := peer.requests()
		if len(got) != before+1 {
			t.Fatalf("%s: the peer got %d requests, want 1", tc.what, len(got)-before)
		}
		h := got[len(got)-1]
		if h.Get(api.HeaderForwarded) == "" || h.Get("X-Test-Path") != tc.path {
			t.Errorf("%s: the peer got %v", tc.what, h)
		}
		for _, k := range []string{"Authorization", api.HeaderToken, "X-Serverless-Authorization"} {
			if w := tc.want.Values(k); strings.Join(h.Values(k), ",") != strings.Join(w, ",") {
				t.Errorf("%s: the peer got %s %q, want %q (this shard's own)", tc.what, k, h.Values(k), w)
			}
		}
	}
	// A caller this shard refuses has nothing forwarded: its wrong
	// credential is its own secret.
	before := len(peer.requests())
	if code, _ := send("GET", "/v1/sandboxes/peerbox", "", api.HeaderToken, "wrong-token-of-the-client"); code != http.StatusUnauthorized {
		t.Errorf("a wrong service token: %d, want 401 here", code)
	}
	if code, _ := send("GET", "/v1/sandbox/peerbridgebox/running", "", "Authorization", "Bearer wrong-key-of-the-client"); code != http.StatusUnauthorized {
		t.Errorf("a wrong bridge key: %d, want 401 here", code)
	}
	if got := peer.requests(); len(got) != before {
		t.Errorf("the peer got a refused caller's request: %v", got[before:])
	}
}
