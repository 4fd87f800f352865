// Package dnstest runs a real DNS server on loopback for tests: UDP and TCP
// on the same random port of 127.0.0.1, answering only the names a test
// gives it.
//
// Names in the API are canonical: lowercase, without the trailing dot. The
// server matches query names case-insensitively. A name the test never set
// is answered NXDOMAIN. Every method is safe for concurrent use, including
// while queries are being served.
package dnstest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// MaxDelay bounds SetDelay, so that a forgotten delay cannot hang a test.
const MaxDelay = 10 * time.Second

// DefaultTTL is the TTL of records whose name has no TTL of its own.
const DefaultTTL = 60 * time.Second

// maxChase bounds how many CNAMEs the server follows when it builds an
// answer, so that a CNAME loop set by a test still gets an answer.
const maxChase = 16

// Server is a DNS server on 127.0.0.1 serving UDP and TCP on one port.
// Start it with Start; it shuts down when the test ends.
type Server struct {
	// Addr is "127.0.0.1:port", for UDP and TCP alike.
	Addr string

	t         testing.TB    // nil when made by New
	done      chan struct{} // closed at shutdown; aborts delays
	close     func() error
	closeOnce sync.Once

	mu         sync.Mutex
	names      map[string]*entry
	queries    map[string]int
	defaultTTL time.Duration
}

// entry is what the server knows about one name.
type entry struct {
	seq      [][]netip.Addr // answers, one set per query; the last repeats
	served   map[uint16]int // queries answered so far, per type
	cname    string         // canonical target, or ""
	rcode    int            // used when hasRcode
	hasRcode bool           // answer rcode (and no records) instead
	rcodeFor map[uint16]int // like rcode, for one query type only
	ttl      time.Duration  // used when hasTTL
	hasTTL   bool           // else the server's default TTL
	delay    time.Duration  // wait before answering
	hold     chan struct{}  // when set, answer only once it is closed
	truncate bool           // UDP answers carry TC and no records
	inject   []dns.RR       // put verbatim in every answer for this name
}

// Start starts a server on a random loopback port and stops it on
// t.Cleanup. It fails the test if the server cannot start.
func Start(t testing.TB) *Server {
	t.Helper()
	s, err := New()
	if err != nil {
		t.Fatalf("dnstest: %v", err)
	}
	s.t = t
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("dnstest: %v", err)
		}
	})
	return s
}

// New starts a server on a random loopback port, for programs that are not
// tests (benchmarks). Stop it with Close.
func New() (*Server, error) {
	s := &Server{
		done:       make(chan struct{}),
		names:      make(map[string]*entry),
		queries:    make(map[string]int),
		defaultTTL: DefaultTTL,
	}
	pc, l, err := listenPair()
	if err != nil {
		return nil, err
	}
	s.Addr = pc.LocalAddr().String()

	handler := dns.HandlerFunc(s.serveDNS)
	udpStarted := make(chan struct{})
	tcpStarted := make(chan struct{})
	udp := &dns.Server{PacketConn: pc, Handler: handler, NotifyStartedFunc: func() { close(udpStarted) }}
	tcp := &dns.Server{Listener: l, Handler: handler, NotifyStartedFunc: func() { close(tcpStarted) }}
	served := make(chan error, 2)
	go func() { served <- udp.ActivateAndServe() }()
	go func() { served <- tcp.ActivateAndServe() }()

	timer := time.NewTimer(5 * time.Second)
	defer timer.Stop()
	for _, started := range []chan struct{}{udpStarted, tcpStarted} {
		select {
		case <-started:
		case err := <-served:
			pc.Close()
			l.Close()
			return nil, fmt.Errorf("server stopped while starting: %w", err)
		case <-timer.C:
			pc.Close()
			l.Close()
			return nil, errors.New("server did not start within 5s")
		}
	}
	s.close = func() error {
		close(s.done)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var errs []error
		if err := udp.ShutdownContext(ctx); err != nil {
			errs = append(errs, fmt.Errorf("UDP shutdown: %w", err))
		}
		if err := tcp.ShutdownContext(ctx); err != nil {
			errs = append(errs, fmt.Errorf("TCP shutdown: %w", err))
		}
		for range 2 {
			select {
			case <-served:
			case <-ctx.Done():
				return errors.Join(append(errs, errors.New("server did not stop within 5s"))...)
			}
		}
		return errors.Join(errs...)
	}
	return s, nil
}

// Close stops the server, waiting at most 5s. It is safe to call twice.
func (s *Server) Close() error {
	var err error
	s.closeOnce.Do(func() { err = s.close() })
	return err
}

