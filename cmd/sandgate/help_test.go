package main

import (
	"os"
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
				if strings.Count(line, "(default") > 1 {
					t.Errorf("%s: %q says its default twice: put it in DefaultText, not the usage", name, line)
				}
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

// TestREADMEListsEveryProxyFlag: the README's synopsis and flag table of
// the proxy lacked --transform-module, --shutdown-grace and the --wasm-*
// flags. Each flag of the proxy must be in both, with its environment
// variables in its table row.
func TestREADMEListsEveryProxyFlag(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	start, end := strings.Index(readme, "## The egress proxy"), strings.Index(readme, "What it carries:")
	if start < 0 || end < start {
		t.Fatal(`README.md has no "## The egress proxy" section ending before "What it carries:"`)
	}
	section := readme[start:end]
	synopsis, table, _ := strings.Cut(section, "| flag |")
	rows := map[string]string{}
	for _, line := range strings.Split(table, "\n") {
		if name, ok := strings.CutPrefix(line, "| `--"); ok {
			name, _, _ = strings.Cut(name, "`")
			rows[name] = line
		}
	}
	for _, f := range proxyCommand().Flags {
		name := f.Names()[0]
		if name == "help" {
			continue
		}
		if !strings.Contains(synopsis, "--"+name+" ") && !strings.Contains(synopsis, "--"+name+"]") {
			t.Errorf("the README's proxy synopsis lacks --%s", name)
		}
		row, ok := rows[name]
		if !ok {
			t.Errorf("the README's proxy flag table has no row for --%s", name)
			continue
		}
		if ef, ok := f.(interface{ GetEnvVars() []string }); ok {
			for _, env := range ef.GetEnvVars() {
				if !strings.Contains(row, "`"+env+"`") {
					t.Errorf("the README's row for --%s lacks its environment variable %s", name, env)
				}
			}
		}
	}
	if len(rows) != len(proxyCommand().Flags) {
		t.Errorf("the README's proxy flag table has %d rows, the proxy %d flags", len(rows), len(proxyCommand().Flags))
	}
}

// TestREADMEListsEveryVerb: the README's table of verbs names every
// command of the binary and every subcommand of each (it lacked fork,
// inspect, transformations, modules and template save, which the CLI
// lacked too), and each client verb's aliases.
func TestREADMEListsEveryVerb(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	start := strings.Index(readme, "| verb | what it does |")
	end := strings.Index(readme[max(start, 0):], "\n\n")
	if start < 0 || end < 0 {
		t.Fatal(`README.md has no "| verb | what it does |" table`)
	}
	rows := map[string]string{} // a row's first cell's first word
	for _, line := range strings.Split(readme[start:start+end], "\n")[2:] {
		cell, _, _ := strings.Cut(strings.TrimPrefix(line, "| "), " |")
		word, _, _ := strings.Cut(strings.TrimPrefix(cell, "`"), " ")
		rows[strings.TrimSuffix(word, "`")] += cell
	}
	for _, c := range newApp(nil, nil).Commands {
		if c.Name == "help" {
			continue
		}
		row, ok := rows[c.Name]
		if !ok {
			t.Errorf("the README's table of verbs has no row for %s", c.Name)
			continue
		}
		for _, sub := range c.Subcommands {
			if sub.Name != "help" && !strings.Contains(row, sub.Name) {
				t.Errorf("the README's row for %s does not name %s %s", c.Name, c.Name, sub.Name)
			}
		}
		if c.Category != "" {
			for _, a := range c.Aliases {
				if !strings.Contains(row, "`"+a+"`") {
					t.Errorf("the README's row for %s does not name its alias %s", c.Name, a)
				}
			}
		}
	}
}

// The quick start's store (./.snapshots, serve's default) stays out of the
// way: out of commits, and out of the image's build context (every
// sandbox on Cloud Run reads the image).
func TestDefaultStoreIsIgnored(t *testing.T) {
	def := ""
	for _, f := range serveCommand().Flags {
		if f.Names()[0] == "snapshot-dir" {
			def = f.(*cli.StringFlag).Value
		}
	}
	for _, file := range []string{"../../.gitignore", "../../.dockerignore"} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		if !slices.ContainsFunc(lines, func(l string) bool { return strings.Trim(l, "/") == strings.TrimPrefix(def, "./") }) {
			t.Errorf("%s does not list serve's default store %s", file, def)
		}
	}
}
