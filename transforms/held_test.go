package transforms

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
)

// oldKey and newKey are a credential before and after a rotation.
const (
	oldKey = "sk-old-key-5Rr8qWm2Lx7Tn4Vb9Kc1"
	newKey = "sk-new-key-8Hd3Jf6Pz1Qs5Wy2Ge7"
)

// keyRules are the rules of api.example.com sending key as X-Api-Key.
func keyRules(t testing.TB, key string) []Rule {
	rules, err := ParseRules([]byte(`[{"match":{"host":"api.example.com"},"transform":{"headers":{"x-api-key":{"env":"KEY"}}}}]`),
		func(string) (string, bool) { return key, true })
	if err != nil {
		panic(err)
	}
	return rules
}

// echoed is what a sandbox reads of an answer of host quoting text in a
// header and its body, under the set's current rules.
func echoed(t *testing.T, set *RuleSet, host, text string) string {
	t.Helper()
	req := newReq(t, "GET", "https://"+host+"/v1/x")
	a := set.Apply(req)
	resp := &http.Response{StatusCode: 200, Header: http.Header{"X-Echo": {text}}, ContentLength: -1,
		Body: io.NopCloser(strings.NewReader(text)), Request: req}
	if err := a.ScrubResponse(resp); err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if h := resp.Header.Get("X-Echo"); h != string(b) {
		t.Fatalf("header %q, body %q: scrubbed differently", h, b)
	}
	return string(b)
}

// mask is n mask bytes.
func mask(n int) string { return strings.Repeat(string(PartialMask), n) }

// TestRetiredSecretStaysScrubbed: after the rules were replaced, with
// another secret or with none, an upstream that handed back the earlier
// key delivered it in clear. A secret the set held is scrubbed from the
// answers of the hosts its rules targeted for as long as the set lives
// (whole and in runs, each byte masked), refused by the guard, and its
// hosts stay targeted.
func TestRetiredSecretStaysScrubbed(t *testing.T) {
	for _, next := range []struct {
		name  string
		rules []Rule
	}{{"a new secret", keyRules(t, newKey)}, {"no rules", nil}} {
		t.Run(next.name, func(t *testing.T) {
			set := NewRuleSet(keyRules(t, oldKey)...)
			if got := echoed(t, set, "api.example.com", "key "+oldKey); got != "key "+PlaceholderPrefix+"KEY" {
				t.Fatalf("before: %q", got)
			}
			set.Set(next.rules...)
			for in, want := range map[string]string{
				"key " + oldKey:                     "key " + mask(len(oldKey)),
				"cut " + oldKey[:len(oldKey)-1]:     "cut " + mask(len(oldKey)-1),
				"mid " + oldKey[4:4+MinPartialRun]:  "mid " + mask(MinPartialRun),
				"short " + oldKey[:MinPartialRun-1]: "short " + oldKey[:MinPartialRun-1],
			} {
				if got := echoed(t, set, "api.example.com", in); got != want {
					t.Errorf("after the change, %q came back as %q, want %q", in, got, want)
				}
			}
			if next.rules != nil {
				if got := echoed(t, set, "api.example.com", "key "+newKey+" and "+oldKey); got != "key "+PlaceholderPrefix+"KEY and "+mask(len(oldKey)) {
					t.Errorf("both keys came back as %q", got)
				}
			}
			// Another host never received it: its answers pass.
			if got := echoed(t, set, "other.example.com", oldKey); got != oldKey {
				t.Errorf("another host's answer: %q", got)
			}
			if name, ok := set.Targets("API.example.com."); !ok || (next.rules == nil && !strings.Contains(name, "held credential KEY (api.example.com)")) {
				t.Errorf("Targets after the change: %q %v", name, ok)
			}
			if err := set.Guard().Check("the command", "echo "+oldKey[2:]); !errors.Is(err, ErrCredential) {
				t.Errorf("the guard let the retired key in: %v", err)
			}
			if set.Held() != 1+len(next.rules) {
				t.Errorf("Held() = %d", set.Held())
			}
			set.Forget()
			if set.Held() != 0 || set.Len() != 0 || !set.Guard().Empty() {
				t.Errorf("after Forget: %d held, %d rules", set.Held(), set.Len())
			}
			if _, ok := set.Targets("api.example.com"); ok {
				t.Errorf("after Forget the host is still targeted")
			}
		})
	}
}

