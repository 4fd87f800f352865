package netpolicy

import (
	"bufio"
	"container/list"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// Resolver is what the pinned dialer asks for the addresses of a host.
// DNSResolver is the one the proxy uses; tests and callers can supply their
// own. LookupIP returns every address the name resolves to, or an error,
// preferably a *DNSError.
type Resolver interface {
	LookupIP(ctx context.Context, host string) ([]netip.Addr, error)
}

var _ Resolver = (*DNSResolver)(nil)

// Defaults of ResolverConfig, used where a field is zero.
const (
	DefaultDNSTimeout     = 2 * time.Second
	DefaultDNSMaxTTL      = 5 * time.Minute
	DefaultDNSNegativeTTL = 5 * time.Second
	DefaultDNSMaxEntries  = 10000
)

const (
	// maxCNAMEChain bounds how many CNAMEs of one answer are followed.
	maxCNAMEChain = 8
	// ednsUDPSize is the EDNS0 buffer size advertised, the DNS flag day 2020
	// value that avoids IP fragmentation; larger answers come over TCP.
	ednsUDPSize = 1232
	// maxNameLen is the longest name in presentation form, without the dot.
	maxNameLen = 253
)

// ResolverConfig configures a DNSResolver. The zero value of each field
// except Servers means its default. NewDNSResolver validates it once.
type ResolverConfig struct {
	// Servers are the DNS servers asked, in order, as IP:port ("10.0.0.2:53",
	// "[2001:db8::53]:53"); a bare IP means port 53. Names are refused: the
	// resolver never uses the system resolver, not even for its servers.
	// At least one is required; ServersFromResolvConf reads them from
	// /etc/resolv.conf.
	Servers []string
	// Timeout bounds each exchange with one server (UDP, then TCP when the
	// UDP answer is truncated, each get Timeout). When it expires the next
	// server is tried. Zero means DefaultDNSTimeout.
	Timeout time.Duration
	// MinTTL is the shortest time an answer is cached, even when its records
	// say less. Zero means no floor: a TTL of 0 is not cached.
	MinTTL time.Duration
	// MaxTTL caps how long an answer is cached, whatever its records say.
	// Zero means DefaultDNSMaxTTL.
	MaxTTL time.Duration
	// NegativeTTL is how long "no such host" and "no addresses" answers are
	// cached, and the most that an answer is cached when one of its two
	// queries (A or AAAA) failed. Zero means DefaultDNSNegativeTTL.
	NegativeTTL time.Duration
	// MaxEntries bounds the cache; the least recently used name is evicted
	// first. Zero means DefaultDNSMaxEntries.
	MaxEntries int
	// Observe, if not nil, is called once per LookupIP, with the canonical
	// host, the time the lookup took (cache hits included) and its error.
	// The proxy feeds its DNS metrics from it. It is called synchronously
	// from concurrent lookups: it must be fast and safe for concurrent use.
	Observe func(host string, d time.Duration, err error)
	// Now, if not nil, replaces time.Now for cache expiry, so that tests
	// can move time forward instead of sleeping.
	Now func() time.Time
}

// DNSResolver resolves names with miekg/dns against configured servers,
// never through the system resolver. It asks A and AAAA in parallel, over
// UDP and over TCP when an answer is truncated, follows CNAME chains within
// an answer, caches answers (bounded by their TTL and by MaxTTL) and
// failures to find a name (NegativeTTL), and merges concurrent lookups of
// the same name into one. It is safe for concurrent use.
//
// Addresses are returned exactly as DNS gave them: an A record as a 4-byte
// address, an AAAA record as a 16-byte address, even when the AAAA record
// holds an IPv4-mapped address (::ffff:a.b.c.d). Nothing is unmapped here,
// so that the policy judges what DNS said.
type DNSResolver struct {
	servers     []string
	timeout     time.Duration
	minTTL      time.Duration
	maxTTL      time.Duration
	negativeTTL time.Duration
	observe     func(host string, d time.Duration, err error)
	now         func() time.Time

	// base is the context of every lookup in flight; Close cancels it.
	base context.Context
	stop context.CancelCauseFunc

	mu      sync.Mutex // guards cache and flights
	cache   dnsCache
	flights map[string]*dnsFlight
}

// NewDNSResolver returns a resolver for cfg, or an error naming the field
// of cfg that is wrong and how to fix it.
func NewDNSResolver(cfg ResolverConfig) (*DNSResolver, error) {
	if len(cfg.Servers) == 0 {
		return nil, errors.New(`netpolicy: ResolverConfig.Servers is empty: give at least one DNS server as IP:port, e.g. "192.0.2.53:53", or read them with ServersFromResolvConf`)
	}
	servers := make([]string, 0, len(cfg.Servers))
	for i, s := range cfg.Servers {
		ap, err := parseDNSServer(s)
		if err != nil {
			return nil, fmt.Errorf("netpolicy: ResolverConfig.Servers[%d] %q %s", i, s, err.Error())
		}
		servers = append(servers, ap.String())
	}
	durations := []struct {
		field string
		v     *time.Duration
		def   time.Duration
	}{
		{"Timeout", &cfg.Timeout, DefaultDNSTimeout},
		{"MinTTL", &cfg.MinTTL, 0},
		{"MaxTTL", &cfg.MaxTTL, DefaultDNSMaxTTL},
		{"NegativeTTL", &cfg.NegativeTTL, DefaultDNSNegativeTTL},
	}
	for _, d := range durations {
		if *d.v < 0 {
			return nil, fmt.Errorf("netpolicy: ResolverConfig.%s is %v: use a positive duration, or 0 for the default (%v)", d.field, *d.v, d.def)
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if cfg.MinTTL > cfg.MaxTTL {
		return nil, fmt.Errorf("netpolicy: ResolverConfig.MinTTL (%v) is more than MaxTTL (%v): lower MinTTL or raise MaxTTL", cfg.MinTTL, cfg.MaxTTL)
	}
	if cfg.MaxEntries < 0 {
		return nil, fmt.Errorf("netpolicy: ResolverConfig.MaxEntries is %d: use a positive number, or 0 for the default (%d)", cfg.MaxEntries, DefaultDNSMaxEntries)
	}
	if cfg.MaxEntries == 0 {
		cfg.MaxEntries = DefaultDNSMaxEntries
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	base, stop := context.WithCancelCause(context.Background())
	return &DNSResolver{
		base:        base,
		stop:        stop,
		servers:     servers,
		timeout:     cfg.Timeout,
		minTTL:      cfg.MinTTL,
		maxTTL:      cfg.MaxTTL,
		negativeTTL: cfg.NegativeTTL,
		observe:     cfg.Observe,
		now:         now,
		cache:       dnsCache{max: cfg.MaxEntries, lru: list.New(), items: make(map[string]*list.Element)},
		flights:     make(map[string]*dnsFlight),
	}, nil
}

// parseDNSServer accepts "IP:port" or a bare IP (port 53).
func parseDNSServer(s string) (netip.AddrPort, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		if ap.Port() == 0 {
			return ap, errors.New("has port 0: use the server's port, usually 53")
		}
		return ap, nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return netip.AddrPortFrom(a, 53), nil
	}
	return netip.AddrPort{}, errors.New(`is not an IP address with a port: write it like "192.0.2.53:53" or "[2001:db8::53]:53" (DNS servers are never looked up by name)`)
}

// ServersFromResolvConf returns the servers of the nameserver lines of a
// resolv.conf(5) file, as IP:53, in file order. Comments (from '#' or ';'
// to the end of a line) and other options are ignored. It is an error for
// a nameserver line not to hold an IP address, or for the file to have
// none.
//
// It does not use dns.ClientConfigFromFile, which neither strips comments
// nor checks that a nameserver is an address.
func ServersFromResolvConf(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("netpolicy: reading DNS servers: %w", err)
	}
	defer f.Close()
	var servers []string
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if i := strings.IndexAny(line, "#;"); i >= 0 {
			line = line[:i]
		}
		fields := strings.Fields(line)
		if len(fields) == 0 || fields[0] != "nameserver" {
			continue
		}
		if len(fields) < 2 {
			return nil, fmt.Errorf("netpolicy: %s line %d: nameserver without an address", path, n)
		}
		a, err := netip.ParseAddr(fields[1])
		if err != nil {
			return nil, fmt.Errorf("netpolicy: %s line %d: nameserver %q is not an IP address", path, n, fields[1])
		}
		servers = append(servers, netip.AddrPortFrom(a, 53).String())
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("netpolicy: reading DNS servers from %s: %w", path, err)
	}
	if len(servers) == 0 {
		return nil, fmt.Errorf("netpolicy: %s has no nameserver line: give a DNS server explicitly (--dns IP:port)", path)
	}
	return servers, nil
}

// ErrNoSuchHost is the cause of a *DNSError whose name does not exist or has
// no address (NXDOMAIN, or no A and no AAAA record).
var ErrNoSuchHost = errors.New("no such host")

// Causes of other DNS errors. They say nothing about servers or addresses,
// so that an error can be shown to the sandbox that caused it.
var (
	errDNSTimeout     = errors.New("DNS query timed out")
	errDNSMisbehaving = errors.New("DNS server misbehaving")
	errDNSUnreachable = errors.New("DNS server unreachable")
	errDNSCNAMEChain  = errors.New("CNAME chain too long")
	errDNSInvalidName = errors.New("invalid host name")
	errDNSClosed      = errors.New("resolver closed")
)

// DNSError is the error of a failed lookup. Its message holds only the host
// name and the cause: "lookup api.example.com: no such host". Branch with
// errors.As, IsNotFound, or the Timeout method.
type DNSError struct {
	// Host is the name looked up, canonical (lowercase, no trailing dot).
	Host string
	// Err is the cause: ErrNoSuchHost, context.Canceled,
	// context.DeadlineExceeded (the caller's context), or another cause
	// whose message is safe to show.
	Err error
	// NotFound says the name does not exist or has no address.
	NotFound bool
	// IsTimeout says the servers did not answer in time, or the caller's
	// context expired. (Named IsTimeout because Timeout is the method.)
	IsTimeout bool
}

func (e *DNSError) Error() string {
	cause := "lookup failed"
	if e.Err != nil {
		cause = e.Err.Error()
	}
	return "lookup " + e.Host + ": " + cause
}

// Unwrap returns the cause.
func (e *DNSError) Unwrap() error { return e.Err }

// Timeout reports whether the lookup failed because time ran out.
func (e *DNSError) Timeout() bool { return e.IsTimeout }

// IsNotFound reports whether err is a *DNSError saying that the name does
// not exist or has no address.
func IsNotFound(err error) bool {
	var de *DNSError
	return errors.As(err, &de) && de.NotFound
}

// LookupIP returns the addresses of host: deduplicated, the A records first
// then the AAAA records, each exactly as DNS gave it (see DNSResolver).
// host is used as given, lowercased and without one trailing dot: no search
// domain is appended, and it must be a valid DNS name of letters, digits,
// '-' and '_' (canonicalise first: IDNA and numeric spellings are the
// caller's business). An IP literal is returned as the only address,
// without a query. Errors are *DNSError.
//
// When ctx ends first LookupIP returns at once; the lookup it started goes
// on, bounded by Timeout per server, and fills the cache for the next
// caller.
func (r *DNSResolver) LookupIP(ctx context.Context, host string) ([]netip.Addr, error) {
	start := time.Now()
	name := strings.ToLower(strings.TrimSuffix(host, "."))
	addrs, derr := r.lookup(ctx, host, name)
	var err error
	if derr != nil {
		err = derr // only when non-nil: a nil *DNSError is not a nil error
	}
	if r.observe != nil {
		r.observe(name, time.Since(start), err)
	}
	return addrs, err
}

// lookup is LookupIP without the Observe hook.
func (r *DNSResolver) lookup(ctx context.Context, host, name string) ([]netip.Addr, *DNSError) {
	if a, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{a}, nil
	}
	if name == "localhost" || strings.HasSuffix(name, ".localhost") {
		// RFC 6761: localhost is loopback, and no name server is asked.
		return []netip.Addr{netip.AddrFrom4([4]byte{127, 0, 0, 1}), netip.IPv6Loopback()}, nil
	}
	if !validDNSName(name) {
		return nil, &DNSError{Host: name, Err: errDNSInvalidName}
	}
	if err := ctx.Err(); err != nil {
		return nil, ctxDNSError(name, err)
	}
	if r.base.Err() != nil {
		return nil, &DNSError{Host: name, Err: errDNSClosed}
	}

	r.mu.Lock()
	if e, ok := r.cache.get(name, r.now()); ok {
		r.mu.Unlock()
		return slices.Clone(e.addrs), copyDNSError(e.err)
	}
	f := r.flights[name]
	if f == nil {
		f = &dnsFlight{done: make(chan struct{})}
		r.flights[name] = f
		// Not under ctx, so that one caller giving up does not fail the
		// others waiting on the same flight; bounded by r.timeout per try,
		// and ended by Close.
		go r.fly(r.base, name, f)
	} else {
		f.joined++
	}
	r.mu.Unlock()

	select {
	case <-f.done:
		return slices.Clone(f.addrs), copyDNSError(f.err)
	case <-ctx.Done():
		return nil, ctxDNSError(name, ctx.Err())
	}
}

