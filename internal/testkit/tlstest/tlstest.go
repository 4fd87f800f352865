// Package tlstest makes a throwaway certificate authority and HTTPS
// upstreams on loopback for tests and benchmarks: real TLS, real
// verification, certificates for whatever names a test routes to.
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// CA is a certificate authority that signs leaf certificates for tests.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// Pool trusts this CA alone.
	Pool *x509.CertPool
	// PEM is the CA certificate, PEM-encoded.
	PEM []byte
}

// NewCA creates a CA valid for a day.
func NewCA() (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "sandgate test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{cert: cert, key: key, Pool: pool, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// Leaf issues a server certificate for the given DNS names and IP addresses.
func (ca *CA) Leaf(names ...string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: names[0]},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// WritePEM writes the CA certificate to dir/ca.pem and returns its path
// (for --upstream-ca).
func (ca *CA) WritePEM(dir string) (string, error) {
	p := filepath.Join(dir, "ca.pem")
	return p, os.WriteFile(p, ca.PEM, 0o644)
}

// MustCA is NewCA for tests.
func MustCA(t testing.TB) *CA {
	t.Helper()
	ca, err := NewCA()
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// Listen443 listens on port 443 of a random address in 127.0.0.0/8, the
// only port the proxy ever dials, so that tests exercise exactly what runs
// in production. Binding 443 needs root (or CAP_NET_BIND_SERVICE): without
// it the test is skipped with a message saying so.
func Listen443(t testing.TB) net.Listener {
	t.Helper()
	ln, err := ListenLoopback443()
	if errors.Is(err, syscall.EACCES) {
		t.Skip("binding port 443 on loopback needs root or CAP_NET_BIND_SERVICE; the proxy only ever dials 443, so this test needs it")
	}
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

// ListenLoopback443 is Listen443 for programs that are not tests.
func ListenLoopback443() (net.Listener, error) {
	var lastErr error
	for range 50 {
		b := make([]byte, 3)
		rand.Read(b)
		if b[2] == 0 || b[2] == 255 {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort(net.IPv4(127, b[0], b[1], b[2]).String(), "443"))
		if err == nil {
			return ln, nil
		}
		if errors.Is(err, syscall.EACCES) {
			return nil, fmt.Errorf("listen on loopback port 443: %w", err)
		}
		lastErr = err
	}
	return nil, fmt.Errorf("no free 127.x.y.z:443: %w", lastErr)
}

// Addr returns the address of a server started by Server.
func Addr(srv *httptest.Server) netip.Addr {
	return netip.MustParseAddrPort(srv.Listener.Addr().String()).Addr()
}

// Server starts an HTTPS server on 127.x.y.z:443 (see Listen443) with a certificate from ca for
// names, speaking HTTP/1.1 and HTTP/2. It is closed on t.Cleanup.
func (ca *CA) Server(t testing.TB, h http.Handler, names ...string) *httptest.Server {
	t.Helper()
	leaf, err := ca.Leaf(names...)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(h)
	srv.Listener.Close()
	srv.Listener = Listen443(t)
	srv.EnableHTTP2 = true
	// Clients that give up before the handshake (tests of refusals do)
	// are not worth a log line each.
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{leaf}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}
