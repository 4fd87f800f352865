package netpolicy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/sandgate/sandgate/internal/testkit/dnstest"
)

// fakeClock is an injectable clock for cache expiry.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newTestResolver returns a resolver asking servers, with cfg's other
// fields, a fake clock unless cfg has one, and a 2s timeout unless set.
func newTestResolver(t *testing.T, cfg ResolverConfig, servers ...string) (*DNSResolver, *fakeClock) {
	t.Helper()
	clock := newFakeClock()
	cfg.Servers = servers
	if cfg.Now == nil {
		cfg.Now = clock.Now
	}
	r, err := NewDNSResolver(cfg)
	if err != nil {
		t.Fatalf("NewDNSResolver: %v", err)
	}
	return r, clock
}

func addrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

// lookup runs LookupIP with a bounded context.
func lookup(t *testing.T, r Resolver, host string) ([]netip.Addr, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	return r.LookupIP(ctx, host)
}

// mustLookup fails the test unless host resolves to want.
func mustLookup(t *testing.T, r Resolver, host string, want []netip.Addr) {
	t.Helper()
	got, err := lookup(t, r, host)
	if err != nil {
		t.Fatalf("LookupIP(%q): %v", host, err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("LookupIP(%q) = %v, want %v", host, got, want)
	}
}

// dnsErr fails the test unless err is a *DNSError for host, and returns it.
// It also checks that the message holds nothing but the host and a cause.
func dnsErr(t *testing.T, err error, host string) *DNSError {
	t.Helper()
	var de *DNSError
	if !errors.As(err, &de) {
		t.Fatalf("error %v (%T) is not a *DNSError", err, err)
	}
	if de.Host != host {
		t.Errorf("DNSError.Host = %q, want %q", de.Host, host)
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "lookup "+host+": ") {
		t.Errorf("error %q does not start with %q", msg, "lookup "+host+": ")
	}
	if strings.Contains(msg, "127.0.0.1") || strings.Contains(msg, "udp") || strings.Contains(msg, "tcp") {
		t.Errorf("error %q names a server or transport", msg)
	}
	return de
}

func TestLookupIPv4AndIPv6(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("api.example.com", addrs("93.184.216.34", "93.184.216.35", "2606:2800:220:1::1", "::ffff:10.0.0.1")...)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)

	got, err := lookup(t, r, "API.Example.com.")
	if err != nil {
		t.Fatal(err)
	}
	want := addrs("93.184.216.34", "93.184.216.35", "2606:2800:220:1::1", "::ffff:10.0.0.1")
	if !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	// What DNS said, exactly: A records are 4-byte, AAAA records 16-byte,
	// and an IPv4-mapped AAAA is not unmapped (the policy judges it).
	if !got[0].Is4() || got[2].Is4() || !got[3].Is4In6() {
		t.Errorf("address forms changed: %#v", got)
	}
	if n := s.Queries("api.example.com"); n != 2 {
		t.Errorf("server got %d queries, want 2 (A and AAAA)", n)
	}
}

func TestLookupDeduplicates(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("dup.example", addrs("192.0.2.1", "192.0.2.1", "2001:db8::1", "2001:db8::1")...)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	mustLookup(t, r, "dup.example", addrs("192.0.2.1", "2001:db8::1"))
}

func TestLookupIPLiteralAsksNobody(t *testing.T) {
	s := dnstest.Start(t)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	for _, lit := range []string{"192.0.2.7", "2001:db8::7", "::ffff:127.0.0.1"} {
		mustLookup(t, r, lit, addrs(lit))
		if n := s.Queries(lit); n != 0 {
			t.Errorf("%s: server got %d queries, want 0", lit, n)
		}
	}
}

func TestLookupInvalidNameAsksNobody(t *testing.T) {
	s := dnstest.Start(t)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	for _, host := range []string{"", ".", "a..b", "bad host.example", "exa\x00mple.com", "ünï.example", strings.Repeat("a", 64) + ".example", strings.Repeat("a.", 127) + "com"} {
		_, err := lookup(t, r, host)
		var de *DNSError
		if !errors.As(err, &de) || de.NotFound || de.IsTimeout || !errors.Is(err, errDNSInvalidName) {
			t.Errorf("LookupIP(%q) error = %v, want an invalid host name DNSError", host, err)
		}
	}
}

