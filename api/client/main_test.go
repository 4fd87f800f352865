package client_test

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/servetest"
)

// svc is the real service every test and Example of this package talks
// to, started once; nil where sandboxes cannot run.
var svc *servetest.Service

// TestMain starts one service for the package when sandboxes can run here
// (Linux, root) and gives its URL and token to the Examples the way a
// program gets them: SANDGATE_URL and SANDBOX_SERVICE_TOKEN. Where they
// cannot run, the tests that need it skip, and the Examples, which need it
// to produce their output, are compiled but not run: the run is narrowed
// to the tests unless -run was given.
func TestMain(m *testing.M) {
	flag.Parse()
	if ok, why := servetest.CanRun(); ok {
		s, err := servetest.Start(servetest.Config{})
		if err != nil {
			fmt.Fprintf(os.Stderr, "api/client: starting the test service: %v\n", err)
			gobuild.Cleanup()
			os.Exit(1)
		}
		svc = s
		os.Setenv("SANDGATE_URL", s.URL)
		os.Setenv("SANDBOX_SERVICE_TOKEN", s.Token)
	} else if f := flag.Lookup("test.run"); f != nil && f.Value.String() == "" {
		fmt.Fprintf(os.Stderr, "api/client: %s; the Examples need a service: compiled, not run\n", why)
		flag.Set("test.run", "^Test")
	}
	code := m.Run()
	if svc != nil {
		svc.Close()
	}
	gobuild.Cleanup()
	os.Exit(code)
}

// need skips a test that needs the service where there is none.
func need(t *testing.T) *servetest.Service {
	t.Helper()
	if svc == nil {
		_, why := servetest.CanRun()
		t.Skip(why)
	}
	return svc
}