// listenPair opens UDP and TCP on the same random loopback port. The port
// the kernel picks for UDP may be taken for TCP, so it tries a few times.
func listenPair() (net.PacketConn, net.Listener, error) {
	var lastErr error
	for range 20 {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			return nil, nil, fmt.Errorf("listen udp: %w", err)
		}
		l, err := net.Listen("tcp", pc.LocalAddr().String())
		if err == nil {
			return pc, l, nil
		}
		pc.Close()
		lastErr = err
	}
	return nil, nil, fmt.Errorf("listen tcp on the UDP port: %w", lastErr)
}

// canonical turns a query name or API name into the map key.
func canonical(name string) string {
	return strings.TrimSuffix(strings.ToLower(name), ".")
}

// get returns the entry for name, creating it. s.mu must be held.
func (s *Server) get(name string) *entry {
	name = canonical(name)
	e := s.names[name]
	if e == nil {
		e = &entry{served: make(map[uint16]int)}
		s.names[name] = e
	}
	return e
}

// Set makes name answer the given addresses: the IPv4 ones to A queries,
// the IPv6 ones (including IPv4-mapped, sent as 16 bytes) to AAAA queries.
// No address makes name exist with no records (NOERROR, no data). Set
// replaces earlier answers, clears any rcode set by SetRcode and restarts
// the sequence count.
func (s *Server) Set(name string, answers ...netip.Addr) {
	s.SetSequence(name, answers)
}

// SetSequence makes name answer seq[0] to its first query of each type,
// seq[1] to the second, and so on; the last set repeats. It is made for
// DNS-rebinding tests: a public address first, a private one next.
func (s *Server) SetSequence(name string, seq ...[]netip.Addr) {
	if len(seq) == 0 {
		seq = [][]netip.Addr{nil}
	}
	cp := make([][]netip.Addr, len(seq))
	for i, set := range seq {
		cp[i] = append([]netip.Addr(nil), set...)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.get(name)
	e.seq = cp
	e.served = make(map[uint16]int)
	e.hasRcode = false
	e.rcodeFor = nil
}

// SetCNAME makes name an alias of target: its answers carry the CNAME
// record followed by what target answers (the server follows the chain,
// like a recursive resolver). An empty target removes the alias.
func (s *Server) SetCNAME(name, target string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.get(name).cname = canonical(target)
}

// SetRcode makes name answer rcode (for example dns.RcodeNameError or
// dns.RcodeServerFailure) with no records. dns.RcodeSuccess gives a
// "no data" answer. Set or SetSequence clear it.
func (s *Server) SetRcode(name string, rcode int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.get(name)
	e.rcode = rcode
	e.hasRcode = true
}

// SetRcodeFor makes queries of type qtype (dns.TypeA, dns.TypeAAAA…) for
// name answer rcode with no records, while other types answer as usual:
// for example a working A and a failing AAAA. Set or SetSequence clear it.
func (s *Server) SetRcodeFor(name string, qtype uint16, rcode int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.get(name)
	if e.rcodeFor == nil {
		e.rcodeFor = make(map[uint16]int)
	}
	e.rcodeFor[qtype] = rcode
}

// SetDelay makes the server wait d before answering queries for name,
// capped at MaxDelay; the wait ends early when the server stops.
func (s *Server) SetDelay(name string, d time.Duration) {
	d = min(max(d, 0), MaxDelay)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.get(name).delay = d
}

// Hold makes the server keep its answers to queries for name until release
// is called (or the server stops): a test can then act while a lookup is
// certainly in flight, whatever the machine's load. Release is idempotent.
func (s *Server) Hold(name string) (release func()) {
	ch := make(chan struct{})
	s.mu.Lock()
	s.get(name).hold = ch
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			if e := s.get(name); e.hold == ch {
				e.hold = nil
			}
			s.mu.Unlock()
			close(ch)
		})
	}
}

// SetTTL sets the TTL of the records owned by name (whole seconds, rounded
// down); zero is a valid TTL ("do not cache"). Names without one get the
// server's default TTL.
func (s *Server) SetTTL(name string, ttl time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.get(name)
	e.ttl = max(ttl, 0)
	e.hasTTL = true
}

// SetDefaultTTL sets the TTL of records whose name has no TTL of its own;
// it starts as DefaultTTL. Zero is a valid TTL ("do not cache").
func (s *Server) SetDefaultTTL(ttl time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.defaultTTL = max(ttl, 0)
}

