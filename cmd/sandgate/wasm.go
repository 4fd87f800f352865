package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/appliance/localbox"
	"github.com/sandgate/sandgate/transforms/wasm"
)

func wasmCommand() *cli.Command {
	return &cli.Command{
		Name:  "wasm",
		Usage: "check and try WebAssembly transform modules (http-wasm guests)",
		Subcommands: []*cli.Command{
			{
				Name:      "check",
				Usage:     "load a module as the proxy would and report its exports, imports and features",
				ArgsUsage: "FILE",
				Description: `Loads FILE with its --config as "sandgate proxy --transform-module" would:
compiles it, checks its imports and exports against the http-wasm ABI and
starts one instance. Prints what it exports and imports and the features it
enabled while starting, and exits 0; a module the proxy would refuse exits 2
with the reason.`,
				Flags:        append(wasmRuntimeFlags(), wasmConfigFlag()),
				OnUsageError: usageError,
				Action:       runWasmCheck,
			},
			{
				Name:      "run",
				Usage:     "run one HTTP request through a module and print what the proxy would send",
				ArgsUsage: "FILE --request REQFILE",
				Description: `Reads an HTTP/1.1 request from REQFILE (request line with an origin-form
target, headers with Host: the destination, a blank line, the body), runs it
through the module's handle_request as the proxy would, before any secret is
swapped in, and prints the request it would send upstream. A refusal prints
the status and reason and exits 3; a response the module gave itself is
printed and exits 0; a module failure exits 1. Audit notes and the module's
log go to standard error.`,
				Flags: append(wasmRuntimeFlags(), wasmConfigFlag(),
					&cli.StringFlag{Name: "request", Usage: "read the HTTP request from `REQFILE`, - for standard input (required)"},
					&cli.StringFlag{Name: "sandbox-id", Value: "standalone", Usage: "the sandbox `ID` the module sees (sandgate.sandbox_id)"},
				),
				OnUsageError: usageError,
				Action:       runWasmRun,
			},
		},
	}
}

// wasmRuntimeFlags configure the runtime modules run in (proxy, wasm check,
// wasm run).
func wasmRuntimeFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "wasm-cache-dir", Usage: "compilation cache `DIR` for transform modules (\"off\" for none; default under the user cache directory)", EnvVars: []string{"SANDGATE_WASM_CACHE_DIR"}},
		&cli.UintFlag{Name: "wasm-memory-pages", Value: 512, Usage: "memory cap of each module instance, in 64 KiB `PAGES`", EnvVars: []string{"SANDGATE_WASM_MEMORY_PAGES"}},
		&cli.DurationFlag{Name: "wasm-call-timeout", Value: 100 * time.Millisecond, Usage: "stop each call into a module after `DURATION`", EnvVars: []string{"SANDGATE_WASM_CALL_TIMEOUT"}},
		&cli.IntFlag{Name: "wasm-max-body", Value: 1 << 20, Usage: "buffer for, or let a module write, bodies of at most `BYTES`", EnvVars: []string{"SANDGATE_WASM_MAX_BODY"}},
		&cli.StringFlag{Name: "wasm-max-module", Value: "32m", Usage: "load modules of at most `SIZE`", EnvVars: []string{"SANDGATE_WASM_MAX_MODULE"}},
	}
}

func wasmConfigFlag() cli.Flag {
	return &cli.StringFlag{Name: "config", Usage: "the module's `CONFIG`: the text itself, or @FILE to read it from FILE"}
}

