package transforms

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
)

// stepTimeout bounds each wait in the streaming tests; it only turns a
// hang (an event held back) into a failure, it asserts no timing.
const stepTimeout = 10 * time.Second

// encoder compresses chunks so that each one can be decoded on its own
// arrival (a flush after each), as a streaming server would.
type encoder struct {
	name  string
	new   func(io.Writer) (io.Writer, func() error, func() error) // writer, flush, close
	extra string                                                  // Content-Encoding
}

var encoders = []encoder{
	{"identity", func(w io.Writer) (io.Writer, func() error, func() error) {
		return w, func() error { return nil }, func() error { return nil }
	}, ""},
	{"gzip", func(w io.Writer) (io.Writer, func() error, func() error) {
		z := gzip.NewWriter(w)
		return z, z.Flush, z.Close
	}, "gzip"},
	{"zstd", func(w io.Writer) (io.Writer, func() error, func() error) {
		z, err := zstd.NewWriter(w)
		if err != nil {
			panic(err)
		}
		return z, z.Flush, z.Close
	}, "zstd"},
}

func encode(t testing.TB, e encoder, s string) []byte {
	t.Helper()
	var b bytes.Buffer
	w, _, closeFn := e.new(&b)
	if _, err := io.WriteString(w, s); err != nil {
		t.Fatal(err)
	}
	if err := closeFn(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func TestScrubResponseEncodings(t *testing.T) {
	secret := mustSecret(t, "K", "sk-ant-0123456789abcdef", "")
	body := strings.Repeat(`{"echo":"sk-ant-0123456789abcdef","pad":"xxxxxxxxxxxxxxxxxxxxxxxxxxxx"}`+"\n", 5000)
	want := strings.ReplaceAll(body, secret.value, secret.placeholder)
	for _, e := range encoders {
		for _, reader := range []string{"whole", "bytewise"} {
			t.Run(e.name+"/"+reader, func(t *testing.T) {
				enc := encode(t, e, body)
				var src io.Reader = bytes.NewReader(enc)
				if reader == "bytewise" {
					src = &chunkReader{chunks: splitEvery(enc, 1)}
				}
				resp := &http.Response{
					StatusCode:    200,
					Header:        http.Header{"Content-Length": {fmt.Sprint(len(enc))}, "X-Echo": {"k=" + secret.value}},
					ContentLength: int64(len(enc)),
					Body:          io.NopCloser(src),
				}
				if e.extra != "" {
					resp.Header.Set("Content-Encoding", e.extra)
				}
				if err := ScrubResponse(resp, []*Secret{secret}); err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(resp.Body)
				if err != nil {
					t.Fatal(err)
				}
				if string(got) != want {
					t.Errorf("body differs: got %d bytes, want %d; contains secret: %v", len(got), len(want), bytes.Contains(got, []byte(secret.value)))
				}
				if got := resp.Header.Get("X-Echo"); got != "k="+secret.placeholder {
					t.Errorf("header: got %q, want %q", got, "k="+secret.placeholder)
				}
				if ce, cl := resp.Header.Get("Content-Encoding"), resp.Header.Get("Content-Length"); ce != "" || cl != "" || resp.ContentLength != -1 {
					t.Errorf("got Content-Encoding %q, Content-Length %q (%d); want both gone and -1", ce, cl, resp.ContentLength)
				}
				if resp.Uncompressed != (e.extra != "") {
					t.Errorf("Uncompressed: got %v", resp.Uncompressed)
				}
				if err := resp.Body.Close(); err != nil {
					t.Errorf("close: %v", err)
				}
			})
		}
	}
}

func splitEvery(b []byte, n int) [][]byte {
	var out [][]byte
	for len(b) > n {
		out = append(out, b[:n])
		b = b[n:]
	}
	return append(out, b)
}

func TestScrubResponseRefusesOtherEncodings(t *testing.T) {
	secret := mustSecret(t, "K", "sk-ant-0123456789abcdef", "")
	for _, ce := range []string{"br", "deflate", "compress", "gzip, br", "x-unknown"} {
		resp := &http.Response{Header: http.Header{"Content-Encoding": {ce}, "X-Echo": {secret.value}}, Body: io.NopCloser(strings.NewReader("..."))}
		body := resp.Body
		err := ScrubResponse(resp, []*Secret{secret})
		if !errors.Is(err, ErrUnsupportedEncoding) {
			t.Errorf("%q: got %v, want ErrUnsupportedEncoding", ce, err)
		}
		if resp.Body != body || resp.Header.Get("X-Echo") != secret.value {
			t.Errorf("%q: the response was changed by a refusal", ce)
		}
	}
	// Stacked codings in two header lines are refused as well.
	resp := &http.Response{Header: http.Header{"Content-Encoding": {"gzip", "gzip"}}, Body: io.NopCloser(strings.NewReader(""))}
	if err := ScrubResponse(resp, []*Secret{secret}); !errors.Is(err, ErrUnsupportedEncoding) {
		t.Errorf("gzip twice: got %v, want ErrUnsupportedEncoding", err)
	}
	// Without a body, an encoding does not matter; headers are scrubbed.
	resp = &http.Response{Header: http.Header{"Content-Encoding": {"br"}, "X-Echo": {secret.value}}, Body: http.NoBody}
	if err := ScrubResponse(resp, []*Secret{secret}); err != nil {
		t.Errorf("no body: got %v", err)
	}
	if got := resp.Header.Get("X-Echo"); got != secret.placeholder {
		t.Errorf("no body: header got %q, want %q", got, secret.placeholder)
	}
	// Without secrets nothing is touched.
	resp = &http.Response{Header: http.Header{"Content-Encoding": {"br"}}, Body: io.NopCloser(strings.NewReader(""))}
	if err := ScrubResponse(resp, nil); err != nil || resp.Header.Get("Content-Encoding") != "br" {
		t.Errorf("no secrets: got %v, headers %v", err, resp.Header)
	}
}

func TestScrubResponseEmptyAndCorrupt(t *testing.T) {
	secret := mustSecret(t, "K", "sk-ant-0123456789abcdef", "")
	for _, ce := range []string{"gzip", "zstd"} {
		resp := &http.Response{Header: http.Header{"Content-Encoding": {ce}}, Body: io.NopCloser(strings.NewReader(""))}
		if err := ScrubResponse(resp, []*Secret{secret}); err != nil {
			t.Fatal(err)
		}
		if got, err := io.ReadAll(resp.Body); err != nil || len(got) != 0 {
			t.Errorf("%s empty: got %q, %v; want empty, nil", ce, got, err)
		}
		resp = &http.Response{Header: http.Header{"Content-Encoding": {ce}}, Body: io.NopCloser(strings.NewReader("not compressed " + secret.value))}
		if err := ScrubResponse(resp, []*Secret{secret}); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		if err == nil || strings.Contains(err.Error(), secret.value) || bytes.Contains(got, []byte(secret.value)) {
			t.Errorf("%s corrupt: got %q, %v; want a decode error without the secret", ce, got, err)
		}
	}
}

// stepReader hands out the chunks the test sends, as a connection would:
// what arrived is returned (as much as p holds) without waiting for more;
// the next chunk is waited for only when nothing is left.
type stepReader struct {
	ch   chan []byte
	left []byte
}

func (r *stepReader) Read(p []byte) (int, error) {
	if len(r.left) == 0 {
		b, ok := <-r.ch
		if !ok {
			return 0, io.EOF
		}
		r.left = b
	}
	n := copy(p, r.left)
	r.left = r.left[n:]
	return n, nil
}

// TestScrubResponseStreamsSSE feeds an SSE stream one event per Read and
// requires each event to reach the consumer before the next is produced:
// with the producer waiting on the consumer, any holding back would hang.
func TestScrubResponseStreamsSSE(t *testing.T) {
	secret := mustSecret(t, "K", "sk-ant-0123456789abcdef", "")
	events := []string{
		"event: message_start\ndata: {\"type\":\"message_start\"}\n\n",
		"event: content_block_delta\ndata: {\"text\":\"your key is sk-ant-0123456789abcdef\"}\n\n",
		"event: content_block_delta\ndata: {\"text\":\"sk-ant-0123456789abcdef\"}\n\n",
		": keep-alive\n\n",
		"event: message_stop\ndata: {}\n\n",
	}
	for _, e := range encoders {
		t.Run(e.name, func(t *testing.T) {
			feed := make(chan []byte)
			var comp bytes.Buffer
			w, flush, closeFn := e.new(&comp)
			resp := &http.Response{
				Header: http.Header{"Content-Type": {"text/event-stream"}},
				Body:   io.NopCloser(&stepReader{ch: feed}),
			}
			if e.extra != "" {
				resp.Header.Set("Content-Encoding", e.extra)
			}
			if err := ScrubResponse(resp, []*Secret{secret}); err != nil {
				t.Fatal(err)
			}
			got := make(chan string)
			readErr := make(chan error, 1)
			go func() { // the consumer: the proxy copying to the sandbox
				defer close(got)
				buf := make([]byte, 64<<10)
				for {
					n, err := resp.Body.Read(buf)
					if n > 0 {
						got <- string(buf[:n])
					}
					if err != nil {
						if err != io.EOF {
							readErr <- err
						}
						return
					}
				}
			}()
			for i, ev := range events {
				comp.Reset()
				if _, err := io.WriteString(w, ev); err != nil {
					t.Fatal(err)
				}
				if err := flush(); err != nil {
					t.Fatal(err)
				}
				chunk := bytes.Clone(comp.Bytes())
				if len(chunk) == 0 {
					t.Fatalf("event %d: encoder produced nothing on flush", i)
				}
				select {
				case feed <- chunk:
				case <-time.After(stepTimeout):
					t.Fatalf("event %d: the reader did not ask for more input", i)
				}
				want := strings.ReplaceAll(ev, secret.value, secret.placeholder)
				var have string
				for have != want {
					select {
					case s, ok := <-got:
						if !ok {
							t.Fatalf("event %d: stream ended early: %v", i, <-readErr)
						}
						have += s
						if !strings.HasPrefix(want, have) {
							t.Fatalf("event %d: got %q, want %q", i, have, want)
						}
					case <-time.After(stepTimeout):
						t.Fatalf("event %d held back: got %q before the next chunk, want %q", i, have, want)
					}
				}
			}
			comp.Reset()
			if err := closeFn(); err != nil {
				t.Fatal(err)
			}
			if comp.Len() > 0 {
				feed <- bytes.Clone(comp.Bytes())
			}
			close(feed)
			for s := range got {
				t.Errorf("got %q after the last event, want nothing", s)
			}
			select {
			case err := <-readErr:
				t.Errorf("read: %v", err)
			default:
			}
		})
	}
}

// TestScrubResponseOverHTTP runs a real upstream on loopback that echoes
// the credential it received, in a header, the body and a trailer, encoded
// as asked; the client side swaps the secret in and scrubs what comes back.
func TestScrubResponseOverHTTP(t *testing.T) {
	rules, err := ParseRules([]byte(`[{"match":{"host":"127.0.0.1","path":{"startsWith":"/v1/"}},
	  "transform":{"headers":{"x-api-key":{"env":"CANARY"}}}}]`), canaryEnv)
	if err != nil {
		t.Fatal(err)
	}
	set := NewRuleSet(rules...)
	seen := make(chan string, 10)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-Api-Key")
		seen <- key + "|" + r.Header.Get("Authorization")
		coding := r.URL.Query().Get("coding")
		w.Header().Set("Trailer", "X-Echo-Trailer")
		w.Header().Set("X-Echo", "got "+key)
		var out io.Writer = w
		closeFn := func() error { return nil }
		for _, e := range encoders {
			if e.extra != "" && e.extra == coding {
				w.Header().Set("Content-Encoding", coding)
				out, _, closeFn = e.new(w)
			}
		}
		fmt.Fprintf(out, "you sent %s; again: %s", key, r.Header.Get("Authorization"))
		_ = closeFn()
		w.Header().Set("X-Echo-Trailer", key)
	}))
	defer upstream.Close()
	for _, coding := range []string{"", "gzip", "zstd"} {
		t.Run("coding="+coding, func(t *testing.T) {
			req := newReq(t, "POST", upstream.URL+"/v1/messages?coding="+coding,
				"Authorization", "Bearer sandgate-placeholder-CANARY", "Accept-Encoding", "br, gzip, zstd")
			applied := set.Apply(req)
			resp, err := upstream.Client().Transport.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if got, want := <-seen, canary+"|Bearer "+canary; got != want {
				t.Errorf("upstream saw %q, want %q", got, want)
			}
			if err := applied.ScrubResponse(resp); err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			ph := "sandgate-placeholder-CANARY"
			if got, want := string(body), "you sent "+ph+"; again: Bearer "+ph; got != want {
				t.Errorf("body: got %q, want %q", got, want)
			}
			if got, want := resp.Header.Get("X-Echo"), "got "+ph; got != want {
				t.Errorf("header: got %q, want %q", got, want)
			}
			if got := resp.Trailer.Get("X-Echo-Trailer"); got != ph {
				t.Errorf("trailer: got %q, want %q", got, ph)
			}
			var all bytes.Buffer
			_ = resp.Header.Write(&all)
			_ = resp.Trailer.Write(&all)
			all.Write(body)
			if bytes.Contains(all.Bytes(), []byte(canary)) {
				t.Errorf("the canary reached the sandbox side: %q", all.String())
			}
		})
	}
}

func TestScrubBodyCloseWhileReading(t *testing.T) {
	secret := mustSecret(t, "K", "sk-ant-0123456789abcdef", "")
	for _, ce := range []string{"", "gzip", "zstd"} {
		pr, pw := io.Pipe()
		resp := &http.Response{Header: http.Header{"Content-Encoding": {ce}}, Body: pr}
		if err := ScrubResponse(resp, []*Secret{secret}); err != nil {
			t.Fatal(err)
		}
		done := make(chan error)
		go func() {
			_, err := resp.Body.Read(make([]byte, 10))
			done <- err
		}()
		_ = resp.Body.Close() // must unblock the Read, not wait for it
		select {
		case err := <-done:
			if err == nil {
				t.Errorf("%q: got nil error from a read on a closed body", ce)
			}
		case <-time.After(stepTimeout):
			t.Fatalf("%q: Close did not unblock Read", ce)
		}
		_ = pw.Close()
		if err := resp.Body.Close(); err != nil {
			t.Errorf("second close: %v", err)
		}
	}
}
