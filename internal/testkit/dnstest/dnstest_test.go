package dnstest

import (
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// ask sends one query over network ("udp" or "tcp") and returns the answer.
func ask(t *testing.T, s *Server, network, name string, qtype uint16) *dns.Msg {
	t.Helper()
	c := &dns.Client{Net: network, Timeout: 5 * time.Second}
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	r, _, err := c.Exchange(m, s.Addr)
	if err != nil {
		t.Fatalf("%s query %s %s: %v", network, name, dns.TypeToString[qtype], err)
	}
	return r
}

// addrs returns the A and AAAA records of r, in order, and their TTLs.
func addrs(r *dns.Msg) ([]netip.Addr, []uint32) {
	var out []netip.Addr
	var ttls []uint32
	for _, rr := range r.Answer {
		switch rr := rr.(type) {
		case *dns.A:
			a, _ := netip.AddrFromSlice(rr.A.To4())
			out = append(out, a)
			ttls = append(ttls, rr.Hdr.Ttl)
		case *dns.AAAA:
			a, _ := netip.AddrFromSlice(rr.AAAA.To16())
			out = append(out, a)
			ttls = append(ttls, rr.Hdr.Ttl)
		}
	}
	return out, ttls
}

func mustAddrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

func TestSetAnswersByFamily(t *testing.T) {
	s := Start(t)
	s.Set("api.example.com", mustAddrs("93.184.216.34", "2606:2800:220:1::1", "::ffff:10.0.0.1")...)

	for _, network := range []string{"udp", "tcp"} {
		r := ask(t, s, network, "API.Example.COM.", dns.TypeA)
		if r.Rcode != dns.RcodeSuccess {
			t.Fatalf("%s A rcode = %s, want NOERROR", network, dns.RcodeToString[r.Rcode])
		}
		got, ttls := addrs(r)
		if want := mustAddrs("93.184.216.34"); !slices.Equal(got, want) {
			t.Errorf("%s A = %v, want %v", network, got, want)
		}
		if ttls[0] != uint32(DefaultTTL/time.Second) {
			t.Errorf("%s A TTL = %d, want %d", network, ttls[0], DefaultTTL/time.Second)
		}
		got, _ = addrs(ask(t, s, network, "api.example.com", dns.TypeAAAA))
		want := mustAddrs("2606:2800:220:1::1", "::ffff:10.0.0.1")
		if !slices.Equal(got, want) {
			t.Errorf("%s AAAA = %v, want %v", network, got, want)
		}
		for _, a := range got {
			if !a.Is6() {
				t.Errorf("%s AAAA %v is not a 16-byte address", network, a)
			}
		}
	}
	if got := s.Queries("api.example.com"); got != 4 {
		t.Errorf("Queries = %d, want 4", got)
	}
}

func TestUnknownNameIsNXDOMAIN(t *testing.T) {
	s := Start(t)
	r := ask(t, s, "udp", "nowhere.example", dns.TypeA)
	if r.Rcode != dns.RcodeNameError {
		t.Errorf("rcode = %s, want NXDOMAIN", dns.RcodeToString[r.Rcode])
	}
	if got := s.Queries("nowhere.example"); got != 1 {
		t.Errorf("Queries = %d, want 1", got)
	}
}

func TestNoDataAndRcode(t *testing.T) {
	s := Start(t)
	s.Set("v4only.example", netip.MustParseAddr("192.0.2.1"))
	r := ask(t, s, "udp", "v4only.example", dns.TypeAAAA)
	if got, _ := addrs(r); r.Rcode != dns.RcodeSuccess || len(got) != 0 {
		t.Errorf("AAAA of v4-only name: rcode %s, %v; want NOERROR, no data", dns.RcodeToString[r.Rcode], got)
	}

	s.SetRcode("broken.example", dns.RcodeServerFailure)
	if r := ask(t, s, "tcp", "broken.example", dns.TypeA); r.Rcode != dns.RcodeServerFailure {
		t.Errorf("rcode = %s, want SERVFAIL", dns.RcodeToString[r.Rcode])
	}
	s.Set("half.example", netip.MustParseAddr("192.0.2.3"), netip.MustParseAddr("2001:db8::3"))
	s.SetRcodeFor("half.example", dns.TypeAAAA, dns.RcodeServerFailure)
	if got, _ := addrs(ask(t, s, "udp", "half.example", dns.TypeA)); len(got) != 1 {
		t.Errorf("A of half.example = %v, want one address", got)
	}
	if r := ask(t, s, "udp", "half.example", dns.TypeAAAA); r.Rcode != dns.RcodeServerFailure {
		t.Errorf("AAAA of half.example: rcode = %s, want SERVFAIL", dns.RcodeToString[r.Rcode])
	}

	s.Set("broken.example", netip.MustParseAddr("192.0.2.2"))
	if r := ask(t, s, "tcp", "broken.example", dns.TypeA); r.Rcode != dns.RcodeSuccess {
		t.Errorf("after Set: rcode = %s, want NOERROR", dns.RcodeToString[r.Rcode])
	}
}

func TestSequencePerType(t *testing.T) {
	s := Start(t)
	s.SetSequence("rebind.example",
		mustAddrs("93.184.216.34"),
		mustAddrs("10.0.0.5", "fd00::5"),
	)
	steps := []struct {
		qtype uint16
		want  []netip.Addr
	}{
		{dns.TypeA, mustAddrs("93.184.216.34")},
		{dns.TypeAAAA, nil}, // first AAAA query: first set, which has no IPv6
		{dns.TypeA, mustAddrs("10.0.0.5")},
		{dns.TypeA, mustAddrs("10.0.0.5")}, // the last set repeats
		{dns.TypeAAAA, mustAddrs("fd00::5")},
	}
	for i, st := range steps {
		got, _ := addrs(ask(t, s, "udp", "rebind.example", st.qtype))
		if !slices.Equal(got, st.want) {
			t.Errorf("step %d (%s): got %v, want %v", i, dns.TypeToString[st.qtype], got, st.want)
		}
	}
}

func TestCNAMEChainAndTTL(t *testing.T) {
	s := Start(t)
	s.SetCNAME("www.example.com", "edge.cdn.example")
	s.SetCNAME("edge.cdn.example", "host.cdn.example")
	s.Set("host.cdn.example", netip.MustParseAddr("198.51.100.7"))
	s.SetTTL("host.cdn.example", 30*time.Second)
	s.SetTTL("edge.cdn.example", 5*time.Second)

	r := ask(t, s, "udp", "www.example.com", dns.TypeA)
	if len(r.Answer) != 3 {
		t.Fatalf("answer = %v, want CNAME, CNAME, A", r.Answer)
	}
	c1, ok1 := r.Answer[0].(*dns.CNAME)
	c2, ok2 := r.Answer[1].(*dns.CNAME)
	a, ok3 := r.Answer[2].(*dns.A)
	if !ok1 || !ok2 || !ok3 {
		t.Fatalf("answer = %v, want CNAME, CNAME, A", r.Answer)
	}
	if c1.Hdr.Name != "www.example.com." || c1.Target != "edge.cdn.example." ||
		c2.Hdr.Name != "edge.cdn.example." || c2.Target != "host.cdn.example." ||
		a.Hdr.Name != "host.cdn.example." {
		t.Errorf("chain = %v", r.Answer)
	}
	if c1.Hdr.Ttl != 60 || c2.Hdr.Ttl != 5 || a.Hdr.Ttl != 30 {
		t.Errorf("TTLs = %d, %d, %d; want 60, 5, 30", c1.Hdr.Ttl, c2.Hdr.Ttl, a.Hdr.Ttl)
	}

	s.SetCNAME("dangling.example", "missing.example")
	if r := ask(t, s, "udp", "dangling.example", dns.TypeA); r.Rcode != dns.RcodeNameError || len(r.Answer) != 1 {
		t.Errorf("dangling CNAME: rcode %s, answer %v; want NXDOMAIN with the CNAME", dns.RcodeToString[r.Rcode], r.Answer)
	}

	s.SetCNAME("loop1.example", "loop2.example")
	s.SetCNAME("loop2.example", "loop1.example")
	if r := ask(t, s, "udp", "loop1.example", dns.TypeA); len(r.Answer) != maxChase {
		t.Errorf("CNAME loop: %d records, want %d", len(r.Answer), maxChase)
	}
}

func TestTruncateOnlyOverUDP(t *testing.T) {
	s := Start(t)
	s.Set("big.example", netip.MustParseAddr("192.0.2.9"))
	s.SetTruncate("big.example", true)

	r := ask(t, s, "udp", "big.example", dns.TypeA)
	if !r.Truncated || len(r.Answer) != 0 {
		t.Errorf("UDP: TC=%v answer=%v; want TC and no records", r.Truncated, r.Answer)
	}
	r = ask(t, s, "tcp", "big.example", dns.TypeA)
	if got, _ := addrs(r); r.Truncated || !slices.Equal(got, mustAddrs("192.0.2.9")) {
		t.Errorf("TCP: TC=%v answer=%v; want the full answer", r.Truncated, got)
	}
}

func TestInject(t *testing.T) {
	s := Start(t)
	s.Set("victim.example", netip.MustParseAddr("192.0.2.1"))
	s.Inject("victim.example", "bank.example. 3600 IN A 10.6.6.6")
	r := ask(t, s, "udp", "victim.example", dns.TypeA)
	got, _ := addrs(r)
	if !slices.Equal(got, mustAddrs("10.6.6.6", "192.0.2.1")) {
		t.Errorf("answer = %v, want the injected record then the real one", r.Answer)
	}
}

func TestDelay(t *testing.T) {
	s := Start(t)
	s.Set("slow.example", netip.MustParseAddr("192.0.2.1"))
	s.SetDelay("slow.example", time.Hour) // capped at MaxDelay, and cut short at cleanup

	c := &dns.Client{Net: "udp", Timeout: 100 * time.Millisecond}
	m := new(dns.Msg)
	m.SetQuestion("slow.example.", dns.TypeA)
	if _, _, err := c.Exchange(m, s.Addr); err == nil {
		t.Fatal("query to a delayed name answered within 100ms")
	}
	s.SetDelay("slow.example", 0)
	if got, _ := addrs(ask(t, s, "udp", "slow.example", dns.TypeA)); len(got) != 1 {
		t.Errorf("after delay removed: %v", got)
	}
}

func TestConcurrent(t *testing.T) {
	s := Start(t)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for range 20 {
				s.Set("busy.example", netip.AddrFrom4([4]byte{192, 0, 2, byte(i)}))
				r := ask(t, s, []string{"udp", "tcp"}[i%2], "busy.example", dns.TypeA)
				if r.Rcode != dns.RcodeSuccess {
					t.Errorf("rcode = %s", dns.RcodeToString[r.Rcode])
					return
				}
			}
		})
	}
	wg.Wait()
	if got := s.Queries("busy.example"); got != 160 {
		t.Errorf("Queries = %d, want 160", got)
	}
}
