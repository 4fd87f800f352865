// Regression tests from an attack run on the upstream pool: an upstream
// that sends more than the response asked of it (a second response, a body
// where none may be) must never have those bytes taken for the answer to
// the sandbox's next request.

package relay

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/tlstest"
	"github.com/sandgate/sandgate/transforms"
)

// TestUnsolicitedResponseCarriedSecretToNextRequest: an upstream answered a
// request that carried the secret ("first"), then, unasked and a moment
// later, sent a second response echoing that request — the real credential
// the proxy swapped in. The sandbox's next request to the same host, which
// carried no placeholder (no rule matched it, so nothing was scrubbed), was
// given that second response. Whatever the timing of the second response
// against the next request, the secret must never reach the sandbox: when
// it lands before the next request the pooled connection is retired (and
// the next request gets its own answer); when it races the request it may
// be read as the answer, but it is scrubbed like every response of a host
// the sandbox holds credentials for.
func TestUnsolicitedResponseCarriedSecretToNextRequest(t *testing.T) {
	rules := `[{"match":{"host":"api.example.com","path":{"startsWith":"/extra/"}},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, rules)
	sent := make(chan struct{}, 64)     // a second response was written
	answered := make(chan struct{}, 64) // an answer to /next was written
	rawUpstream(t, e, func(i int, raw *net.TCPConn, c *tls.Conn) {
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			delay, isExtra := strings.CutPrefix(req.URL.Path, "/extra/")
			if !isExtra {
				body := "ok " + req.URL.Path
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
				answered <- struct{}{}
				continue
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst")
			d, _ := time.ParseDuration(delay)
			time.Sleep(d)
			var dump strings.Builder
			req.Header.Write(&dump)
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nX-Echo: %s\r\nContent-Length: %d\r\n\r\n%s",
				req.Header.Get("X-Api-Key"), dump.Len(), dump.String())
			sent <- struct{}{}
		}
	})
	placeholder := transforms.PlaceholderPrefix + "CANARY_KEY"
	for _, delay := range []time.Duration{0, 10 * time.Millisecond, 50 * time.Millisecond} {
		for _, after := range []bool{false, true} {
			name := fmt.Sprintf("second response after %v, next request at once", delay)
			if after {
				name = fmt.Sprintf("second response after %v, next request after it", delay)
			}
			for round := range 3 {
				c, _ := e.dial()
				var seen bytes.Buffer // every byte the sandbox reads
				br := bufio.NewReader(io.TeeReader(c, &seen))
				fmt.Fprintf(c, "GET /https/api.example.com/extra/%v HTTP/1.1\r\nHost: x\r\nX-Api-Key: %s\r\n\r\n", delay, placeholder)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("%s, round %d: first response: %v", name, round, err)
				}
				if b := body(t, resp); b != "first" {
					t.Fatalf("%s, round %d: first response %q, want \"first\"", name, round, b)
				}
				if after {
					waitSent(t, sent)
				}
				io.WriteString(c, "GET /https/api.example.com/next HTTP/1.1\r\nHost: x\r\n\r\n")
				resp, err = http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("%s, round %d: next response: %v", name, round, err)
				}
				got := body(t, resp)
				if strings.Contains(seen.String(), canary) {
					t.Fatalf("%s, round %d: the sandbox read the secret:\n%s", name, round, seen.String())
				}
				if !after && got != "ok /next" {
					t.Logf("%s, round %d: the second response raced the next request and was read as its answer, scrubbed: %q", name, round, got)
				}
				if after && got != "ok /next" {
					t.Errorf("%s, round %d: next request got %q, want its own answer \"ok /next\"", name, round, got)
				}
				if !after {
					waitSent(t, sent)
				}
				// Everything the upstream writes in this round is written
				// (on loopback: delivered) before the next round starts.
				// When the second response raced the request and was read
				// as its answer, the real answer comes after it, unasked:
				// the pool must retire the connection it lands on.
				waitSent(t, answered)
				c.Close()
			}
		}
	}
}

func waitSent(t *testing.T, sent <-chan struct{}) {
	t.Helper()
	select {
	case <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("the upstream did not send its response within 10s")
	}
}

// heldConn is an upstream's side of a TCP connection whose writes, once
// hold is set, wait in a buffer until flush sends them: a test decides how
// the TLS records written reach the proxy (several in one segment, a part
// now and the rest later).
type heldConn struct {
	net.Conn
	mu   sync.Mutex
	hold bool
	buf  []byte
}

func (h *heldConn) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.hold {
		return h.Conn.Write(p)
	}
	h.buf = append(h.buf, p...)
	return len(p), nil
}

// held returns how many bytes wait.
func (h *heldConn) held() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.buf)
}

// flush sends the first n bytes that wait (all when n < 0) in one write.
func (h *heldConn) flush(n int) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n < 0 || n > len(h.buf) {
		n = len(h.buf)
	}
	_, err := h.Conn.Write(h.buf[:n])
	h.buf = h.buf[n:]
	return err
}

// heldUpstream serves api.example.com over TLS on connections whose writes
// behave holds (see heldConn) once the handshake is done.
func heldUpstream(t *testing.T, e *env, behave func(i int, c *tls.Conn, h *heldConn)) {
	leaf, err := e.ca.Leaf("api.example.com")
	if err != nil {
		t.Fatal(err)
	}
	ln := tlstest.Listen443(t)
	t.Cleanup(func() { ln.Close() })
	var n atomic.Int32
	go func() {
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			i := int(n.Add(1)) - 1
			go func() {
				defer raw.Close()
				h := &heldConn{Conn: raw}
				tc := tls.Server(h, &tls.Config{Certificates: []tls.Certificate{leaf}, NextProtos: []string{"http/1.1"}})
				raw.SetDeadline(time.Now().Add(20 * time.Second))
				if tc.Handshake() != nil {
					return
				}
				h.mu.Lock()
				h.hold = true
				h.mu.Unlock()
				behave(i, tc, h)
			}()
		}
	}()
	a := netip.MustParseAddrPort(ln.Addr().String()).Addr()
	e.dns.Set("api.example.com", a)
	e.decider.AllowPrivate = append(e.decider.AllowPrivate, netip.PrefixFrom(a, 32))
}

// forged is a response an upstream sends unasked, after its answer.
const forged = "HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nforged!"

// TestUnsolicitedBytesInTLSLayerRetireConnection: an upstream sent its
// answer and an unsolicited response as two TLS records in one segment, so
// the proxy's TLS layer read the second off the socket with the first; no
// peek at the socket sees it, and the bufio reader does not hold it. The
// pooled connection must still be retired before the next request, also
// when only part of the second record came with the first.
func TestUnsolicitedBytesInTLSLayerRetireConnection(t *testing.T) {
	for _, tc := range []struct {
		name string
		part func(first, total int) int // how much goes out with the answer
	}{
		{"whole record", func(first, total int) int { return total }},
		{"part of a record", func(first, total int) int { return first + (total-first)/2 }},
		{"a record header's first bytes", func(first, total int) int { return first + 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
			heldUpstream(t, e, func(i int, c *tls.Conn, h *heldConn) {
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(req.URL.Path), req.URL.Path)
					if req.URL.Path != "/1" {
						h.flush(-1)
						continue
					}
					first := h.held()
					io.WriteString(c, forged) // a record of its own
					if err := h.flush(tc.part(first, h.held())); err != nil {
						return
					}
					// The rest, if any, only once another request came:
					// what a reused connection would read as its answer.
					if req, err = http.ReadRequest(br); err != nil {
						return
					}
					h.flush(-1)
					fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(req.URL.Path), req.URL.Path)
					h.flush(-1)
				}
			})
			if _, b := e.get(t, "api.example.com/1"); b != "/1" {
				t.Fatalf("first: %q", b)
			}
			if _, b := e.get(t, "api.example.com/2"); b != "/2" {
				t.Errorf("second request got %q, want \"/2\": bytes the TLS layer held were served as its answer", b)
			}
		})
	}
}

// TestBodyWhereNoneMayBeDoesNotPoisonNextRequest: an upstream answered a
// HEAD (or with a 204) and sent a body anyway — here a whole response.
// net/http reads no body for either, so those bytes would be the answer to
// the next request on the connection. However they arrive (with the head,
// in a record of their own, or a moment later), the next request gets its
// own answer.
func TestBodyWhereNoneMayBeDoesNotPoisonNextRequest(t *testing.T) {
	for _, method := range []string{"HEAD", "GET-204"} {
		for _, how := range []string{"same record", "own record, same segment", "later"} {
			t.Run(method+"/"+how, func(t *testing.T) {
				e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, "")
				sent := make(chan struct{}, 4)
				heldUpstream(t, e, func(i int, c *tls.Conn, h *heldConn) {
					br := bufio.NewReader(c)
					for {
						req, err := http.ReadRequest(br)
						if err != nil {
							return
						}
						io.Copy(io.Discard, req.Body)
						if req.URL.Path != "/bodyless" {
							fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(req.URL.Path), req.URL.Path)
							h.flush(-1)
							continue
						}
						head := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", len(forged))
						if req.Method != "HEAD" {
							head = "HTTP/1.1 204 No Content\r\n\r\n"
						}
						switch how {
						case "same record":
							io.WriteString(c, head+forged)
							h.flush(-1)
						case "own record, same segment":
							io.WriteString(c, head)
							io.WriteString(c, forged)
							h.flush(-1)
						case "later":
							io.WriteString(c, head)
							h.flush(-1)
							time.Sleep(20 * time.Millisecond)
							io.WriteString(c, forged)
							h.flush(-1)
						}
						sent <- struct{}{}
					}
				})
				req, _ := http.NewRequest("GET", e.routeURL("api.example.com/bodyless"), nil)
				if method == "HEAD" {
					req.Method = "HEAD"
				}
				resp, err := e.routeClient().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body(t, resp)
				select {
				case <-sent:
				case <-time.After(10 * time.Second):
					t.Fatal("the upstream did not send its body within 10s")
				}
				if _, b := e.get(t, "api.example.com/next"); b != "/next" {
					t.Errorf("next request got %q, want \"/next\": the body after a %s poisoned the connection", b, method)
				}
			})
		}
	}
}

// TestCredentialedHostScrubbedWithoutPlaceholder: every response of a host
// the sandbox holds a credential for is scrubbed, also when the request
// carried no placeholder and no rule matched it (here an upstream that
// keeps the key it was sent and shows it on another path). A host no rule
// targets is left alone: its body and encoding pass as they came.
func TestCredentialedHostScrubbedWithoutPlaceholder(t *testing.T) {
	rules := `[{"match":{"host":"api.example.com","path":{"startsWith":"/v1/"}},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com","plain.example.com"]}`, rules)
	var kept atomic.Value
	kept.Store("")
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if k := r.Header.Get("X-Api-Key"); k != "" {
			kept.Store(k)
		}
		if r.Header.Get("Accept-Encoding") != "identity" {
			t.Errorf("%s: Accept-Encoding %q reached the upstream; want identity, so the response can be scrubbed", r.URL.Path, r.Header.Get("Accept-Encoding"))
		}
		w.Header().Set("X-Last-Key", kept.Load().(string))
		fmt.Fprintf(w, "last key %s", kept.Load())
	}))
	e.upstream("plain.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "br")
		io.WriteString(w, "opaque")
	}))
	ph := transforms.PlaceholderPrefix + "CANARY_KEY"
	for _, path := range []string{"/v1/messages", "/status"} {
		req, _ := http.NewRequest("GET", e.routeURL("api.example.com"+path), nil)
		if path == "/v1/messages" {
			req.Header.Set("X-Api-Key", ph)
		}
		req.Header.Set("Accept-Encoding", "br")
		resp, err := e.routeClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if b := body(t, resp); b != "last key "+ph || resp.Header.Get("X-Last-Key") != ph {
			t.Errorf("%s: got %q (X-Last-Key %q), want the placeholder where the key was", path, b, resp.Header.Get("X-Last-Key"))
		}
	}
	req, _ := http.NewRequest("GET", e.routeURL("plain.example.com/x"), nil)
	req.Header.Set("Accept-Encoding", "br")
	resp, err := e.routeClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := body(t, resp); resp.StatusCode != 200 || b != "opaque" || resp.Header.Get("Content-Encoding") != "br" || resp.ContentLength != 6 {
		t.Errorf("a host no rule targets: got %d %q (Content-Encoding %q, length %d), want its response untouched",
			resp.StatusCode, b, resp.Header.Get("Content-Encoding"), resp.ContentLength)
	}
}
