package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/api/client"
)

// The client verbs of a sandbox's egress beyond its policy: its request
// transformations (credentials swapped in outside it) and its own
// WebAssembly modules.

const transformationsHelp = `FILE (- for standard input) holds a JSON list of protocol 1's request
transformations, the AI SDK harness's:

  [{"match": {"host": "api.anthropic.com", "path": {"startsWith": "/v1/"},
              "headers": [{"key": {"exact": "x-api-key"}, "value": {"exact": "PLACEHOLDER"}}]},
    "transform": {"headers": {"x-api-key": {"env": "ANTHROPIC_API_KEY"}}}}]

A header value is a string, or {"env": "VAR"} (with "prefix": "Bearer " if
the header needs one) to read the credential from this process's
environment, so that it is written in no file. The service holds the
credentials in memory only: the sandbox sees the placeholder, and a
suspended sandbox loses them (set them again after resume). A field the
file does not know is refused by name.`

func transformationsCommand() *cli.Command {
	return &cli.Command{
		Name:     "transformations",
		Usage:    "a sandbox's request transformations: credentials swapped in outside it",
		Category: "client verbs (a sandgate service at --url)",
		Subcommands: []*cli.Command{
			remoteCommand(&cli.Command{
				Name:        "set",
				Usage:       "replace a running sandbox's request transformations with FILE's",
				ArgsUsage:   "NAME FILE",
				Description: transformationsHelp,
				Action:      func(c *cli.Context) error { return runTransformations(c, "set") },
			}),
			remoteCommand(&cli.Command{
				Name:        "add",
				Usage:       "add FILE's request transformations to a running sandbox's",
				ArgsUsage:   "NAME FILE",
				Description: transformationsHelp,
				Action:      func(c *cli.Context) error { return runTransformations(c, "add") },
			}),
			remoteCommand(&cli.Command{
				Name:      "clear",
				Usage:     "remove a running sandbox's request transformations",
				ArgsUsage: "NAME",
				Action:    func(c *cli.Context) error { return runTransformations(c, "clear") },
			}),
		},
	}
}

func runTransformations(c *cli.Context, how string) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	var ts []client.RequestTransformation
	switch {
	case how == "clear" && len(args) == 1:
	case how != "clear" && len(args) == 2:
		if ts, err = readTransformations(c, args[1]); err != nil {
			return err
		}
	case how == "clear":
		return badInput("transformations clear takes a sandbox NAME")
	default:
		return badInput("transformations %s takes a sandbox NAME and a FILE (- for standard input)", how)
	}
	s, err := attachRemote(c, args[0])
	if err != nil {
		return err
	}
	if how == "add" {
		return s.AddRequestTransformations(c.Context, ts)
	}
	return s.SetRequestTransformations(c.Context, ts)
}

// readTransformations reads a transformations file: header values given
// as {"env": VAR, "prefix": P} are read from the environment here, and
// any field the file does not know is refused by name. An error never
// quotes a credential.
func readTransformations(c *cli.Context, name string) ([]client.RequestTransformation, error) {
	var data []byte
	var err error
	if name == "-" {
		data, err = io.ReadAll(c.App.Reader)
	} else {
		data, err = os.ReadFile(name)
	}
	if err != nil {
		return nil, badInput("transformations: %v", err)
	}
	var items []map[string]json.RawMessage
	if err := json.Unmarshal(data, &items); err != nil {
		return nil, badInput("transformations %s: want a JSON list of {match, transform}: %v", name, err)
	}
	out := make([]client.RequestTransformation, 0, len(items))
	for i, item := range items {
		where := fmt.Sprintf("transformations %s: [%d]", name, i)
		for _, k := range slices.Sorted(maps.Keys(item)) {
			if k != "match" && k != "transform" {
				return nil, badInput("%s: unknown field %q (an item takes match and transform)", where, k)
			}
		}
		var tr struct {
			Headers map[string]json.RawMessage `json:"headers"`
		}
		if err := strictJSON(item["transform"], &tr); err != nil {
			return nil, badInput("%s.transform: %v (want {\"headers\": {NAME: VALUE}})", where, err)
		}
		headers := map[string]string{}
		for _, h := range slices.Sorted(maps.Keys(tr.Headers)) {
			v, err := headerValue(tr.Headers[h])
			if err != nil {
				return nil, badInput("%s.transform.headers.%s: %v", where, h, err)
			}
			headers[h] = v
		}
		var m client.Match
		if err := strictJSON(item["match"], &m); err != nil {
			return nil, badInput("%s.match: %v", where, err)
		}
		if m.Host == "" {
			return nil, badInput("%s.match.host is required", where)
		}
		out = append(out, client.RequestTransformation{Match: m, Transform: client.Transform{Headers: headers}})
	}
	return out, nil
}