func TestLookupCNAMEChain(t *testing.T) {
	s := dnstest.Start(t)
	s.SetCNAME("www.example.com", "edge.cdn.example")
	s.SetCNAME("edge.cdn.example", "host.cdn.example")
	s.Set("host.cdn.example", addrs("198.51.100.7", "2001:db8::7")...)
	s.SetTTL("edge.cdn.example", 5*time.Second) // the smallest TTL of the chain
	r, clock := newTestResolver(t, ResolverConfig{}, s.Addr)

	mustLookup(t, r, "www.example.com", addrs("198.51.100.7", "2001:db8::7"))
	clock.Advance(4 * time.Second)
	mustLookup(t, r, "www.example.com", addrs("198.51.100.7", "2001:db8::7"))
	if n := s.Queries("www.example.com"); n != 2 {
		t.Errorf("within the CNAME's TTL: %d queries, want 2", n)
	}
	clock.Advance(2 * time.Second)
	mustLookup(t, r, "www.example.com", addrs("198.51.100.7", "2001:db8::7"))
	if n := s.Queries("www.example.com"); n != 4 {
		t.Errorf("after the CNAME's TTL: %d queries, want 4", n)
	}
	// The resolver follows the chain inside the answer; it never asks for
	// the targets itself.
	if n := s.Queries("host.cdn.example"); n != 0 {
		t.Errorf("target asked %d times, want 0", n)
	}
}

func TestLookupCNAMEChainTooLong(t *testing.T) {
	s := dnstest.Start(t)
	for i := range maxCNAMEChain + 1 {
		s.SetCNAME("c"+string(rune('a'+i))+".example", "c"+string(rune('a'+i+1))+".example")
	}
	s.Set("c"+string(rune('a'+maxCNAMEChain+1))+".example", addrs("192.0.2.1")...)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)

	_, err := lookup(t, r, "ca.example")
	de := dnsErr(t, err, "ca.example")
	if de.NotFound || !errors.Is(err, errDNSCNAMEChain) {
		t.Errorf("error = %v, want %v", err, errDNSCNAMEChain)
	}

	// A chain of exactly maxCNAMEChain is followed.
	mustLookup(t, r, "cb.example", addrs("192.0.2.1"))
}

func TestLookupCNAMELoop(t *testing.T) {
	s := dnstest.Start(t)
	s.SetCNAME("loop1.example", "loop2.example")
	s.SetCNAME("loop2.example", "loop1.example")
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	_, err := lookup(t, r, "loop1.example")
	if !errors.Is(err, errDNSCNAMEChain) {
		t.Errorf("error = %v, want %v", err, errDNSCNAMEChain)
	}
}

// Records about names that were not asked must not be used or cached.
func TestLookupIgnoresUnrelatedRecords(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("victim.example", addrs("192.0.2.1")...)
	s.Inject("victim.example",
		"bank.example. 3600 IN A 10.6.6.6",
		"bank.example. 3600 IN AAAA fd00::666",
		"other.example. 3600 IN CNAME bank.example.",
		"victim.example. 3600 CH A 10.7.7.7", // wrong class
	)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)

	mustLookup(t, r, "victim.example", addrs("192.0.2.1"))
	_, err := lookup(t, r, "bank.example")
	if !IsNotFound(err) {
		t.Errorf("bank.example: error = %v, want not found (the planted record must not be cached)", err)
	}
	if n := s.Queries("bank.example"); n != 2 {
		t.Errorf("bank.example asked %d times, want 2", n)
	}
}

func TestLookupNXDOMAIN(t *testing.T) {
	s := dnstest.Start(t)
	r, clock := newTestResolver(t, ResolverConfig{NegativeTTL: 10 * time.Second}, s.Addr)

	_, err := lookup(t, r, "nowhere.example")
	de := dnsErr(t, err, "nowhere.example")
	if !de.NotFound || de.Timeout() || !IsNotFound(err) || !errors.Is(err, ErrNoSuchHost) {
		t.Errorf("error = %#v, want NotFound", de)
	}
	if got, want := err.Error(), "lookup nowhere.example: no such host"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}

	// Negative caching: no new query until NegativeTTL has passed.
	clock.Advance(9 * time.Second)
	if _, err := lookup(t, r, "nowhere.example"); !IsNotFound(err) {
		t.Errorf("cached: error = %v, want not found", err)
	}
	if n := s.Queries("nowhere.example"); n != 2 {
		t.Errorf("within NegativeTTL: %d queries, want 2", n)
	}
	clock.Advance(2 * time.Second)
	s.Set("nowhere.example", addrs("192.0.2.3")...)
	mustLookup(t, r, "nowhere.example", addrs("192.0.2.3"))
	if n := s.Queries("nowhere.example"); n != 4 {
		t.Errorf("after NegativeTTL: %d queries, want 4", n)
	}
}

