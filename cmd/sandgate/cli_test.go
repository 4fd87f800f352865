package main

import (
	"bytes"
	"testing"
)

// runCLI runs the CLI in-process and returns its exit status, stdout and
// stderr.
func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(append([]string{"sandgate"}, args...), &out, &errb)
	return code, out.String(), errb.String()
}