// Close ends the lookups in flight (their callers get an error at once) and
// makes every later lookup of a name fail (IP literals are still returned).
// It always returns nil and may be called more than once. A resolver that
// is never closed leaks nothing: a lookup in flight ends within Timeout per
// server.
func (r *DNSResolver) Close() error {
	r.stop(errDNSClosed)
	return nil
}

// dnsFlight is one lookup in progress, shared by everyone who asks for the
// same name meanwhile. addrs and err are set before done is closed.
type dnsFlight struct {
	done   chan struct{}
	addrs  []netip.Addr
	err    *DNSError
	joined int // callers sharing it besides the first; guarded by r.mu
}

// fly resolves name for f, caches the result and releases f's waiters.
func (r *DNSResolver) fly(ctx context.Context, name string, f *dnsFlight) {
	addrs, ttl, err := r.resolve(ctx, name)
	now := r.now()
	r.mu.Lock()
	switch {
	case err == nil && ttl > 0:
		r.cache.put(name, dnsCacheEntry{addrs: addrs, expires: now.Add(ttl)})
	case err != nil && err.NotFound:
		r.cache.put(name, dnsCacheEntry{err: err, expires: now.Add(r.negativeTTL)})
	}
	delete(r.flights, name)
	r.mu.Unlock()
	f.addrs, f.err = addrs, err
	close(f.done)
}