func TestLookupNoData(t *testing.T) {
	s := dnstest.Start(t)
	s.SetRcode("empty.example", dns.RcodeSuccess)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	_, err := lookup(t, r, "empty.example")
	if de := dnsErr(t, err, "empty.example"); !de.NotFound {
		t.Errorf("error = %v, want NotFound", err)
	}
}

func TestLookupSERVFAIL(t *testing.T) {
	s := dnstest.Start(t)
	s.SetRcode("broken.example", dns.RcodeServerFailure)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)

	_, err := lookup(t, r, "broken.example")
	de := dnsErr(t, err, "broken.example")
	if de.NotFound || de.Timeout() || IsNotFound(err) {
		t.Errorf("error = %#v, want neither NotFound nor Timeout", de)
	}
	// Failures are not cached.
	if _, err := lookup(t, r, "broken.example"); err == nil {
		t.Fatal("second lookup succeeded")
	}
	if n := s.Queries("broken.example"); n != 4 {
		t.Errorf("%d queries, want 4 (SERVFAIL is not cached)", n)
	}
}

func TestLookupSERVFAILTriesNextServer(t *testing.T) {
	bad := dnstest.Start(t)
	bad.SetRcode("api.example.com", dns.RcodeServerFailure)
	good := dnstest.Start(t)
	good.Set("api.example.com", addrs("192.0.2.10")...)
	r, _ := newTestResolver(t, ResolverConfig{}, bad.Addr, good.Addr)
	mustLookup(t, r, "api.example.com", addrs("192.0.2.10"))
}

// An authoritative "no such name" is final: the next server is not asked.
func TestLookupNXDOMAINDoesNotTryNextServer(t *testing.T) {
	first := dnstest.Start(t)
	second := dnstest.Start(t)
	second.Set("gone.example", addrs("192.0.2.10")...)
	r, _ := newTestResolver(t, ResolverConfig{}, first.Addr, second.Addr)
	if _, err := lookup(t, r, "gone.example"); !IsNotFound(err) {
		t.Errorf("error = %v, want not found", err)
	}
	if n := second.Queries("gone.example"); n != 0 {
		t.Errorf("second server asked %d times, want 0", n)
	}
}

func TestLookupTimeout(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("slow.example", addrs("192.0.2.1")...)
	s.SetDelay("slow.example", 5*time.Second)
	r, _ := newTestResolver(t, ResolverConfig{Timeout: 100 * time.Millisecond}, s.Addr)

	_, err := lookup(t, r, "slow.example")
	de := dnsErr(t, err, "slow.example")
	if !de.Timeout() || de.NotFound {
		t.Errorf("error = %#v, want a Timeout", de)
	}
	var te interface{ Timeout() bool }
	if !errors.As(err, &te) || !te.Timeout() {
		t.Errorf("error does not satisfy interface{ Timeout() bool }")
	}
}

func TestLookupHonoursContext(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("slow.example", addrs("192.0.2.1")...)
	s.SetDelay("slow.example", 5*time.Second)
	r, _ := newTestResolver(t, ResolverConfig{Timeout: 5 * time.Second}, s.Addr)

	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	_, err := r.LookupIP(ctx, "slow.example")
	if de := dnsErr(t, err, "slow.example"); !de.Timeout() || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("deadline: error = %v, want a Timeout wrapping context.DeadlineExceeded", err)
	}

	ctx, cancel = context.WithCancel(t.Context())
	go func() {
		time.Sleep(50 * time.Millisecond)
		cancel()
	}()
	_, err = r.LookupIP(ctx, "slow.example")
	if de := dnsErr(t, err, "slow.example"); de.Timeout() || !errors.Is(err, context.Canceled) {
		t.Errorf("cancel: error = %v, want context.Canceled", err)
	}

	// A context that has already ended asks nobody.
	before := s.Queries("other.example")
	if _, err := r.LookupIP(ctx, "other.example"); !errors.Is(err, context.Canceled) {
		t.Errorf("ended context: error = %v, want context.Canceled", err)
	}
	if n := s.Queries("other.example"); n != before {
		t.Errorf("ended context: %d queries, want %d", n, before)
	}
}

