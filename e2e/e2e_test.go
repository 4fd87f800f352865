package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/internal/testkit/gobuild"
	"github.com/sandgate/sandgate/internal/testkit/servetest"
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	gobuild.Cleanup()
	os.Exit(code)
}

// target is a service the scenarios run against: a deployment, or a
// `sandgate serve` of the test's own.
type target struct {
	name string
	c    *client.Client
	// remote: a deployment, reached over the internet; the scenarios
	// that need the service's machine (SIGTERM) or our own upstreams skip.
	remote bool
	// nonce makes this run's sandbox and template names its own.
	nonce string

	// Local only.
	f        *fixtures
	srv      *serve
	cli      string // SANDBOX_CLI of the serves it starts ("": sandgate sandbox)
	token    string
	identity string // the identity token the client sends

	// echoURL is an upstream that echoes the X-Api-Key it receives; ""
	// when there is none (a deployment without SANDGATE_E2E_ECHO_URL).
	echoURL string
}

// TestE2E runs every scenario against the deployment named by
// CLOUD_RUN_SANDBOX_URL, or else against `sandgate serve` started here
// over each launcher: `sandgate sandbox` and Google's CLI (its stand-in).
func TestE2E(t *testing.T) {
	if u := os.Getenv("CLOUD_RUN_SANDBOX_URL"); u != "" {
		c, err := client.New(u, client.WithToken(os.Getenv("CLOUD_RUN_SANDBOX_SERVICE_TOKEN")), client.WithIdentity(client.GcloudIdentity()))
		if err != nil {
			t.Fatal(err)
		}
		scenarios(t, &target{name: "deployment", c: c, remote: true, nonce: nonce(), echoURL: os.Getenv("SANDGATE_E2E_ECHO_URL")})
		return
	}
	if ok, why := servetest.CanRun(); !ok {
		t.Skip(why + " (or set CLOUD_RUN_SANDBOX_URL to run the suite against a deployment)")
	}
	for _, mode := range []string{"sandgate-sandbox", "google-cli"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			// Fixtures of its own: what its stand-ins see is its own.
			f := newFixtures(t)
			tg := &target{name: mode, f: f, nonce: nonce(), echoURL: "https://" + echoHost,
				token: "e2e-service-token-" + nonce(), identity: "e2e-identity-token-" + nonce()}
			if mode == "google-cli" {
				tg.cli = gobuild.GoogleCLI(t)
			}
			tg.srv = startServe(t, serveEnv(f, t.TempDir(), tg.token, tg.cli))
			tg.c = newClient(t, tg.srv.url, tg.token, tg.identity)
			scenarios(t, tg)
		})
	}
}

func scenarios(t *testing.T, tg *target) {
	for _, sc := range []struct {
		name string
		run  func(*testing.T, *target)
	}{
		{"template-from-registry", testTemplateFromRegistry},
		{"exit-codes", testExitCodes},
		{"binary-files", testBinaryFiles},
		{"credential-swapped-outside", testCredentialSwappedOutside},
		{"private-addresses-out-of-reach", testPrivateOutOfReach},
		{"port-through-service", testPort},
		{"suspend-resume", testSuspendResume},
		{"sigterm-saves-all", testSIGTERMSavesAll},
		{"protocol-1-fidelity", testProtocol1Fidelity},
		{"egress-without-proxy-variables", testEgressWithoutProxy},
	} {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			sc.run(t, tg)
		})
	}
}

func nonce() string {
	var b [4]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// ctx is a scenario's context: only a hang outlasts it.
func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 3*hang)
	t.Cleanup(cancel)
	return c
}

// create makes a sandbox named after the scenario and destroys it when
// the test ends.
func (tg *target) create(t *testing.T, c *client.Client, opts client.CreateOptions) *client.Session {
	t.Helper()
	if opts.ID == "" {
		opts.ID = tg.sandboxName(t, "")
	}
	s, err := c.Create(ctx(t), opts)
	if err != nil {
		t.Fatalf("create %s: %v", opts.ID, err)
	}
	t.Cleanup(func() { destroy(t, c, opts.ID) })
	return s
}

// sandboxName is a name of this run for the scenario, with suffix.
func (tg *target) sandboxName(t *testing.T, suffix string) string {
	base := t.Name()[strings.LastIndex(t.Name(), "/")+1:]
	if len(base) > 30 {
		base = base[:30]
	}
	n := "e2e-" + strings.Trim(base, "-") + "-" + tg.nonce
	if suffix != "" {
		n += "-" + suffix
	}
	return n
}

func destroy(t *testing.T, c *client.Client, id string) {
	dctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	if err := c.Destroy(dctx, id); err != nil {
		t.Errorf("destroying %s: %v", id, err)
	}
}

// run runs command and fails the test unless it exits 0; it returns its
// standard output.
func run(t *testing.T, s *client.Session, command string) string {
	t.Helper()
	return runWith(t, s, client.Command{Command: command})
}

func runWith(t *testing.T, s *client.Session, cmd client.Command) string {
	t.Helper()
	res, err := s.Run(ctx(t), cmd)
	if err != nil {
		t.Fatalf("%s: %v", cmd.Command, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("%s: exit %d\nstdout: %s\nstderr: %s", cmd.Command, res.ExitCode, res.Stdout, res.Stderr)
	}
	return string(res.Stdout)
}

// hostOf is the host name of a URL.
func hostOf(t *testing.T, u string) string {
	t.Helper()
	p, err := url.Parse(u)
	if err != nil || p.Hostname() == "" {
		t.Fatalf("URL %q: %v", u, err)
	}
	return p.Hostname()
}

// waitFor polls cond until it holds; only a hang exceeds the bound.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, hang)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
