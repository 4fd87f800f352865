// Package ca is the certificate authority of a sandgate service's TLS
// interception: the proxy presents a certificate it signs to a sandbox
// process that connects to a host its policy intercepts, and sandboxes
// trust its certificate (never its key).
//
// The key exists in the service's memory, and on disk only where an
// operator asked for it (Open: a directory, the key file 0600). It is
// never written anywhere else: not into a sandbox, a snapshot, a template,
// a log or an audit event. An Authority prints as its fingerprint.
package ca

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Files of a CA kept in a directory (Open).
const (
	CertFile = "ca.pem"
	KeyFile  = "ca-key.pem"
)

// Lifetimes.
const (
	caLifetime   = 10 * 365 * 24 * time.Hour
	leafLifetime = 7 * 24 * time.Hour
	// leafRenew: a cached leaf with less than this left is minted anew.
	leafRenew = 24 * time.Hour
	// maxLeaves bounds the cache of minted leaves (a wildcard intercept
	// rule lets a sandbox name any number of hosts).
	maxLeaves = 4096
)

// Authority signs leaf certificates for intercepted hosts. It is safe for
// concurrent use.
type Authority struct {
	cert    *x509.Certificate
	certPEM []byte
	key     *ecdsa.PrivateKey
	// leafKey is the key of every leaf: minting a leaf is then a
	// signature, not a key generation.
	leafKey *ecdsa.PrivateKey

	mu     sync.Mutex
	leaves map[string]*tls.Certificate
}

// New creates an authority in memory: its key exists only in this
// process, and goes with it.
func New() (*Authority, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	return create(key)
}

func create(key *ecdsa.PrivateKey) (*Authority, error) {
	serial, err := serialNumber()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "sandgate interception CA " + now.UTC().Format("2006-01-02T15:04:05Z"), Organization: []string{"sandgate"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(caLifetime),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	return fromParts(der, key)
}

func fromParts(der []byte, key *ecdsa.PrivateKey) (*Authority, error) {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	if !cert.IsCA || cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, errors.New("the certificate is not a CA's (basic constraints CA:TRUE and key usage certSign)")
	}
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(&key.PublicKey) {
		return nil, errors.New("the key does not belong to the certificate")
	}
	leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	return &Authority{
		cert: cert, key: key, leafKey: leafKey, leaves: map[string]*tls.Certificate{},
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
	}, nil
}

// Open loads the authority kept in dir (CertFile, and KeyFile, which must
// be readable by its owner only), or creates one there if dir holds
// neither: the directory is made 0700, the key written 0600. A restart
// with the same dir keeps the same CA, so sandboxes that trust it go on
// trusting the proxy.
func Open(dir string) (*Authority, error) {
	certPath, keyPath := filepath.Join(dir, CertFile), filepath.Join(dir, KeyFile)
	certPEM, cerr := os.ReadFile(certPath)
	keyPEM, kerr := readKey(keyPath)
	switch {
	case errors.Is(cerr, fs.ErrNotExist) && errors.Is(kerr, fs.ErrNotExist):
		return createIn(dir)
	case cerr != nil:
		return nil, fmt.Errorf("interception CA: %w", cerr)
	case kerr != nil:
		return nil, fmt.Errorf("interception CA: %w", kerr)
	}
	cb, _ := pem.Decode(certPEM)
	if cb == nil || cb.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("interception CA: %s holds no PEM certificate", certPath)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, fmt.Errorf("interception CA: %s holds no PEM key", keyPath)
	}
	key, err := parseKey(kb)
	if err != nil {
		return nil, fmt.Errorf("interception CA: %s: %w", keyPath, err)
	}
	a, err := fromParts(cb.Bytes, key)
	if err != nil {
		return nil, fmt.Errorf("interception CA in %s: %w", dir, err)
	}
	return a, nil
}

// readKey reads the key file, refusing one that others may read.
func readKey(path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("%s is readable by others (mode %v): chmod 600 it", path, fi.Mode().Perm())
	}
	return os.ReadFile(path)
}

func parseKey(b *pem.Block) (*ecdsa.PrivateKey, error) {
	switch b.Type {
	case "EC PRIVATE KEY":
		return x509.ParseECPrivateKey(b.Bytes)
	case "PRIVATE KEY":
		k, err := x509.ParsePKCS8PrivateKey(b.Bytes)
		if err != nil {
			return nil, err
		}
		ek, ok := k.(*ecdsa.PrivateKey)
		if !ok {
			return nil, errors.New("the key is not an ECDSA key")
		}
		return ek, nil
	}
	return nil, fmt.Errorf("PEM block %q is not a private key", b.Type)
}

func createIn(dir string) (*Authority, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("interception CA: %w", err)
	}
	a, err := New()
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(a.key)
	if err != nil {
		return nil, err
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
	// The key first, exclusively: two services starting on one directory
	// do not both write one.
	if err := writeExcl(filepath.Join(dir, KeyFile), keyPEM, 0o600); err != nil {
		return nil, fmt.Errorf("interception CA: %w", err)
	}
	if err := writeExcl(filepath.Join(dir, CertFile), a.certPEM, 0o644); err != nil {
		return nil, fmt.Errorf("interception CA: %w", err)
	}
	return a, nil
}

func writeExcl(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(path)
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// CertPEM returns the CA's certificate, PEM-encoded: what sandboxes trust.
func (a *Authority) CertPEM() []byte { return append([]byte(nil), a.certPEM...) }

// Certificate returns the CA's certificate.
func (a *Authority) Certificate() *x509.Certificate { return a.cert }

// Fingerprint is the SHA-256 of the CA certificate, in hex.
func (a *Authority) Fingerprint() string {
	sum := sha256.Sum256(a.cert.Raw)
	return hex.EncodeToString(sum[:])
}

// String names the authority by its fingerprint; its key is never printed.
func (a *Authority) String() string { return "sandgate CA sha256:" + a.Fingerprint() }

// GoString is String: %#v prints no key either.
func (a *Authority) GoString() string { return a.String() }

// Leaf returns a server certificate for host (a canonical DNS name),
// signed by the CA, minted once and kept until close to its expiry.
func (a *Authority) Leaf(host string) (*tls.Certificate, error) {
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	if host == "" {
		return nil, errors.New("no host name to mint a certificate for")
	}
	now := time.Now()
	a.mu.Lock()
	if c, ok := a.leaves[host]; ok && c.Leaf.NotAfter.Sub(now) > leafRenew {
		a.mu.Unlock()
		return c, nil
	}
	a.mu.Unlock()
	c, err := a.mint(host, now)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	if len(a.leaves) >= maxLeaves {
		for h := range a.leaves { // drop one at random
			delete(a.leaves, h)
			break
		}
	}
	a.leaves[host] = c
	a.mu.Unlock()
	return c, nil
}

func (a *Authority) mint(host string, now time.Time) (*tls.Certificate, error) {
	serial, err := serialNumber()
	if err != nil {
		return nil, err
	}
	notAfter := now.Add(leafLifetime)
	if notAfter.After(a.cert.NotAfter) {
		notAfter = a.cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: host},
		DNSNames:     []string{host},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, a.cert, &a.leafKey.PublicKey, a.key)
	if err != nil {
		return nil, fmt.Errorf("minting a certificate for %s: %w", host, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &tls.Certificate{Certificate: [][]byte{der, a.cert.Raw}, PrivateKey: a.leafKey, Leaf: leaf}, nil
}

func serialNumber() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}