func TestCloseEndsLookupsInFlight(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("slow.example", addrs("192.0.2.1")...)
	s.SetDelay("slow.example", dnstest.MaxDelay)
	s.Set("fast.example", addrs("192.0.2.2")...)
	r, _ := newTestResolver(t, ResolverConfig{Timeout: time.Minute}, s.Addr)
	mustLookup(t, r, "fast.example", addrs("192.0.2.2"))

	done := make(chan error, 1)
	go func() {
		_, err := r.LookupIP(context.Background(), "slow.example")
		done <- err
	}()
	deadline := time.Now().Add(5 * time.Second)
	for s.Queries("slow.example") < 2 {
		if time.Now().After(deadline) {
			t.Fatal("lookup did not reach the server within 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	select {
	case err := <-done:
		if de := dnsErr(t, err, "slow.example"); !errors.Is(err, errDNSClosed) || de.NotFound {
			t.Errorf("error = %v, want %v", err, errDNSClosed)
		}
	case <-time.After(dnstest.MaxDelay - time.Second):
		t.Fatalf("LookupIP still running %s after Close (the server delays %s)", dnstest.MaxDelay-time.Second, dnstest.MaxDelay)
	}
	if _, err := lookup(t, r, "fast.example"); !errors.Is(err, errDNSClosed) {
		t.Errorf("after Close: error = %v, want %v", err, errDNSClosed)
	}
	if err := r.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestLookupCacheHit(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("api.example.com", addrs("192.0.2.1", "2001:db8::1")...)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	for range 5 {
		got, err := lookup(t, r, "api.example.com")
		if err != nil {
			t.Fatal(err)
		}
		got[0] = netip.MustParseAddr("10.0.0.1") // must not reach the cache
	}
	mustLookup(t, r, "API.EXAMPLE.COM.", addrs("192.0.2.1", "2001:db8::1"))
	if n := s.Queries("api.example.com"); n != 2 {
		t.Errorf("%d queries, want 2", n)
	}
}

func TestLookupTTL(t *testing.T) {
	tests := []struct {
		name      string
		cfg       ResolverConfig
		ttl       time.Duration
		stillHit  time.Duration // cached at this age
		expiredAt time.Duration // asked again at this age; 0: never cached
	}{
		{"record TTL", ResolverConfig{}, 10 * time.Second, 9 * time.Second, 10 * time.Second},
		{"capped by MaxTTL", ResolverConfig{MaxTTL: time.Minute}, time.Hour, 59 * time.Second, time.Minute},
		{"TTL 0 is not cached", ResolverConfig{}, 0, 0, 0},
		{"raised to MinTTL", ResolverConfig{MinTTL: 30 * time.Second}, 0, 29 * time.Second, 30 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := dnstest.Start(t)
			s.Set("ttl.example", addrs("192.0.2.1")...)
			s.SetTTL("ttl.example", tt.ttl)
			r, clock := newTestResolver(t, tt.cfg, s.Addr)

			mustLookup(t, r, "ttl.example", addrs("192.0.2.1"))
			if tt.expiredAt == 0 {
				mustLookup(t, r, "ttl.example", addrs("192.0.2.1"))
				if n := s.Queries("ttl.example"); n != 4 {
					t.Errorf("%d queries, want 4 (not cached)", n)
				}
				return
			}
			clock.Advance(tt.stillHit)
			mustLookup(t, r, "ttl.example", addrs("192.0.2.1"))
			if n := s.Queries("ttl.example"); n != 2 {
				t.Errorf("at %v: %d queries, want 2 (cached)", tt.stillHit, n)
			}
			clock.Advance(tt.expiredAt - tt.stillHit)
			mustLookup(t, r, "ttl.example", addrs("192.0.2.1"))
			if n := s.Queries("ttl.example"); n != 4 {
				t.Errorf("at %v: %d queries, want 4 (expired)", tt.expiredAt, n)
			}
		})
	}
}

// When one of A and AAAA fails, the other's addresses are returned but
// cached only for NegativeTTL, so that the failed type is asked again soon.
// A type that has no data is not a failure and keeps the record TTL.
func TestLookupPartialFailure(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("half.example", addrs("192.0.2.1", "2001:db8::1")...)
	s.SetRcodeFor("half.example", dns.TypeAAAA, dns.RcodeServerFailure)
	s.Set("v4only.example", addrs("192.0.2.2")...)
	r, clock := newTestResolver(t, ResolverConfig{NegativeTTL: 3 * time.Second}, s.Addr)

	mustLookup(t, r, "half.example", addrs("192.0.2.1"))
	mustLookup(t, r, "v4only.example", addrs("192.0.2.2"))
	clock.Advance(2 * time.Second)
	mustLookup(t, r, "half.example", addrs("192.0.2.1"))
	if n := s.Queries("half.example"); n != 2 {
		t.Errorf("within NegativeTTL: %d queries, want 2", n)
	}
	clock.Advance(2 * time.Second)
	mustLookup(t, r, "half.example", addrs("192.0.2.1"))
	if n := s.Queries("half.example"); n != 4 {
		t.Errorf("after NegativeTTL: %d queries, want 4", n)
	}
	mustLookup(t, r, "v4only.example", addrs("192.0.2.2"))
	if n := s.Queries("v4only.example"); n != 2 {
		t.Errorf("no-data AAAA: %d queries, want 2 (cached for the A TTL)", n)
	}
}

// startHandler serves h over UDP on loopback, for answers dnstest will not
// give.
func startHandler(t *testing.T, h dns.HandlerFunc) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	srv := &dns.Server{PacketConn: pc, Handler: h, NotifyStartedFunc: func() { close(started) }}
	served := make(chan error, 1)
	go func() { served <- srv.ActivateAndServe() }()
	select {
	case <-started:
	case err := <-served:
		t.Fatalf("server: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("server did not start within a minute")
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.ShutdownContext(ctx)
	})
	return pc.LocalAddr().String()
}

// A response must answer the question asked: one about another name or
// type, or one that is not a response, is refused and the next server asked.
func TestLookupRefusesMismatchedResponses(t *testing.T) {
	good := dnstest.Start(t)
	good.Set("api.example.com", addrs("192.0.2.10")...)
	tests := []struct {
		name   string
		mangle func(m *dns.Msg)
	}{
		{"other name", func(m *dns.Msg) { m.Question[0].Name = "evil.example." }},
		{"other type", func(m *dns.Msg) { m.Question[0].Qtype = dns.TypeMX }},
		{"no question", func(m *dns.Msg) { m.Question = nil }},
		{"not a response", func(m *dns.Msg) { m.Response = false }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bad := startHandler(t, func(w dns.ResponseWriter, req *dns.Msg) {
				m := new(dns.Msg)
				m.SetReply(req)
				hdr := dns.RR_Header{Name: req.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.IPv4(10, 6, 6, 6)})
				tt.mangle(m)
				_ = w.WriteMsg(m)
			})
			// A bad answer is refused at once, so no try waits out its
			// timeout: it only bounds the good server's answer, which a
			// loaded machine may delay.
			r, _ := newTestResolver(t, ResolverConfig{Timeout: 10 * time.Second}, bad, good.Addr)
			mustLookup(t, r, "api.example.com", addrs("192.0.2.10"))

			r, _ = newTestResolver(t, ResolverConfig{Timeout: 10 * time.Second}, bad)
			_, err := lookup(t, r, "api.example.com")
			if de := dnsErr(t, err, "api.example.com"); de.NotFound {
				t.Errorf("only a bad server: error = %v, want a failure", err)
			}
		})
	}
}

