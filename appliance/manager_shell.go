package appliance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/sandgate/sandgate/appliance/agent"
)

// Sessions are shells. A command of a session (ExecRequest.Session) runs
// in a bash that starts from the session's shell state and saves it when
// the command ends: its directory, its exported variables (those that
// differ from what every command gets, and those it unset), its other
// variables, its functions and its aliases. So `cd`, `export`, a function
// or an alias carry from one command to the next, as in the Cloudflare
// bridge's persistent shell, while each command is still a process of its
// own: its exit code exact, its stdout and stderr apart, its timeout and
// kill those of any command. A `sh -c SCRIPT` or `bash -c SCRIPT` argv runs
// SCRIPT in that shell itself (a child shell would keep nothing).
//
// The state lives in the sandbox (sessionStateDir, a tmpfs: it goes with
// a suspend), and the manager reads the directory and the exported
// variables back after each command and keeps them with the sandbox's
// sessions in the store: a sandbox resumed, here or on another shard,
// writes them into its new state first (seed), so a session's directory
// and variables survive a suspend and a move; its functions, aliases and
// unexported variables do not. Commands of one session run one at a time,
// in the order they came (the reference serialises them the same way); a
// command that must wait for its turn says so (ExecRequest.Queued).
//
// An image without bash (4.4 or later, at /bin/bash or /usr/bin/bash)
// runs a session's commands with sh, from the session's directory and
// variables as kept, without saving what they change.

// sessionStateDir is where a sandbox keeps its sessions' shell state:
// <name>.sh, what a session's shell sources (bash), and <name>.env, what
// the manager reads back (the directory, then NAME=VALUE and -NAME for an
// unset variable, NUL-separated).
const sessionStateDir = "/tmp/.sandgate-sessions"

// maxSessionState bounds what one session keeps in the store (its
// directory and variables): more stays in the running sandbox only.
const maxSessionState = 64 << 10

// sessionFallback runs a session's command with sh, in an image without
// bash: from the session's state as kept (a seed is plain sh), saving
// nothing.
const sessionFallback = `[ -r "$1/$2.sh" ] && . "$1/$2.sh" 2>/dev/null
c=$3; shift 3
if [ -n "$c" ]; then cd -- "$c" 2>/dev/null || { printf 'sandgate: working directory %s: no such directory\n' "$c" >&2; exit 2; }; fi
"$@"`

// allVariables expands, in bash, to the name of every variable set: the
// names by their first character, with no subshell to fork.
var allVariables = func() string {
	var b strings.Builder
	for _, r := range "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_" {
		b.WriteString("${!" + string(r) + "@} ")
	}
	return b.String()
}()

