// Regression tests from an attack run on the response scrub.

package relay

import (
	"fmt"
	"net/http"
	"net/http/httputil"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/transforms"
)

// TestTruncatedEchoOfSecretScrubbed: an upstream that echoed the key minus
// its first or its last byte handed it to the sandbox, since only whole
// copies were scrubbed. Every run of transforms.MinPartialRun bytes of it
// is masked now, in the body (small and streamed) and in the headers.
func TestTruncatedEchoOfSecretScrubbed(t *testing.T) {
	rules := `[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"CANARY_KEY"}}}}]`
	e := newEnv(t, `{"mode":"custom","allowedHosts":["api.example.com"]}`, rules)
	e.upstream("api.example.com", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k := r.Header.Get("X-Api-Key")
		w.Header().Set("X-Echo", "key "+k[1:])
		if r.URL.Query().Get("stream") == "1" {
			w.Header().Set("Content-Type", "text/event-stream")
			for _, part := range []string{"data: prefix:" + k[:7], k[7:len(k)-1] + "\n\n", "data: suffix:" + k[1:] + "\n\n"} {
				fmt.Fprint(w, part)
				w.(http.Flusher).Flush()
			}
			return
		}
		fmt.Fprintf(w, "prefix:%s suffix:%s", k[:len(k)-1], k[1:])
	}))
	mask := func(n int) string { return strings.Repeat(string(transforms.PartialMask), n) }
	n := len(canary) - 1
	for q, want := range map[string]string{
		"":          "prefix:" + mask(n) + " suffix:" + mask(n),
		"?stream=1": "data: prefix:" + mask(n) + "\n\ndata: suffix:" + mask(n) + "\n\n",
	} {
		resp, err := e.routeClient().Get(e.routeURL("api.example.com/v1/x" + q))
		if err != nil {
			t.Fatal(err)
		}
		dump, _ := httputil.DumpResponse(resp, false)
		if b := body(t, resp); b != want {
			t.Errorf("%q: body %q, want %q", q, b, want)
		}
		if h := resp.Header.Get("X-Echo"); h != "key "+mask(n) {
			t.Errorf("%q: X-Echo %q, want the run masked", q, h)
		}
		for i := 0; i+transforms.MinPartialRun <= len(canary); i++ {
			if strings.Contains(string(dump), canary[i:i+transforms.MinPartialRun]) {
				t.Errorf("%q: %d bytes of the secret reached the sandbox in the head:\n%s", q, transforms.MinPartialRun, dump)
			}
		}
	}
}
