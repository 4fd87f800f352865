package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/api/bridge"
	"github.com/sandgate/sandgate/api/forward"
	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/api/service"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/localbox"
	"github.com/sandgate/sandgate/internal/cloudlog"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms"
)

// serveCommand builds `sandgate serve`: the appliance. Every setting is a
// flag and an environment variable of the same meaning (protocol 1's
// service configuration, and sandgate's own).
func serveCommand() *cli.Command {
	return &cli.Command{
		Name:  "serve",
		Usage: "serve sandboxes over HTTP: protocol 1 of ai-sdk-sandbox-cloud-run, and sandgate's /v1",
		Description: `With no configuration, on a Linux host as root: listens on 127.0.0.1:8080,
keeps snapshots and templates in ./.snapshots, runs sandboxes with
'sandgate sandbox' (state under /var/lib/sandgate) on an image of the
host's programs and libraries only, each in a user namespace where the
kernel allows. On Cloud Run (K_SERVICE set): listens on 0.0.0.0:$PORT, logs JSON,
drives Google's sandbox CLI, and needs SNAPSHOT_BUCKET.

A malformed or unknown value stops it at start, naming the variable. It
refuses to listen beyond loopback without a service token, unless on Cloud
Run (IAM in front) or with --allow-open.`,
		Flags: slices.Concat([]cli.Flag{
			&cli.StringFlag{Name: "host", Usage: "listen on `ADDR` (default 127.0.0.1; 0.0.0.0 on Cloud Run)", EnvVars: []string{"HOST"}},
			&cli.IntFlag{Name: "port", Value: 8080, Usage: "listen on `PORT`", EnvVars: []string{"PORT"}},
			&cli.StringFlag{Name: "token", Usage: "the service `TOKEN` every request must carry in X-Ai-Sdk-Sandbox-Token", EnvVars: []string{"SANDBOX_SERVICE_TOKEN"}},
			&cli.StringFlag{Name: "local-hostnames", Usage: "without a token, also answer requests for these host `NAMES` (comma-separated; a compose service's name), beside localhost and IP addresses", EnvVars: []string{"SANDGATE_LOCAL_HOSTNAMES"}},
			&cli.BoolFlag{Name: "allow-open", Usage: "listen beyond loopback without a token (loudly logged; never on an untrusted network)", EnvVars: []string{"SANDGATE_ALLOW_OPEN"}},
			&cli.StringFlag{Name: "log-format", Usage: "`FORMAT` json (JSON lines Cloud Logging reads) or text (default text; json on Cloud Run)", EnvVars: []string{"LOG_FORMAT"}},
			&cli.StringFlag{Name: "bucket", Usage: "Cloud Storage `BUCKET` for snapshots and templates (required on Cloud Run)", EnvVars: []string{"SNAPSHOT_BUCKET"}},
			&cli.StringFlag{Name: "snapshot-dir", Value: ".snapshots", Usage: "local store `DIR` when there is no bucket", EnvVars: []string{"SNAPSHOT_DIRECTORY"}},
			&cli.StringFlag{Name: "state-dir", Value: "/var/lib/sandgate", Usage: "`DIR` for the service's own state: sandboxes, templates, layers in transit", EnvVars: []string{"SANDGATE_STATE_DIR"}},
			&cli.StringFlag{Name: "sandbox-cli", Usage: "the sandbox `CLI` to drive (default: Google's at " + appliance.GoogleCLI + " when present, else this binary's 'sandbox')", EnvVars: []string{"SANDBOX_CLI"}},
			&cli.StringFlag{Name: "rootfs", Usage: "host `DIR` sandboxes see as /, all of it (sandgate sandbox; default: the host's programs and libraries and an /etc of the sandbox's own, nothing else of the host)", EnvVars: []string{"SANDGATE_ROOTFS"}},
			&cli.StringFlag{Name: "hide", Usage: "host `PATHS` no sandbox may see, comma-separated, beside those serve hides itself (its state and snapshot directories, audit log, CA and module files)", EnvVars: []string{"SANDGATE_HIDE"}},
			&cli.StringFlag{Name: "userns", Value: "auto", Usage: "run each sandbox in a user namespace: `MODE` auto (where the kernel allows), on (or refuse to start it), off (sandgate sandbox)", EnvVars: []string{"SANDGATE_USERNS"}},
			&cli.StringFlag{Name: "allowed-hosts", Usage: "`HOSTS` every sandbox may reach, comma-separated (* is every host)", EnvVars: []string{"SANDBOX_ALLOWED_HOSTS"}},
			&cli.StringFlag{Name: "base-urls", Usage: "`NAME=URL,...` base URL variables every sandbox gets (default ANTHROPIC_BASE_URL and OPENAI_BASE_URL; empty: none)", EnvVars: []string{"SANDBOX_BASE_URLS"}},
			&cli.StringFlag{Name: "image-id", Usage: "`ID` of the image, in the template namespace (default $K_REVISION, else local)", EnvVars: []string{"SANDBOX_IMAGE_ID"}},
			&cli.StringFlag{Name: "path", Value: agent.DefaultPath, Usage: "`PATH` of sandbox commands", EnvVars: []string{"SANDBOX_PATH"}},
			&cli.StringFlag{Name: "home", Value: "/home/agent", Usage: "a sandbox's home `DIR` ({sandbox} is its name)", EnvVars: []string{"SANDBOX_HOME"}},
			&cli.StringFlag{Name: "workdir", Value: "/workspace", Usage: "a sandbox's working `DIR` ({sandbox} is its name)", EnvVars: []string{"SANDBOX_WORKDIR"}},
			&cli.IntFlag{Name: "egress-port", Value: 3128, Usage: "`PORT` of the relay inside sandboxes (0: any free one)", EnvVars: []string{"SANDBOX_EGRESS_PORT"}},
			&cli.StringFlag{Name: "allow-private-network", Usage: "`true` makes private addresses reachable (tests; refused on Cloud Run)", EnvVars: []string{"SANDBOX_ALLOW_PRIVATE_NETWORK"}},
			&cli.StringFlag{Name: "allow-egress", Usage: "refused: sandgate never gives a sandbox a network of its own (`true` would)", EnvVars: []string{"SANDBOX_ALLOW_EGRESS"}},
			&cli.DurationFlag{Name: "idle-suspend", Value: appliance.DefaultIdleSuspend, Usage: "suspend a sandbox idle (no call, port connection or egress) for `DURATION`; 0 never", EnvVars: []string{"SANDGATE_IDLE_SUSPEND"}},
			&cli.DurationFlag{Name: "pty-grace", Value: appliance.DefaultTerminalGrace, Usage: "keep a terminal whose client went away running for `DURATION`, for the client to come back to; 0: hang it up at once", EnvVars: []string{"SANDGATE_PTY_GRACE"}},
			&cli.IntFlag{Name: "max-sandboxes", Usage: "run at most `N` sandboxes at once", DefaultText: "host memory over --sandbox-memory", EnvVars: []string{"SANDGATE_MAX_SANDBOXES"}},
			&cli.StringFlag{Name: "sandbox-memory", Value: appliance.DefaultMemoryLimit, Usage: "memory limit of each sandbox, `SIZE` (sandgate sandbox)", EnvVars: []string{"SANDGATE_SANDBOX_MEMORY"}},
			&cli.IntFlag{Name: "sandbox-pids", Value: appliance.DefaultPidsLimit, Usage: "process limit of each sandbox, `N` (sandgate sandbox)", EnvVars: []string{"SANDGATE_SANDBOX_PIDS"}},
			&cli.StringFlag{Name: "sandbox-cpu", Usage: "CPU limit of each sandbox: the `CORES`' worth of time its processes may use together, e.g. 1.5; 0 for none (sandgate sandbox)", DefaultText: "the host's cores less one", EnvVars: []string{"SANDGATE_SANDBOX_CPU"}},
			&cli.IntFlag{Name: "sandbox-cpu-weight", Value: appliance.DefaultCPUWeight, Usage: "CPU weight of each sandbox, `W` from 1 to 10000: its share of the cores when sandboxes contend for them (sandgate sandbox)", EnvVars: []string{"SANDGATE_SANDBOX_CPU_WEIGHT"}},
			&cli.IntFlag{Name: "sandboxes-cpu-weight", Value: appliance.DefaultSandboxesCPUWeight, Usage: "CPU weight `W` of all the sandboxes together against serve and the other processes beside them, 1 to 10000 (100: as much as one of them; sandgate sandbox)", EnvVars: []string{"SANDGATE_SANDBOXES_CPU_WEIGHT"}},
			&cli.StringFlag{Name: "sandbox-disk", Value: appliance.DefaultDiskLimit, Usage: "disk quota of each sandbox's writable layer, `SIZE` (sandgate sandbox: an ext4 image of its own, needing root, the loop driver and mke2fs); none to run without one", EnvVars: []string{"SANDGATE_SANDBOX_DISK"}},
			&cli.StringFlag{Name: "output-buffer", Value: "8m", Usage: "output of each process kept for resumable streams, `SIZE`", EnvVars: []string{"SANDGATE_OUTPUT_BUFFER"}},
			&cli.StringFlag{Name: "output-budget", Value: "64m", Usage: "output kept of all processes together, `SIZE`: past it the oldest finished process's goes first, then running ones keep an equal share each; 0 no bound", EnvVars: []string{"SANDGATE_OUTPUT_BUDGET"}},
			&cli.DurationFlag{Name: "sandbox-lifetime", Usage: "destroy a sandbox `DURATION` after its creation, running or suspended (a sandbox's own limits.lifetime overrides); 0 never", EnvVars: []string{"SANDGATE_SANDBOX_LIFETIME"}},
			&cli.DurationFlag{Name: "keep-suspended", Usage: "destroy a sandbox suspended for `DURATION` (its audit stays for --audit-retention; a sandbox's own limits.keepSuspended overrides); 0 forever", EnvVars: []string{"SANDGATE_KEEP_SUSPENDED"}},
			&cli.DurationFlag{Name: "shutdown-grace", Value: 9 * time.Second, Usage: "on SIGTERM/SIGINT, save every running sandbox within `DURATION` (Cloud Run gives 10s)", EnvVars: []string{"SANDGATE_SHUTDOWN_GRACE"}},
			&cli.StringFlag{Name: "audit-log", Value: "-", Usage: "write egress audit events as JSON lines to `FILE` (- for standard output)", EnvVars: []string{"SANDGATE_AUDIT_LOG"}},
			&cli.DurationFlag{Name: "audit-flush", Value: 10 * time.Second, Usage: "write a running sandbox's new audit events to the store every `DURATION` (what a crash can lose of them)", EnvVars: []string{"SANDGATE_AUDIT_FLUSH"}},
			&cli.DurationFlag{Name: "audit-retention", Value: appliance.DefaultAuditRetention, Usage: "keep a sandbox's audit in the store for `DURATION` (a destroy removes it at once); 0 forever", EnvVars: []string{"SANDGATE_AUDIT_RETENTION"}},
			&cli.StringSliceFlag{Name: "upstream-ca", Usage: "also trust the PEM certificates in `FILE` for upstreams (tests, private CAs); repeatable", EnvVars: []string{"SANDGATE_UPSTREAM_CA"}},
			&cli.StringFlag{Name: "seal-key", Usage: "key `MATERIAL` (32 bytes or more) that seals, in each sandbox's record, the credentials its rules have held, so that they stay scrubbed when it resumes; the same on every shard over one store (default: derived from SANDBOX_SERVICE_TOKEN when it is set, else a key kept in the state directory)", EnvVars: []string{"SANDGATE_SEAL_KEY"}},
			&cli.StringFlag{Name: "intercept-ca", Usage: "the interception CA (hosts a policy's \"intercept\" names): `DIR` to keep it in (ca.pem, ca-key.pem 0600; made if absent), off for none (default: made at start, in memory only)", EnvVars: []string{"SANDGATE_INTERCEPT_CA"}},
			&cli.BoolFlag{Name: "console", Value: true, Usage: "serve the web console at /ui, under the API's auth (--console=false: none)", EnvVars: []string{"SANDGATE_CONSOLE"}},
			&cli.BoolFlag{Name: "capture", Value: true, Usage: "capture, in each sandbox, the connections of processes that ignore the proxy variables, and judge them as CONNECT (sandgate sandbox, as root; --capture=false: their lookups fail at once, audited)", EnvVars: []string{"SANDGATE_CAPTURE"}},
			&cli.StringFlag{Name: "bridge-key", Usage: "the `KEY` the Cloudflare sandbox bridge's routes (/v1/sandbox, /v1/pool) need as Authorization: Bearer; unset, they refuse every request", EnvVars: []string{"SANDBOX_API_KEY"}},
			&cli.StringFlag{Name: "bridge-allowed-hosts", Usage: "`HOSTS` the sandboxes the bridge starts may reach, beside --allowed-hosts (comma-separated)", EnvVars: []string{"SANDGATE_BRIDGE_ALLOWED_HOSTS"}},
			&cli.StringFlag{Name: "bridge-base-urls", Usage: "`NAME=URL,...` base URL variables the sandboxes the bridge starts get, over --base-urls", EnvVars: []string{"SANDGATE_BRIDGE_BASE_URLS"}},
			&cli.StringFlag{Name: "bridge-max-body", Value: "1g", Usage: "largest file write or hydrate tar the bridge takes, `SIZE`", EnvVars: []string{"SANDGATE_BRIDGE_MAX_BODY"}},
			&cli.GenericFlag{Name: "transform-module", Value: &moduleSpecs{}, Usage: "apply the WebAssembly module in `FILE[?CONFIG]` to every sandbox's base-URL routes, before its own modules and the credential swap; repeatable"},
		}, auditLogFlags(), shardFlags(), dnsFlags(), wasmRuntimeFlags()),
		OnUsageError: usageError,
		Action:       runServe,
	}
}

