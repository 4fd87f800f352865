// Command sandbox measures real sandboxes on this machine, in one run, and
// prints p50 and p99 (and ratios where there is a baseline):
//
//   - create: appliance.Create (`sandbox run --detach`, the agent started,
//     the hello exchange) until a first command (`true` through
//     Sandbox.Run) has returned, N sandboxes one after another, each
//     destroyed after; and, for comparison, the `sandgate sandbox run
//     --detach` CLI call alone and `delete --force`;
//   - `exec true`: Sandbox.Run(/bin/true) on a live sandbox, and
//     `sandgate sandbox exec <id> -- /bin/true` through the CLI;
//   - egress: curl inside the sandbox downloads a large body from a
//     loopback HTTPS upstream through HTTPS_PROXY (the agent's relay
//     listener → relay.Proxy in this process), against the same download by
//     curl on the host through the same relay.Proxy on a TCP listener; from
//     a sandbox whose agent passes the connection's socket (our CLI), and
//     from one whose bytes cross the agent and the yamux link on pipes (the
//     launcher driving a wrapper named "sandbox" as it drives Google's CLI).
//
// The upstream runs in a process of its own (bench/internal/benchkit), so
// it shares neither this program's Go runtime nor its CPU accounting. Run
// it as root with bench/sandbox.sh.
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// config is what the flags choose.
type config struct {
	bin        string
	creates    int
	execs      int
	cliExecs   int
	bulk       int64
	rounds     int
	cpuProfile string
}

func main() {
	log.SetFlags(0)
	if child, err := benchkit.UpstreamChild(); child {
		log.Fatal("upstream: ", err)
	}
	var c config
	flag.StringVar(&c.bin, "sandgate", "", "path to the sandgate binary (built from this checkout when empty)")
	flag.IntVar(&c.creates, "creates", 20, "sandboxes created (and destroyed) one after another, and as many CLI run/delete pairs")
	flag.IntVar(&c.execs, "execs", 1000, "`exec true` round trips through Sandbox.Run")
	flag.IntVar(&c.cliExecs, "cli-execs", 100, "`sandgate sandbox exec -- true` CLI calls")
	flag.Int64Var(&c.bulk, "bulk", 512<<20, "bytes per egress download (256 MiB to 1 GiB is meaningful)")
	flag.IntVar(&c.rounds, "rounds", 3, "egress downloads per path, the paths taking turns")
	flag.StringVar(&c.cpuProfile, "cpuprofile", "", "write a pprof CPU profile of this process (relay.Proxy and the link client) during one extra download over the pipes link to `FILE`")
	flag.Parse()
	if runtime.GOOS != "linux" {
		log.Fatal("bench: sandboxes need Linux (namespaces, overlayfs)")
	}
	if os.Geteuid() != 0 {
		log.Fatal("bench: sandboxes and the upstream on 127.x.y.z:443 need root: run bench/sandbox.sh as root")
	}
	if c.creates < 1 || c.execs < 1 || c.cliExecs < 1 || c.rounds < 1 || c.bulk < 1<<20 {
		log.Fatal("bench: -creates, -execs, -cli-execs and -rounds must be at least 1, and -bulk at least 1 MiB")
	}
	if err := run(c); err != nil {
		log.Fatal("bench: ", err)
	}
}

func run(c config) error {
	start := time.Now()
	r, err := newRig(c.bin)
	if err != nil {
		return err
	}
	defer r.close()
	// An interrupted bench must not leave detached sandboxes running:
	// clean up, then exit.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		if _, ok := <-sigs; ok {
			fmt.Fprintln(os.Stderr, "bench: interrupted; removing its sandboxes")
			r.close()
			os.Exit(130)
		}
	}()

	fmt.Printf("sandgate sandbox bench: %s\n", benchkit.Machine())
	fmt.Printf("kernel %s, upstream %s:443 (own process), state %s\n\n", kernel(), r.env.Upstream, r.state)

	if err := r.benchCreate(c.creates); err != nil {
		return err
	}
	if err := r.benchExec(c.execs, c.cliExecs); err != nil {
		return err
	}
	if err := r.benchEgress(c.bulk, c.rounds, c.cpuProfile); err != nil {
		return err
	}
	fmt.Printf("\ntotal bench time %.1f s\n", time.Since(start).Seconds())
	explain()
	return nil
}

// explain says what each figure means.
func explain() {
	fmt.Print(`
What the figures mean:
  create      appliance.Create (CLI run --detach, agent exec'd, yamux hello) plus the first
              Sandbox.Run(true) returning; "of which" splits it. destroy is Sandbox.Destroy.
  CLI run     ` + "`sandgate sandbox run <id> --detach`" + ` as the launcher calls it (agent --idle as CMD),
              CLI process start included; CLI delete is ` + "`delete <id> --force`" + `.
  exec        Sandbox.Run(/bin/true): a yamux stream to the agent, fork+exec in the sandbox,
              exit code back. CLI exec is ` + "`sandgate sandbox exec <id> -- /bin/true`" + `: it adds the
              start of a Go process (the CLI) and its connection to the sandbox's init socket.
  egress      curl's own download rate (size / time_total, TLS included) of one large body
              through a CONNECT tunnel; sandbox = curl in the sandbox via HTTPS_PROXY → agent
              relay listener, which passes each accepted socket to this process (SCM_RIGHTS over
              the agent's socketpair link; agent CPU ≈ 0 shows it) → relay.Proxy here → upstream;
              yamux on pipes = the same from a sandbox whose link is a pair of pipes (Google's CLI):
              the agent copies each connection's bytes into a yamux stream, and this process's
              link client hands the stream to relay.Proxy;
              standalone = curl on the host → the same relay.Proxy on a TCP listener → upstream.
              CPU per GiB: seconds of CPU each process spent per GiB carried (2 cores shared).
`)
}

// kernel returns the running kernel's release.
func kernel() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}
