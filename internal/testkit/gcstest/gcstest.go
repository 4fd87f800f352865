// Package gcstest starts a Cloud Storage emulator (fsouza/fake-gcs-server)
// in-process on a loopback port, speaking its real JSON API, and returns a
// storage client pointed at it. For tests only.
package gcstest

import (
	"context"
	"io"
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
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{
		Scheme: "http",
		Host:   "127.0.0.1",
		Writer: io.Discard,
	})
	if err != nil {
		t.Fatalf("start fake-gcs-server: %v", err)
	}
	t.Cleanup(srv.Stop)
	for _, b := range buckets {
		srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: b})
	}
	client, err := storage.NewClient(context.Background(),
		option.WithEndpoint(srv.URL()+"/storage/v1/"),
		option.WithoutAuthentication(),
		storage.WithJSONReads())
	if err != nil {
		t.Fatalf("storage client: %v", err)
	}
	t.Cleanup(func() { client.Close() })
	return srv, client
}