// A secret held under two rules' hosts is scrubbed from the answers of
// both; setting the same secret again holds it once.
func TestHeldSecretsMerge(t *testing.T) {
	set := NewRuleSet(keyRules(t, oldKey)...)
	other, err := ParseRules([]byte(`[{"match":{"host":"*.other.example"},"transform":{"headers":{"authorization":{"env":"KEY","prefix":"Bearer "}}}}]`),
		func(string) (string, bool) { return oldKey, true })
	if err != nil {
		t.Fatal(err)
	}
	set.Set(other...)
	set.Set(keyRules(t, oldKey)...)
	set.Set()
	if set.Held() != 1 {
		t.Fatalf("Held() = %d, want the one secret", set.Held())
	}
	for _, host := range []string{"api.example.com", "a.other.example"} {
		if got := echoed(t, set, host, oldKey); got != mask(len(oldKey)) {
			t.Errorf("%s: %q", host, got)
		}
	}
	if n := set.HeldWith(keyRules(t, newKey)...); n != 2 {
		t.Errorf("HeldWith a new secret = %d, want 2", n)
	}
	if n := set.HeldWith(keyRules(t, oldKey)...); n != 1 {
		t.Errorf("HeldWith the same secret = %d, want 1", n)
	}
}

// Seal and Unseal carry what a set held to the set a sandbox resumes with:
// under the same key and for the same sandbox only.
func TestSealedHeldSecrets(t *testing.T) {
	k, err := NewSealKey([]byte("a service's seal key material, 32+ bytes"))
	if err != nil {
		t.Fatal(err)
	}
	set := NewRuleSet(keyRules(t, oldKey)...)
	set.Set(keyRules(t, newKey)...)
	sealed := set.Seal(k, "sb-1")
	if len(sealed) != 2 {
		t.Fatalf("sealed %d secrets, want 2", len(sealed))
	}
	js, _ := json.Marshal(sealed)
	for _, key := range []string{oldKey, newKey} {
		for i := 0; i+MinPartialRun <= len(key); i++ {
			if strings.Contains(string(js), key[i:i+MinPartialRun]) {
				t.Fatalf("the sealed form holds a run of a key: %s", js)
			}
		}
	}
	if !strings.Contains(string(js), `"hosts":["api.example.com"]`) || !strings.Contains(string(js), `"name":"KEY"`) || !strings.Contains(string(js), `"key":"`+k.ID()+`"`) {
		t.Errorf("sealed: %s", js)
	}

	// Resumed with other rules, on a service with the same key material.
	k2, _ := NewSealKey([]byte("a service's seal key material, 32+ bytes"))
	resumed := NewRuleSet()
	if err := resumed.Unseal(k2, "sb-1", sealed); err != nil {
		t.Fatal(err)
	}
	if got := echoed(t, resumed, "api.example.com", oldKey+" "+newKey); got != mask(len(oldKey))+" "+mask(len(newKey)) {
		t.Errorf("after Unseal: %q", got)
	}
	if resumed.Held() != 2 || resumed.Guard().Check("x", newKey) == nil {
		t.Errorf("after Unseal: %d held, guard %v", resumed.Held(), resumed.Guard().Check("x", newKey))
	}
	// The current rules' secret and a sealed one of the same value are one.
	again := NewRuleSet(keyRules(t, newKey)...)
	if err := again.Unseal(k2, "sb-1", sealed); err != nil || again.Held() != 2 {
		t.Errorf("Unseal over the rules: %v, %d held", err, again.Held())
	}
	if got := echoed(t, again, "api.example.com", newKey); got != PlaceholderPrefix+"KEY" {
		t.Errorf("the current secret: %q, want its placeholder", got)
	}

	// Another key, another sandbox, an altered seal: not opened; kept as
	// they were, their hosts refused.
	other, _ := NewSealKey([]byte("another service's key material, 32+ bytes"))
	altered := append([]SealedSecret(nil), sealed...)
	altered[0].Sealed = append([]byte(nil), altered[0].Sealed...)
	altered[0].Sealed[20] ^= 1
	moved := append([]SealedSecret(nil), sealed...)
	moved[1].Hosts = []string{"attacker.example"}
	for _, tc := range []struct {
		name    string
		k       *SealKey
		sandbox string
		sealed  []SealedSecret
		bad     int
	}{
		{"another key", other, "sb-1", sealed, 2},
		{"another sandbox", k2, "sb-2", sealed, 2},
		{"altered", k2, "sb-1", altered, 1},
		{"its hosts changed", k2, "sb-1", moved, 1},
	} {
		s := NewRuleSet()
		err := s.Unseal(tc.k, tc.sandbox, tc.sealed)
		var ue *UnsealError
		if !errors.Is(err, ErrSealed) || !errors.As(err, &ue) || len(ue.Names) != tc.bad {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if strings.Contains(err.Error(), oldKey[:MinPartialRun]) || strings.Contains(err.Error(), newKey[:MinPartialRun]) {
			t.Errorf("%s: the error holds a key: %v", tc.name, err)
		}
		host := "api.example.com"
		if tc.name == "its hosts changed" {
			host = "attacker.example"
		}
		if ue, ok := s.Unscrubbable(host); !ok || !errors.Is(ue, ErrSealed) {
			t.Errorf("%s: %s is not refused", tc.name, host)
		}
		if _, ok := s.Targets(host); !ok {
			t.Errorf("%s: %s is not targeted", tc.name, host)
		}
		x, err := Chain{Rules: s}.Request(t.Context(), newReq(t, "GET", "https://"+host+"/v1"), RequestInfo{})
		if !errors.Is(err, ErrSealed) {
			t.Errorf("%s: a request to %s: %v, want it refused", tc.name, host, err)
		}
		x.Close()
		if got := s.Seal(k2, tc.sandbox); len(got) != len(tc.sealed) {
			t.Errorf("%s: sealed again %d, want %d", tc.name, len(got), len(tc.sealed))
		} else if g, _ := json.Marshal(got); tc.name == "another key" && string(g) != string(js) {
			t.Errorf("%s: not written back as read:\n%s\n%s", tc.name, g, js)
		}
	}
	if _, err := NewSealKey([]byte("short")); err == nil {
		t.Errorf("a seal key of 5 bytes was accepted")
	}
}

// A SealKey prints nothing of itself.
func TestSealKeyPrintsRedacted(t *testing.T) {
	k, _ := NewSealKey([]byte("key material that must not print"))
	var logged strings.Builder
	slog.New(slog.NewJSONHandler(&logged, nil)).Info("k", "k", k, "v", *k)
	js, _ := json.Marshal(map[string]any{"k": k})
	for _, s := range []string{fmt.Sprint(k), fmt.Sprintf("%v %+v %#v %s %x", k, k, k, k, k), fmt.Sprintf("%+v", *k), logged.String(), string(js)} {
		if !strings.Contains(s, Redacted) || strings.Contains(s, "material") {
			t.Errorf("a seal key printed %q", s)
		}
	}
}

// FuzzUnseal: whatever a record in the store says of a sandbox's held
// secrets, Unseal neither panics nor opens what it did not seal, keeps each
// entry it cannot open as it was, and what it opens is scrubbed.
func FuzzUnseal(f *testing.F) {
	k, _ := NewSealKey([]byte("the fuzz target's seal key, 32 bytes+"))
	good := NewRuleSet(keyRules(nil, oldKey)...).Seal(k, "sb")[0]
	f.Add(good.Name, "api.example.com", good.Key, good.Sealed, "sb")
	f.Add("K", "*.example.com", k.ID(), []byte("short"), "sb")
	f.Add("", "bad host/", "", []byte{}, "")
	f.Add(good.Name, "API.EXAMPLE.COM.", good.Key, append([]byte(nil), good.Sealed...), "other")
	f.Fuzz(func(t *testing.T, name, host, key string, sealed []byte, sandbox string) {
		in := []SealedSecret{{Name: name, Hosts: []string{host}, Key: key, Sealed: sealed}}
		s := NewRuleSet()
		err := s.Unseal(k, sandbox, in)
		out := s.Seal(k, sandbox)
		if len(out) != 1 || s.Held() != 1 {
			t.Fatalf("Unseal of one entry holds %d, seals %d", s.Held(), len(out))
		}
		if err != nil {
			if !errors.Is(err, ErrSealed) {
				t.Fatalf("Unseal: %v", err)
			}
			if out[0].Name != name || out[0].Key != key || string(out[0].Sealed) != string(sealed) {
				t.Fatalf("an entry it could not open was not kept as read: %+v", out[0])
			}
			if _, ok := s.Unscrubbable(strings.TrimPrefix(host, "*.")); !ok && host == "api.example.com" {
				t.Fatalf("its host is not refused")
			}
			return
		}
		// Opened: only an entry sealed for this sandbox, label and host
		// (the seed's; nonces differ between fuzzing processes).
		if sandbox != "sb" || name != good.Name || host != "api.example.com" || key != k.ID() {
			t.Fatalf("opened an entry it did not seal: %q %q %q", sandbox, name, host)
		}
		if got := echoed(t, s, "api.example.com", oldKey); got != mask(len(oldKey)) {
			t.Fatalf("opened, but not scrubbed: %q", got)
		}
	})
}