// SetTruncate makes UDP answers for name carry the TC bit and no records,
// so that a client must retry over TCP, where the full answer is given.
func (s *Server) SetTruncate(name string, on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.get(name).truncate = on
}

// Inject adds resource records, in zone-file syntax, to the answer section
// of every answer for name, whatever they are about: for testing that a
// client ignores records for names it did not ask (cache poisoning). It
// fails the test if a record does not parse.
func (s *Server) Inject(name string, records ...string) {
	if s.t != nil {
		s.t.Helper()
	}
	rrs := make([]dns.RR, 0, len(records))
	for _, text := range records {
		rr, err := dns.NewRR(text)
		if err != nil || rr == nil {
			if s.t == nil {
				panic(fmt.Sprintf("dnstest: Inject(%q): bad record %q: %v", name, text, err))
			}
			s.t.Fatalf("dnstest: Inject(%q): bad record %q: %v", name, text, err)
			return
		}
		rrs = append(rrs, rr)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.get(name)
	e.inject = append(e.inject, rrs...)
}

// Queries returns how many queries the server received for name, of any
// type, over UDP and TCP, including names it answered NXDOMAIN.
func (s *Server) Queries(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queries[canonical(name)]
}

// serveDNS answers one query.
func (s *Server) serveDNS(w dns.ResponseWriter, req *dns.Msg) {
	if len(req.Question) != 1 {
		m := new(dns.Msg)
		m.SetRcodeFormatError(req)
		_ = w.WriteMsg(m)
		return
	}
	q := req.Question[0]
	udp := w.RemoteAddr() != nil && w.RemoteAddr().Network() == "udp"

	s.mu.Lock()
	name := canonical(q.Name)
	s.queries[name]++
	var delay time.Duration
	var hold chan struct{}
	if e := s.names[name]; e != nil {
		delay, hold = e.delay, e.hold
	}
	s.mu.Unlock()

	if hold != nil {
		select {
		case <-hold:
		case <-s.done:
			return
		}
	}

	if delay > 0 {
		timer := time.NewTimer(delay)
		select {
		case <-timer.C:
		case <-s.done:
			timer.Stop()
			return
		}
	}

	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	m.RecursionAvailable = true

	s.mu.Lock()
	s.answer(m, q, udp)
	s.mu.Unlock()
	m.Compress = true
	if udp {
		size := dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			size = max(int(opt.UDPSize()), dns.MinMsgSize)
		}
		m.Truncate(size) // sets TC when the answer does not fit
	}
	_ = w.WriteMsg(m)
}

// answer fills m for question q. s.mu must be held.
func (s *Server) answer(m *dns.Msg, q dns.Question, udp bool) {
	name := canonical(q.Name)
	first := s.names[name]
	if first == nil {
		m.Rcode = dns.RcodeNameError
		return
	}
	if first.truncate && udp {
		m.Truncated = true
		return
	}
	m.Answer = append(m.Answer, first.inject...)

	owner := q.Name // keep the asker's spelling, as servers do
	for range maxChase {
		e := s.names[name]
		if e == nil {
			m.Rcode = dns.RcodeNameError
			return
		}
		if e.hasRcode {
			m.Rcode = e.rcode
			return
		}
		if rcode, ok := e.rcodeFor[q.Qtype]; ok {
			m.Rcode = rcode
			return
		}
		ttl := uint32(s.defaultTTL / time.Second)
		if e.hasTTL {
			ttl = uint32(e.ttl / time.Second)
		}
		hdr := dns.RR_Header{Name: dns.Fqdn(owner), Class: dns.ClassINET, Ttl: ttl}
		if e.cname != "" {
			hdr.Rrtype = dns.TypeCNAME
			m.Answer = append(m.Answer, &dns.CNAME{Hdr: hdr, Target: dns.Fqdn(e.cname)})
			name, owner = e.cname, e.cname
			continue
		}
		if len(e.seq) == 0 || (q.Qtype != dns.TypeA && q.Qtype != dns.TypeAAAA) {
			return // no data
		}
		i := min(e.served[q.Qtype], len(e.seq)-1)
		e.served[q.Qtype]++
		for _, a := range e.seq[i] {
			switch {
			case q.Qtype == dns.TypeA && a.Is4():
				hdr.Rrtype = dns.TypeA
				b := a.As4()
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.IP(b[:])})
			case q.Qtype == dns.TypeAAAA && a.Is6():
				hdr.Rrtype = dns.TypeAAAA
				b := a.As16()
				m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr, AAAA: net.IP(b[:])})
			}
		}
		return
	}
	// The chain is longer than maxChase: answer what was gathered, as a
	// server that gave up would.
}
