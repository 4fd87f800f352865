package wasm

import (
	"context"
	"net/http"
	"testing"
	"time"
)

// benchGuests runs bench once per kind of guest — a Go guest and a
// hand-written one — with a loaded module, and do performs one request
// through it: handle_request and handle_response, each under its deadline
// and the memory cap.
func benchGuests(b *testing.B, bench func(b *testing.B, do func())) {
	r := newRuntime(b, Config{})
	for _, tc := range []struct {
		name string
		bin  []byte
	}{
		{"go-guest", guest(b, "noop")},
		{"handwritten", handler(opI64Const1...).bytes()},
	} {
		b.Run(tc.name, func(b *testing.B) {
			m, err := r.Load(context.Background(), tc.name, tc.bin, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer m.Close(context.Background())
			req, _ := http.NewRequest("GET", "https://api.example.com/v1/x", nil)
			resp := &http.Response{StatusCode: 200, Header: http.Header{}, Body: http.NoBody}
			ctx := context.Background()
			bench(b, func() {
				x, err := HandleRequest(ctx, req, info, NewChain(m))
				if err != nil {
					b.Fatal(err)
				}
				if err := x.HandleResponse(ctx, resp); err != nil {
					b.Fatal(err)
				}
				x.Close()
			})
		})
	}
}

// BenchmarkCall measures what one module adds to a request: a pooled
// instance's handle_request and handle_response, back to back. Compare
// BenchmarkInstantiate, the cost a request would pay without the pool.
func BenchmarkCall(b *testing.B) {
	benchGuests(b, func(b *testing.B, do func()) {
		b.ReportAllocs()
		for b.Loop() {
			do()
		}
	})
}

// BenchmarkCallIdle is BenchmarkCall with an idle gap of 100 µs before
// each request, as on a proxy that is not saturated: a request then finds
// the process's other threads asleep, and whatever wakes one (a goroutine
// started, a timer armed) is paid in its latency. Only the request's own
// time is reported (µs/req); ns/op includes the gaps.
func BenchmarkCallIdle(b *testing.B) {
	benchGuests(b, func(b *testing.B, do func()) {
		var spent time.Duration
		var n int
		for b.Loop() {
			time.Sleep(100 * time.Microsecond)
			t0 := time.Now()
			do()
			spent += time.Since(t0)
			n++
		}
		b.ReportMetric(float64(spent.Microseconds())/float64(n), "µs/req")
	})
}

// BenchmarkInstantiate measures starting a fresh instance of a Go guest
// (what a failed instance's replacement costs).
func BenchmarkInstantiate(b *testing.B) {
	r := newRuntime(b, Config{})
	m, err := r.Load(context.Background(), "noop", guest(b, "noop"), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close(context.Background())
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		inst, err := m.instantiate(ctx)
		if err != nil {
			b.Fatal(err)
		}
		m.closeInstance(inst)
	}
}

// BenchmarkCallInFlight measures requests through one module with the
// upstream's wait between the two passes, as the proxy runs them: 4×
// GOMAXPROCS requests at once, each handle_request, 200 µs of waiting for
// the upstream, then handle_response. A module with a response pass keeps
// its instance across that wait; one without (package guest with no
// response handler: sandgate_response_noop) gives it back, so the pool
// serves the other requests meanwhile. The pool is the runtime's default.
func BenchmarkCallInFlight(b *testing.B) {
	r := newRuntime(b, Config{})
	bin := guest(b, "libresponse")
	for _, mode := range []string{"none", "response"} {
		b.Run("response-handler-"+mode, func(b *testing.B) {
			ctx := context.Background()
			m, err := r.Load(ctx, mode, bin, []byte(mode))
			if err != nil {
				b.Fatal(err)
			}
			defer m.Close(ctx)
			b.SetParallelism(4)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					req, _ := http.NewRequest("GET", "https://api.example.com/v1/x", nil)
					x, err := HandleRequest(ctx, req, info, NewChain(m))
					if err != nil {
						b.Error(err)
						return
					}
					time.Sleep(200 * time.Microsecond)
					resp := &http.Response{StatusCode: 200, Header: http.Header{}, Body: http.NoBody}
					if err := x.HandleResponse(ctx, resp); err != nil {
						b.Error(err)
					}
					x.Close()
				}
			})
		})
	}
}
