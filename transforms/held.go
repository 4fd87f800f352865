package transforms

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Held secrets. A RuleSet never forgets a secret it held: when a change of
// its rules (Set, with other secrets or none) takes one away, the secret is
// retired, not dropped, and the responses of the hosts its rules targeted
// go on being scrubbed of it (whole and in runs, each byte replaced by
// PartialMask: a retired secret has no placeholder the sandbox still
// uses), the credential guard goes on refusing it, and a tunnel to those
// hosts is still carried only where it is scrubbed (Targets). An upstream
// may hand a key back long after it was sent it; rotating the key must not
// make it readable.
//
// The set keeps them for as long as it lives; a sandbox keeps them for its
// whole life across suspend, resume and shards by writing them, sealed
// (Seal: AES-256-GCM under a service's SealKey, bound to the sandbox), into
// its record, and reading them back into the set it resumes with (Unseal).
// Forget drops everything, held secrets included: the set then holds
// nothing a sandbox ever gave it.

// MaxHeldSecrets bounds the distinct secrets a sandbox's set holds and has
// held: each stays scrubbed for the sandbox's life, so the service refuses
// rules that would take it past (see [RuleSet.HeldWith]); Set and Add do
// not check it.
const MaxHeldSecrets = 256

// heldSecret is one secret a set holds or held. It is immutable.
type heldSecret struct {
	name  string
	value string        // "" when it is sealed under a key this service does not have
	hosts []hostMatcher // the match.host of every rule that held it
	// masked is the secret with a mask of its own length for placeholder:
	// what its retired occurrences are replaced by.
	masked *Secret
	// sealed is the secret as read from a record, when it cannot be
	// opened here (another key, or altered): it is written back as it
	// was, and its hosts are refused (see Unscrubbable).
	sealed *SealedSecret
}

func (h *heldSecret) targets(host string) bool {
	for _, m := range h.hosts {
		if m.targets(host) {
			return true
		}
	}
	return false
}

// hostPatterns are h's host patterns, as written.
func (h *heldSecret) hostPatterns() []string {
	out := make([]string, len(h.hosts))
	for i, m := range h.hosts {
		out[i] = m.pattern
	}
	return out
}

// newHeld is a held secret readable here.
func newHeld(name, value string, hosts []hostMatcher) *heldSecret {
	return &heldSecret{name: name, value: value, hosts: hosts,
		masked: newSecret(name, value, strings.Repeat(string(PartialMask), len(value)))}
}

// addHeld returns held with the secrets of rules added (a secret already
// held gains the rules' hosts), or held itself when nothing is new. held is
// not modified.
func addHeld(held []*heldSecret, rules []Rule) []*heldSecret {
	out := held
	copied := false
	for i := range rules {
		r := &rules[i]
		for _, sec := range r.secrets {
			j := slices.IndexFunc(out, func(h *heldSecret) bool { return h.value == sec.value && h.sealed == nil })
			switch {
			case j < 0:
				if !copied {
					out, copied = slices.Clone(out), true
				}
				out = append(out, newHeld(sec.name, sec.value, []hostMatcher{r.host}))
			case !slices.Contains(out[j].hosts, r.host):
				if !copied {
					out, copied = slices.Clone(out), true
				}
				h := *out[j]
				h.hosts = append(slices.Clone(h.hosts), r.host)
				out[j] = &h
			}
		}
	}
	return out
}

// heldCount is how many distinct secrets held holds after rules were
// added.
func heldCount(held []*heldSecret, rules []Rule) int {
	return len(addHeld(held, rules))
}

// SealedSecret is a secret a sandbox's rules hold or held, as its record in
// the store keeps it: its value sealed (AES-256-GCM) under a service's
// [SealKey] and bound to the sandbox, its label and hosts, and the id of
// the key. It holds nothing a reader of the store can recover the value
// from without the key.
type SealedSecret struct {
	// Name is the secret's label (the variable it was read from). Not
	// secret.
	Name string `json:"name"`
	// Hosts are the match.host patterns of the rules that held it: the
	// hosts whose responses are scrubbed of it.
	Hosts []string `json:"hosts"`
	// Key is the id of the SealKey that sealed it.
	Key string `json:"key"`
	// Sealed is a random nonce followed by the value sealed with AES-GCM,
	// its additional data binding the sandbox, Name and Hosts.
	Sealed []byte `json:"sealed"`
}