// typeResult is the outcome of one query type against the servers.
type typeResult struct {
	addrs    []netip.Addr
	ttl      uint32 // the smallest TTL of the records used
	nxdomain bool
	err      error // a cause; nil when the server answered NOERROR
	timeout  bool
}

// resolve asks A and AAAA in parallel and merges the answers. ttl is how
// long the result may be cached (0: not at all).
func (r *DNSResolver) resolve(ctx context.Context, name string) ([]netip.Addr, time.Duration, *DNSError) {
	fqdn := dns.Fqdn(name)
	qtypes := [2]uint16{dns.TypeA, dns.TypeAAAA}
	var results [2]typeResult
	var wg sync.WaitGroup
	for i, qt := range qtypes {
		wg.Go(func() { results[i] = r.query(ctx, fqdn, qt) })
	}
	wg.Wait()

	var addrs []netip.Addr
	seen := make(map[netip.Addr]bool)
	ttl := uint32(1<<32 - 1)
	partial := false
	for _, res := range results {
		if res.err != nil || res.nxdomain {
			partial = true
			continue
		}
		for _, a := range res.addrs {
			if !seen[a] {
				seen[a] = true
				addrs = append(addrs, a)
			}
		}
		if len(res.addrs) > 0 {
			ttl = min(ttl, res.ttl)
		}
	}
	if len(addrs) > 0 {
		d := time.Duration(ttl) * time.Second
		d = min(max(d, r.minTTL), r.maxTTL)
		if partial {
			// Keep what we have, but ask again soon for the type that failed.
			d = min(d, r.negativeTTL)
		}
		return addrs, d, nil
	}

	// No address. An NXDOMAIN, or both types answering "no data", means the
	// name has none; otherwise report the failure, a timeout first.
	for _, res := range results {
		if res.nxdomain {
			return nil, 0, &DNSError{Host: name, Err: ErrNoSuchHost, NotFound: true}
		}
	}
	if results[0].err == nil && results[1].err == nil {
		return nil, 0, &DNSError{Host: name, Err: ErrNoSuchHost, NotFound: true}
	}
	for _, res := range results {
		if res.timeout {
			return nil, 0, &DNSError{Host: name, Err: res.err, IsTimeout: true}
		}
	}
	for _, res := range results {
		if res.err != nil {
			return nil, 0, &DNSError{Host: name, Err: res.err}
		}
	}
	return nil, 0, &DNSError{Host: name, Err: errDNSMisbehaving} // not reached
}

