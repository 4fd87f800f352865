package wasm

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

// loadRun loads bin with config and runs one request through it: the module
// and the exchange (both closed at cleanup), and the request as the module
// left it. A handle_request error fails the test.
func loadRun(t *testing.T, r *Runtime, name string, bin, config []byte) (*Module, *Exchange, *http.Request) {
	t.Helper()
	m, err := r.Load(context.Background(), name, bin, config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(context.Background()) })
	req := outbound(t, "GET", "/v1/x", "")
	x, err := run(t, req, m)
	if err != nil {
		t.Fatal(err)
	}
	return m, x, req
}

func okResponse() *http.Response {
	return &http.Response{StatusCode: 200, Header: http.Header{}, Body: http.NoBody}
}

// A module built with package guest that registers no response handler
// says so (sandgate_response_noop): a request gives its instance back as
// soon as handle_request returns, instead of keeping it while the upstream
// answers, so a pool of one serves a second request meanwhile.
func TestInstanceGivenBackWhenResponseHandlerIsNone(t *testing.T) {
	r := newRuntime(t, Config{PoolSize: 1, CallTimeout: normalCallTimeout})
	bin := guest(t, "libresponse")
	for _, tc := range []struct {
		mode     string
		held     bool
		wantResp string
	}{
		{"none", false, ""},
		{"response", true, "1"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			m, x, req := loadRun(t, r, tc.mode, bin, []byte(tc.mode))
			if got := req.Header.Get("X-Req"); got != tc.mode {
				t.Fatalf("handle_request did not run: X-Req = %q", got)
			}
			if idle := m.Idle(); idle != 1 != tc.held {
				t.Fatalf("after handle_request the pool has %d idle instance(s); held for the response pass: want %v", idle, tc.held)
			}
			resp := okResponse()
			if err := x.HandleResponse(context.Background(), resp); err != nil {
				t.Fatal(err)
			}
			if got := resp.Header.Get("X-Resp"); got != tc.wantResp {
				t.Fatalf("X-Resp = %q, want %q (the response handler runs exactly when there is one)", got, tc.wantResp)
			}
			x.Close()
			if idle := m.Idle(); idle != 1 {
				t.Fatalf("after Close the pool has %d idle instances, want 1", idle)
			}
		})
	}
}

// Registering the first response handler once the module serves requests
// would leave it never called (the host already asked): the library
// panics instead, and the request fails closed.
func TestLateResponseHandlerFailsTheRequest(t *testing.T) {
	r := newRuntime(t, Config{CallTimeout: normalCallTimeout})
	m, err := r.Load(context.Background(), "late", guest(t, "libresponse"), []byte("late"))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close(context.Background())
	_, err = run(t, outbound(t, "GET", "/v1/x", ""), m)
	var we *Error
	if !errors.As(err, &we) || we.Status != http.StatusBadGateway || !strings.Contains(err.Error(), "register the response handler while the module initialises") {
		t.Fatalf("got %v, want a 502 with the library's reason", err)
	}
}

// The host honours sandgate_response_noop from any guest, and checks its
// type: a hand-written module whose handle_response would trap is not
// called when it answers 1, and is when it answers 0.
func TestResponseNoopExport(t *testing.T) {
	r := newRuntime(t, Config{CallTimeout: normalCallTimeout})
	module := func(answer []byte, results []byte) []byte {
		m := handler(opI64Const1...)
		m.funcs[1].body = opUnreachable // handle_response traps if called
		m.types = append(m.types, [2][]byte{nil, results})
		m.funcs = append(m.funcs, wfunc{2, answer})
		m.exports = append(m.exports, [3]any{"sandgate_response_noop", 0, 2})
		return m.bytes()
	}
	for _, tc := range []struct {
		name    string
		bin     []byte
		wantErr string
	}{
		{"noop", module([]byte{0x41, 0x01}, []byte{tI32}), ""},
		{"not-noop", module([]byte{0x41, 0x00}, []byte{tI32}), "trapped in handle_response"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, x, _ := loadRun(t, r, tc.name, tc.bin, nil)
			err := x.HandleResponse(context.Background(), okResponse())
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("HandleResponse: %v, want %q", err, tc.wantErr)
			}
		})
	}
	_, err := r.Load(context.Background(), "badtype", module([]byte{0x42, 0x01}, []byte{tI64}), nil)
	if err == nil || !strings.Contains(err.Error(), "exports sandgate_response_noop with type () -> (i64); sandgate's is () -> i32") {
		t.Fatalf("got %v, want a refusal naming sandgate_response_noop's type", err)
	}
}

// Instances a burst of requests in flight started, and that the traffic
// after it does not use, are closed once they sat unused for poolIdleTTL;
// the pool keeps at least one.
func TestPoolClosesInstancesLeftUnused(t *testing.T) {
	old := poolIdleTTL
	t.Cleanup(func() { poolIdleTTL = old })
	r := newRuntime(t, Config{CallTimeout: normalCallTimeout})
	m, err := r.Load(context.Background(), "response", guest(t, "libresponse"), []byte("response"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(context.Background()) })
	var burst []*Exchange // three requests in flight: three instances held
	for range 3 {
		x, err := run(t, outbound(t, "GET", "/v1/x", ""), m)
		if err != nil {
			t.Fatal(err)
		}
		burst = append(burst, x)
	}
	for _, x := range burst {
		x.Close()
	}
	if n := m.Idle(); n != 3 {
		t.Fatalf("after the burst the pool has %d idle instances, want 3", n)
	}
	// Only now the limit is short: however slow the machine, the burst's
	// instances all went back before it applied.
	poolIdleTTL = 5 * time.Millisecond
	time.Sleep(10 * poolIdleTTL)
	x, err := run(t, outbound(t, "GET", "/v1/x", ""), m)
	if err != nil {
		t.Fatal(err)
	}
	x.Close()
	if n := m.Idle(); n != 1 {
		t.Fatalf("after one request past the idle limit the pool has %d idle instances, want 1 (the two left unused closed)", n)
	}
}