// SealKey seals the secrets a sandbox's rules have held for its record (see
// [RuleSet.Seal]). Every service that may resume a sandbox needs the key it
// was sealed with. Like a Secret, it prints, logs and marshals as
// [Redacted].
type SealKey struct {
	redacted
	id   string
	aead cipher.AEAD
}

// MinSealKeyMaterial is the least key material NewSealKey takes.
const MinSealKeyMaterial = 16

// NewSealKey derives a seal key from material (HKDF-SHA256): the same
// material gives the same key, and the same id, on every service.
func NewSealKey(material []byte) (*SealKey, error) {
	if len(material) < MinSealKeyMaterial {
		return nil, fmt.Errorf("transforms: seal key material is %d bytes; at least %d are needed", len(material), MinSealKeyMaterial)
	}
	key, err := hkdf.Key(sha256.New, material, nil, "sandgate held-secrets seal key v1", 32)
	if err != nil {
		return nil, err
	}
	id, err := hkdf.Key(sha256.New, material, nil, "sandgate held-secrets seal key id v1", 8)
	if err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	clear(key)
	return &SealKey{id: hex.EncodeToString(id), aead: aead}, nil
}

// ID names the key (a digest of its material, not secret): a sealed secret
// records the id of the key that sealed it.
func (k *SealKey) ID() string { return k.id }

// sealAAD is what a sealed value is bound to.
func sealAAD(sandbox, name string, hosts []string) []byte {
	return []byte("sandgate held secret v1\x00" + sandbox + "\x00" + name + "\x00" + strings.Join(hosts, "\x00"))
}

func (k *SealKey) seal(sandbox string, h *heldSecret) SealedSecret {
	hosts := h.hostPatterns()
	nonce := make([]byte, k.aead.NonceSize(), k.aead.NonceSize()+len(h.value)+k.aead.Overhead())
	rand.Read(nonce)
	plain := []byte(h.value)
	sealed := k.aead.Seal(nonce, nonce, plain, sealAAD(sandbox, h.name, hosts))
	clear(plain)
	return SealedSecret{Name: h.name, Hosts: hosts, Key: k.id, Sealed: sealed}
}

// open returns the value of s, sealed for sandbox under k.
func (k *SealKey) open(sandbox string, s SealedSecret) (string, error) {
	if s.Key != k.id {
		return "", fmt.Errorf("sealed under key %s; this service's is %s", s.Key, k.id)
	}
	n := k.aead.NonceSize()
	if len(s.Sealed) < n+k.aead.Overhead() {
		return "", errors.New("altered: too short")
	}
	plain, err := k.aead.Open(nil, s.Sealed[:n], s.Sealed[n:], sealAAD(sandbox, s.Name, s.Hosts))
	if err != nil {
		return "", errors.New("altered, or sealed for another sandbox")
	}
	v := string(plain)
	clear(plain)
	if checkSecret(s.Name, v, Redacted) != nil {
		return "", errors.New("not a valid secret")
	}
	return v, nil
}

// ErrSealed matches the error of [RuleSet.Unseal] for secrets it could not
// open, and that of a request to one of their hosts ([UnscrubbableError]).
var ErrSealed = errors.New("transforms: a held secret sealed under a key this service does not have")

// UnsealError says which sealed secrets could not be opened, and why. It
// names them by label and host, never by value.
type UnsealError struct {
	Names   []string // their labels
	Hosts   []string // the hosts they were for
	Reasons []string // per secret, why
}

func (e *UnsealError) Error() string {
	return fmt.Sprintf("%d held credentials (%s) could not be unsealed (%s): the responses of their hosts (%s) cannot be scrubbed of them, so those hosts are refused to the sandbox; give this service the seal key of the service that sealed them (SANDGATE_SEAL_KEY)",
		len(e.Names), strings.Join(e.Names, ", "), strings.Join(e.Reasons, "; "), strings.Join(e.Hosts, ", "))
}

// Is makes errors.Is(err, ErrSealed) true.
func (e *UnsealError) Is(target error) bool { return target == ErrSealed }

// UnscrubbableError refuses a request to a host that a held secret this
// service cannot open targets: its responses could not be scrubbed of it.
type UnscrubbableError struct {
	Host string
	Name string // the secret's label
}

func (e *UnscrubbableError) Error() string {
	return fmt.Sprintf("%s may hand back a credential this sandbox's rules held (%s), which is sealed under a seal key this service does not have, so its answers cannot be scrubbed of it: it is refused here; give every service the same seal key (SANDGATE_SEAL_KEY)", e.Host, e.Name)
}

// Is makes errors.Is(err, ErrSealed) true.
func (e *UnscrubbableError) Is(target error) bool { return target == ErrSealed }