// query asks each server in turn for (fqdn, qtype) until one answers
// NOERROR or NXDOMAIN with a valid response. A network error, a timeout, a
// bad response or another rcode (SERVFAIL, REFUSED…) moves on to the next
// server; the last such failure is returned.
func (r *DNSResolver) query(ctx context.Context, fqdn string, qtype uint16) typeResult {
	q := new(dns.Msg)
	q.SetQuestion(fqdn, qtype)
	q.RecursionDesired = true
	q.SetEdns0(ednsUDPSize, false)

	last := typeResult{err: errDNSUnreachable}
	for _, server := range r.servers {
		if ctx.Err() != nil {
			return ctxTypeResult(ctx)
		}
		q.Id = dns.Id() // a fresh ID per server
		resp, err := r.exchange(ctx, "udp", server, q)
		if err == nil && resp.Truncated {
			resp, err = r.exchange(ctx, "tcp", server, q)
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctxTypeResult(ctx)
			}
			last = exchangeFailure(err)
			continue
		}
		if !sameQuestion(resp, q) {
			last = typeResult{err: errDNSMisbehaving}
			continue
		}
		switch resp.Rcode {
		case dns.RcodeSuccess:
			addrs, ttl, err := addressesFor(resp, fqdn, qtype)
			if err != nil {
				last = typeResult{err: err}
				continue
			}
			return typeResult{addrs: addrs, ttl: ttl}
		case dns.RcodeNameError:
			return typeResult{nxdomain: true}
		default:
			last = typeResult{err: errDNSMisbehaving}
		}
	}
	return last
}