// newWasmRuntime builds the runtime from the wasm flags. longCalls, when
// not nil, is the runtime's Config.LongCalls.
func newWasmRuntime(c *cli.Context, logger *slog.Logger, longCalls func(n int)) (*wasm.Runtime, error) {
	pages := c.Uint("wasm-memory-pages")
	if pages == 0 || pages > 65536 {
		return nil, badInput("--wasm-memory-pages: %d is out of range; give 1 to 65536 pages of 64 KiB", pages)
	}
	if c.Duration("wasm-call-timeout") <= 0 {
		return nil, badInput("--wasm-call-timeout: give a positive duration such as 100ms")
	}
	if c.Int("wasm-max-body") <= 0 {
		return nil, badInput("--wasm-max-body: give a positive number of bytes")
	}
	maxModule, err := localbox.ParseSize(c.String("wasm-max-module"))
	if err != nil || maxModule <= 0 || maxModule > 1<<30 {
		return nil, badInput("--wasm-max-module (SANDGATE_WASM_MAX_MODULE) %q: give a size such as 32m, at most 1g", c.String("wasm-max-module"))
	}
	r, err := wasm.NewRuntime(c.Context, wasm.Config{
		MaxModuleBytes:   int(maxModule),
		CacheDir:         c.String("wasm-cache-dir"),
		MemoryLimitPages: uint32(pages),
		CallTimeout:      c.Duration("wasm-call-timeout"),
		MaxBodyBytes:     c.Int("wasm-max-body"),
		Logger:           logger,
		LongCalls:        longCalls,
	})
	if err != nil {
		return nil, badInput("--wasm-cache-dir (SANDGATE_WASM_CACHE_DIR): %v", err)
	}
	return r, nil
}

// moduleConfig reads a config value: the string itself, or @FILE.
func moduleConfig(v string) ([]byte, error) {
	if f, ok := strings.CutPrefix(v, "@"); ok {
		return os.ReadFile(f)
	}
	return []byte(v), nil
}

// parseModuleSpec splits a --transform-module value FILE[?CONFIG].
func parseModuleSpec(spec string) (string, []byte, error) {
	path, cfg, _ := strings.Cut(spec, "?")
	if path == "" {
		return "", nil, fmt.Errorf("%q names no file; write FILE[?CONFIG]", spec)
	}
	b, err := moduleConfig(cfg)
	return path, b, err
}

// moduleSpecs collects repeated --transform-module values in order,
// without splitting them at commas (a config may contain commas).
type moduleSpecs []string

func (s *moduleSpecs) Set(v string) error { *s = append(*s, v); return nil }
func (s *moduleSpecs) String() string     { return strings.Join(*s, " ") }

// loadModules loads the --transform-module specs in order into a chain.
func loadModules(ctx context.Context, r *wasm.Runtime, specs []string) (*wasm.Chain, error) {
	var mods []*wasm.Module
	for _, spec := range specs {
		path, cfg, err := parseModuleSpec(spec)
		if err == nil {
			var m *wasm.Module
			if m, err = r.LoadFile(ctx, path, cfg); err == nil {
				mods = append(mods, m)
				continue
			}
		}
		wasm.NewChain(mods...).Close(ctx)
		return nil, badInput("--transform-module %s: %v", spec, err)
	}
	return wasm.NewChain(mods...), nil
}

func loadOne(c *cli.Context, logger *slog.Logger) (*wasm.Runtime, *wasm.Module, error) {
	args, err := interspersed(c)
	if err != nil {
		return nil, nil, err
	}
	if len(args) != 1 {
		return nil, nil, badInput("%s takes one module FILE, got %d arguments", c.Command.HelpName, len(args))
	}
	cfg, err := moduleConfig(c.String("config"))
	if err != nil {
		return nil, nil, badInput("--config: %v", err)
	}
	r, err := newWasmRuntime(c, logger, nil)
	if err != nil {
		return nil, nil, err
	}
	m, err := r.LoadFile(c.Context, args[0], cfg)
	if err != nil {
		r.Close(context.Background())
		return nil, nil, &exitError{code: exitBadInput, err: err}
	}
	return r, m, nil
}

func runWasmCheck(c *cli.Context) error {
	r, m, err := loadOne(c, slog.New(slog.NewTextHandler(c.App.ErrWriter, nil)))
	if err != nil {
		return err
	}
	defer r.Close(context.Background())
	w := c.App.Writer
	fmt.Fprintf(w, "module: %s\n", m.Name())
	fmt.Fprintf(w, "exports: %s\n", strings.Join(m.Exports(), ", "))
	fmt.Fprintf(w, "imports: %s\n", strings.Join(m.Imports(), ", "))
	fmt.Fprintf(w, "features enabled at start: %s\n", m.Features())
	fmt.Fprintf(w, "ok: the proxy would load it\n")
	return nil
}

