package main

import (
	"fmt"
	"os"

	"github.com/urfave/cli/v2"

	"github.com/sandgate/sandgate/appliance/localbox"
)

// sandboxTemplateCommand builds `sandgate sandbox template
// import|ls|rm`: layers kept once per host and shared read-only beneath
// the sandboxes made from them (`run --template`).
func sandboxTemplateCommand() *cli.Command {
	return &cli.Command{
		Name:  "template",
		Usage: "manage templates: layers shared read-only beneath the sandboxes run from them (sandgate's own)",
		Description: `A template is a layer (what 'sandbox tar' writes, or 'snapshot pack') kept in
its own file system image under the state directory and mounted read-only
beneath each sandbox run with --template NAME: one copy on disk for all of
them, no extraction when one starts, and a sandbox's own layer holds only
what it changed. Templates are immutable; one in use cannot be removed.`,
		Subcommands: []*cli.Command{{
			Name:         "import",
			Usage:        "make layer --file (tar, zstd or gzip) template NAME",
			ArgsUsage:    "NAME --file=F",
			Flags:        []cli.Flag{&cli.StringFlag{Name: "file", Aliases: []string{"f"}, Usage: "layer `FILE` to import (required)"}},
			OnUsageError: usageError,
			Action:       runSandboxTemplateImport,
		}, {
			Name:         "ls",
			Usage:        "list the templates",
			OnUsageError: usageError,
			Action:       runSandboxTemplateList,
		}, {
			Name:         "rm",
			Usage:        "remove template NAME (refused while a sandbox uses it)",
			ArgsUsage:    "NAME",
			OnUsageError: usageError,
			Action:       runSandboxTemplateRemove,
		}},
	}
}

func runSandboxTemplateImport(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 1 || c.String("file") == "" {
		return badInput("sandbox template import takes a NAME and --file FILE")
	}
	f, err := os.Open(c.String("file"))
	if err != nil {
		return badInput("--file: %v", err)
	}
	defer f.Close()
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	if err := m.ImportTemplate(c.Context, args[0], f, localbox.TemplateSize{}); err != nil {
		return sandboxErr(err)
	}
	fmt.Fprintln(c.App.Writer, args[0])
	return nil
}

func runSandboxTemplateList(c *cli.Context) error {
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	names, err := m.Templates()
	if err != nil {
		return err
	}
	for _, n := range names {
		fmt.Fprintln(c.App.Writer, n)
	}
	return nil
}

func runSandboxTemplateRemove(c *cli.Context) error {
	args, err := interspersed(c)
	if err != nil {
		return err
	}
	if len(args) != 1 {
		return badInput("sandbox template rm takes one NAME")
	}
	m, err := sandboxRuntime(c)
	if err != nil {
		return err
	}
	return sandboxErr(m.RemoveTemplate(args[0]))
}