// A 4-byte A record and a 16-byte AAAA record holding a mapped address are
// returned as sent, whatever the server's encoding of the A record.
func TestLookupAddressForms(t *testing.T) {
	srv := startHandler(t, func(w dns.ResponseWriter, req *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(req)
		hdr := dns.RR_Header{Name: req.Question[0].Name, Rrtype: req.Question[0].Qtype, Class: dns.ClassINET, Ttl: 60}
		switch req.Question[0].Qtype {
		case dns.TypeA:
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.ParseIP("192.0.2.1")}) // a 16-byte net.IP
		case dns.TypeAAAA:
			m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr, AAAA: net.ParseIP("::ffff:169.254.169.254")})
		}
		_ = w.WriteMsg(m)
	})
	r, _ := newTestResolver(t, ResolverConfig{}, srv)
	got, err := lookup(t, r, "forms.example")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || !got[0].Is4() || got[0] != netip.MustParseAddr("192.0.2.1") ||
		!got[1].Is4In6() || got[1] != netip.MustParseAddr("::ffff:169.254.169.254") {
		t.Errorf("got %v, want [192.0.2.1 ::ffff:169.254.169.254] in their DNS forms", got)
	}
}

// The dialer checks every answer, so a name that answers a public address
// first and a private one next is caught either way; the resolver's part
// is to return what each answer said and not to cache past the TTL.
func TestLookupRebindingSequence(t *testing.T) {
	s := dnstest.Start(t)
	s.SetSequence("rebind.example", addrs("93.184.216.34"), addrs("10.0.0.5", "fd00::5"))
	s.SetTTL("rebind.example", 0)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	mustLookup(t, r, "rebind.example", addrs("93.184.216.34"))
	mustLookup(t, r, "rebind.example", addrs("10.0.0.5", "fd00::5"))
	mustLookup(t, r, "rebind.example", addrs("10.0.0.5", "fd00::5"))

	// With a TTL, the first answer is what every caller sees until it expires.
	s2 := dnstest.Start(t)
	s2.SetSequence("rebind.example", addrs("93.184.216.34"), addrs("10.0.0.5"))
	s2.SetTTL("rebind.example", 30*time.Second)
	r2, clock := newTestResolver(t, ResolverConfig{}, s2.Addr)
	mustLookup(t, r2, "rebind.example", addrs("93.184.216.34"))
	mustLookup(t, r2, "rebind.example", addrs("93.184.216.34"))
	clock.Advance(31 * time.Second)
	mustLookup(t, r2, "rebind.example", addrs("10.0.0.5"))
}

