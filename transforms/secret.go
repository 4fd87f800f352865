package transforms

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// Redacted is what a [Secret] prints, logs and marshals as.
const Redacted = "[REDACTED]"

// MinSecretLen is the shortest secret accepted. Response scrubbing replaces
// every occurrence of a secret, so a very short one would mangle ordinary
// text; real credentials are far longer.
const MinSecretLen = 8

// PlaceholderPrefix starts the default placeholder of a secret read from the
// environment: "sandgate-placeholder-" followed by the variable's name.
const PlaceholderPrefix = "sandgate-placeholder-"

// Secret is a credential that the sandbox never sees: the sandbox holds its
// placeholder, the proxy swaps the value in on the way out and swaps it back
// out of responses.
//
// Every way of printing a Secret — String, GoString, fmt with any verb,
// log/slog, encoding/json, encoding.TextMarshaler — yields [Redacted]. There
// is no exported accessor for the value: only this package's swap and
// scrubbers read it. Use *Secret in structs; a nil *Secret is not valid.
type Secret struct {
	redacted
	name        string // label, e.g. the environment variable; not secret
	placeholder string
	value       string
	// scrub scrubs this secret alone, built once (newSecret): most
	// requests swap in one secret, and their responses then need no
	// scrubber of their own.
	scrub *scrubber
}

// newSecret builds a valid secret with its scrubber.
func newSecret(name, value, placeholder string) *Secret {
	s := &Secret{name: name, placeholder: placeholder, value: value}
	s.scrub = buildScrubber([]*Secret{s})
	return s
}

// NewSecret returns a secret with the given label (for audit and errors; not
// secret), value and placeholder. An empty placeholder means
// PlaceholderPrefix+name. The value must be at least [MinSecretLen] bytes and
// valid in an HTTP header; the placeholder must be valid in a header and must
// not contain the value. Errors never contain the value.
func NewSecret(name, value, placeholder string) (*Secret, error) {
	if placeholder == "" {
		placeholder = PlaceholderPrefix + name
	}
	if err := checkSecret(name, value, placeholder); err != nil {
		return nil, err
	}
	return newSecret(name, value, placeholder), nil
}

// checkSecret validates a secret; its messages name the secret by label only.
func checkSecret(name, value, placeholder string) error {
	switch {
	case value == "":
		return fmt.Errorf("secret %s is empty", name)
	case len(value) < MinSecretLen:
		return fmt.Errorf("secret %s is shorter than %d bytes; so short a value cannot be scrubbed from responses without mangling them", name, MinSecretLen)
	case !httpguts.ValidHeaderFieldValue(value) || strings.TrimSpace(value) != value:
		return fmt.Errorf("secret %s holds characters not allowed in an HTTP header value (control characters, or leading/trailing space)", name)
	case placeholder == "" || !httpguts.ValidHeaderFieldValue(placeholder) || strings.TrimSpace(placeholder) != placeholder:
		return fmt.Errorf("placeholder of secret %s must be a non-empty HTTP header value without control characters or surrounding space", name)
	case strings.Contains(placeholder, value):
		return fmt.Errorf("placeholder of secret %s contains the secret's value; choose another placeholder", name)
	}
	return nil
}

// Name returns the secret's label (for a secret from a rules file, the
// environment variable it was read from). It is not secret.
func (s Secret) Name() string { return s.name }

// Placeholder returns the text that stands for the secret inside the
// sandbox and replaces it in scrubbed responses.
func (s Secret) Placeholder() string { return s.placeholder }

// reveal returns the value. It is for the swap and the scrubbers only.
func (s *Secret) reveal() string { return s.value }

// redacted, embedded in a type that holds a secret (Secret, Guard,
// SealKey), makes it print, log and marshal as [Redacted].
type redacted struct{}

// String returns [Redacted].
func (redacted) String() string { return Redacted }

// GoString returns [Redacted], so %#v prints no value either.
func (redacted) GoString() string { return Redacted }

// Format prints [Redacted] whatever the verb and flags (%v, %+v, %#v, %s,
// %q, %x, %d, ...).
func (redacted) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, Redacted) }

// LogValue makes log/slog print [Redacted].
func (redacted) LogValue() slog.Value { return slog.StringValue(Redacted) }

// MarshalJSON encodes the value as the JSON string "[REDACTED]".
func (redacted) MarshalJSON() ([]byte, error) { return []byte(`"` + Redacted + `"`), nil }

// MarshalText encodes the secret as [Redacted].
func (s Secret) MarshalText() ([]byte, error) { return []byte(Redacted), nil }

// GobEncode refuses: a secret is never serialised.
func (s Secret) GobEncode() ([]byte, error) {
	return nil, errors.New("transforms: a Secret cannot be encoded")
}

var (
	_ fmt.Stringer   = Secret{}
	_ fmt.GoStringer = Secret{}
	_ fmt.Formatter  = Secret{}
	_ slog.LogValuer = Secret{}
)