// sessionShell is the bash (4.4 or later) a session's command runs in: $1
// the state directory, $2 the session, $3 the command's own directory
// ("": the session's), the rest the command. Every name it uses starts
// with __sg_ and is never saved; it forks nothing but the command.
var sessionShell = strings.ReplaceAll(`__sg_dir=$1 __sg_name=$2 __sg_cwd=$3
shift 3
__sg_sh=$__sg_dir/$__sg_name.sh __sg_env=$__sg_dir/$__sg_name.env
declare -A __sg_base=() __sg_v0=()
for __sg_n in ALL; do
	__sg_v0[$__sg_n]=1
	[[ ${!__sg_n@a} == *x* ]] && __sg_base[$__sg_n]=${!__sg_n}
done
__sg_save() {
	local __sg_n __sg_keep=$PWD
	local -a __sg_set=() __sg_gone=() __sg_own=()
	local -A __sg_now=()
	[ -n "$__sg_cwd" ] && __sg_keep=$__sg_home
	for __sg_n in ALL; do
		case $__sg_n in __sg_*|_|PWD|OLDPWD|SHLVL|BASH_*|FUNCNAME|PIPESTATUS|COMP_*|LINENO|RANDOM|SRANDOM|SECONDS|EPOCHSECONDS|EPOCHREALTIME) continue;; esac
		if [[ ${!__sg_n@a} == *x* ]]; then
			__sg_now[$__sg_n]=1
			[[ -v __sg_base[$__sg_n] && ${__sg_base[$__sg_n]} == "${!__sg_n}" ]] || __sg_set+=("$__sg_n")
		elif [[ ! -v __sg_v0[$__sg_n] ]]; then
			__sg_own+=("$__sg_n")
		fi
	done
	for __sg_n in "${!__sg_base[@]}"; do
		case $__sg_n in __sg_*|_|PWD|OLDPWD|SHLVL|BASH_*) continue;; esac
		[[ -v __sg_now[$__sg_n] ]] || __sg_gone+=("$__sg_n")
	done
	{
		printf '%s\0' "$__sg_keep"
		for __sg_n in "${__sg_set[@]}"; do printf '%s=%s\0' "$__sg_n" "${!__sg_n}"; done
		(( ${#__sg_gone[@]} )) && printf -- '-%s\0' "${__sg_gone[@]}"
	} >"$__sg_env" 2>/dev/null
	{
		printf 'cd -- %q 2>/dev/null\n' "$__sg_keep"
		(( ${#__sg_set[@]} )) && declare -p -- "${__sg_set[@]}"
		(( ${#__sg_gone[@]} )) && printf 'unset -v %s\n' "${__sg_gone[@]}"
		(( ${#__sg_own[@]} )) && declare -p -- "${__sg_own[@]}"
		unset -f __sg_save
		declare -f
		alias -p
	} >"$__sg_sh" 2>/dev/null
}
[ -r "$__sg_sh" ] && . "$__sg_sh" 2>/dev/null
__sg_home=$PWD
if [ -n "$__sg_cwd" ]; then
	cd -- "$__sg_cwd" 2>/dev/null || { printf 'sandgate: working directory %s: no such directory\n' "$__sg_cwd" >&2; exit 2; }
fi
shopt -s expand_aliases
trap '__sg_rc=$?; trap - EXIT; __sg_save; exit $__sg_rc' EXIT
unset -v __sg_n
if [[ $# -ge 3 && $2 == -c && ( $1 == sh || $1 == bash || $1 == */sh || $1 == */bash ) ]]; then
	__sg_script=$3
	shift 3
	(( $# )) && shift
	eval "$__sg_script"
else
	"$@"
fi`, "ALL", allVariables)

// sessionArgs is a session's command as the agent runs it: with the
// sandbox's bash ("" for none: sh, from the state kept).
func sessionArgs(bash, name, dir string, argv []string) []string {
	if bash == "" {
		return append([]string{"/bin/sh", "-c", sessionFallback, "sh", sessionStateDir, name, dir}, argv...)
	}
	return append([]string{bash, "--norc", "--noprofile", "-c", sessionShell, "sandgate-session", sessionStateDir, name, dir}, argv...)
}

// bashPaths are where a sandbox's bash is looked for.
var bashPaths = []string{"/bin/bash", "/usr/bin/bash"}

// whereSession is what the credential guard names when a session's kept
// state, written into the sandbox again after a resume, holds a
// credential.
const whereSession = "the session's directory and variables (kept from its earlier commands)"

// sessionTurn is a session's place in line: commands of one session run
// one at a time, in the order they came.
type sessionTurn struct {
	busy    bool
	waiters []chan struct{}
}

// sessionRun is a command of a session, holding the session's turn until
// its state is read back.
type sessionRun struct {
	m    *Manager
	b    *box
	sb   *Sandbox
	name string
	args []string
}