func runWasmRun(c *cli.Context) error {
	r, m, err := loadOne(c, slog.New(slog.NewTextHandler(c.App.ErrWriter, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		return err
	}
	if c.String("request") == "" {
		r.Close(context.Background())
		return badInput("wasm run needs --request FILE: the HTTP request to run through the module")
	}
	defer r.Close(context.Background())
	var in io.Reader = os.Stdin
	if f := c.String("request"); f != "-" {
		file, err := os.Open(f)
		if err != nil {
			return badInput("--request: %v", err)
		}
		defer file.Close()
		in = file
	}
	req, err := readWasmRequest(in)
	if err != nil {
		return badInput("--request: %v", err)
	}
	ctx, cancel := context.WithTimeoutCause(c.Context, 30*time.Second, errors.New("wasm run timed out"))
	defer cancel()
	x, err := wasm.HandleRequest(ctx, req, wasm.RequestInfo{Sandbox: c.String("sandbox-id"), SourceAddr: "127.0.0.1:0", Proto: "HTTP/1.1"}, wasm.NewChain(m))
	defer func() {
		x.Close()
		for _, n := range x.Notes() {
			fmt.Fprintf(c.App.ErrWriter, "note: %s\n", n)
		}
		if d := x.NotesDropped(); d > 0 {
			fmt.Fprintf(c.App.ErrWriter, "notes dropped: %d\n", d)
		}
	}()
	w := c.App.Writer
	if err != nil {
		return &exitError{code: exitFailure, err: err}
	}
	if a := x.Answer(); a != nil {
		if a.Refused {
			fmt.Fprintf(w, "refused by %s: %d %s\n", a.Module, a.Status, a.Reason)
			if a.Body != nil {
				fmt.Fprintf(w, "\n%s\n", a.Body)
			}
			return &exitError{code: exitDenied}
		}
		resp := &http.Response{StatusCode: a.Status, ProtoMajor: 1, ProtoMinor: 1, Header: a.Header,
			ContentLength: int64(len(a.Body)), Body: io.NopCloser(strings.NewReader(string(a.Body)))}
		fmt.Fprintf(w, "answered by %s:\n", a.Module)
		return resp.Write(w)
	}
	return writeOutbound(w, req)
}

// readWasmRequest reads the request and shapes it as the proxy's outbound
// request: https://HOST/target, hop-by-hop headers gone.
func readWasmRequest(in io.Reader) (*http.Request, error) {
	req, err := http.ReadRequest(bufio.NewReader(in))
	if err != nil {
		return nil, err
	}
	if req.Host == "" {
		return nil, errors.New("the request has no Host header; add the destination, e.g. Host: api.example.com")
	}
	u, err := url.ParseRequestURI(req.RequestURI)
	if err != nil || u.Host != "" || !strings.HasPrefix(req.RequestURI, "/") {
		return nil, fmt.Errorf("request target %q is not origin-form (/path?query)", req.RequestURI)
	}
	body, err := io.ReadAll(io.LimitReader(req.Body, 64<<20))
	if err != nil {
		return nil, err
	}
	out, err := http.NewRequest(req.Method, "https://"+req.Host+req.RequestURI, strings.NewReader(string(body)))
	if err != nil {
		return nil, err
	}
	out.Header = req.Header.Clone()
	for _, h := range []string{"Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Expect", "Proxy-Connection", "Proxy-Authorization"} {
		out.Header.Del(h)
	}
	if len(body) == 0 {
		out.Body, out.ContentLength = http.NoBody, 0
	}
	return out, nil
}

// writeOutbound prints the request as the proxy would send it.
func writeOutbound(w io.Writer, req *http.Request) error {
	fmt.Fprintf(w, "%s %s HTTP/1.1\r\nHost: %s\r\n", req.Method, req.URL.RequestURI(), req.URL.Host)
	var body []byte
	if req.Body != nil {
		b, err := io.ReadAll(req.Body)
		if err != nil {
			return err
		}
		body = b
	}
	h := req.Header.Clone()
	h.Del("Content-Length")
	if len(body) > 0 || req.ContentLength > 0 {
		h.Set("Content-Length", fmt.Sprint(len(body)))
	}
	if err := h.WriteSubset(w, map[string]bool{"Host": true}); err != nil {
		return err
	}
	fmt.Fprintf(w, "\r\n%s", body)
	return nil
}