func TestLookupTruncatedFallsBackToTCP(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("big.example", addrs("192.0.2.1", "2001:db8::1")...)
	s.SetTruncate("big.example", true)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	mustLookup(t, r, "big.example", addrs("192.0.2.1", "2001:db8::1"))
	if n := s.Queries("big.example"); n != 4 {
		t.Errorf("%d queries, want 4 (UDP then TCP, for A and AAAA)", n)
	}
}

// A large answer that does not fit in UDP is truncated by the server and
// fetched whole over TCP.
func TestLookupLargeAnswer(t *testing.T) {
	s := dnstest.Start(t)
	var many []netip.Addr
	for i := range 200 {
		many = append(many, netip.AddrFrom4([4]byte{198, 51, byte(i / 250), byte(i%250 + 1)}))
	}
	s.Set("many.example", many...)
	r, _ := newTestResolver(t, ResolverConfig{}, s.Addr)
	mustLookup(t, r, "many.example", many)
}

func TestLookupFirstServerDead(t *testing.T) {
	// A server that reads queries and never answers: the first try times out.
	blackhole, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { blackhole.Close() })
	// A port where nothing listens: the first try is refused.
	closed, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.LocalAddr().String()
	closed.Close()

	good := dnstest.Start(t)
	good.Set("api.example.com", addrs("192.0.2.10")...)

	for _, dead := range []string{blackhole.LocalAddr().String(), closedAddr} {
		// The black hole costs one timeout; the same timeout bounds the
		// good server's answer, so it is long enough for a loaded machine.
		r, _ := newTestResolver(t, ResolverConfig{Timeout: 3 * time.Second}, dead, good.Addr)
		mustLookup(t, r, "api.example.com", addrs("192.0.2.10"))
	}

	// All servers dead: an error of kind Timeout, or unreachable.
	r, _ := newTestResolver(t, ResolverConfig{Timeout: 100 * time.Millisecond}, blackhole.LocalAddr().String())
	_, err = lookup(t, r, "api.example.com")
	if de := dnsErr(t, err, "api.example.com"); !de.Timeout() {
		t.Errorf("black hole: error = %#v, want a Timeout", de)
	}
	r, _ = newTestResolver(t, ResolverConfig{Timeout: 2 * time.Second}, closedAddr)
	_, err = lookup(t, r, "api.example.com")
	if de := dnsErr(t, err, "api.example.com"); de.NotFound {
		t.Errorf("refused: error = %#v, want a failure that is not NotFound", de)
	}
}

func TestLookupConcurrent(t *testing.T) {
	s := dnstest.Start(t)
	names := []string{"a.example", "b.example", "c.example", "d.example"}
	for i, n := range names {
		s.Set(n, netip.AddrFrom4([4]byte{192, 0, 2, byte(i + 1)}))
	}
	r, clock := newTestResolver(t, ResolverConfig{MaxEntries: 3}, s.Addr)

	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 50 {
				n := (g + i) % len(names)
				if i%10 == 0 {
					clock.Advance(time.Second)
				}
				got, err := lookup(t, r, names[n])
				if err != nil {
					t.Errorf("LookupIP(%s): %v", names[n], err)
					return
				}
				if want := netip.AddrFrom4([4]byte{192, 0, 2, byte(n + 1)}); len(got) != 1 || got[0] != want {
					t.Errorf("LookupIP(%s) = %v, want %v", names[n], got, want)
					return
				}
			}
		})
	}
	wg.Wait()
	r.mu.Lock()
	defer r.mu.Unlock()
	if n := r.cache.len(); n > 3 {
		t.Errorf("cache holds %d names, want at most MaxEntries 3", n)
	}
}