// exchange sends q to server over network and returns the response, within
// r.timeout and ctx.
func (r *DNSResolver) exchange(ctx context.Context, network, server string, q *dns.Msg) (*dns.Msg, error) {
	qctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	c := &dns.Client{Net: network, Timeout: r.timeout}
	conn, err := c.DialContext(qctx, server)
	if err != nil {
		return nil, timeoutOr(qctx, err)
	}
	defer conn.Close()
	// miekg/dns only honours the context's deadline; closing the connection
	// also ends the exchange when Close cancels the lookup.
	stop := context.AfterFunc(qctx, func() { conn.Close() })
	defer stop()
	resp, _, err := c.ExchangeWithConnContext(qctx, q, conn)
	if err != nil {
		return nil, timeoutOr(qctx, err)
	}
	return resp, nil
}

// timeoutOr returns errDNSTimeout when qctx's own deadline ended the
// exchange (the connection may then have been closed under it), else err.
func timeoutOr(qctx context.Context, err error) error {
	if errors.Is(qctx.Err(), context.DeadlineExceeded) {
		return errDNSTimeout
	}
	return err
}

// exchangeFailure turns an error of exchange into a safe cause: the
// network errors of miekg/dns name the server, which must not leak.
func exchangeFailure(err error) typeResult {
	var ne net.Error
	switch {
	case errors.Is(err, errDNSTimeout), errors.As(err, &ne) && ne.Timeout():
		return typeResult{err: errDNSTimeout, timeout: true}
	case errors.As(err, new(*net.OpError)):
		return typeResult{err: errDNSUnreachable}
	default: // bad ID over TCP, unpack errors…
		return typeResult{err: errDNSMisbehaving}
	}
}

// ctxTypeResult is the result of a query cut short by its context, which
// is the resolver's own: its cause is ours to show.
func ctxTypeResult(ctx context.Context) typeResult {
	return typeResult{err: context.Cause(ctx), timeout: errors.Is(ctx.Err(), context.DeadlineExceeded)}
}

// ctxDNSError is the error of a lookup cut short by the caller's context.
func ctxDNSError(name string, err error) *DNSError {
	return &DNSError{Host: name, Err: err, IsTimeout: errors.Is(err, context.DeadlineExceeded)}
}

