package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/servetest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// The turn, against a real service whose "model API" is the test
// upstream: the key reaches the API, never the sandbox, and the
// sandbox's files survive the suspension.
func TestAgentTurn(t *testing.T) {
	if ok, why := servetest.CanRun(); !ok {
		t.Skip(why)
	}
	svc, err := servetest.Start(servetest.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key := "sk-example-real-key-0123456789"
	var out, errOut bytes.Buffer
	err = run(ctx, config{URL: svc.URL, Token: svc.Token, APIURL: "https://" + servetest.UpstreamHost, APIKey: key,
		Registry: servetest.UpstreamHost, Setup: []string{"mkdir -p /opt/agent"}, Task: "say hello"}, &out, &errOut)
	if err != nil {
		t.Fatalf("%v\n%s%s", err, out.String(), errOut.String())
	}
	got := out.String()
	for _, want := range []string{"agent: working on: say hello", "path=/v1/messages auth= key=aisdkhc_", "suspended ", `RESULT.md still begins "# say hello"`, "destroyed "} {
		if !strings.Contains(got, want) {
			t.Errorf("the turn's output lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, key) {
		t.Error("the real key reached the sandbox's output")
	}
	seen := svc.UpstreamSeen()
	if len(seen) == 0 || seen[len(seen)-1].Get("X-Api-Key") != key {
		t.Error("the API did not get the real key")
	}
	if err := run(ctx, config{URL: svc.URL, Token: svc.Token}, &out, &errOut); err == nil || !strings.Contains(err.Error(), "ANTHROPIC_API_KEY") {
		t.Errorf("without a key: %v", err)
	}

	// A model call that fails fails the turn (and so the program's exit,
	// through main's log.Fatal): it used to write the error as the answer
	// and end well. Here the API's host is one the service's DNS does not
	// know, so the proxy answers the route with 502.
	out.Reset()
	errOut.Reset()
	err = run(ctx, config{URL: svc.URL, Token: svc.Token, APIURL: "https://nowhere.example.com", APIKey: key,
		Registry: servetest.UpstreamHost, Setup: []string{"mkdir -p /opt/agent"}, Task: "say hello"}, &out, &errOut)
	if err == nil || !strings.Contains(err.Error(), "exited with 1") || !strings.Contains(errOut.String(), "the model API call failed") {
		t.Errorf("a failed model call: %v\n%s%s", err, out.String(), errOut.String())
	}
	if strings.Contains(out.String(), "wrote RESULT.md") {
		t.Errorf("the agent wrote a result of a failed call:\n%s", out.String())
	}
}
