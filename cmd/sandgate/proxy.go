package main

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/localbox"
	"github.com/sandgate/sandgate/internal/cloudlog"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/relay/ca"
	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms"
	"github.com/sandgate/sandgate/transforms/wasm"
)

func proxyCommand() *cli.Command {
	return &cli.Command{
		Name:  "proxy",
		Usage: "run the egress proxy standalone (CONNECT to :443 and base-URL routes)",
		Description: `Serves HTTP proxy connections on --listen as one sandbox (--sandbox-id):
CONNECT host:443 tunnels, and base-URL routes http://LISTEN/https/<host>/<path>
forwarded over HTTPS with the --transformations applied. Every decision is
one audit event on --audit-log; with --audit-store, also kept in a store as
serve keeps a sandbox's (segments of zstd JSON lines under
audit/<sandbox-id>/, written every --audit-flush and at exit).`,
		// Where it listens, what it allows, what it rewrites, where it
		// reports, how it stops, then the tuning of transform modules.
		Flags: slices.Concat(
			[]cli.Flag{&cli.StringFlag{Name: "listen", Value: "127.0.0.1:3128", Usage: "serve the proxy on `ADDR`", EnvVars: []string{"SANDGATE_PROXY_LISTEN"}}},
			egressFlags(),
			[]cli.Flag{
				&cli.StringFlag{Name: "transformations", Usage: "request-transformation rules `FILE` (JSON list; header values may be {\"env\":\"NAME\"})", EnvVars: []string{"SANDBOX_TRANSFORMATIONS_FILE"}},
				&cli.GenericFlag{Name: "transform-module", Value: &moduleSpecs{}, Usage: "apply the WebAssembly (http-wasm) module in `FILE[?CONFIG]` to base-URL routes, before the secret swap; repeatable, applied in order; CONFIG is the module's config, or @PATH to read it from a file"},
				&cli.StringSliceFlag{Name: "upstream-ca", Usage: "also trust the PEM certificates in `FILE` for upstreams (tests, private CAs); repeatable", EnvVars: []string{"SANDGATE_UPSTREAM_CA"}},
				&cli.StringFlag{Name: "intercept-ca", Usage: "the interception CA, kept in `DIR` (ca.pem, which clients must trust, and ca-key.pem, 0600; made if absent): needed when the policy's \"intercept\" names hosts", EnvVars: []string{"SANDGATE_INTERCEPT_CA"}},
				&cli.StringFlag{Name: "audit-log", Value: "-", Usage: "write audit events as JSON lines to `FILE` (- for standard output)", EnvVars: []string{"SANDGATE_AUDIT_LOG"}},
				&cli.StringFlag{Name: "audit-store", Usage: "also keep the audit in the store at `LOCATION` (a directory, file:///dir or gs://bucket/prefix), as serve does", EnvVars: []string{"SANDGATE_AUDIT_STORE"}},
				&cli.DurationFlag{Name: "audit-flush", Value: 10 * time.Second, Usage: "with --audit-store, write new events every `DURATION`", EnvVars: []string{"SANDGATE_AUDIT_FLUSH"}},
				&cli.StringFlag{Name: "metrics-listen", Usage: "serve Prometheus /metrics on `ADDR` (off when empty)", EnvVars: []string{"SANDGATE_METRICS_LISTEN"}},
				&cli.StringFlag{Name: "sandbox-id", Value: "standalone", Usage: "the sandbox `ID` this proxy's connections are served and audited as"},
				&cli.DurationFlag{Name: "shutdown-grace", Value: 10 * time.Second, Usage: "on SIGTERM/SIGINT, let requests and tunnels in progress finish for up to `DURATION` before cutting them", EnvVars: []string{"SANDGATE_SHUTDOWN_GRACE"}},
			},
			auditLogFlags(),
			wasmRuntimeFlags(),
		),

		OnUsageError: usageError,
		Action:       runProxy,
	}
}