// sameQuestion reports whether resp is a response to q's question. miekg/dns
// has already matched the ID.
func sameQuestion(resp, q *dns.Msg) bool {
	if !resp.Response || resp.Opcode != dns.OpcodeQuery || len(resp.Question) != 1 {
		return false
	}
	got, want := resp.Question[0], q.Question[0]
	return got.Qtype == want.Qtype && got.Qclass == want.Qclass && strings.EqualFold(got.Name, want.Name)
}

// addressesFor follows the CNAME chain from fqdn within the answer section
// only, and returns the records of qtype owned by the last name of the
// chain, with the smallest TTL of the records used. Records about any other
// name are ignored: an answer cannot plant addresses for names not asked.
func addressesFor(resp *dns.Msg, fqdn string, qtype uint16) ([]netip.Addr, uint32, error) {
	ttl := uint32(1<<32 - 1)
	owner := fqdn
	for hops := 0; ; hops++ {
		var next *dns.CNAME
		for _, rr := range resp.Answer {
			if cn, ok := rr.(*dns.CNAME); ok && cn.Hdr.Class == dns.ClassINET && strings.EqualFold(cn.Hdr.Name, owner) {
				next = cn
				break
			}
		}
		if next == nil {
			break
		}
		if hops == maxCNAMEChain {
			return nil, 0, errDNSCNAMEChain
		}
		ttl = min(ttl, next.Hdr.Ttl)
		owner = next.Target
	}

	var addrs []netip.Addr
	for _, rr := range resp.Answer {
		h := rr.Header()
		if h.Class != dns.ClassINET || h.Rrtype != qtype || !strings.EqualFold(h.Name, owner) {
			continue
		}
		var a netip.Addr
		var ok bool
		switch rr := rr.(type) {
		case *dns.A:
			a, ok = netip.AddrFromSlice(rr.A.To4())
		case *dns.AAAA:
			a, ok = netip.AddrFromSlice(rr.AAAA.To16()) // 16 bytes: mapped stays mapped
		}
		if !ok {
			continue
		}
		addrs = append(addrs, a)
		ttl = min(ttl, h.Ttl)
	}
	return addrs, ttl, nil
}

// validDNSName reports whether name (lowercase, no trailing dot) is a DNS
// name the resolver will ask for: labels of 1 to 63 letters, digits, '-'
// or '_', 253 characters at most.
func validDNSName(name string) bool {
	if name == "" || len(name) > maxNameLen {
		return false
	}
	for label := range strings.SplitSeq(name, ".") {
		if label == "" || len(label) > 63 {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// copyDNSError returns a copy of e, so that callers cannot change what the
// cache or other callers hold.
func copyDNSError(e *DNSError) *DNSError {
	if e == nil {
		return nil
	}
	cp := *e
	return &cp
}

// dnsCache is an LRU cache of lookup results by canonical name. It is
// guarded by DNSResolver.mu.
type dnsCache struct {
	max   int
	lru   *list.List // of *dnsCacheItem, most recently used first
	items map[string]*list.Element
}

// dnsCacheEntry is a cached result: addresses, or a NotFound error.
type dnsCacheEntry struct {
	addrs   []netip.Addr
	err     *DNSError
	expires time.Time
}

type dnsCacheItem struct {
	name  string
	entry dnsCacheEntry
}

// get returns the live entry for name, dropping it if it has expired.
func (c *dnsCache) get(name string, now time.Time) (dnsCacheEntry, bool) {
	el, ok := c.items[name]
	if !ok {
		return dnsCacheEntry{}, false
	}
	it := el.Value.(*dnsCacheItem)
	if !now.Before(it.entry.expires) {
		c.lru.Remove(el)
		delete(c.items, name)
		return dnsCacheEntry{}, false
	}
	c.lru.MoveToFront(el)
	return it.entry, true
}

// put stores e for name, evicting the least recently used names beyond max.
func (c *dnsCache) put(name string, e dnsCacheEntry) {
	if el, ok := c.items[name]; ok {
		el.Value.(*dnsCacheItem).entry = e
		c.lru.MoveToFront(el)
		return
	}
	c.items[name] = c.lru.PushFront(&dnsCacheItem{name: name, entry: e})
	for c.lru.Len() > c.max {
		oldest := c.lru.Back()
		c.lru.Remove(oldest)
		delete(c.items, oldest.Value.(*dnsCacheItem).name)
	}
}

// len returns the number of cached names, live or expired.
func (c *dnsCache) len() int { return c.lru.Len() }
