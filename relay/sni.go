package relay

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/sandgate/sandgate/netpolicy"
)

// A CONNECT tunnel is judged on the host the sandbox names, but the bytes
// inside go to that host's address whatever they say. On a shared address
// (a CDN) a ClientHello naming another site would reach that site: so the
// first bytes of a tunnel must be a TLS ClientHello whose server name is
// the CONNECT host (or none, for an IP-literal target). The ClientHello is
// parsed by crypto/tls itself, on a connection whose writes go nowhere, and
// the bytes read are then replayed to the upstream unchanged.

// Codes for tunnel refusals after the 200.
const (
	CodeNotTLS      = "not_tls"
	CodeSNIMismatch = "sni_mismatch"
)

// helloSniffer is a net.Conn that reads from r, records what it read, and
// refuses every write: tls.Server on it parses a ClientHello and sends
// nothing to the sandbox.
type helloSniffer struct {
	net.Conn
	r   io.Reader
	rec bytes.Buffer
}

func (h *helloSniffer) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	h.rec.Write(p[:n])
	return n, err
}

func (h *helloSniffer) Write(p []byte) (int, error) { return 0, errors.New("sniffer: no writes") }

var errHelloRead = errors.New("client hello read")

// maxHelloBytes bounds what is read while looking for the ClientHello.
const maxHelloBytes = 64 << 10

// sniffHello reads the tunnel's first TLS ClientHello from r (bounded by
// deadline on c) and returns its server name and the bytes consumed.
func sniffHello(c net.Conn, r io.Reader, deadline time.Time) (sni string, consumed []byte, err error) {
	s := &helloSniffer{Conn: c, r: io.LimitReader(r, maxHelloBytes)}
	c.SetReadDeadline(deadline)
	defer c.SetReadDeadline(time.Time{})
	var got *tls.ClientHelloInfo
	srv := tls.Server(s, &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		got = h
		return nil, errHelloRead
	}})
	herr := srv.Handshake()
	if got == nil {
		if isTimeout(herr) {
			return "", s.rec.Bytes(), herr
		}
		return "", s.rec.Bytes(), fmt.Errorf("%w: %v", errNotTLS, herr)
	}
	return got.ServerName, s.rec.Bytes(), nil
}

var errNotTLS = errors.New("the tunnel did not start with a TLS ClientHello")

// checkSNI says why a ClientHello's server name does not fit the CONNECT
// target, or "" when it does.
func checkSNI(target netpolicy.Host, sni string) string {
	if target.IsIP() {
		if sni == "" {
			return ""
		}
		return fmt.Sprintf("TLS server name %q does not match the CONNECT target %s", truncate(sni, 100), target)
	}
	if sni == "" {
		return fmt.Sprintf("TLS ClientHello names no server; the CONNECT target was %s", target)
	}
	if strings.TrimSuffix(strings.ToLower(sni), ".") != target.Name {
		// The target is canonical (punycode); so is a valid SNI.
		return fmt.Sprintf("TLS server name %q does not match the CONNECT target %s", truncate(sni, 100), target)
	}
	return ""
}
