package localbox

import (
	"errors"
	"testing"
)

func TestCheckID(t *testing.T) {
	for _, id := range []string{"a", "A-1", "sandbox-0123"} {
		if err := CheckID(id); err != nil {
			t.Errorf("CheckID(%q): %v", id, err)
		}
	}
	for _, id := range []string{"", "-a", "a_b", "a/b", "..", "a.b", string(make([]byte, 64))} {
		if err := CheckID(id); !errors.Is(err, ErrBadInput) {
			t.Errorf("CheckID(%q) = %v, want ErrBadInput", id, err)
		}
	}
}

func TestParseMount(t *testing.T) {
	m, err := ParseMount("type=bind,source=/usr/bin/env,destination=/.sandgate/sandgate,readonly")
	if err != nil || m != (Mount{Source: "/usr/bin/env", Destination: "/.sandgate/sandgate", ReadOnly: true}) {
		t.Fatalf("got %+v, %v", m, err)
	}
	for _, bad := range []string{
		"source=/a,destination=/b", "type=volume,source=/a,destination=/b", "type=bind,source=a,destination=/b",
		"type=bind,source=/a,destination=b", "type=bind,source=/a,destination=/", "type=bind,source=/a,destination=/proc/x",
		"type=bind,source=/a,destination=/b/../c", "type=bind,source=/a,destination=/b,colour=red",
	} {
		if _, err := ParseMount(bad); !errors.Is(err, ErrBadInput) {
			t.Errorf("ParseMount(%q) = %v, want ErrBadInput", bad, err)
		}
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1024": 1024, "512m": 512 << 20, "2G": 2 << 30, "64KiB": 64 << 10, "1MB": 1 << 20} {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "0", "-1", "1x", "m"} {
		if _, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q): no error", bad)
		}
	}
}

// TestSeccompPolicyTranslates checks that every rule of Docker's profile
// that applies here was expressed, and that the filter assembles.
func TestSeccompPolicyTranslates(t *testing.T) {
	p, rep, err := SeccompPolicy(Capabilities)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Dropped) > 0 {
		t.Errorf("rules dropped: %v", rep.Dropped)
	}
	if rep.Rules < 10 {
		t.Errorf("only %d rules kept", rep.Rules)
	}
	insts, err := p.Assemble()
	if err != nil {
		t.Fatal(err)
	}
	if len(insts) > 4096 {
		t.Errorf("%d BPF instructions: over the kernel's limit", len(insts))
	}
}
