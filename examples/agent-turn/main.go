// Command agent-turn runs one turn of a coding agent in a sandgate
// sandbox, the way a platform does it with api/client:
//
//  1. a template with the agent installed, built once (in a throwaway
//     sandbox that may reach the package registry) and reused;
//  2. a sandbox made from it, whose model API base URL routes through the
//     service and whose API key is a placeholder: the service swaps in the
//     real key on the way out, so the agent never holds it;
//  3. the agent's command, its output streamed as it runs;
//  4. the file it wrote, read back;
//  5. suspended between turns (nothing runs, nothing is billed), resumed
//     for the next, and destroyed at the end of the session.
//
// Run it against a service:
//
//	SANDGATE_URL=http://127.0.0.1:8080 SANDBOX_SERVICE_TOKEN=... ANTHROPIC_API_KEY=sk-... \
//	  go run ./examples/agent-turn -task 'say hello'
//
// The agent here is a stand-in, a shell script calling the model API with
// curl; a real platform installs its harness in the template instead (the
// -setup commands, which may reach -registry).
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/sandgate/sandgate/api/client"
)

// config is what a turn needs.
type config struct {
	URL, Token string
	// APIURL is the model API's base URL; APIKey its real key, which only
	// the service ever holds.
	APIURL, APIKey string
	// Registry is the host the template's setup may reach (packages).
	Registry string
	Setup    []string
	Task     string
}

// agentScript is the stand-in agent: it asks the model API and writes the
// answer to RESULT.md. It sees only ANTHROPIC_BASE_URL (a route through
// the service) and a placeholder key. A failed call (an error status from
// the API or the proxy's refusal, or no answer) fails the agent: it
// exits 1 and says why, with what the API or the proxy answered.
const agentScript = `#!/bin/sh
set -e
echo "agent: working on: $1"
if ! curl -sS --fail-with-body -H "x-api-key: $ANTHROPIC_API_KEY" -H "anthropic-version: 2023-06-01" \
  -H "content-type: application/json" "$ANTHROPIC_BASE_URL/v1/messages" \
  -d "{\"model\":\"claude-sonnet-4-5\",\"max_tokens\":64,\"messages\":[{\"role\":\"user\",\"content\":\"$1\"}]}" > answer.json; then
  echo "agent: the model API call failed:" >&2
  cat answer.json >&2
  echo >&2
  exit 1
fi
{ echo "# $1"; echo; cat answer.json; echo; } > RESULT.md
echo "agent: wrote RESULT.md"
`

func main() {
	cfg := config{URL: os.Getenv("SANDGATE_URL"), Token: os.Getenv("SANDBOX_SERVICE_TOKEN"), APIKey: os.Getenv("ANTHROPIC_API_KEY")}
	flag.StringVar(&cfg.URL, "url", cfg.URL, "the sandgate service (SANDGATE_URL)")
	flag.StringVar(&cfg.APIURL, "api", "https://api.anthropic.com", "the model API's base URL")
	flag.StringVar(&cfg.Registry, "registry", "registry.npmjs.org", "the package registry the template's setup may reach")
	flag.StringVar(&cfg.Task, "task", "Say hello in five words.", "what the agent is asked")
	flag.Parse()
	cfg.Setup = []string{"mkdir -p /opt/agent"}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg, os.Stdout, os.Stderr); err != nil {
		log.Fatal(err)
	}
}

// run is one session of one turn, reporting on out.
func run(ctx context.Context, cfg config, out, errOut io.Writer) error {
	if cfg.APIKey == "" {
		return errors.New("no API key: set ANTHROPIC_API_KEY (it stays in this process and the service, never in the sandbox)")
	}
	c, err := client.New(cfg.URL, client.WithToken(cfg.Token))
	if err != nil {
		return err
	}
	if _, err := c.Preflight(ctx); err != nil {
		return fmt.Errorf("the service is not fit for use: %w", err)
	}
	api, err := url.Parse(cfg.APIURL)
	if err != nil || api.Hostname() == "" {
		return fmt.Errorf("-api %q: want a URL such as https://api.anthropic.com", cfg.APIURL)
	}

	// 1. The agent, installed once in a template.
	agent := &client.Template{
		Identity: "example-agent@2", // @2: the agent fails when its model call fails
		Setup:    cfg.Setup,
		Prepare: func(ctx context.Context, sb *client.Restricted) error {
			// A harness installs itself here (npm install -g ...).
			if err := sb.WriteTextFile(ctx, "/opt/agent/agent", agentScript); err != nil {
				return err
			}
			res, err := sb.Run(ctx, client.Command{Command: "chmod +x /opt/agent/agent"})
			if err == nil && res.ExitCode != 0 {
				err = fmt.Errorf("chmod: %s", res.Stderr)
			}
			return err
		},
		AllowedHosts: []string{cfg.Registry},
	}

	// 2. The session's sandbox, with the model API as a base URL and a
	// placeholder for its key.
	s, err := c.Create(ctx, client.CreateOptions{
		Template:     agent,
		AllowedHosts: []string{cfg.Registry},
		BaseURLs:     map[string]string{"ANTHROPIC_BASE_URL": cfg.APIURL},
	})
	if err != nil {
		return err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := s.Destroy(dctx); err == nil {
			fmt.Fprintf(out, "destroyed %s\n", s.ID())
		}
	}()
	fmt.Fprintf(out, "sandbox %s, from template %s\n", s.ID(), client.TemplateID(agent.Identity, agent.Setup))
	placeholder := newPlaceholder()
	err = s.AddRequestTransformations(ctx, []client.RequestTransformation{{
		Match: client.Match{
			Host:    api.Hostname(),
			Headers: []client.KeyValueMatcher{{Key: client.Exact("x-api-key"), Value: client.Exact(placeholder)}},
		},
		Transform: client.Transform{Headers: map[string]string{"x-api-key": cfg.APIKey}},
	}})
	if err != nil {
		return err
	}

	// 3. The agent's turn, streamed.
	p, err := s.Spawn(ctx, client.Command{
		Command: "/opt/agent/agent " + shellQuote(cfg.Task),
		Env:     map[string]string{"ANTHROPIC_API_KEY": placeholder},
		Stdout:  out,
		Stderr:  errOut,
	})
	if err != nil {
		return err
	}
	code, err := p.Wait(ctx)
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("the agent's turn failed: it exited with %d (its stderr above says why)", code)
	}

	// 4. What it wrote.
	result, err := s.ReadTextFile(ctx, "RESULT.md")
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "--- RESULT.md\n%s---\n", result)

	// 5. Between turns: suspended; the next turn resumes it, files and
	// all (the credential goes with the suspension: hand it again).
	id := s.ID()
	if err := s.Stop(ctx); err != nil {
		return err
	}
	fmt.Fprintf(out, "suspended %s\n", id)
	if s, err = c.Resume(ctx, id, client.ResumeOptions{AllowedHosts: []string{cfg.Registry}, BaseURLs: map[string]string{"ANTHROPIC_BASE_URL": cfg.APIURL}}); err != nil {
		return err
	}
	again, err := s.ReadTextLines(ctx, "RESULT.md", 1, 1)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "resumed %s: RESULT.md still begins %q\n", id, again)
	return nil
}

// newPlaceholder is a fresh placeholder credential, in the harness's
// aisdkhc_ form.
func newPlaceholder() string {
	var b [16]byte
	rand.Read(b[:])
	return "aisdkhc_" + hex.EncodeToString(b[:])
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