// takeTurn waits for session name's turn (t.mu not held): queued, when
// set, is called once if it has to wait. ctx bounds the wait.
func (t *sessionTable) takeTurn(ctx context.Context, name string, queued func()) error {
	t.mu.Lock()
	if t.turns == nil {
		t.turns = map[string]*sessionTurn{}
	}
	q := t.turns[name]
	if q == nil {
		q = &sessionTurn{}
		t.turns[name] = q
	}
	if !q.busy {
		q.busy = true
		t.mu.Unlock()
		return nil
	}
	ch := make(chan struct{})
	q.waiters = append(q.waiters, ch)
	t.mu.Unlock()
	if queued != nil {
		queued()
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
	}
	t.mu.Lock()
	if i := slices.Index(q.waiters, ch); i >= 0 {
		q.waiters = slices.Delete(q.waiters, i, i+1)
		t.mu.Unlock()
		return fmt.Errorf("waiting for the command before it in session %q: %w", name, context.Cause(ctx))
	}
	t.mu.Unlock()
	t.giveTurn(name) // granted as ctx ended: pass it on
	return fmt.Errorf("waiting for the command before it in session %q: %w", name, context.Cause(ctx))
}

// giveTurn ends a command's turn in session name: the next in line, if
// any, has it.
func (t *sessionTable) giveTurn(name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	q := t.turns[name]
	if q == nil {
		return
	}
	if len(q.waiters) > 0 {
		ch := q.waiters[0]
		q.waiters = q.waiters[1:]
		close(ch)
		return
	}
	delete(t.turns, name)
}

// startSession readies a command of session name in running sandbox sb
// (b's): it waits for the session's turn, writes the session's kept state
// into the sandbox if this sandbox has not run the session yet (through
// the credential guard), and gives the command's arguments. The turn is
// the caller's until finish (or release, on a failure before the start).
func (m *Manager) startSession(ctx context.Context, b *box, sb *Sandbox, req ExecRequest) (*sessionRun, error) {
	name := req.Session
	if !sessionName.MatchString(name) || name == "." || name == ".." {
		return nil, fmt.Errorf("%w: session name %q: want 1 to 128 letters, digits, '.', '_' or '-'", ErrBadInput, name)
	}
	t := &b.sessions
	if err := t.takeTurn(ctx, name, req.Queued); err != nil {
		return nil, err
	}
	r := &sessionRun{m: m, b: b, sb: sb, name: name}
	t.mu.Lock()
	err := m.loadSessions(ctx, b.id, t)
	s, kept := t.m[name]
	seeded := t.seeded[name]
	bash, looked := t.bash, t.bashLooked
	t.mu.Unlock()
	if err != nil {
		r.release()
		return nil, err
	}
	if !looked {
		for _, p := range bashPaths {
			if fi, err := sb.Stat(ctx, p); err == nil && !fi.IsDir() {
				bash = p
				break
			}
		}
		t.mu.Lock()
		t.bash, t.bashLooked = bash, true
		t.mu.Unlock()
	}
	r.args = sessionArgs(bash, name, req.Dir, req.Args)
	if !seeded {
		seed := sessionSeed(s, kept)
		if err := sb.relay.Transforms().Guard().Check(whereSession, seed); err != nil {
			r.release()
			return nil, err
		}
		if _, err := sb.WriteFile(ctx, r.statePath(".sh"), strings.NewReader(seed), agent.WriteOptions{Perm: 0o600}); err != nil {
			r.release()
			return nil, fmt.Errorf("sandbox %s: writing session %s's state: %w", b.id, name, err)
		}
		t.mu.Lock()
		if t.seeded == nil {
			t.seeded = map[string]bool{}
		}
		t.seeded[name] = true
		t.mu.Unlock()
	}
	return r, nil
}

func (r *sessionRun) statePath(ext string) string { return path.Join(sessionStateDir, r.name+ext) }

// release gives the turn up without reading the state back: the command
// did not start.
func (r *sessionRun) release() { r.b.sessions.giveTurn(r.name) }