func runProxy(c *cli.Context) error {
	if c.NArg() > 0 {
		return badInput("proxy takes no arguments, got %q", c.Args().First())
	}
	logger := cloudlog.New(c.App.ErrWriter, slog.LevelInfo)
	eg, err := newEgress(c, logger)
	if err != nil {
		return err
	}
	defer eg.Close()

	rules := transforms.NewRuleSet()
	if f := c.String("transformations"); f != "" {
		list, err := transforms.LoadRulesFile(f, os.LookupEnv)
		if err != nil {
			return badInput("--transformations: %v", err)
		}
		rules.Set(list...)
	}
	auditOut, closeAudit, err := openAuditLog(c, c.App.Writer)
	if err != nil {
		return badInput("%v", err)
	}
	defer closeAudit()
	var ica *ca.Authority
	switch dir := c.String("intercept-ca"); {
	case dir != "":
		if ica, err = ca.Open(dir); err != nil {
			return badInput("--intercept-ca: %v", err)
		}
		logger.Info("interception CA: clients must trust its certificate", "cert", filepath.Join(dir, ca.CertFile), "fingerprint", ica.Fingerprint())
	case len(eg.policy.Intercept) > 0:
		return badInput(`the policy's "intercept" names hosts, and the proxy has no CA to intercept them with: give --intercept-ca DIR (made if absent; its ca.pem is what clients must trust)`)
	}
	var journals *audit.Journals
	if loc := c.String("audit-store"); loc != "" {
		if c.Duration("audit-flush") <= 0 {
			return badInput("--audit-flush: want a positive duration such as 10s")
		}
		st, err := store.Open(c.Context, loc)
		if err != nil {
			return badInput("--audit-store: %v", err)
		}
		defer st.Close()
		if journals, err = audit.NewJournals(audit.JournalsConfig{Writer: appliance.NewAuditStore(st), Log: audit.NewJSONLines(auditOut),
			FlushEvery: c.Duration("audit-flush"), Logger: logger}); err != nil {
			return err
		}
		journals.Open(c.String("sandbox-id"))
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := journals.Close(ctx); err != nil {
				logger.Warn("the audit could not all be written to the store (it is in the audit log)", "err", err)
			}
		}()
	}
	pp, err := buildProxy(c, logger, eg, auditOut, journals, false, ica)
	if err != nil {
		return err
	}
	defer pp.Close()
	p, modules, reg := pp.proxy, pp.modules, pp.reg

	ln, err := net.Listen("tcp", c.String("listen"))
	if err != nil {
		return badInput("--listen: %v", err)
	}
	ctx, cancel := context.WithCancelCause(c.Context)
	defer cancel(errors.New("proxy stopped"))
	if addr := c.String("metrics-listen"); addr != "" {
		mln, err := net.Listen("tcp", addr)
		if err != nil {
			ln.Close()
			return badInput("--metrics-listen: %v", err)
		}
		go serveMetrics(ctx, mln, reg, logger)
		logger.Info("metrics listening", "addr", mln.Addr().String())
	}
	tenant := relay.NewTenant(c.String("sandbox-id"), eg.policy, rules)
	defer tenant.Close()
	logger.Info("proxy listening", "addr", ln.Addr().String(), "sandbox", tenant.ID(),
		"service_hosts", len(eg.decider.ServiceHosts), "transformations", rules.Len(), "transform_modules", modules.Len())
	served := make(chan error, 1)
	go func() { served <- p.Serve(c.Context, ln, tenant) }()
	select {
	case err := <-served:
		return err
	case <-c.Context.Done():
	}
	grace := c.Duration("shutdown-grace")
	logger.Info("proxy stopping: refusing new connections, letting those in progress finish", "grace", grace.String())
	sctx, cancelGrace := context.WithTimeoutCause(context.Background(), grace, errors.New("grace period over"))
	defer cancelGrace()
	if err := p.Shutdown(sctx); err != nil {
		logger.Warn("grace period over: cut the connections still open", "grace", grace.String())
	}
	<-served
	logger.Info("proxy stopped")
	return nil
}