// headerValue is a transformation's header value: a string, or the
// environment variable {"env", "prefix"} names.
func headerValue(raw json.RawMessage) (string, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var ref struct {
		Env    string `json:"env"`
		Prefix string `json:"prefix"`
	}
	if err := strictJSON(raw, &ref); err != nil {
		return "", fmt.Errorf("want a string, or {\"env\": \"VAR\", \"prefix\": \"...\"}: %v", err)
	}
	if ref.Env == "" {
		return "", fmt.Errorf("\"env\" is required: the environment variable holding the credential")
	}
	v, ok := os.LookupEnv(ref.Env)
	if !ok || v == "" {
		return "", fmt.Errorf("the environment variable %s is not set here", ref.Env)
	}
	return ref.Prefix + v, nil
}

// strictJSON decodes raw into v, refusing fields v does not have.
func strictJSON(raw json.RawMessage, v any) error {
	if len(raw) == 0 {
		return fmt.Errorf("missing")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return errors.New(strings.TrimPrefix(err.Error(), "json: "))
	}
	return nil
}

func modulesCommand() *cli.Command {
	return &cli.Command{
		Name:     "modules",
		Usage:    "a sandbox's own WebAssembly transform modules",
		Category: "client verbs (a sandgate service at --url)",
		Subcommands: []*cli.Command{
			remoteCommand(&cli.Command{
				Name:      "set",
				Usage:     "replace a running sandbox's own modules (none: remove them)",
				ArgsUsage: "NAME [FILE[?CONFIG]]...",
				Description: `Each FILE is an http-wasm guest, as 'sandgate proxy --transform-module'
takes it (CONFIG may be @PATH); they run in order on the sandbox's
base-URL routes, after the service's own modules and before the credential
swap. The service loads and checks each (as 'sandgate wasm check') and
keeps them with the sandbox across suspend and resume. Modules see the
base-URL routes only, not CONNECT tunnels.`,
				Action: runModulesSet,
			}),
			remoteCommand(&cli.Command{
				Name:      "ls",
				Aliases:   []string{"list"},
				Usage:     "list a sandbox's own modules",
				ArgsUsage: "NAME",
				Flags:     []cli.Flag{&cli.BoolFlag{Name: "json", Usage: "print JSON, as the service describes them"}},
				Action:    runModulesLs,
			}),
		},
	}
}

func runModulesSet(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) < 1 {
		return badInput("modules set takes a sandbox NAME and the module FILEs (none removes them)")
	}
	mods := []client.Module{}
	for _, spec := range args[1:] {
		path, cfg, err := parseModuleSpec(spec)
		if err != nil {
			return badInput("modules set %s: %v", spec, err)
		}
		bin, err := os.ReadFile(path)
		if err != nil {
			return badInput("modules set: %v", err)
		}
		mods = append(mods, client.Module{Name: strings.TrimSuffix(filepath.Base(path), ".wasm"), Wasm: bin, Config: string(cfg)})
	}
	s, err := attachRemote(c, args[0])
	if err != nil {
		return err
	}
	return s.SetModules(c.Context, mods)
}

func runModulesLs(c *cli.Context) error {
	name, err := oneName(c, "modules ls")
	if err != nil {
		return err
	}
	cl, err := newRemote(c)
	if err != nil {
		return err
	}
	in, err := cl.Info(c.Context, name)
	if err != nil {
		return err
	}
	return printList(c, in.Modules, "NAME\tDIGEST\tSIZE", func(m client.ModuleInfo) []string {
		size := "-"
		if m.Bytes > 0 {
			size = human(int64(m.Bytes))
		}
		return []string{m.Name, m.Digest, size}
	})
}
