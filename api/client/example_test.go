package client_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strings"

	"github.com/sandgate/sandgate/api/client"
)

// A sandbox for one session of an agent: a command, a suspension between
// turns (nothing runs, nothing is billed), and the next turn resumed where
// it was.
func Example() {
	ctx := context.Background()
	c, err := client.New(os.Getenv("SANDGATE_URL"), client.WithToken(os.Getenv("SANDBOX_SERVICE_TOKEN")))
	if err != nil {
		log.Fatal(err)
	}
	s, err := c.Create(ctx, client.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	res, err := s.Run(ctx, client.Command{Command: "echo 'turn 1' > notes.txt; cat notes.txt; exit 3"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("exit %d: %s", res.ExitCode, res.Stdout) // a non-zero exit is a result

	id := s.ID() // keep it: another process may resume the sandbox
	if err := s.Stop(ctx); err != nil {
		log.Fatal(err)
	}

	s, err = c.Resume(ctx, id, client.ResumeOptions{})
	if err != nil {
		log.Fatal(err)
	}
	notes, err := s.ReadTextFile(ctx, "notes.txt")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print("after resume: ", notes)
	if err := s.Destroy(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// exit 3: turn 1
	// after resume: turn 1
}

// A template: the harness is installed once, in a throwaway sandbox, and
// every sandbox made with it starts with it installed.
func ExampleClient_EnsureTemplate() {
	ctx := context.Background()
	c, err := client.New(os.Getenv("SANDGATE_URL"), client.WithToken(os.Getenv("SANDBOX_SERVICE_TOKEN")))
	if err != nil {
		log.Fatal(err)
	}
	harness := &client.Template{
		Identity: "example-harness@1.0.0",
		Setup:    []string{"mkdir -p /opt/harness"},
		Prepare: func(ctx context.Context, sb *client.Restricted) error {
			return sb.WriteTextFile(ctx, "/opt/harness/VERSION", "1.0.0\n")
		},
	}
	s, err := c.Create(ctx, client.CreateOptions{Template: harness})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Destroy(ctx)
	version, err := s.ReadTextFile(ctx, "/opt/harness/VERSION")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print("harness ", version)
	fmt.Println(strings.HasPrefix(client.TemplateID(harness.Identity, harness.Setup), "ai-sdk-harness-template-"))
	// Output:
	// harness 1.0.0
	// true
}

// A credential the sandbox never holds: the agent gets a placeholder, and
// the service puts the real key on the request on its way out to the API
// (api.example.com stands in for the model API here).
func ExampleSession_AddRequestTransformations() {
	ctx := context.Background()
	c, err := client.New(os.Getenv("SANDGATE_URL"), client.WithToken(os.Getenv("SANDBOX_SERVICE_TOKEN")))
	if err != nil {
		log.Fatal(err)
	}
	s, err := c.Create(ctx, client.CreateOptions{BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": "https://api.example.com"}})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Destroy(ctx)
	const placeholder = "aisdkhc_placeholder_0123456789"
	err = s.AddRequestTransformations(ctx, []client.RequestTransformation{{
		Match: client.Match{
			Host:    "api.example.com",
			Headers: []client.KeyValueMatcher{{Key: client.Exact("x-api-key"), Value: client.Exact(placeholder)}},
		},
		Transform: client.Transform{Headers: map[string]string{"x-api-key": "sk-the-real-key-never-in-the-sandbox"}},
	}})
	if err != nil {
		log.Fatal(err)
	}
	// The test API echoes the key it received: the service scrubs the
	// real one back to the placeholder on the way in.
	res, err := s.Run(ctx, client.Command{
		Command: `curl -sS -H "x-api-key: $KEY" "$ANTHROPIC_BASE_URL/v1/messages"`,
		Env:     map[string]string{"KEY": placeholder},
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s\n", res.Stdout)
	// Output:
	// path=/v1/messages auth= key=aisdkhc_placeholder_0123456789
}

// A server in the sandbox, reached from outside: over the TCP bridge
// (DialPort, any protocol), and the port tunnel's endpoint a harness
// bridge connects to (PortEndpoint).
func ExampleSession_DialPort() {
	ctx := context.Background()
	c, err := client.New(os.Getenv("SANDGATE_URL"), client.WithToken(os.Getenv("SANDBOX_SERVICE_TOKEN")))
	if err != nil {
		log.Fatal(err)
	}
	s, err := c.Create(ctx, client.CreateOptions{Ports: []int{8000}})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Destroy(ctx)
	if err := s.WriteTextFile(ctx, "site/index.html", "hello from the sandbox\n"); err != nil {
		log.Fatal(err)
	}
	server, err := s.Spawn(ctx, client.Command{Command: "exec python3 -m http.server 8000 --bind 127.0.0.1 --directory site", Stdout: io.Discard, Stderr: io.Discard})
	if err != nil {
		log.Fatal(err)
	}
	defer server.Kill(ctx)
	// Until it listens (a bounded wait, in the sandbox).
	if res, err := s.Run(ctx, client.Command{Command: `for i in $(seq 200); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8000))' 2>/dev/null && exit 0; sleep 0.05; done; exit 1`}); err != nil || res.ExitCode != 0 {
		log.Fatal("the server did not start: ", err)
	}

	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return s.DialPort(ctx, 8000)
	}}}
	resp, err := hc.Get("http://sandbox/index.html")
	if err != nil {
		log.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Printf("%s: %s", resp.Status, body)

	ep, err := s.PortEndpoint(ctx, 8000, "ws")
	if err != nil {
		log.Fatal(err)
	}
	path := strings.Replace(ep.URL[strings.Index(ep.URL, "/v1/"):], s.ID(), "ID", 1)
	fmt.Println(ep.URL[:2], path, ep.Header.Get("X-Ai-Sdk-Sandbox-Protocol"))
	// Output:
	// 200 OK: hello from the sandbox
	// ws /v1/sandboxes/ID/ports/8000 1
}