// proxyParts is the egress proxy as `proxy` and `serve` build it, with
// what it was built from.
type proxyParts struct {
	proxy   *relay.Proxy
	reg     *prometheus.Registry
	runtime *wasm.Runtime
	modules *wasm.Chain // the service-wide modules (--transform-module)
	closers []func()
}

// Close cuts the proxy, then releases its modules and runtime.
func (pp *proxyParts) Close() {
	if pp.proxy != nil {
		pp.proxy.Close()
	}
	for i := len(pp.closers) - 1; i >= 0; i-- {
		pp.closers[i]()
	}
}

// buildProxy builds the standalone egress proxy from its flags
// (--upstream-ca, --transform-module and the --wasm-* ones): audit events
// as JSON lines to auditOut, or through journals (which write them there
// too) when given, and counted in a Prometheus registry. withRuntime
// makes a WebAssembly runtime even without service-wide modules. ica, when
// set, is the interception CA.
func buildProxy(c *cli.Context, logger *slog.Logger, eg *egress, auditOut io.Writer, journals *audit.Journals, withRuntime bool, ica *ca.Authority) (_ *proxyParts, err error) {
	pp := &proxyParts{}
	defer func() {
		if err != nil {
			pp.Close()
		}
	}()
	roots, err := upstreamRoots(c.StringSlice("upstream-ca"))
	if err != nil {
		return nil, badInput("--upstream-ca: %v", err)
	}
	if pp.runtime, pp.modules, err = loadWasm(c, logger, withRuntime); err != nil {
		return nil, err
	}
	pp.closers = append(pp.closers, func() { closeWasm(pp.runtime, pp.modules) })
	pp.reg = prometheus.NewRegistry()
	pp.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := audit.NewMetrics(pp.reg)
	sinks := audit.Multi{audit.NewJSONLines(auditOut), metrics}
	if journals != nil {
		sinks = audit.Multi{journals, metrics}
	}
	pp.proxy, err = relay.New(relay.Config{
		Decider:       eg.decider,
		Audit:         sinks,
		Metrics:       metrics,
		Logger:        logger,
		UpstreamRoots: roots,
		Modules:       pp.modules,
		CA:            ica,
	})
	if err != nil {
		return nil, err
	}
	return pp, nil
}

// loadWasm makes the WebAssembly runtime of the --wasm-* flags and loads
// the service-wide modules of --transform-module; always makes the runtime
// even without such modules (serve compiles sandboxes' own). Both are nil
// when neither is needed; closeWasm releases them.
func loadWasm(c *cli.Context, logger *slog.Logger, always bool) (*wasm.Runtime, *wasm.Chain, error) {
	specs := *c.Generic("transform-module").(*moduleSpecs)
	if len(specs) == 0 && !always {
		return nil, nil, nil
	}
	rt, err := newWasmRuntime(c, logger, wasmHeadroom(logger))
	if err != nil {
		return nil, nil, err
	}
	if len(specs) == 0 {
		return rt, nil, nil
	}
	modules, err := loadModules(c.Context, rt, specs)
	if err != nil {
		rt.Close(context.Background())
		return nil, nil, err
	}
	for _, m := range modules.Modules() {
		logger.Info("transform module loaded", "module", m.Name(), "features", m.Features().String())
	}
	return rt, modules, nil
}

// closeWasm releases what loadWasm made.
func closeWasm(rt *wasm.Runtime, modules *wasm.Chain) {
	if modules != nil {
		modules.Close(context.Background())
	}
	if rt != nil {
		rt.Close(context.Background())
	}
}

