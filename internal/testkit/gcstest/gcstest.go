// Package gcstest starts a Cloud Storage emulator (fsouza/fake-gcs-server)
// in-process on a loopback port, speaking its real JSON API, and returns a
// storage client pointed at it. For tests only.
//
// The emulator ignores ifGenerationMatch on a delete or a metadata update,
// which Cloud Storage honours and leases depend on: the front put before
// it refuses such a call with 412 when the object is at another
// generation, as Cloud Storage does, and runs every change of the bucket
// one at a time so that the check and the change are one step.
package gcstest

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"cloud.google.com/go/storage"
	"github.com/fsouza/fake-gcs-server/fakestorage"
	"google.golang.org/api/option"
)

// Start runs an emulator with the given buckets on 127.0.0.1 and returns
// it with a client that talks to it over HTTP. Both are stopped when the
// test ends.
func Start(t testing.TB, buckets ...string) (*fakestorage.Server, *storage.Client) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("gcstest: listen: %v", err)
	}
	base := "http://" + ln.Addr().String()
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{
		Scheme:      "http",
		Host:        "127.0.0.1",
		NoListener:  true,
		ExternalURL: base,
		Writer:      io.Discard,
	})
	if err != nil {
		ln.Close()
		t.Fatalf("start fake-gcs-server: %v", err)
	}
	for _, b := range buckets {
		srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: b})
	}
	front := &front{srv: srv, next: srv.HTTPHandler()}
	hs := httptest.NewUnstartedServer(front)
	hs.Listener.Close()
	hs.Listener = ln
	hs.Start()
	t.Cleanup(func() { hs.Close(); srv.Stop() })
	client, err := storage.NewClient(context.Background(),
		option.WithEndpoint(base+"/storage/v1/"),
		option.WithoutAuthentication(),
		storage.WithJSONReads())
	if err != nil {
		t.Fatalf("storage client: %v", err)
	}
	t.Cleanup(func() { client.Close() })
	return srv, client
}

// front serialises the bucket's changes and checks the ifGenerationMatch
// of deletes and metadata updates.
type front struct {
	srv  *fakestorage.Server
	next http.Handler
	mu   sync.Mutex
}

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		f.next.ServeHTTP(w, r)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.Method == http.MethodDelete || r.Method == http.MethodPatch || r.Method == http.MethodPut {
		if want := r.URL.Query().Get("ifGenerationMatch"); want != "" {
			if bucket, object, ok := objectOf(r.URL); ok {
				if obj, err := f.srv.GetObject(bucket, object); err == nil && strconv.FormatInt(obj.Generation, 10) != want {
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusPreconditionFailed)
					io.WriteString(w, `{"error":{"code":412,"message":"At least one of the pre-conditions you specified did not hold.","errors":[{"reason":"conditionNotMet"}]}}`)
					return
				}
			}
		}
	}
	f.next.ServeHTTP(w, r)
}

// objectOf is the bucket and object of a JSON API object URL
// (/storage/v1/b/<bucket>/o/<object>).
func objectOf(u *url.URL) (bucket, object string, ok bool) {
	rest, ok := strings.CutPrefix(u.EscapedPath(), "/storage/v1/b/")
	if !ok {
		return "", "", false
	}
	b, o, ok := strings.Cut(rest, "/o/")
	if !ok {
		return "", "", false
	}
	bucket, err1 := url.PathUnescape(b)
	object, err2 := url.PathUnescape(o)
	return bucket, object, err1 == nil && err2 == nil
}