// Callers asking for a name while a lookup of it is in flight share that
// lookup instead of sending their own queries.
func TestLookupSharesInFlightQueries(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("shared.example", addrs("192.0.2.1")...)
	s.SetTTL("shared.example", 0) // no cache: only sharing can save queries
	release := s.Hold("shared.example")
	defer release()
	r, _ := newTestResolver(t, ResolverConfig{Timeout: time.Minute}, s.Addr)

	results := make(chan error, 11)
	go func() {
		_, err := lookup(t, r, "shared.example")
		results <- err
	}()
	// Wait (bounded) until the server holds both queries of the first lookup.
	waitFor(t, "the first lookup to reach the server", func() bool { return s.Queries("shared.example") >= 2 })
	for range 10 {
		go func() {
			got, err := lookup(t, r, "shared.example")
			if err == nil && !slices.Equal(got, addrs("192.0.2.1")) {
				err = errors.New("wrong addresses")
			}
			results <- err
		}()
	}
	// The answer is held until all ten have joined the flight in progress.
	waitFor(t, "ten lookups to join the one in flight", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		f := r.flights["shared.example"]
		return f != nil && f.joined == 10
	})
	release()
	for range 11 {
		if err := <-results; err != nil {
			t.Error(err)
		}
	}
	if n := s.Queries("shared.example"); n != 2 {
		t.Errorf("%d queries for 11 concurrent lookups, want 2", n)
	}
}

// waitFor polls cond until it holds, failing the test after 30s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 30s for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestLookupEviction(t *testing.T) {
	s := dnstest.Start(t)
	for _, n := range []string{"a.example", "b.example", "c.example"} {
		s.Set(n, addrs("192.0.2.1")...)
	}
	r, _ := newTestResolver(t, ResolverConfig{MaxEntries: 2}, s.Addr)
	mustLookup(t, r, "a.example", addrs("192.0.2.1"))
	mustLookup(t, r, "b.example", addrs("192.0.2.1"))
	mustLookup(t, r, "a.example", addrs("192.0.2.1")) // a is now the most recent
	mustLookup(t, r, "c.example", addrs("192.0.2.1")) // evicts b
	mustLookup(t, r, "a.example", addrs("192.0.2.1"))
	mustLookup(t, r, "b.example", addrs("192.0.2.1"))
	if got := []int{s.Queries("a.example"), s.Queries("b.example"), s.Queries("c.example")}; !slices.Equal(got, []int{2, 4, 2}) {
		t.Errorf("queries a, b, c = %v, want [2 4 2]", got)
	}
}

func TestLookupObserve(t *testing.T) {
	s := dnstest.Start(t)
	s.Set("seen.example", addrs("192.0.2.1")...)
	type call struct {
		host string
		err  error
	}
	var mu sync.Mutex
	var calls []call
	r, _ := newTestResolver(t, ResolverConfig{Observe: func(host string, d time.Duration, err error) {
		mu.Lock()
		defer mu.Unlock()
		if d < 0 {
			t.Errorf("Observe got negative duration %v", d)
		}
		calls = append(calls, call{host, err})
	}}, s.Addr)

	mustLookup(t, r, "Seen.Example.", addrs("192.0.2.1"))
	mustLookup(t, r, "seen.example", addrs("192.0.2.1")) // cache hit, observed too
	_, _ = lookup(t, r, "missing.example")

	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 3 {
		t.Fatalf("Observe called %d times, want 3", len(calls))
	}
	if calls[0].host != "seen.example" || calls[0].err != nil || calls[1].err != nil {
		t.Errorf("calls = %v", calls)
	}
	if calls[2].host != "missing.example" || !IsNotFound(calls[2].err) {
		t.Errorf("call 3 = %v, want missing.example, not found", calls[2])
	}
}