// finish reads the session's state back once its command ended, keeps
// its directory and exported variables with the sandbox's sessions (in
// the store, when they changed), and gives the turn up.
func (r *sessionRun) finish() {
	defer r.release()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := r.readState(ctx)
	if err != nil {
		if r.sb.Context().Err() == nil {
			r.m.log.Info("a session's state could not be read back: its next command starts where the one before this did", "sandbox", r.b.id, "session", r.name, "err", err)
		}
		return
	}
	t := &r.b.sessions
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := r.m.loadSessions(ctx, r.b.id, t); err != nil {
		r.m.log.Warn("keeping a session's state failed", "sandbox", r.b.id, "session", r.name, "err", err)
		return
	}
	old, ok := t.m[r.name]
	if !ok || old.Dir == s.Dir && maps.Equal(old.Env, s.Env) && slices.Equal(old.Unset, s.Unset) {
		return // unchanged, or not a session of the sandbox's (deleted meanwhile)
	}
	next := maps.Clone(t.m)
	next[r.name] = s
	if err := r.m.writeSessions(ctx, r.b.id, t, next); err != nil {
		r.m.log.Warn("keeping a session's state in the store failed: a suspend loses what its last commands changed", "sandbox", r.b.id, "session", r.name, "err", err)
		return
	}
	t.m = next
}

// readState reads what the session's shell saved: its directory, its
// exported variables and those it unset (parseSessionState).
func (r *sessionRun) readState(ctx context.Context) (Session, error) {
	rc, _, err := r.sb.ReadFile(ctx, r.statePath(".env"))
	if err != nil {
		return Session{}, err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, maxSessionState+1))
	if err != nil {
		return Session{}, err
	}
	if len(data) > maxSessionState {
		return Session{}, fmt.Errorf("its directory and variables are over %d bytes", maxSessionState)
	}
	return parseSessionState(data)
}

// parseSessionState reads a session's state as its shell wrote it (what
// the sandbox wrote: checked, never trusted): its directory, then
// NAME=VALUE for a variable set and -NAME for one unset, each ended by a
// NUL byte.
func parseSessionState(data []byte) (Session, error) {
	fields := bytes.Split(data, []byte{0})
	if len(fields) < 2 || len(fields[len(fields)-1]) != 0 {
		return Session{}, errors.New("not a session state: want NUL-ended fields")
	}
	fields = fields[:len(fields)-1]
	dir := string(fields[0])
	if !path.IsAbs(dir) {
		return Session{}, fmt.Errorf("not a session state: directory %q is not absolute", dir)
	}
	s := Session{Dir: dir}
	for _, f := range fields[1:] {
		if name, ok := bytes.CutPrefix(f, []byte("-")); ok {
			if !envName.Match(name) {
				return Session{}, fmt.Errorf("not a session state: unset %q", name)
			}
			s.Unset = append(s.Unset, string(name))
			continue
		}
		name, value, ok := bytes.Cut(f, []byte("="))
		if !ok || !envName.Match(name) {
			return Session{}, fmt.Errorf("not a session state: variable %q", truncate(string(f), 64))
		}
		if s.Env == nil {
			s.Env = map[string]string{}
		}
		s.Env[string(name)] = string(value)
	}
	slices.Sort(s.Unset)
	return s, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// sessionSeed is a session's kept state as a shell script its shell
// sources: its directory, the variables it set and those it unset (sh
// reads it too). A session not kept starts where its first command does.
func sessionSeed(s Session, kept bool) string {
	var b strings.Builder
	if kept && s.Dir != "" {
		b.WriteString("cd -- " + shellQuote(s.Dir) + " 2>/dev/null\n")
	}
	for _, k := range slices.Sorted(maps.Keys(s.Env)) {
		if envName.MatchString(k) {
			b.WriteString("export " + k + "=" + shellQuote(s.Env[k]) + "\n")
		}
	}
	for _, k := range s.Unset {
		if envName.MatchString(k) {
			b.WriteString("unset -v " + k + "\n")
		}
	}
	return b.String()
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
