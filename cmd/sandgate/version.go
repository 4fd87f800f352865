package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/urfave/cli/v2"
)

func versionCommand() *cli.Command {
	return &cli.Command{
		Name:  "version",
		Usage: "print sandgate's version, the Go version it was built with and its VCS commit",
		Action: func(c *cli.Context) error {
			if c.NArg() > 0 {
				return badInput("version takes no arguments, got %q", c.Args().First())
			}
			return printVersion(c.App.Writer)
		},
		OnUsageError: usageError,
	}
}

// linkVersion and linkCommit are set at link time where the build has no
// module version or VCS information to read them from: the image's build
// stage (see the Dockerfile) builds from a copy of the source without
// .git, with
//
//	-ldflags "-X main.linkVersion=v1.2.3 -X main.linkCommit=<sha>"
//
// Empty (any other build) means: read them from the build information.
var linkVersion, linkCommit string

func printVersion(w io.Writer) error {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		bi = nil
	}
	_, err := io.WriteString(w, versionText(bi))
	return err
}

// versionText renders what `sandgate version` prints from the binary's
// build information (nil when it has none): the main module's version, the
// Go version and the VCS commit, "unknown" for what was not recorded (a
// build with -buildvcs=false, or outside a git checkout, has no commit).
// The link-time version and commit win over the build information.
func versionText(bi *debug.BuildInfo) string {
	v, goVersion := "unknown", runtime.Version()
	commit, when, modified := "unknown", "", false
	if bi != nil {
		if bi.Main.Version != "" {
			v = bi.Main.Version
		}
		if bi.GoVersion != "" {
			goVersion = bi.GoVersion
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				commit = s.Value
			case "vcs.time":
				when = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if linkVersion != "" {
		v = linkVersion
	}
	if linkCommit != "" {
		commit, when, modified = linkCommit, "", false
	}
	var b strings.Builder
	fmt.Fprintf(&b, "sandgate version %s\n", v)
	fmt.Fprintf(&b, "go version %s %s/%s\n", goVersion, runtime.GOOS, runtime.GOARCH)
	var notes []string
	if when != "" {
		notes = append(notes, when)
	}
	if modified {
		notes = append(notes, "modified")
	}
	if commit == "unknown" {
		notes = append(notes, "built without VCS information, e.g. with -buildvcs=false")
	}
	fmt.Fprintf(&b, "commit %s", commit)
	if len(notes) > 0 {
		fmt.Fprintf(&b, " (%s)", strings.Join(notes, ", "))
	}
	b.WriteString("\n")
	return b.String()
}
