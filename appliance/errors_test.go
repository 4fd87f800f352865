package appliance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/snapshot"
	"github.com/sandgate/sandgate/snapshot/store"
)

// TestOneSentinelEach: each meaning has one sentinel, whichever package
// names it, so errors.Is matches whichever layer produced the error; and
// "not found" / "already exists" of every layer meet in the io/fs
// categories while each keeps its own sentinel.
func TestOneSentinelEach(t *testing.T) {
	for name, pair := range map[string][2]error{
		"digest mismatch":   {snapshot.ErrDigestMismatch, store.ErrDigestMismatch},
		"refused":           {agent.ErrRefused, snapshot.ErrRefused},
		"no such sandbox":   {ErrNotFound, sandboxcli.ErrNotFound},
		"sandbox exists":    {ErrExists, sandboxcli.ErrExists},
		"sandbox busy":      {ErrBusy, sandboxcli.ErrBusy},
		"sandbox stopped":   {ErrNotRunning, sandboxcli.ErrNotRunning},
		"sandbox running":   {ErrRunning, sandboxcli.ErrRunning},
		"bad sandbox input": {ErrBadInput, sandboxcli.ErrBadInput},
	} {
		if pair[0] != pair[1] {
			t.Errorf("%s: two sentinels, %v and %v", name, pair[0], pair[1])
		}
	}

	// Produced by each layer, matched by every name.
	ctx := context.Background()
	st, err := store.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	var layer bytes.Buffer
	if _, err := snapshot.Pack(ctx, t.TempDir(), &layer, snapshot.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	_, layerErr := snapshot.Unpack(ctx, bytes.NewReader(layer.Bytes()), filepath.Join(t.TempDir(), "x"),
		snapshot.ApplyOptions{Digest: "sha256:" + fmt.Sprintf("%064d", 0)})
	_, objErr := st.Stat(ctx, "snapshots/none.tar.zst")
	cliErr := &CLIError{Verb: "exec", Err: &exec.ExitError{}, Kind: sandboxcli.ErrorForExit(sandboxcli.ExitNotFound)}
	agentErr := &agent.Error{Op: "tar", Code: "refused", Message: "entry \"../x\": name contains '..'"}
	for _, tc := range []struct {
		err  error
		want []error
		not  []error
	}{
		{layerErr, []error{snapshot.ErrDigestMismatch, store.ErrDigestMismatch}, nil},
		{objErr, []error{store.ErrNotFound, fs.ErrNotExist}, []error{ErrNotFound}},
		{cliErr, []error{ErrNotFound, sandboxcli.ErrNotFound, fs.ErrNotExist}, []error{store.ErrNotFound}},
		{fmt.Errorf("create: %w", sandboxcli.ErrExists), []error{ErrExists, fs.ErrExist}, []error{fs.ErrNotExist}},
		{agentErr, []error{agent.ErrRefused, snapshot.ErrRefused}, nil},
	} {
		for _, w := range tc.want {
			if !errors.Is(tc.err, w) {
				t.Errorf("%v does not match %v", tc.err, w)
			}
		}
		for _, n := range tc.not {
			if errors.Is(tc.err, n) {
				t.Errorf("%v matches %v", tc.err, n)
			}
		}
	}
}

// A missing template or process says so in its own words, not "no such
// sandbox: no such template", and still matches ErrNotFound.
func TestNotFoundOfOtherThingsSaysWhat(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{fmt.Errorf("%w: %q (namespace ns)", ErrNoTemplate, "tool"), `no such template: "tool" (namespace ns)`},
		{fmt.Errorf("%w: %q in sandbox %q", ErrNoProcess, "p1", "box"), `no such process: "p1" in sandbox "box"`},
	} {
		if tc.err.Error() != tc.want {
			t.Errorf("got %q, want %q", tc.err, tc.want)
		}
		for _, target := range []error{ErrNotFound, fs.ErrNotExist} {
			if !errors.Is(tc.err, target) {
				t.Errorf("%v does not match %v", tc.err, target)
			}
		}
	}
	if errors.Is(ErrNoTemplate, ErrNoProcess) || errors.Is(ErrNotFound, ErrNoTemplate) {
		t.Errorf("the sentinels match each other")
	}
}