// serveVersion is the version /health reports.
func serveVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

// serveConfig is serve's configuration, checked.
type serveConfig struct {
	cloudRun     bool
	addr         string
	allowedHosts []string
	baseURLs     map[string]string
	imageID      string
	allowPrivate []netip.Prefix
	outputBytes  int64
	outputBudget int64
	limits       appliance.Limits // the service's defaults: cpu, weight, disk, lifetime and keep-suspended
	memory       string
	// cpu and cpuWeight are every sandbox's default CPU limit (negative:
	// none; 0: the manager's default) and weight.
	cpu       float64
	cpuWeight int
	disk      int64 // each sandbox's default disk quota; 0: none (the operator opted out)
	// The Cloudflare bridge's sandboxes' network, and its size limit.
	bridgeHosts    []string
	bridgeBaseURLs map[string]string
	bridgeMaxBody  int64
}

// parseBaseURLs reads NAME=URL,... of variable name; empty is none.
func parseBaseURLs(name, value string) (map[string]string, error) {
	out := map[string]string{}
	for _, e := range strings.Split(value, ",") {
		if e = strings.TrimSpace(e); e == "" {
			continue
		}
		k, v, ok := strings.Cut(e, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, badInput("%s entry %q: want NAME=URL", name, e)
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if err := agent.CheckBaseURL(k, v); err != nil {
			return nil, badInput("%s entry %s: %v", name, k, err)
		}
		out[k] = v
	}
	return out, nil
}

// checkServe reads and checks serve's settings; a bad one is the
// caller's mistake, named by its variable.
func checkServe(c *cli.Context) (*serveConfig, error) {
	sc := &serveConfig{cloudRun: os.Getenv("K_SERVICE") != ""}
	var err error
	if c.Int("port") < 0 || c.Int("port") > 65535 {
		return nil, badInput("PORT (--port) %d: want 0 to 65535", c.Int("port"))
	}
	host := c.String("host")
	if host == "" {
		host = "127.0.0.1"
		if sc.cloudRun {
			host = "0.0.0.0"
		}
	}
	sc.addr = net.JoinHostPort(host, fmt.Sprint(c.Int("port")))
	if v := c.String("allow-egress"); v != "" && v != "false" {
		return nil, badInput("SANDBOX_ALLOW_EGRESS=%q: sandgate never gives a sandbox a network of its own; every byte leaves through its egress proxy. Unset it, and allow hosts with SANDBOX_ALLOWED_HOSTS", v)
	}
	switch v := c.String("allow-private-network"); v {
	case "", "false":
	case "true":
		if sc.cloudRun {
			return nil, badInput("SANDBOX_ALLOW_PRIVATE_NETWORK=true is refused on Cloud Run: it would open the metadata server (and its token) to sandboxes")
		}
		sc.allowPrivate = []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")}
	default:
		return nil, badInput("SANDBOX_ALLOW_PRIVATE_NETWORK=%q: want true, or leave it unset", v)
	}
	private, err := netpolicy.ParseCIDRs("SANDBOX_ALLOW_PRIVATE (--allow-private)", splitAll(c.StringSlice("allow-private")))
	if err != nil {
		return nil, badInput("%v", err)
	}
	if len(private) > 0 && sc.cloudRun {
		return nil, badInput("SANDBOX_ALLOW_PRIVATE is refused on Cloud Run: it would open private addresses, the metadata server's among them, to sandboxes")
	}
	sc.allowPrivate = append(sc.allowPrivate, private...)
	if sc.cloudRun && c.String("bucket") == "" {
		return nil, badInput("SNAPSHOT_BUCKET is required on Cloud Run: an instance's disk goes with the instance, and with it every snapshot; name a bucket the service account may write (roles/storage.objectUser)")
	}
	for _, h := range strings.Split(c.String("allowed-hosts"), ",") {
		if h = strings.TrimSpace(h); h != "" {
			sc.allowedHosts = append(sc.allowedHosts, h)
		}
	}
	sc.baseURLs = agent.DefaultBaseURLs()
	if c.IsSet("base-urls") {
		if sc.baseURLs, err = parseBaseURLs("SANDBOX_BASE_URLS", c.String("base-urls")); err != nil {
			return nil, err
		}
	}
	sc.bridgeHosts = splitAll([]string{c.String("bridge-allowed-hosts")})
	for _, h := range sc.bridgeHosts {
		if _, aerr := netip.ParseAddr(strings.Trim(h, "[]")); h != "*" && aerr != nil {
			if _, err := netpolicy.ParseHostRule(h); err != nil {
				return nil, badInput("SANDGATE_BRIDGE_ALLOWED_HOSTS (--bridge-allowed-hosts) %q: %v", h, err)
			}
		}
	}
	if sc.bridgeBaseURLs, err = parseBaseURLs("SANDGATE_BRIDGE_BASE_URLS", c.String("bridge-base-urls")); err != nil {
		return nil, err
	}
	if sc.bridgeMaxBody, err = localbox.ParseSize(c.String("bridge-max-body")); err != nil || sc.bridgeMaxBody <= 0 {
		return nil, badInput("SANDGATE_BRIDGE_MAX_BODY (--bridge-max-body) %q: want a size such as 1g", c.String("bridge-max-body"))
	}
	if k := c.String("bridge-key"); k != "" && (len(k) < bridge.MinKeyLength || strings.TrimSpace(k) != k) {
		return nil, badInput("SANDBOX_API_KEY (--bridge-key): want %d characters or more, without white space at its ends (a random one: openssl rand -hex 32)", bridge.MinKeyLength)
	}
	sc.imageID = c.String("image-id")
	if sc.imageID == "" {
		sc.imageID = os.Getenv("K_REVISION")
	}
	if sc.imageID == "" {
		sc.imageID = "local"
	}
	if sc.outputBytes, err = localbox.ParseSize(c.String("output-buffer")); err != nil {
		return nil, badInput("SANDGATE_OUTPUT_BUFFER (--output-buffer): %v", err)
	}
	if sc.outputBudget, err = localbox.ParseSize(c.String("output-budget")); err != nil {
		return nil, badInput("SANDGATE_OUTPUT_BUDGET (--output-budget): %v", err)
	}
	if sc.outputBudget == 0 {
		sc.outputBudget = -1 // no bound
	}
	sc.limits = appliance.Limits{Lifetime: c.Duration("sandbox-lifetime"), KeepSuspended: c.Duration("keep-suspended")}
	if err := sc.limits.Check(); err != nil {
		return nil, badInput("SANDGATE_SANDBOX_LIFETIME (--sandbox-lifetime), SANDGATE_KEEP_SUSPENDED (--keep-suspended): %v", err)
	}
	if _, err := localbox.ParseSize(c.String("sandbox-memory")); err != nil {
		return nil, badInput("SANDGATE_SANDBOX_MEMORY (--sandbox-memory): %v", err)
	}
	sc.memory = c.String("sandbox-memory")
	if v := c.String("sandbox-cpu"); v != "" {
		cpu, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || math.IsNaN(cpu) || math.IsInf(cpu, 0) || cpu < 0 || (cpu > 0 && cpu < appliance.MinCPU) {
			return nil, badInput("SANDGATE_SANDBOX_CPU (--sandbox-cpu) %q: give the cores' worth of time each sandbox may use, at least %v (e.g. 1.5), or 0 for no limit", v, appliance.MinCPU)
		}
		if sc.cpu = cpu; cpu == 0 {
			sc.cpu = -1 // none
		}
	}
	if sc.cpuWeight = c.Int("sandbox-cpu-weight"); sc.cpuWeight < 1 || sc.cpuWeight > appliance.MaxCPUWeight {
		return nil, badInput("SANDGATE_SANDBOX_CPU_WEIGHT (--sandbox-cpu-weight) %d: give 1 to %d (%d is an equal share)", sc.cpuWeight, appliance.MaxCPUWeight, appliance.DefaultCPUWeight)
	}
	sc.limits.CPU, sc.limits.CPUWeight = sc.cpu, sc.cpuWeight
	if w := c.Int("sandboxes-cpu-weight"); w < 1 || w > appliance.MaxCPUWeight {
		return nil, badInput("SANDGATE_SANDBOXES_CPU_WEIGHT (--sandboxes-cpu-weight) %d: give 1 to %d (%d weighs as much as one process beside them)", w, appliance.MaxCPUWeight, appliance.DefaultCPUWeight)
	}
	if v := c.String("sandbox-disk"); v != "none" {
		if sc.disk, err = localbox.ParseSize(v); err != nil || sc.disk < appliance.MinDisk {
			return nil, badInput("SANDGATE_SANDBOX_DISK (--sandbox-disk) %q: want a size of at least %dm such as 10g, or none to run sandboxes without a disk quota", v, appliance.MinDisk>>20)
		}
	}
	sc.limits.Disk = sc.disk
	if c.Int("egress-port") < 0 || c.Int("egress-port") > 65535 {
		return nil, badInput("SANDBOX_EGRESS_PORT %d: want 0 to 65535", c.Int("egress-port"))
	}
	switch v := c.String("userns"); v {
	case "auto", "on", "off":
	default:
		return nil, badInput("SANDGATE_USERNS (--userns) %q: want auto, on or off", v)
	}
	if c.Duration("audit-flush") <= 0 {
		return nil, badInput("SANDGATE_AUDIT_FLUSH (--audit-flush): want a positive duration such as 10s")
	}
	if c.Duration("audit-retention") < 0 {
		return nil, badInput("SANDGATE_AUDIT_RETENTION (--audit-retention): want a duration such as 720h, or 0 to keep it forever")
	}
	if c.Duration("shutdown-grace") <= 0 {
		return nil, badInput("SANDGATE_SHUTDOWN_GRACE: want a positive duration such as 9s")
	}
	return sc, nil
}

func runServe(c *cli.Context) error {
	if c.NArg() > 0 {
		return badInput("serve takes no arguments, got %q", c.Args().First())
	}
	sc, err := checkServe(c)
	if err != nil {
		return err
	}
	logger := cloudlog.NewText(c.App.ErrWriter, slog.LevelInfo)
	if f := c.String("log-format"); f == "json" || (f == "" && sc.cloudRun) {
		logger = cloudlog.New(c.App.ErrWriter, slog.LevelInfo)
	}
	ln, err := net.Listen("tcp", sc.addr)
	if err != nil {
		return badInput("HOST/PORT: %v", err)
	}
	defer ln.Close()
	loopback := false
	if ap, err := netip.ParseAddrPort(ln.Addr().String()); err == nil {
		loopback = ap.Addr().IsLoopback()
	}
	switch {
	case loopback || c.String("token") != "":
	case sc.cloudRun && c.String("bridge-key") != "":
		logger.Warn("SANDBOX_API_KEY without SANDBOX_SERVICE_TOKEN on Cloud Run: bridge clients send the key in Authorization, where IAM's invoker check wants its identity token; if that check is off for them, protocol 1's routes are open: set SANDBOX_SERVICE_TOKEN too")
	case sc.cloudRun:
		logger.Info("no service token: relying on Cloud Run's IAM (roles/run.invoker) in front")
	case c.Bool("allow-open"):
		logger.Error("LISTENING BEYOND LOOPBACK WITHOUT A SERVICE TOKEN (--allow-open): anyone who reaches " + ln.Addr().String() + " runs commands in your sandboxes")
	case c.String("bridge-key") != "":
		return badInput("refusing to listen on %s without a service token: SANDBOX_API_KEY locks the Cloudflare bridge's routes only, and protocol 1's would be open; set SANDBOX_SERVICE_TOKEN too, listen on loopback (HOST=127.0.0.1), or pass --allow-open on a network you trust", ln.Addr())
	default:
		return badInput("refusing to listen on %s without a service token: set SANDBOX_SERVICE_TOKEN, listen on loopback (HOST=127.0.0.1), or pass --allow-open on a network you trust", ln.Addr())
	}

	auditOut, closeAudit, err := openAuditLog(c, c.App.Writer)
	if err != nil {
		return badInput("%v", err)
	}
	defer closeAudit()
	roots, err := upstreamRoots(c.StringSlice("upstream-ca"))
	if err != nil {
		return badInput("SANDGATE_UPSTREAM_CA (--upstream-ca): %v", err)
	}
	state, err := filepath.Abs(c.String("state-dir"))
	if err != nil {
		return badInput("SANDGATE_STATE_DIR (--state-dir): %v", err)
	}
	unlock, lockName, err := lockStateDir(state)
	if err != nil {
		return badInput("SANDGATE_STATE_DIR (--state-dir): %v", err)
	}
	defer unlock()
	lc := appliance.LauncherConfig{
		CLI: c.String("sandbox-cli"), StateDir: filepath.Join(state, "sandboxes"),
		Memory: sc.memory, Pids: c.Int("sandbox-pids"), SandboxesCPUWeight: c.Int("sandboxes-cpu-weight"), Rootfs: c.String("rootfs"),
		Hide: hiddenPaths(c, state), PrivateDir: state, UserNS: userNSMode(c.String("userns")),
		Capture: c.Bool("capture"),
	}
	ica, err := interceptCA(c.String("intercept-ca"))
	if err != nil {
		return badInput("SANDGATE_INTERCEPT_CA (--intercept-ca): %v", err)
	}
	if !lc.Google() {
		// An image that shows the service's state cannot be run: say so
		// now, not at the first create.
		if err := os.MkdirAll(state, 0o700); err != nil {
			return badInput("SANDGATE_STATE_DIR (--state-dir) %s: %v", state, err)
		}
		if err := localbox.CheckImage(lc.Rootfs, lc.Hide); err != nil {
			return badInput("SANDGATE_ROOTFS (--rootfs) %q: %v", lc.Rootfs, err)
		}
		if err := checkDiskQuota(c, lc.StateDir, sc.disk, logger); err != nil {
			return err
		}
	} else if sc.disk > 0 {
		logger.Info("SANDGATE_SANDBOX_DISK does not apply to Google's sandbox CLI, which has no disk quota per sandbox: what a sandbox writes counts against the instance's memory")
	}
	rt, modules, err := loadWasm(c, logger, true)
	if err != nil {
		return err
	}
	defer closeWasm(rt, modules)

	ctx := c.Context
	var st store.Store
	if b := c.String("bucket"); b != "" {
		if st, err = store.OpenGCS(ctx, b, ""); err != nil {
			return fmt.Errorf("SNAPSHOT_BUCKET %s: %w", b, err)
		}
	} else {
		d, err := store.NewDir(c.String("snapshot-dir"))
		if err != nil {
			return badInput("SNAPSHOT_DIRECTORY %s: %v", c.String("snapshot-dir"), err)
		}
		st = d
	}
	idle := c.Duration("idle-suspend")
	if idle == 0 {
		idle = -1
	}
	shard, err := shardConfig(c, sc.cloudRun, logger)
	if err != nil {
		return err
	}
	shard.Lock = lockName // a restart after a crash need not wait for the dead process's heartbeat
	peers, err := forward.ParsePeers(splitAll([]string{c.String("shard-peers")}))
	if err != nil {
		return badInput("SANDGATE_SHARD_PEERS (--shard-peers) %v", err)
	}
	checkpoints := c.Duration("checkpoint-interval")
	if checkpoints == 0 {
		checkpoints = -1
	}
	ptyGrace := c.Duration("pty-grace")
	if ptyGrace <= 0 {
		ptyGrace = -1
	}
	sealKey, sealFrom, err := sealKeyMaterial(c)
	if err != nil {
		return err
	}
	svc, err := service.New(ctx, service.Config{
		DNSServers: splitAll(c.StringSlice("dns")), AllowPrivate: sc.allowPrivate, UpstreamRoots: roots, InterceptCA: ica,
		AuditLog: auditOut, AuditFlush: c.Duration("audit-flush"), Modules: rt, ServiceModules: modules, Store: st, Launcher: lc, Logger: logger,
		Manager: appliance.ManagerConfig{
			ImageID: sc.imageID, Version: serveVersion(), WorkDir: filepath.Join(state, "work"), AuditRetention: auditRetention(c.Duration("audit-retention")),
			MaxRunning: c.Int("max-sandboxes"), IdleSuspend: idle,
			AllowedHosts: sc.allowedHosts, BaseURLs: sc.baseURLs, OutputBytes: int(sc.outputBytes),
			OutputBudget: sc.outputBudget, Limits: sc.limits,
			Shard: shard, CheckpointInterval: checkpoints, TerminalGrace: ptyGrace, SealKey: sealKey,
		},
		Peers: peers, PeerAuth: peerAuth(sc.cloudRun, logger), NoConsole: !c.Bool("console"),
		Server: server.Config{
			Token: c.String("token"), LocalOnly: loopback && c.String("token") == "", LocalHosts: splitAll([]string{c.String("local-hostnames")}),
			Version: serveVersion(), Home: c.String("home"), WorkDir: c.String("workdir"), Path: c.String("path"),
			EgressPort: c.Int("egress-port"), MaxModuleBytes: int64(rt.Config().MaxModuleBytes), TempDir: filepath.Join(state, "work"),
		},
		Bridge: bridge.Config{
			Key: c.String("bridge-key"), MaxBody: sc.bridgeMaxBody,
			Network: appliance.NetworkSpec{AllowedHosts: sc.bridgeHosts, BaseURLs: sc.bridgeBaseURLs},
		},
	})
	if errors.Is(err, appliance.ErrBadInput) {
		return badInput("%v", err)
	}
	if err != nil {
		return err
	}
	// The store's clean-up runs only once the service stands (a start
	// that failed closed the store under it: "openat .: file already
	// closed"), and ends before the service stops.
	cleaned := make(chan struct{})
	cctx, stopCleaning := context.WithCancel(ctx)
	if d, ok := st.(*store.Dir); ok {
		go func() { defer close(cleaned); removeStaleUploads(cctx, d, logger) }()
	} else {
		close(cleaned)
	}
	shutdown := func(sctx context.Context) service.ShutdownResult {
		stopCleaning()
		<-cleaned
		return svc.Shutdown(sctx)
	}
	served := make(chan error, 1)
	go func() { served <- svc.Serve(ln) }()
	shardID, shardURL := svc.Manager.Shard()
	logger.Info("sandgate serving", "addr", ln.Addr().String(), "cli", svc.Launcher.String(), "store", storeName(c), "image_id", sc.imageID,
		"template_namespace", svc.Manager.Namespace(), "cloud_run", sc.cloudRun, "token", c.String("token") != "",
		"shard", shardID, "shard_url", shardURL, "shard_peers", peers.String(), "cloudflare_bridge", c.String("bridge-key") != "", "seal_key", sealFrom)
	if svc.Console != nil {
		logger.Info("the web console is served at /ui, under the API's auth (README: Console)", "url", "http://"+ln.Addr().String()+"/ui")
	}

	select {
	case err := <-served:
		shutdown(context.Background())
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	grace := c.Duration("shutdown-grace")
	logger.Info("stopping: refusing new requests and saving every running sandbox", "grace", grace.String())
	gctx, cancel := context.WithTimeoutCause(context.Background(), grace, errors.New("shutdown grace period over"))
	defer cancel()
	res := shutdown(gctx)
	if len(res.Failed) == 0 {
		logger.Info(fmt.Sprintf("saved %d sandboxes", len(res.Saved)), "saved", res.Saved)
	}
	if res.EgressCut {
		logger.Warn("egress connections still open at the end of the grace period were cut")
	}
	if res.RequestsCut {
		logger.Warn("requests still open at the end of the grace period were cut")
	}
	if res.AuditLost != nil {
		logger.Warn("audit events could not all be written to the store (they are in the audit log)", "err", res.AuditLost)
	}
	logger.Info("stopped")
	return nil
}

// auditRetention is the manager's AuditRetention for the flag's value: 0
// (forever) is negative there.
func auditRetention(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// hiddenPaths are the host paths no sandbox may see: serve's state
// directory (sandboxes' layers, layers in transit), a local snapshot
// store, the files serve reads its configuration from or writes its
// audit to, and what SANDGATE_HIDE names.
func hiddenPaths(c *cli.Context, state string) []string {
	out := []string{state}
	add := func(p string) {
		if p == "" || p == "-" {
			return
		}
		if abs, err := filepath.Abs(p); err == nil && !slices.Contains(out, abs) {
			out = append(out, abs)
		}
	}
	if c.String("bucket") == "" {
		add(c.String("snapshot-dir"))
	}
	add(c.String("audit-log"))
	if d := c.String("intercept-ca"); d != "off" {
		add(d)
	}
	for _, f := range c.StringSlice("upstream-ca") {
		add(f)
	}
	for _, spec := range *c.Generic("transform-module").(*moduleSpecs) {
		if path, _, err := parseModuleSpec(spec); err == nil {
			add(path)
		}
	}
	for _, p := range splitAll([]string{c.String("hide")}) {
		add(p)
	}
	return out
}

// sealKeyMaterial is the material of the seal key of held credentials
// (appliance.ManagerConfig.SealKey), and where it came from, for the log:
// SANDGATE_SEAL_KEY, else the service token (which every shard has; after
// it changes, the old token is the seal key), else none (the manager keeps
// a key in the state directory: shards over one store need
// SANDGATE_SEAL_KEY).
func sealKeyMaterial(c *cli.Context) ([]byte, string, error) {
	if k := c.String("seal-key"); k != "" {
		if len(k) < 32 {
			return nil, "", badInput("SANDGATE_SEAL_KEY (--seal-key) is %d bytes: give at least 32 (e.g. openssl rand -base64 32), the same on every shard", len(k))
		}
		return []byte(k), "SANDGATE_SEAL_KEY", nil
	}
	if t := c.String("token"); len(t) >= transforms.MinSealKeyMaterial {
		return []byte(t), "SANDBOX_SERVICE_TOKEN", nil
	}
	return nil, "state directory", nil
}

// interceptCA is the interception CA of --intercept-ca: made in memory
// (""), none ("off"), or kept in a directory.
func interceptCA(v string) (*ca.Authority, error) {
	switch v {
	case "off":
		return nil, nil
	case "":
		return ca.New()
	}
	return ca.Open(v)
}

func storeName(c *cli.Context) string {
	if b := c.String("bucket"); b != "" {
		return "gs://" + b
	}
	abs, _ := filepath.Abs(c.String("snapshot-dir"))
	return abs
}

// staleUploadAge is how long a directory store's temporary file of an
// unfinished put must have gone unwritten before serve removes it.
const staleUploadAge = time.Hour

// removeStaleUploads removes, once at startup, what puts interrupted by a
// crash left in the directory store (whole layers, possibly), and says so.
func removeStaleUploads(ctx context.Context, d *store.Dir, logger *slog.Logger) {
	files, size, err := d.RemoveStale(ctx, staleUploadAge)
	if err != nil && ctx.Err() == nil {
		logger.Warn("could not clean the snapshot directory of unfinished uploads", "err", err, "removed", files)
		return
	}
	if files > 0 {
		logger.Info("removed unfinished uploads left in the snapshot directory by an earlier crash", "files", files, "bytes", size)
	}
}

// checkDiskQuota makes sure, at start, that the default disk quota of
// sandboxes can be applied on this host (`sandgate sandbox` in stateDir),
// so that no sandbox runs without one unless the operator said so
// (SANDGATE_SANDBOX_DISK=none, size 0), which is logged.
func checkDiskQuota(c *cli.Context, stateDir string, size int64, logger *slog.Logger) error {
	if size == 0 {
		logger.Warn("sandboxes run without a disk quota (SANDGATE_SANDBOX_DISK=none): one can fill the file system holding " + stateDir)
		return nil
	}
	rt, err := localbox.NewRuntime(stateDir)
	if err == nil {
		err = rt.CheckDisk(c.Context, size)
	}
	switch {
	case errors.Is(err, localbox.ErrNoDiskQuota):
		return fmt.Errorf("SANDGATE_SANDBOX_DISK (--sandbox-disk) %s: each sandbox's disk quota cannot be applied on this host: %w; run serve as root on a host with the loop driver (modprobe loop) and mke2fs (apt-get install e2fsprogs), or set SANDGATE_SANDBOX_DISK=none to run sandboxes without one (a sandbox can then fill the file system holding %s)", localbox.FormatSize(size), err, stateDir)
	case errors.Is(err, localbox.ErrBadInput):
		return badInput("SANDGATE_SANDBOX_DISK (--sandbox-disk) %s: %v", localbox.FormatSize(size), err)
	case err != nil:
		return fmt.Errorf("SANDGATE_SANDBOX_DISK (--sandbox-disk) %s: %w", localbox.FormatSize(size), err)
	}
	return nil
}
