package service_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/internal/testkit/stacktest"
	"github.com/sandgate/sandgate/transforms"
)

// tunnelServer is a server in the sandbox, on port 4000, that writes every
// byte it receives to /workspace/received.log and answers as a hostile app
// would: with the service's own headers (an owner elsewhere, another
// protocol, a process id, a digest trailer) beside one of its own. A
// request that asks "Upgrade: echo" gets a 101 and its bytes echoed; any
// other gets a 103 and a chunked 200 with trailers. It answers only once
// the request's body came whole.
const tunnelServer = `import socket, threading
evil = b"X-Sandgate-Owner: http://evil.example\r\nX-Ai-Sdk-Sandbox-Protocol: 7\r\nX-Process-Id: evil\r\nX-Sandgate-Whatever: evil\r\nX-Kept: yes\r\n"
log = open("/workspace/received.log", "ab", buffering=0)
lock = threading.Lock()
def recv(c):
    b = c.recv(65536)
    with lock:
        log.write(b)
    return b
def serve(c):
    data = b""
    while b"\r\n\r\n" not in data:
        b = recv(c)
        if not b: return c.close()
        data += b
    head, body = data.split(b"\r\n\r\n", 1)
    low = head.lower()
    if b"transfer-encoding: chunked" in low:
        while not (body.startswith(b"0\r\n") or b"\r\n0\r\n" in body) or not body.endswith(b"\r\n\r\n"):
            b = recv(c)
            if not b: return c.close()
            body += b
    elif b"content-length:" in low:
        n = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < n:
            b = recv(c)
            if not b: return c.close()
            body += b
    if b"upgrade: echo" in low:
        c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n" + evil + b"\r\n")
        while True:
            b = recv(c)
            if not b: break
            c.sendall(b)
    else:
        c.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n" + evil + b"\r\n")
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sandgate-Sha256, X-Trail\r\n" + evil + b"\r\n")
        c.sendall(b"2\r\nok\r\n0\r\nX-Sandgate-Sha256: sha256:evil\r\nX-Trail: kept\r\n\r\n")
    c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 4000)); s.listen(16)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()`

