// Command serve measures sandgate's HTTP service (api/server) against the
// lifecycle manager it serves, on real sandboxes, in one run:
//
//   - exec: `true` through the protocol 1 exec route (POST …/exec, the frame
//     stream read to its Exit frame) against Sandbox.Run of the same
//     command on the same sandbox, interleaved; p50, p99 and the difference
//     (target: the API adds < 1 ms at p50). The same for the Cloudflare
//     bridge's exec (POST /v1/sandbox/{id}/exec, its event stream read to
//     the exit event) against Sandbox.Run of what the bridge runs, beside
//     it, and the bridge's exec in a session (Session-Id: the session's
//     bash, its shell state saved and read back) against it without one.
//     GET /health gives the floor of one HTTP round trip on this machine.
//   - create: POST /v1/sandboxes, from the image and from a template,
//     against Manager.Create with the options the server passes, interleaved;
//     p50 each.
//   - port tunnel: a download from a server inside the sandbox through the
//     protocol 1 port tunnel (an Upgrade request on …/ports/{port}/…),
//     against a direct loopback connection to the same server (dialled from
//     the sandbox's network namespace), the agent's port dial alone
//     (Sandbox.DialPort, what the tunnel splices onto), and sandgate's TCP
//     bridge (a WebSocket on …/tcp/{port}); ratios to the direct one
//     (target: tunnel ≥ 0.8).
//   - tenants: what a CPU hog in one sandbox takes from another and from
//     the service. Sandbox A runs eight busy loops, each in a session of its
//     own; sandbox B's `exec true` p50 through the API, a fixed CPU-bound
//     loop in B, and the API's p99 (GET /v1/sandboxes/B), each ÷ the same
//     with A idle, the two phases taking turns (targets: B's loop keeps
//     ≥ 0.8 of its throughput on 2 cores, the API's p99 within 2×).
//
// -only picks some of these (create, exec, tunnel, tenants; all by
// default): bench/tenants.sh runs the tenants part alone.
//
// The service runs in this process: server.New over a real
// appliance.Manager driving `sandgate sandbox` (built from this checkout),
// served by an http.Server configured as `sandgate serve` configures it,
// on a loopback listener, with a service token. In process, the direct
// baselines (Sandbox.Run, Manager.Create, Sandbox.DialPort) call the very
// manager and sandboxes the server uses, so a difference is the HTTP
// service's own cost and nothing else; the built binary would add a
// second manager, and its own sandboxes to compare against. The client
// is a separate connection on loopback, as a caller's would be.
//
// The server inside the sandbox is this program, copied under /var/tmp
// (the sandboxes see the host's / read-only; their /tmp is a tmpfs) and
// started with SANDGATE_BENCH_PORTSERVER set. Run it as root with
// bench/serve.sh.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// config is what the flags choose.
type config struct {
	execs   int
	creates int
	bulk    int64
	rounds  int
	port    int
	only    map[string]bool
	// The tenants part: rounds of both phases, `exec true` calls and API
	// calls per phase.
	tenantRounds, tenantExecs, tenantAPI int
}

func main() {
	log.SetFlags(0)
	if child, err := portServerChild(); child {
		log.Fatal("port server: ", err)
	}
	var c config
	flag.IntVar(&c.execs, "execs", 500, "`exec true` round trips of each kind (HTTP and Sandbox.Run, interleaved)")
	flag.IntVar(&c.creates, "creates", 8, "creates of each kind (HTTP and Manager.Create; from the image and from a template)")
	flag.Int64Var(&c.bulk, "bulk", 512<<20, "bytes per port download (256 MiB to 1 GiB is meaningful)")
	flag.IntVar(&c.rounds, "rounds", 3, "downloads per path, the paths taking turns")
	flag.IntVar(&c.port, "port", 9000, "port of the server inside the sandbox")
	flag.IntVar(&c.tenantRounds, "tenant-rounds", 5, "tenants: rounds of A idle then A hogging")
	flag.IntVar(&c.tenantExecs, "tenant-execs", 30, "tenants: `exec true` calls in B per phase")
	flag.IntVar(&c.tenantAPI, "tenant-api", 200, "tenants: GET /v1/sandboxes/B calls per phase")
	only := flag.String("only", "create,exec,tunnel,tenants", "run only these `PARTS`, comma-separated: create, exec, tunnel, tenants")
	flag.Parse()
	c.only = map[string]bool{}
	for _, p := range strings.Split(*only, ",") {
		switch p = strings.TrimSpace(p); p {
		case "create", "exec", "tunnel", "tenants":
			c.only[p] = true
		default:
			log.Fatalf("bench: -only %q: want create, exec, tunnel or tenants", p)
		}
	}
	if runtime.GOOS != "linux" {
		log.Fatal("bench: sandboxes need Linux (namespaces, overlayfs)")
	}
	if os.Geteuid() != 0 {
		log.Fatal("bench: sandboxes need root: run bench/serve.sh as root")
	}
	if c.execs < 1 || c.creates < 1 || c.rounds < 1 || c.bulk < 1<<20 || c.port < 1 || c.port > 65535 {
		log.Fatal("bench: -execs, -creates and -rounds must be at least 1, -bulk at least 1 MiB, -port 1 to 65535")
	}
	if c.tenantRounds < 1 || c.tenantExecs < 1 || c.tenantAPI < 1 {
		log.Fatal("bench: -tenant-rounds, -tenant-execs and -tenant-api must be at least 1")
	}
	start := time.Now()
	if err := run(c); err != nil {
		log.Fatal("bench: ", err)
	}
	fmt.Printf("\ntotal bench time %.1f s\n", time.Since(start).Seconds())
}

func run(c config) error {
	r, err := newRig()
	if err != nil {
		return err
	}
	defer r.close()
	r.onInterrupt()
	fmt.Printf("sandgate serve bench: %s\n", benchkit.Machine())
	fmt.Printf("service: server.New over appliance.Manager (sandgate sandbox), in process, on %s with a token\n\n", r.addr)

	if c.only["create"] {
		if err := r.benchCreate(c.creates); err != nil {
			return err
		}
	}
	if c.only["exec"] {
		if err := r.benchExec(c.execs); err != nil {
			return err
		}
	}
	if c.only["tunnel"] {
		if err := r.benchTunnel(c.port, c.bulk, c.rounds); err != nil {
			return err
		}
	}
	if c.only["tenants"] {
		return r.benchTenants(c.tenantRounds, c.tenantExecs, c.tenantAPI)
	}
	return nil
}
