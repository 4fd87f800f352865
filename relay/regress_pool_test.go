// Regression tests from the review of the route's upstream pool.

package relay

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/sandgate/sandgate/transforms"
)

func TestHeadKeepsContentLengthWithSecret(t *testing.T) {
	rules := `[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, rules)
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1234")
		if r.Method != "HEAD" {
			w.Write(make([]byte, 1234))
		}
	}))
	for _, withKey := range []bool{false, true} {
		req, _ := http.NewRequest("HEAD", e.routeURL("api.example.com/f"), nil)
		if withKey {
			req.Header.Set("X-Api-Key", transforms.PlaceholderPrefix+"CANARY_KEY")
		}
		resp, err := e.routeClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		t.Logf("withKey=%v: HEAD Content-Length %q (ContentLength %d)", withKey, resp.Header.Get("Content-Length"), resp.ContentLength)
		if resp.ContentLength != 1234 {
			t.Errorf("withKey=%v: HEAD Content-Length %d, want 1234", withKey, resp.ContentLength)
		}
	}
}

// An upstream that sends a second, unsolicited response a moment after the
// first: the pooled connection carries it, and the next request gets it.
func TestUnsolicitedUpstreamBytesRetireConnection(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	forged := make(chan struct{})
	rawUpstream(t, e, func(i int, raw *net.TCPConn, c *tls.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(req.URL.Path), req.URL.Path)
			if req.URL.Path == "/1" {
				time.Sleep(50 * time.Millisecond) // not in the same segment
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nforged!")
				close(forged) // on loopback, written is delivered
			}
		}
	})
	if _, b := e.get(t, "api.example.com/1"); b != "/1" {
		t.Fatalf("first: %q", b)
	}
	select {
	case <-forged:
	case <-time.After(30 * time.Second):
		t.Fatal("the upstream did not send its unsolicited response within 30s")
	}
	if _, b := e.get(t, "api.example.com/2"); b != "/2" {
		t.Errorf("second request got %q, want \"/2\": an unsolicited response was served from the pooled connection", b)
	}
}
