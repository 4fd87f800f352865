package agent

import (
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// The sandbox's DNS responder. A sandbox has no network and no name server
// of its own: its resolv.conf names 127.0.0.1, where the agent answers
// (Config.DNS). What it answers depends on whether the service captures
// connections in the sandbox (op dnsmode, sent once capture is in place):
//
//   - with capture, every name gets an address of the capture prefix
//     (198.18.0.0/15), the same one for as long as the table keeps it, so
//     that a process that ignores the proxy variables connects to that
//     address, on any port; the connection is captured and judged as
//     CONNECT name:port (a refusal happens, and is audited, at connect
//     time, with its reason);
//   - without, every name is NXDOMAIN at once (an Extended DNS Error says
//     why, to clients that read it), and the lookup is reported to the
//     service, which audits it as a direct connection attempted outside
//     the proxy.
//
// localhost is 127.0.0.1 and ::1 either way. Queries are parsed with
// miekg/dns; anything but one IN question of a standard query is answered
// FORMERR or NOTIMP, or not at all when even its header is garbage.

// Limits of the responder.
const (
	dnsTTL          = 30
	maxDNSNames     = 65536
	maxDNSTCPConns  = 32
	dnsTCPIdle      = 10 * time.Second
	dnsReportEvery  = 10 * time.Second // a name is reported at most this often
	dnsReportsPerS  = 20
	maxDNSReportMap = 4096
)

// dnsEDEText is the Extended DNS Error text of a refused lookup.
const dnsEDEText = "sandgate: this sandbox has no network of its own and no connection capture; connect through the proxy (HTTPS_PROXY) or a base URL"

// dnsResponder answers the sandbox's name lookups.
type dnsResponder struct {
	log    *slog.Logger
	report func(name, qtype string) // a refused lookup; nil: none

	mu      sync.Mutex
	capture bool
	table   *nameTable
	// report rate: when each name was last reported, and a token bucket.
	reported map[string]time.Time
	tokens   float64
	refill   time.Time

	udp net.PacketConn
	tcp net.Listener
	wg  sync.WaitGroup
}

func newDNSResponder(log *slog.Logger, report func(name, qtype string)) *dnsResponder {
	return &dnsResponder{log: log, report: report, reported: map[string]time.Time{}, tokens: dnsReportsPerS, refill: time.Now()}
}

// listen starts serving on addr (UDP and TCP).
func (d *dnsResponder) listen(addr string) error {
	udp, err := net.ListenPacket("udp", addr)
	if err != nil {
		return err
	}
	tcp, err := net.Listen("tcp", udp.LocalAddr().String())
	if err != nil {
		udp.Close()
		return err
	}
	d.udp, d.tcp = udp, tcp
	d.wg.Add(2)
	go func() { defer d.wg.Done(); d.serveUDP() }()
	go func() { defer d.wg.Done(); d.serveTCP() }()
	return nil
}

// close stops serving and waits for the servers to end.
func (d *dnsResponder) close() {
	if d.udp != nil {
		d.udp.Close()
		d.tcp.Close()
	}
	d.wg.Wait()
}

// setCapture switches to capture mode: names get addresses of prefix.
func (d *dnsResponder) setCapture(prefix netip.Prefix) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.capture = true
	if d.table == nil || d.table.prefix != prefix {
		d.table = newNameTable(prefix)
	}
}

// nameOf returns the name an address of the capture prefix was given, if
// it still has one.
func (d *dnsResponder) nameOf(a netip.Addr) (string, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.table == nil {
		return "", false
	}
	n, ok := d.table.byAddr[a]
	return n, ok
}

func (d *dnsResponder) serveUDP() {
	buf := make([]byte, 4096)
	for {
		n, from, err := d.udp.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // an error that persists must not spin
			continue
		}
		if reply := d.answer(buf[:n], true); reply != nil {
			d.udp.WriteTo(reply, from)
		}
	}
}

func (d *dnsResponder) serveTCP() {
	sem := make(chan struct{}, maxDNSTCPConns)
	for {
		c, err := d.tcp.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // too many files, say: must not spin
			continue
		}
		select {
		case sem <- struct{}{}:
		default:
			c.Close()
			continue
		}
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			defer func() { <-sem }()
			d.serveTCPConn(c)
		}()
	}
}