// wasmHeadroom returns the wasm runtime's LongCalls hook, which gives the
// process one more P (GOMAXPROCS) per module call running long, and takes
// them back once those calls end. A module's code can be preempted by the
// Go scheduler only at the yields its time checks make (transforms/wasm:
// bound.go), and the scheduler asks for that only after a goroutine has run
// for 10ms: with as many Ps as cores, a few looping requests would hold
// every P for such slices until their deadlines, and everything else would
// wait in between. With a P more per long call (at most
// MaxConcurrentCalls of them run), looping modules never hold every P for
// long, and the kernel shares the cores between their threads and the rest.
// Extra Ps are not kept when no call runs long: idle Ps cost every request
// scheduler work (spinning threads woken to look for work). The hook is
// nil, and GOMAXPROCS left alone, when GOMAXPROCS is set in the
// environment.
func wasmHeadroom(logger *slog.Logger) func(n int) {
	base := runtime.GOMAXPROCS(0)
	if v, ok := os.LookupEnv("GOMAXPROCS"); ok {
		logger.Info("GOMAXPROCS is set in the environment; no Ps will be added while transform module calls run long", "gomaxprocs", base, "env", v)
		return nil
	}
	var once sync.Once
	return func(n int) {
		runtime.GOMAXPROCS(base + n)
		if n > 0 {
			once.Do(func() {
				logger.Info("transform module calls are running long: GOMAXPROCS is raised by one per such call while they run, so that they never hold every P",
					"gomaxprocs", base+n, "base", base)
			})
		}
		logger.Debug("GOMAXPROCS set for long transform module calls", "gomaxprocs", base+n, "long_calls", n)
	}
}

func serveMetrics(ctx context.Context, ln net.Listener, reg *prometheus.Registry, logger *slog.Logger) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	context.AfterFunc(ctx, func() {
		sctx, cancel := context.WithTimeoutCause(context.Background(), 5*time.Second, errors.New("metrics server shutdown timed out"))
		defer cancel()
		srv.Shutdown(sctx)
	})
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		logger.Error("metrics server failed", "err", err)
	}
}

// upstreamRoots returns the system roots plus the certificates in files, or
// nil (the system roots) when files is empty.
func upstreamRoots(files []string) (*x509.CertPool, error) {
	if len(files) == 0 {
		return nil, nil
	}
	pool, err := x509.SystemCertPool()
	if err != nil {
		pool = x509.NewCertPool()
	}
	for _, f := range files {
		pem, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s: no PEM certificate found", f)
		}
	}
	return pool, nil
}

// auditLogFlags say how serve's and proxy's audit log file is rotated.
func auditLogFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "audit-log-size", Value: "100m", Usage: "rotate the audit log file when it would grow past `SIZE` (FILE to FILE.1, FILE.1 to FILE.2, ...); 0 never", EnvVars: []string{"SANDGATE_AUDIT_LOG_SIZE"}},
		&cli.IntFlag{Name: "audit-log-keep", Value: audit.DefaultLogKeep, Usage: "keep `N` rotated audit log files, the oldest removed; 0 none", EnvVars: []string{"SANDGATE_AUDIT_LOG_KEEP"}},
	}
}

// openAuditLog opens the audit destination: --audit-log "-" is stdout,
// else a file appended to (0600), rotated by size (--audit-log-size,
// --audit-log-keep). Its errors name the setting at fault.
func openAuditLog(c *cli.Context, stdout io.Writer) (io.Writer, func(), error) {
	size, err := localbox.ParseSize(c.String("audit-log-size"))
	if err != nil || size < 0 {
		return nil, nil, fmt.Errorf("SANDGATE_AUDIT_LOG_SIZE (--audit-log-size) %q: want a size such as 100m, or 0 never to rotate", c.String("audit-log-size"))
	}
	keep := c.Int("audit-log-keep")
	if keep < 0 {
		return nil, nil, fmt.Errorf("SANDGATE_AUDIT_LOG_KEEP (--audit-log-keep) %d: want how many rotated files to keep, 0 for none", keep)
	}
	path := c.String("audit-log")
	if path == "-" || path == "" {
		return stdout, func() {}, nil
	}
	o := audit.FileOptions{MaxBytes: size, Keep: keep}
	if size == 0 {
		o.MaxBytes = -1
	}
	if keep == 0 {
		o.Keep = -1
	}
	f, err := audit.OpenFile(path, o)
	if err != nil {
		return nil, nil, fmt.Errorf("SANDGATE_AUDIT_LOG (--audit-log): %v", err)
	}
	return f, func() { f.Close() }, nil
}
