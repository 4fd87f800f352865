// Regression tests from the review of the route's upstream pool.

package relay

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// A non-idempotent request with no body, which the upstream received (and
// acted on) on a kept-alive connection before dying without answering, is
// sent a second time.
func TestPostNotResentAfterUpstreamGotIt(t *testing.T) {
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
	var mu sync.Mutex
	var seen []string
	rawUpstream(t, e, func(i int, raw *net.TCPConn, c *tls.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			mu.Lock()
			seen = append(seen, fmt.Sprintf("conn%d %s %s", i, req.Method, req.URL.Path))
			mu.Unlock()
			if req.URL.Path == "/charge" && i == 0 {
				// acted on it, then crashed before answering; half a head
				io.WriteString(c, "HTTP/1.1 200 OK\r\n")
				c.Close()
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	if code, _ := e.get(t, "api.example.com/warm"); code != 200 {
		t.Fatal(code)
	}
	resp, err := e.routeClient().Post(e.routeURL("api.example.com/charge"), "text/plain", strings.NewReader(""))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	mu.Lock()
	defer mu.Unlock()
	n := 0
	for _, s := range seen {
		if strings.Contains(s, "POST /charge") {
			n++
		}
	}
	t.Logf("status %d; upstream saw %v", resp.StatusCode, seen)
	if n != 1 {
		t.Errorf("POST /charge reached the upstream %d times", n)
	}
}