// serveTCPConn answers length-prefixed queries (RFC 7766) until the client
// closes or idles.
func (d *dnsResponder) serveTCPConn(c net.Conn) {
	defer c.Close()
	var lb [2]byte
	buf := make([]byte, 0, 512)
	for range 64 {
		c.SetDeadline(time.Now().Add(dnsTCPIdle))
		if _, err := io.ReadFull(c, lb[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint16(lb[:]))
		if cap(buf) < n {
			buf = make([]byte, n)
		}
		q := buf[:n]
		if _, err := io.ReadFull(c, q); err != nil {
			return
		}
		reply := d.answer(q, false)
		if reply == nil {
			return
		}
		out := binary.BigEndian.AppendUint16(make([]byte, 0, 2+len(reply)), uint16(len(reply)))
		if _, err := c.Write(append(out, reply...)); err != nil {
			return
		}
	}
}

// answer builds the reply to one query (udp: the reply must fit a
// datagram), or returns nil for bytes that get none.
func (d *dnsResponder) answer(q []byte, udp bool) []byte {
	var m dns.Msg
	if err := m.Unpack(q); err != nil {
		return formErr(q)
	}
	if m.Response {
		return nil
	}
	r := new(dns.Msg)
	r.SetReply(&m)
	r.RecursionAvailable = true
	opt := m.IsEdns0()
	size := 512
	if opt != nil {
		r.SetEdns0(1232, false)
		size = max(512, min(int(opt.UDPSize()), 1232))
	}
	switch {
	case m.Opcode != dns.OpcodeQuery:
		r.Rcode = dns.RcodeNotImplemented
		r.Question = nil
	case len(m.Question) != 1:
		r.Rcode = dns.RcodeFormatError
		r.Question = nil
	default:
		d.resolve(r, m.Question[0], opt != nil)
	}
	b, err := r.Pack()
	if err != nil {
		return nil
	}
	if udp && len(b) > size {
		r.Truncated, r.Answer, r.Extra = true, nil, nil
		if opt != nil {
			r.SetEdns0(1232, false)
		}
		if b, err = r.Pack(); err != nil {
			return nil
		}
	}
	return b
}

// formErr answers bytes that are not a message with FORMERR, when at least
// a query's header is there to answer; else nothing.
func formErr(q []byte) []byte {
	if len(q) < 12 || q[2]&0x80 != 0 { // too short, or a response
		return nil
	}
	r := make([]byte, 12)
	copy(r, q[:2])                // ID
	r[2] = 0x80 | q[2]&0x78 | 0x1 // QR, the opcode, RD
	r[3] = dns.RcodeFormatError
	return r
}

// resolve fills r's answer to q.
func (d *dnsResponder) resolve(r *dns.Msg, q dns.Question, edns bool) {
	if q.Qclass != dns.ClassINET {
		r.Rcode = dns.RcodeNotImplemented
		return
	}
	name, ok := canonicalQName(q.Name)
	if !ok {
		r.Rcode = dns.RcodeNameError
		return
	}
	hdr := func(t uint16) dns.RR_Header {
		return dns.RR_Header{Name: q.Name, Rrtype: t, Class: dns.ClassINET, Ttl: dnsTTL}
	}
	if name == "localhost" || strings.HasSuffix(name, ".localhost") {
		switch q.Qtype {
		case dns.TypeA:
			r.Answer = append(r.Answer, &dns.A{Hdr: hdr(dns.TypeA), A: net.IPv4(127, 0, 0, 1).To4()})
		case dns.TypeAAAA:
			r.Answer = append(r.Answer, &dns.AAAA{Hdr: hdr(dns.TypeAAAA), AAAA: net.IPv6loopback})
		}
		return
	}
	d.mu.Lock()
	capture, table := d.capture, d.table
	d.mu.Unlock()
	if !capture {
		r.Rcode = dns.RcodeNameError
		if edns {
			opt := r.IsEdns0()
			opt.Option = append(opt.Option, &dns.EDNS0_EDE{InfoCode: dns.ExtendedErrorCodeProhibited, ExtraText: dnsEDEText})
		}
		switch q.Qtype {
		case dns.TypeA, dns.TypeAAAA, dns.TypeANY, dns.TypeHTTPS, dns.TypeSVCB:
			d.noteRefused(name, dns.TypeToString[q.Qtype])
		}
		return
	}
	if a, ok := reverseName(name, table.prefix); ok {
		d.mu.Lock()
		n, known := table.byAddr[a]
		d.mu.Unlock()
		if !known {
			r.Rcode = dns.RcodeNameError
		} else if q.Qtype == dns.TypePTR {
			r.Answer = append(r.Answer, &dns.PTR{Hdr: hdr(dns.TypePTR), Ptr: dns.Fqdn(n)})
		}
		return
	}
	if q.Qtype != dns.TypeA && q.Qtype != dns.TypeANY {
		return // NODATA: IPv4 only, so clients connect to the A answer
	}
	d.mu.Lock()
	a := table.addrOf(name)
	d.mu.Unlock()
	r.Answer = append(r.Answer, &dns.A{Hdr: hdr(dns.TypeA), A: a.AsSlice()})
}

// canonicalQName lowercases a query name and drops its final dot; ok is
// false for a name that is not a host name (empty, the root, or bytes no
// host name holds).
func canonicalQName(qname string) (string, bool) {
	n := strings.ToLower(strings.TrimSuffix(qname, "."))
	if n == "" || len(n) > 253 {
		return "", false
	}
	for i := 0; i < len(n); i++ {
		c := n[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_') {
			return "", false
		}
	}
	if strings.HasPrefix(n, ".") || strings.Contains(n, "..") {
		return "", false
	}
	return n, true
}

// reverseName parses a PTR name of prefix's reverse zone.
func reverseName(name string, prefix netip.Prefix) (netip.Addr, bool) {
	rest, ok := strings.CutSuffix(name, ".in-addr.arpa")
	if !ok {
		return netip.Addr{}, false
	}
	parts := strings.Split(rest, ".")
	if len(parts) != 4 {
		return netip.Addr{}, false
	}
	a, err := netip.ParseAddr(parts[3] + "." + parts[2] + "." + parts[1] + "." + parts[0])
	if err != nil || !prefix.Contains(a) {
		return netip.Addr{}, false
	}
	return a, true
}

// noteRefused reports a refused lookup to the service: each name at most
// once per dnsReportEvery, and at most dnsReportsPerS a second.
func (d *dnsResponder) noteRefused(name, qtype string) {
	if d.report == nil {
		return
	}
	now := time.Now()
	d.mu.Lock()
	if last, ok := d.reported[name]; ok && now.Sub(last) < dnsReportEvery {
		d.mu.Unlock()
		return
	}
	d.tokens = min(dnsReportsPerS, d.tokens+now.Sub(d.refill).Seconds()*dnsReportsPerS)
	d.refill = now
	if d.tokens < 1 {
		d.mu.Unlock()
		return
	}
	d.tokens--
	if len(d.reported) >= maxDNSReportMap {
		clear(d.reported)
	}
	d.reported[name] = now
	d.mu.Unlock()
	go d.report(name, qtype)
}

// nameTable gives names addresses of a prefix, in turn: the oldest
// mapping is reused once maxDNSNames (or the prefix) are taken.
type nameTable struct {
	prefix netip.Prefix
	first  netip.Addr // the prefix's third address (.0 and .1 are never given)
	size   int
	next   int
	byName map[string]netip.Addr
	byAddr map[netip.Addr]string
}

func newNameTable(prefix netip.Prefix) *nameTable {
	size := maxDNSNames
	if bits := 32 - prefix.Bits(); bits < 17 {
		size = min(size, 1<<bits-3)
	}
	first := prefix.Addr().Next().Next()
	return &nameTable{prefix: prefix, first: first, size: max(size, 1), byName: map[string]netip.Addr{}, byAddr: map[netip.Addr]string{}}
}

// addrOf returns name's address, giving it one if it has none.
func (t *nameTable) addrOf(name string) netip.Addr {
	if a, ok := t.byName[name]; ok {
		return a
	}
	b := t.first.As4()
	v := binary.BigEndian.Uint32(b[:]) + uint32(t.next)
	binary.BigEndian.PutUint32(b[:], v)
	a := netip.AddrFrom4(b)
	t.next = (t.next + 1) % t.size
	if old, ok := t.byAddr[a]; ok {
		delete(t.byName, old)
	}
	t.byName[name], t.byAddr[a] = a, name
	return a
}