func TestNewDNSResolverValidates(t *testing.T) {
	tests := []struct {
		name  string
		cfg   ResolverConfig
		field string // in the error; "" means valid
	}{
		{"valid", ResolverConfig{Servers: []string{"192.0.2.53:53", "[2001:db8::53]:5353", "192.0.2.54"}}, ""},
		{"no servers", ResolverConfig{}, "Servers"},
		{"server by name", ResolverConfig{Servers: []string{"dns.google:53"}}, "Servers[0]"},
		{"server port 0", ResolverConfig{Servers: []string{"192.0.2.53:53", "192.0.2.54:0"}}, "Servers[1]"},
		{"server bad port", ResolverConfig{Servers: []string{"192.0.2.53:99999"}}, "Servers[0]"},
		{"negative timeout", ResolverConfig{Servers: []string{"192.0.2.53"}, Timeout: -time.Second}, "Timeout"},
		{"negative MaxTTL", ResolverConfig{Servers: []string{"192.0.2.53"}, MaxTTL: -1}, "MaxTTL"},
		{"negative MinTTL", ResolverConfig{Servers: []string{"192.0.2.53"}, MinTTL: -1}, "MinTTL"},
		{"negative NegativeTTL", ResolverConfig{Servers: []string{"192.0.2.53"}, NegativeTTL: -1}, "NegativeTTL"},
		{"MinTTL above MaxTTL", ResolverConfig{Servers: []string{"192.0.2.53"}, MinTTL: time.Hour, MaxTTL: time.Minute}, "MinTTL"},
		{"negative MaxEntries", ResolverConfig{Servers: []string{"192.0.2.53"}, MaxEntries: -1}, "MaxEntries"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := NewDNSResolver(tt.cfg)
			if tt.field == "" {
				if err != nil {
					t.Fatalf("error: %v", err)
				}
				want := []string{"192.0.2.53:53", "[2001:db8::53]:5353", "192.0.2.54:53"}
				if !slices.Equal(r.servers, want) || r.timeout != DefaultDNSTimeout || r.maxTTL != DefaultDNSMaxTTL ||
					r.negativeTTL != DefaultDNSNegativeTTL || r.cache.max != DefaultDNSMaxEntries {
					t.Errorf("resolver = %+v, want the defaults and servers %v", r, want)
				}
				return
			}
			if err == nil {
				t.Fatal("no error")
			}
			if !strings.Contains(err.Error(), "ResolverConfig."+tt.field) {
				t.Errorf("error %q does not name ResolverConfig.%s", err, tt.field)
			}
		})
	}
}

func TestServersFromResolvConf(t *testing.T) {
	tests := []struct {
		name    string
		conf    string
		want    []string
		wantErr string
	}{
		{"typical", "# generated\nsearch corp.example\nnameserver 10.0.0.2\nnameserver 10.0.0.3\noptions ndots:5\n",
			[]string{"10.0.0.2:53", "10.0.0.3:53"}, ""},
		{"ipv6 and zone", "nameserver 2001:db8::53\nnameserver fe80::1%eth0\n",
			[]string{"[2001:db8::53]:53", "[fe80::1%eth0]:53"}, ""},
		{"comments", "; old\n#nameserver 192.0.2.9\nnameserver 192.0.2.1 # primary\nnameserver\t192.0.2.2;backup\n",
			[]string{"192.0.2.1:53", "192.0.2.2:53"}, ""},
		{"systemd-resolved stub", "nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch .\n", []string{"127.0.0.53:53"}, ""},
		{"indented and CRLF", "  nameserver 192.0.2.1\r\n", []string{"192.0.2.1:53"}, ""},
		{"empty", "", nil, "no nameserver line"},
		{"only comments", "# nameserver 192.0.2.1\n", nil, "no nameserver line"},
		{"a name", "nameserver dns.example\n", nil, `line 1: nameserver "dns.example" is not an IP address`},
		{"no address", "search x\nnameserver\n", nil, "line 2: nameserver without an address"},
		{"nameserver-like keyword", "nameservers 192.0.2.1\nnameserver 192.0.2.2\n", []string{"192.0.2.2:53"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "resolv.conf")
			if err := os.WriteFile(path, []byte(tt.conf), 0o644); err != nil {
				t.Fatal(err)
			}
			got, err := ServersFromResolvConf(path)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("got %q, want %q", got, tt.want)
			}
			if _, err := NewDNSResolver(ResolverConfig{Servers: got}); err != nil {
				t.Errorf("servers not accepted by NewDNSResolver: %v", err)
			}
		})
	}

	if _, err := ServersFromResolvConf(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: error = %v, want os.ErrNotExist", err)
	}
}

func TestDNSErrorMessage(t *testing.T) {
	tests := []struct {
		err  *DNSError
		want string
	}{
		{&DNSError{Host: "api.example.com", Err: ErrNoSuchHost, NotFound: true}, "lookup api.example.com: no such host"},
		{&DNSError{Host: "api.example.com", Err: errDNSTimeout, IsTimeout: true}, "lookup api.example.com: DNS query timed out"},
		{&DNSError{Host: "api.example.com"}, "lookup api.example.com: lookup failed"},
	}
	for _, tt := range tests {
		if got := tt.err.Error(); got != tt.want {
			t.Errorf("Error() = %q, want %q", got, tt.want)
		}
	}
	if IsNotFound(nil) || IsNotFound(errors.New("no such host")) {
		t.Error("IsNotFound is true for an error that is not a DNSError")
	}
}