// Seal returns every secret the set holds or has held, sealed under k for
// sandbox (in the order they were first held): what the sandbox's record
// keeps, so that the set it is resumed with goes on scrubbing them. Secrets
// the set could not open (Unseal) are returned as they were read.
func (s *RuleSet) Seal(k *SealKey, sandbox string) []SealedSecret {
	return s.SealWith(k, sandbox)
}

// SealWith is Seal of what the set would hold once rules were added to it
// (by Set or Add): what the sandbox's record must keep before the change
// is made.
func (s *RuleSet) SealWith(k *SealKey, sandbox string, rules ...Rule) []SealedSecret {
	var held []*heldSecret
	if l := s.cur.Load(); l != nil {
		held = l.held
	}
	held = addHeld(held, rules)
	if len(held) == 0 {
		return nil
	}
	out := make([]SealedSecret, 0, len(held))
	for _, h := range held {
		if h.sealed != nil {
			out = append(out, *h.sealed)
			continue
		}
		out = append(out, k.seal(sandbox, h))
	}
	return out
}

// Unseal adds secrets sealed under k for sandbox (by Seal) to those the
// set has held: responses of their hosts are scrubbed of them, the guard
// refuses them, and tunnels to their hosts are carried only where they are
// scrubbed. Those it cannot open (sealed under another key, or altered)
// are kept as they are, for Seal to write back, and their hosts are
// refused (Unscrubbable); the error, an *UnsealError, names them.
func (s *RuleSet) Unseal(k *SealKey, sandbox string, sealed []SealedSecret) error {
	if len(sealed) == 0 {
		return nil
	}
	var bad UnsealError
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.cur.Load()
	var rules []Rule
	var held []*heldSecret
	if l != nil {
		rules, held = l.rules, slices.Clone(l.held)
	}
	for _, ss := range sealed {
		hosts := make([]hostMatcher, 0, len(ss.Hosts))
		for _, p := range ss.Hosts {
			m, err := parseHostPattern(p)
			if err != nil {
				m = hostMatcher{} // a host matcher of nothing targets every host: refused everywhere
			}
			hosts = append(hosts, m)
		}
		v, err := k.open(sandbox, ss)
		if err != nil {
			bad.Names = append(bad.Names, ss.Name)
			bad.Hosts = append(bad.Hosts, ss.Hosts...)
			bad.Reasons = append(bad.Reasons, ss.Name+": "+err.Error())
			held = append(held, &heldSecret{name: ss.Name, hosts: hosts, sealed: &ss})
			continue
		}
		if j := slices.IndexFunc(held, func(h *heldSecret) bool { return h.value == v && h.sealed == nil }); j >= 0 {
			h := *held[j]
			h.hosts = slices.Clone(h.hosts)
			for _, m := range hosts {
				if !slices.Contains(h.hosts, m) {
					h.hosts = append(h.hosts, m)
				}
			}
			held[j] = &h
			continue
		}
		held = append(held, newHeld(ss.Name, v, hosts))
	}
	s.cur.Store(newRuleList(rules, held))
	if len(bad.Names) > 0 {
		return &bad
	}
	return nil
}

// Forget drops every rule and every secret the set has held: what is done
// once the sandbox stops running, so that nothing of its secrets stays in
// memory (its record keeps them sealed).
func (s *RuleSet) Forget() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur.Store(newRuleList(nil, nil))
}

// Held returns how many distinct secrets the set holds or has held.
func (s *RuleSet) Held() int {
	if l := s.cur.Load(); l != nil {
		return len(l.held)
	}
	return 0
}

// HeldWith returns how many distinct secrets the set would hold or have
// held once rules were added to it (by Set or Add): more than
// MaxHeldSecrets is too many.
func (s *RuleSet) HeldWith(rules ...Rule) int {
	var held []*heldSecret
	if l := s.cur.Load(); l != nil {
		held = l.held
	}
	return heldCount(held, rules)
}

// Unscrubbable reports whether a held secret the set cannot open (see
// Unseal) targets host, and returns the refusal of a request to it.
func (s *RuleSet) Unscrubbable(host string) (*UnscrubbableError, bool) {
	l := s.cur.Load()
	if l == nil || !l.sealed {
		return nil, false
	}
	host = canonicalHost(host)
	for _, h := range l.held {
		if h.sealed != nil && h.targets(host) {
			return &UnscrubbableError{Host: host, Name: h.name}, true
		}
	}
	return nil, false
}
