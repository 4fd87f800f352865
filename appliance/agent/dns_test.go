package agent

import (
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

var capturePrefix = netip.MustParsePrefix("198.18.0.0/15")

// ask sends one query to the responder's code (no sockets) and unpacks
// the reply.
func ask(t *testing.T, d *dnsResponder, name string, qtype uint16, edns bool) *dns.Msg {
	t.Helper()
	q := new(dns.Msg)
	q.SetQuestion(name, qtype)
	if edns {
		q.SetEdns0(1232, false)
	}
	b, err := q.Pack()
	if err != nil {
		t.Fatal(err)
	}
	rb := d.answer(b, true)
	if rb == nil {
		t.Fatalf("no reply to %s %s", name, dns.TypeToString[qtype])
	}
	r := new(dns.Msg)
	if err := r.Unpack(rb); err != nil {
		t.Fatal(err)
	}
	if r.Id != q.Id || !r.Response {
		t.Fatalf("reply id %d response %v, want id %d", r.Id, r.Response, q.Id)
	}
	return r
}

func aOf(t *testing.T, r *dns.Msg) netip.Addr {
	t.Helper()
	if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 {
		t.Fatalf("reply %v", r)
	}
	a, ok := netip.AddrFromSlice(r.Answer[0].(*dns.A).A)
	if !ok {
		t.Fatal("bad A")
	}
	return a.Unmap()
}

func TestDNSGivesEveryNameAnAddressOfThePrefix(t *testing.T) {
	d := newDNSResponder(nil, nil)
	d.setCapture(capturePrefix)
	a := aOf(t, ask(t, d, "api.example.com.", dns.TypeA, false))
	if !capturePrefix.Contains(a) {
		t.Fatalf("address %s is not in %s", a, capturePrefix)
	}
	if again := aOf(t, ask(t, d, "API.Example.COM.", dns.TypeA, true)); again != a {
		t.Errorf("the same name (another case) got %s, then %s", a, again)
	}
	if other := aOf(t, ask(t, d, "refused.example.org.", dns.TypeA, false)); other == a || !capturePrefix.Contains(other) {
		t.Errorf("another name got %s (the first got %s)", other, a)
	}
	if n, ok := d.nameOf(a); !ok || n != "api.example.com" {
		t.Errorf("nameOf(%s) = %q, %v", a, n, ok)
	}
	r := ask(t, d, "api.example.com.", dns.TypeAAAA, true)
	if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 0 {
		t.Errorf("AAAA: %v, want NOERROR and no answer (IPv4 only)", r)
	}
	b4 := a.As4()
	ptr := ask(t, d, dns.Fqdn(strings.Join([]string{itoa(b4[3]), itoa(b4[2]), itoa(b4[1]), itoa(b4[0]), "in-addr.arpa"}, ".")), dns.TypePTR, false)
	if len(ptr.Answer) != 1 || ptr.Answer[0].(*dns.PTR).Ptr != "api.example.com." {
		t.Errorf("PTR: %v", ptr)
	}
	if lo := aOf(t, ask(t, d, "localhost.", dns.TypeA, false)); lo != netip.MustParseAddr("127.0.0.1") {
		t.Errorf("localhost is %s", lo)
	}
	if r := ask(t, d, `a\032b.example.`, dns.TypeA, false); r.Rcode != dns.RcodeNameError {
		t.Errorf("a name no host has got %v, want NXDOMAIN", r)
	}
}

func itoa(b byte) string { return netip.AddrFrom4([4]byte{0, 0, 0, b}).String()[6:] }

func TestDNSWithoutCaptureRefusesAtOnceAndReports(t *testing.T) {
	var mu sync.Mutex
	reports := map[string]int{}
	got := make(chan struct{}, 10)
	d := newDNSResponder(nil, func(name, qtype string) {
		mu.Lock()
		reports[name+" "+qtype]++
		mu.Unlock()
		got <- struct{}{}
	})
	r := ask(t, d, "example.com.", dns.TypeA, true)
	if r.Rcode != dns.RcodeNameError {
		t.Fatalf("rcode %s, want NXDOMAIN", dns.RcodeToString[r.Rcode])
	}
	var ede *dns.EDNS0_EDE
	for _, o := range r.IsEdns0().Option {
		if e, ok := o.(*dns.EDNS0_EDE); ok {
			ede = e
		}
	}
	if ede == nil || ede.InfoCode != dns.ExtendedErrorCodeProhibited || !strings.Contains(ede.ExtraText, "proxy") {
		t.Errorf("extended error %+v", ede)
	}
	ask(t, d, "example.com.", dns.TypeAAAA, false) // the same name again: reported once
	select {
	case <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("the refused lookup was not reported")
	}
	time.Sleep(50 * time.Millisecond) // a second report, were there one, would be in by now
	mu.Lock()
	defer mu.Unlock()
	if len(reports) != 1 || reports["example.com A"] != 1 {
		t.Errorf("reports %v, want example.com once", reports)
	}
}

func TestDNSOverUDPAndTCP(t *testing.T) {
	d := newDNSResponder(nil, nil)
	d.setCapture(capturePrefix)
	if err := d.listen("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer d.close()
	for _, net := range []string{"udp", "tcp"} {
		c := &dns.Client{Net: net, Timeout: 10 * time.Second}
		q := new(dns.Msg)
		q.SetQuestion("api.example.com.", dns.TypeA)
		r, _, err := c.Exchange(q, d.udp.LocalAddr().String())
		if err != nil {
			t.Fatalf("%s: %v", net, err)
		}
		if a := aOf(t, r); !capturePrefix.Contains(a) {
			t.Errorf("%s: %s", net, a)
		}
	}
}

func TestDNSTableReusesTheOldestAddressWhenFull(t *testing.T) {
	tab := newNameTable(netip.MustParsePrefix("198.18.0.0/29")) // 5 addresses: .2 to .6
	first := tab.addrOf("n0")
	for i := 1; i < 5; i++ {
		tab.addrOf("n" + itoa(byte(i)))
	}
	if got := tab.addrOf("n5"); got != first {
		t.Errorf("the sixth name got %s, want the oldest address %s", got, first)
	}
	if _, ok := tab.byName["n0"]; ok {
		t.Error("the oldest name kept its address after it was given away")
	}
	if a := tab.addrOf("n1"); a != netip.MustParseAddr("198.18.0.3") {
		t.Errorf("n1 is %s", a)
	}
}

// FuzzDNSQuery: whatever a sandbox sends the responder, it answers with a
// well-formed reply to that query (or nothing), never panics, and gives no
// address outside the capture prefix and loopback.
func FuzzDNSQuery(f *testing.F) {
	for _, name := range []string{"api.example.com.", "localhost.", "2.0.18.198.in-addr.arpa."} {
		for _, qt := range []uint16{dns.TypeA, dns.TypeAAAA, dns.TypePTR, dns.TypeANY} {
			q := new(dns.Msg)
			q.SetQuestion(name, qt)
			b, _ := q.Pack()
			f.Add(b, true)
		}
	}
	f.Add([]byte{0, 1, 2}, false)
	f.Add(make([]byte, 12), false)
	capture := newDNSResponder(nil, nil)
	capture.setCapture(capturePrefix)
	refuse := newDNSResponder(nil, func(string, string) {})
	f.Fuzz(func(t *testing.T, q []byte, withCapture bool) {
		d := refuse
		if withCapture {
			d = capture
		}
		rb := d.answer(q, true)
		if rb == nil {
			return
		}
		if len(rb) < 12 || rb[0] != q[0] || rb[1] != q[1] || rb[2]&0x80 == 0 {
			t.Fatalf("reply %x to %x: not a response with the query's id", rb, q)
		}
		if len(rb) > 1232 {
			t.Fatalf("a %d-byte UDP reply", len(rb))
		}
		var r dns.Msg
		if err := r.Unpack(rb); err != nil {
			t.Fatalf("reply does not unpack: %v", err)
		}
		for _, rr := range r.Answer {
			switch a := rr.(type) {
			case *dns.A:
				ip, _ := netip.AddrFromSlice(a.A)
				if ip = ip.Unmap(); !capturePrefix.Contains(ip) && !ip.IsLoopback() {
					t.Fatalf("answered %s", ip)
				}
			case *dns.AAAA:
				if ip, _ := netip.AddrFromSlice(a.AAAA); !ip.IsLoopback() {
					t.Fatalf("answered %s", ip)
				}
			case *dns.PTR:
			default:
				t.Fatalf("answered a %T", rr)
			}
		}
	})
}