// tunnelRig is a rig with the bridge's key, sandbox "box" holding the
// canary as a credential, and tunnelServer listening in it.
func newTunnelRig(t *testing.T) *rig {
	t.Helper()
	r := newRigOn(t, stacktest.Config{Bridge: bridge.Config{Key: bridgeKey}}, nil)
	r.create("box", nil)
	r.must(204, "POST", "/v1/sandboxes/box/transformations", map[string]any{"transformations": []any{map[string]any{
		"match":     map[string]any{"host": "api.example.com", "headers": []any{map[string]any{"key": map[string]string{"exact": "x-api-key"}, "value": map[string]string{"exact": guardPH}}}},
		"transform": map[string]any{"headers": map[string]string{"x-api-key": r.canary}},
	}}})
	r.must(204, "PUT", "/v1/sandboxes/box/files/workspace/srv.py", tunnelServer)
	r.startDetached("box", "python3 /workspace/srv.py")
	for i := 0; ; i++ { // until the server listens
		code, _, _ := r.bridgeCall("POST", "/v1/sandbox/box/tunnel/4000", nil, false)
		if code == 200 {
			break
		}
		if i == 200 {
			t.Fatalf("the server in the sandbox does not listen: %d", code)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return r
}

// received is what the server in the sandbox has received so far.
func (r *rig) received() string {
	return r.must(200, "GET", "/v1/sandboxes/box/files/workspace/received.log", nil)
}

// wantNothingOfCanary fails when the server in the sandbox received any
// run of 12 bytes of the canary (the guard holds back what could begin
// it, so not even its start goes in).
func (r *rig) wantNothingOfCanary(what string) {
	r.t.Helper()
	got := r.received()
	for i := 0; i+12 <= len(r.canary); i++ {
		if strings.Contains(got, r.canary[i:i+12]) {
			r.t.Errorf("%s: the server in the sandbox received bytes of the credential (%q)", what, r.canary[i:i+12])
			return
		}
	}
}

// rawTunnel sends a request on a raw connection to the service and
// returns its answer's head (status line and headers) and the reader
// positioned after it.
func (r *rig) rawTunnel(request string, pieces ...string) (string, *bufio.Reader, net.Conn) {
	r.t.Helper()
	c, err := net.Dial("tcp", r.hs.Listener.Addr().String())
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	io.WriteString(c, request)
	for _, p := range pieces {
		if _, err := io.WriteString(c, p); err != nil {
			break // the service cut the request off
		}
	}
	br := bufio.NewReader(c)
	var head strings.Builder
	for {
		line, err := br.ReadString('\n')
		head.WriteString(line)
		if err != nil || line == "\r\n" {
			return head.String(), br, c
		}
	}
}

// wantRawRefusal fails unless a raw answer is the guard's 400 with its
// message as protocol 1's error body.
func wantRawRefusal(t *testing.T, what, head string, br *bufio.Reader) {
	t.Helper()
	if !strings.HasPrefix(head, "HTTP/1.1 400 ") {
		t.Errorf("%s: answered %q, want the credential guard's 400", what, head)
		return
	}
	var e api.Error
	if err := json.NewDecoder(br).Decode(&e); err != nil || !strings.HasPrefix(e.Error, transforms.CredentialPhrase+": the tunnel's request") {
		t.Errorf("%s: body %+v %v, want %q naming the tunnel's request", what, e, err, transforms.CredentialPhrase)
	}
}

// A credential of the sandbox goes into it through neither tunnel: not in
// the request's path, query, headers, body (whatever its framing and
// however it is cut), nor a chunked body's trailer. Each is refused with
// the guard's 400 before any byte of the credential reaches the server in
// the sandbox; the same requests without it pass.
func TestTunnelsCarryNoCredentialIn(t *testing.T) {
	r := newTunnelRig(t)
	canary := r.canary
	half := len(canary) / 2
	auth := api.HeaderToken + ": " + r.token + "\r\n"
	p1 := func(method, target, hdr string) string {
		return method + " " + target + " HTTP/1.1\r\nHost: x\r\nUpgrade: echo\r\nConnection: Upgrade\r\n" + auth + hdr + "\r\n"
	}

	t.Run("port tunnel", func(t *testing.T) {
		body := "hello " + canary + " bye"
		for _, tc := range []struct {
			what    string
			request string
			pieces  []string
		}{
			{"the path", p1("GET", "/v1/sandboxes/box/ports/4000/a/"+canary, ""), nil},
			{"the query", p1("GET", "/v1/sandboxes/box/ports/4000/?k="+canary, ""), nil},
			{"a header", p1("GET", "/v1/sandboxes/box/ports/4000/", "X-Key: Bearer "+canary+"\r\n"), nil},
			{"the body", p1("POST", "/v1/sandboxes/box/ports/4000/", fmt.Sprintf("Content-Length: %d\r\n", len(body))), []string{"hello ", canary[:half], canary[half:], " bye"}},
			{"a chunked body, the credential across chunks", p1("POST", "/v1/sandboxes/box/ports/4000/", "Transfer-Encoding: chunked\r\n"),
				[]string{fmt.Sprintf("%x\r\nhello %s\r\n", 6+half, canary[:half]), fmt.Sprintf("%x\r\n%s\r\n", len(canary)-half, canary[half:]), "0\r\n\r\n"}},
			{"a chunked body's trailer", p1("POST", "/v1/sandboxes/box/ports/4000/", "Transfer-Encoding: chunked\r\nTrailer: X-T\r\n"),
				[]string{"2\r\nhi\r\n0\r\n", "X-T: " + canary + "\r\n\r\n"}},
		} {
			head, br, _ := r.rawTunnel(tc.request, tc.pieces...)
			wantRawRefusal(t, tc.what, head, br)
			r.wantNothingOfCanary("port tunnel, " + tc.what)
		}
		// Without the credential: the server answers, the body in.
		head, br, c := r.rawTunnel(p1("POST", "/v1/sandboxes/box/ports/4000/?k=v", "Content-Length: 9\r\n"), "hello "+guardPH[:3])
		if !strings.HasPrefix(head, "HTTP/1.1 101 ") {
			t.Fatalf("a request without the credential: %q", head)
		}
		io.WriteString(c, "ping")
		buf := make([]byte, 4)
		if _, err := io.ReadFull(br, buf); err != nil || string(buf) != "ping" {
			t.Errorf("bytes after the upgrade: %q %v", buf, err)
		}
		if got := r.received(); !strings.Contains(got, "hello "+guardPH[:3]) || !strings.Contains(got, "POST /?k=v HTTP/1.1\r\n") {
			t.Errorf("the server received:\n%s", got)
		}
	})

	t.Run("bridge tunnel", func(t *testing.T) {
		do := func(method, path string, body io.Reader, hdr ...string) (int, string) {
			return r.send(method, path, body, append([]string{"Authorization", "Bearer " + bridgeKey}, hdr...)...)
		}
		// A body that arrives in pieces, the credential cut across them.
		streamed := func() io.Reader {
			pr, pw := io.Pipe()
			go func() {
				for _, p := range []string{"hello ", canary[:3], canary[3:half], canary[half:], " bye"} {
					if _, err := pw.Write([]byte(p)); err != nil {
						return
					}
				}
				pw.Close()
			}()
			return pr
		}
		for _, tc := range []struct {
			what, method, path string
			body               func() io.Reader
			hdr                []string
		}{
			{"the path", "GET", "/v1/sandbox/box/tunnel/4000/a/" + canary, nil, nil},
			{"the path, escaped", "GET", "/v1/sandbox/box/tunnel/4000/a%2F" + canary, nil, nil},
			{"the query", "GET", "/v1/sandbox/box/tunnel/4000/?k=" + canary, nil, nil},
			{"a header", "GET", "/v1/sandbox/box/tunnel/4000/", nil, []string{"X-Key", "Bearer " + canary}},
			{"a cookie", "GET", "/v1/sandbox/box/tunnel/4000/", nil, []string{"Cookie", "k=" + canary}},
			{"the body, streamed", "POST", "/v1/sandbox/box/tunnel/4000/", streamed, nil},
			{"the body", "PUT", "/v1/sandbox/box/tunnel/4000/", func() io.Reader { return strings.NewReader("x=" + canary) }, nil},
			{"an upgrade's header", "GET", "/v1/sandbox/box/tunnel/4000/ws", nil, []string{"Upgrade", "echo", "Connection", "Upgrade", "X-Key", canary}},
		} {
			var body io.Reader
			if tc.body != nil {
				body = tc.body()
			}
			code, out := do(tc.method, tc.path, body, tc.hdr...)
			var e bridge.ErrorBody
			if code != http.StatusBadRequest || json.Unmarshal([]byte(out), &e) != nil || e.Code != "invalid_request" ||
				!strings.HasPrefix(e.Error, transforms.CredentialPhrase+": the tunnel's request") {
				t.Errorf("%s: %d %s, want the credential guard's 400", tc.what, code, out)
			}
			if strings.Contains(out, canary) {
				t.Errorf("%s: the refusal quotes the credential", tc.what)
			}
			r.wantNothingOfCanary("bridge tunnel, " + tc.what)
		}
		if code, out := do("POST", "/v1/sandbox/box/tunnel/4000/x?k=v", strings.NewReader("hello "+guardPH)); code != 200 || out != "ok" {
			t.Errorf("a request without the credential: %d %q", code, out)
		}
		if got := r.received(); !strings.Contains(got, "hello "+guardPH) {
			t.Errorf("the server received:\n%s", got)
		}
	})
}

// wantNoServiceHeaders fails when h holds a header only the service may
// set, or lost the app's own.
func wantNoServiceHeaders(t *testing.T, what string, h http.Header, own ...string) {
	t.Helper()
	for k, v := range h {
		if api.ServiceHeader(k) && strings.Contains(strings.Join(v, ","), "evil") || strings.EqualFold(k, api.HeaderProtocol) && v[0] != "1" {
			t.Errorf("%s: %s: %q reached the caller", what, k, v)
		}
	}
	for _, k := range own {
		if h.Get(k) == "" {
			t.Errorf("%s: the app's own %s is gone: %v", what, k, h)
		}
	}
}

// An app in the sandbox sets the service's headers on its answers (an
// owner elsewhere, another protocol, a process id, a digest trailer):
// neither tunnel lets one through, on a 1xx, a 101, a final answer or its
// trailer; the app's own headers pass.
func TestTunnelAnswersCarryNoServiceHeaders(t *testing.T) {
	r := newTunnelRig(t)
	auth := api.HeaderToken + ": " + r.token + "\r\n"

	t.Run("port tunnel", func(t *testing.T) {
		head, _, _ := r.rawTunnel("GET /v1/sandboxes/box/ports/4000/ HTTP/1.1\r\nHost: x\r\nUpgrade: echo\r\nConnection: Upgrade\r\n" + auth + "\r\n")
		if !strings.HasPrefix(head, "HTTP/1.1 101 ") {
			t.Fatalf("upgrade: %q", head)
		}
		wantNoServiceHeaders(t, "the 101", parseHead(t, head), "X-Kept", "Upgrade")
		// An answer that is not a 101: 103, then 200 with a trailer; the
		// tunnel ends after it.
		head, br, _ := r.rawTunnel("GET /v1/sandboxes/box/ports/4000/ HTTP/1.1\r\nHost: x\r\nUpgrade: no\r\nConnection: Upgrade\r\n" + auth + "\r\n")
		if !strings.HasPrefix(head, "HTTP/1.1 103 ") {
			t.Fatalf("early hints: %q", head)
		}
		wantNoServiceHeaders(t, "the 103", parseHead(t, head), "X-Kept", "Link")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		if err != nil || string(body) != "ok" || !resp.Close {
			t.Errorf("the 200: %q %v, closing %v", body, err, resp.Close)
		}
		wantNoServiceHeaders(t, "the 200", resp.Header, "X-Kept")
		wantNoServiceHeaders(t, "the 200's trailer", resp.Trailer, "X-Trail")
		if _, err := br.ReadByte(); err != io.EOF {
			t.Errorf("after the answer, the tunnel is still open: %v", err)
		}
	})

	t.Run("bridge tunnel", func(t *testing.T) {
		var early []http.Header
		trace := &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			early = append(early, http.Header(h).Clone())
			return nil
		}}
		req, _ := http.NewRequest("GET", r.hs.URL+"/v1/sandbox/box/tunnel/4000/", nil)
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), trace))
		req.Header.Set("Authorization", "Bearer "+bridgeKey)
		resp, err := (&http.Client{Timeout: 2 * time.Minute}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(body) != "ok" {
			t.Fatalf("through the tunnel: %d %q %v", resp.StatusCode, body, err)
		}
		wantNoServiceHeaders(t, "the answer", resp.Header, "X-Kept")
		wantNoServiceHeaders(t, "the answer's trailer", resp.Trailer, "X-Trail")
		if len(early) != 1 {
			t.Errorf("1xx answers: %v, want the 103", early)
		}
		for _, h := range early {
			wantNoServiceHeaders(t, "the 103", h, "X-Kept", "Link")
		}
		head, _, _ := r.rawTunnel("GET /v1/sandbox/box/tunnel/4000/ws HTTP/1.1\r\nHost: x\r\nUpgrade: echo\r\nConnection: Upgrade\r\nAuthorization: Bearer " + bridgeKey + "\r\n\r\n")
		if !strings.HasPrefix(head, "HTTP/1.1 101 ") {
			t.Fatalf("upgrade: %q", head)
		}
		wantNoServiceHeaders(t, "the 101", parseHead(t, head), "X-Kept", "Upgrade")
	})
}

// parseHead reads the headers of an answer's head.
func parseHead(t *testing.T, head string) http.Header {
	t.Helper()
	_, rest, _ := strings.Cut(head, "\r\n")
	h, err := textproto.NewReader(bufio.NewReader(strings.NewReader(rest))).ReadMIMEHeader()
	if err != nil {
		t.Fatalf("the answer's head %q: %v", head, err)
	}
	return http.Header(h)
}
