package audit

import "strings"

// MaxCmd is the most bytes of a command line an event keeps.
const MaxCmd = 256

// Redacted replaces what CommandLine takes out of a command line.
const Redacted = "[REDACTED]"

// CommandLine renders a process's arguments as an event's "cmd": joined by
// spaces, control characters made '?', credentials a command line commonly
// carries redacted, then cut to MaxCmd bytes. Redacted are: the user
// information of a URL (https://user:token@host, https://token@host), the
// value of a credential header given as an argument ("Authorization:
// Bearer …", X-Api-Key, Api-Key, Cookie, Proxy-Authorization,
// Private-Token), the value of a flag whose name says it holds one
// (--token=…, --password …, --api-key …, --secret …), and of a variable
// assignment whose name does (GITHUB_TOKEN=…, AWS_SECRET_ACCESS_KEY=…). It
// cannot know every spelling: the service's own secrets never reach a
// sandbox (the credential guard), and the proxy also replaces a command
// line that holds one of the sandbox's secrets whole.
func CommandLine(args []string) string {
	var b strings.Builder
	redactNext := false
	for i, a := range args {
		if b.Len() > MaxCmd {
			break
		}
		if i > 0 {
			b.WriteByte(' ')
		}
		switch {
		case redactNext:
			a, redactNext = Redacted, false
		default:
			a, redactNext = redactArg(a)
		}
		for _, r := range strings.ToValidUTF8(a, "\uFFFD") {
			if r < 0x20 || r == 0x7f {
				r = '?'
			}
			b.WriteRune(r)
		}
	}
	return Truncate(b.String(), MaxCmd)
}

// credentialHeaders are headers whose value is a credential, lower case.
var credentialHeaders = []string{"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "private-token", "x-auth-token"}

// secretWords mark a flag or variable name whose value is a credential.
var secretWords = []string{"token", "password", "passwd", "secret", "apikey", "api-key", "api_key", "credential", "private-key", "private_key", "auth"}

// redactArg returns arg with a credential in it redacted, and whether the
// next argument is a flag's value to redact.
func redactArg(arg string) (string, bool) {
	lower := strings.ToLower(arg)
	for _, h := range credentialHeaders {
		if rest, ok := strings.CutPrefix(lower, h); ok && strings.HasPrefix(strings.TrimLeft(rest, " \t"), ":") {
			return arg[:len(h)] + ": " + Redacted, false
		}
	}
	if strings.HasPrefix(arg, "-") {
		name, _, hasValue := strings.Cut(strings.TrimLeft(lower, "-"), "=")
		if secretName(name) {
			if hasValue {
				return arg[:strings.IndexByte(arg, '=')+1] + Redacted, false
			}
			return arg, true
		}
		return redactURLs(arg), false
	}
	if name, _, ok := strings.Cut(arg, "="); ok && isVarName(name) && secretName(strings.ToLower(name)) {
		return name + "=" + Redacted, false
	}
	return redactURLs(arg), false
}

func secretName(name string) bool {
	for _, w := range secretWords {
		if strings.Contains(name, w) {
			return true
		}
	}
	return false
}

func isVarName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// redactURLs replaces the user information of every URL in s
// (scheme://userinfo@host) with Redacted.
func redactURLs(s string) string {
	var b strings.Builder
	for {
		i := strings.Index(s, "://")
		if i < 0 {
			break
		}
		b.WriteString(s[:i+3])
		s = s[i+3:]
		end := strings.IndexAny(s, "/?# \t")
		if end < 0 {
			end = len(s)
		}
		if at := strings.LastIndexByte(s[:end], '@'); at >= 0 {
			b.WriteString(Redacted)
			s = s[at:]
		}
	}
	b.WriteString(s)
	return b.String()
}
