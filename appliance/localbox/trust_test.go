package localbox

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func testCAPEM(t *testing.T) []byte {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "trust test CA"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// TestTrustCAInTheDefaultImage: the CA is in the synthesized /etc's system
// bundle and beside it, and the host's own bundle is left as it was.
func TestTrustCAInTheDefaultImage(t *testing.T) {
	m := newRuntime(t)
	ca := testCAPEM(t)
	before, _ := os.ReadFile(TrustBundle)
	runDetached(t, m, "trust", func(o *RunOptions) { o.TrustCA = ca })
	code, out, errOut := sh(t, m, "trust", "cat "+TrustedCAFile+"; echo @@SEP@@; tail -c "+itoaInt(len(ca))+" "+TrustBundle)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	alone, inBundle, _ := strings.Cut(out, "@@SEP@@\n")
	if alone != string(ca) || inBundle != string(ca) {
		t.Errorf("the sandbox's CA file is %q and its bundle ends with %q; want the CA in both", alone, inBundle)
	}
	if after, _ := os.ReadFile(TrustBundle); string(after) != string(before) {
		t.Error("the host's own bundle changed")
	}
}

func itoaInt(n int) string { return big.NewInt(int64(n)).String() }

// TestTrustNeverWritesThroughALinkOutOfTheImage: an /etc whose ssl/certs
// is a link to a host directory (as a copied link may be) is not written
// through.
func TestTrustNeverWritesThroughALinkOutOfTheImage(t *testing.T) {
	outside := t.TempDir()
	host := filepath.Join(outside, "ca-certificates.crt")
	os.WriteFile(host, []byte("HOST BUNDLE\n"), 0o644)
	etc := filepath.Join(t.TempDir(), "etc")
	os.MkdirAll(filepath.Join(etc, "ssl"), 0o755)
	if err := os.Symlink(outside, filepath.Join(etc, "ssl", "certs")); err != nil {
		t.Fatal(err)
	}
	addTrust(etc, testCAPEM(t), os.Getuid(), os.Getgid())
	if b, _ := os.ReadFile(host); string(b) != "HOST BUNDLE\n" {
		t.Errorf("a file outside the image was written: %q", b)
	}
	if _, err := os.Stat(filepath.Join(outside, "sandgate-ca.pem")); err == nil {
		t.Error("a file was created outside the image")
	}
}

func TestTrustCAMustBeCertificatesOnly(t *testing.T) {
	key := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte("x")})
	for name, b := range map[string][]byte{"key": key, "junk": []byte("hello"), "cert and key": append(testCAPEM(t), key...)} {
		if err := checkTrustCA(b); err == nil {
			t.Errorf("%s accepted as CA certificates", name)
		}
	}
	if err := checkTrustCA(testCAPEM(t)); err != nil {
		t.Error(err)
	}
}
