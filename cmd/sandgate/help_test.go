package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// TestHelpText reads every command's flags as --help shows them: no bare
// "value" placeholder (urfave/cli prints one unless the usage has a
// backquoted placeholder), required flags say so, a boolean that defaults
// to true says how to turn it off, and the proxy lists --listen first.
func TestHelpText(t *testing.T) {
	required := map[string][]string{
		"sandgate snapshot pack":   {"out"},
		"sandgate snapshot unpack": {"into"},
		"sandgate sandbox tar":     {"file"},
		"sandgate wasm run":        {"request"},
	}
	var walk func(path string, cmds []*cli.Command)
	walk = func(path string, cmds []*cli.Command) {
		for _, c := range cmds {
			name := path + " " + c.Name
			for _, f := range c.Flags {
				line := cli.FlagStringer(f)
				if strings.Contains(line, " value\t") {
					t.Errorf("%s: %q has no placeholder: put one in backquotes in its usage", name, line)
				}
				if bf, ok := f.(*cli.BoolFlag); ok && bf.Value && !strings.Contains(bf.Usage, "--"+bf.Name+"=false") {
					t.Errorf("%s: --%s defaults to true and does not say --%s=false turns it off", name, bf.Name, bf.Name)
				}
				if df, ok := f.(cli.DocGenerationFlag); ok && slices.Contains(required[name], f.Names()[0]) && !strings.Contains(df.GetUsage(), "(required)") {
					t.Errorf("%s: --%s is required and its usage does not say so", name, f.Names()[0])
				}
			}
			walk(name, c.Subcommands)
		}
	}
	app := newApp(nil, nil)
	walk("sandgate", app.Commands)
	for _, c := range app.Commands {
		if c.Name == "proxy" && c.Flags[0].Names()[0] != "listen" {
			t.Errorf("proxy's first flag is --%s, want --listen", c.Flags[0].Names()[0])
		}
	}
}
