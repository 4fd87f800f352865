package ca

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLeafVerifiesAgainstTheCAForItsHostOnly(t *testing.T) {
	a, err := New()
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(a.CertPEM()) {
		t.Fatal("CertPEM does not parse")
	}
	c, err := a.Leaf("API.GitHub.com.")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Leaf.Verify(x509.VerifyOptions{DNSName: "api.github.com", Roots: pool}); err != nil {
		t.Errorf("leaf does not verify for its host: %v", err)
	}
	if _, err := c.Leaf.Verify(x509.VerifyOptions{DNSName: "github.com", Roots: pool}); err == nil {
		t.Error("leaf verifies for another host")
	}
	if again, _ := a.Leaf("api.github.com"); again != c {
		t.Error("a second Leaf for the same host minted again instead of reusing")
	}
}

func TestOpenKeepsTheKeyOwnerOnlyAndTheSameCA(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ca")
	a, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]os.FileMode{KeyFile: 0o600, CertFile: 0o644, ".": 0o700} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s has mode %v, want %v", name, fi.Mode().Perm(), want)
		}
	}
	b, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if a.Fingerprint() != b.Fingerprint() {
		t.Error("reopening the directory gave another CA")
	}
	os.Chmod(filepath.Join(dir, KeyFile), 0o644)
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("a key readable by others was accepted (%v)", err)
	}
	os.Chmod(filepath.Join(dir, KeyFile), 0o600)
	other, _ := New()
	os.WriteFile(filepath.Join(dir, CertFile), other.CertPEM(), 0o644)
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "does not belong") {
		t.Errorf("a key of another certificate was accepted (%v)", err)
	}
}

func TestAuthorityNeverPrintsItsKey(t *testing.T) {
	dir := t.TempDir()
	a, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, _ := os.ReadFile(filepath.Join(dir, KeyFile))
	blk, _ := pem.Decode(keyPEM)
	k, _ := parseKey(blk)
	scalar := k.D.Bytes()
	for _, s := range []string{fmt.Sprint(a), fmt.Sprintf("%v %+v %#v %s", a, a, a, a)} {
		if bytes.Contains([]byte(s), scalar) || strings.Contains(s, k.D.String()) || strings.Contains(s, "PRIVATE") {
			t.Errorf("printing the authority shows its key: %s", s)
		}
	}
}
