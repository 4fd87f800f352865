// Command netprobe is run inside sandboxes by tests: a program that
// ignores the proxy variables, as many SDKs and programs with their own
// HTTP stack do. It looks a name up by sending its own DNS query to the
// server resolv.conf names (no libc, no Go resolver), and fetches a URL
// with a transport of its own (no proxy), trusting the CA files it is
// given (else the system's).
//
//	netprobe [-ca FILE]... [-lookup NAME] [-get URL]
//
// It prints what happened, one line each ("lookup NAME rcode ADDR...",
// "get STATUS BODY" or "get error ..."), and exits 1 if a step failed.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/miekg/dns"
)

type files []string

func (f *files) String() string     { return strings.Join(*f, ",") }
func (f *files) Set(v string) error { *f = append(*f, v); return nil }

func main() {
	var cas files
	flag.Var(&cas, "ca", "trust the PEM certificates in `FILE` (repeatable; default: the system's)")
	lookup := flag.String("lookup", "", "look `NAME` up with a DNS query of its own")
	get := flag.String("get", "", "fetch `URL` with a transport of its own, no proxy")
	flag.Parse()
	ok := true
	if *lookup != "" {
		ok = doLookup(*lookup) && ok
	}
	if *get != "" {
		ok = doGet(*get, cas) && ok
	}
	if !ok {
		os.Exit(1)
	}
}

func doLookup(name string) bool {
	conf, err := dns.ClientConfigFromFile("/etc/resolv.conf")
	if err != nil || len(conf.Servers) == 0 {
		fmt.Printf("lookup %s error no name server: %v\n", name, err)
		return false
	}
	q := new(dns.Msg)
	q.SetQuestion(dns.Fqdn(name), dns.TypeA)
	c := &dns.Client{Timeout: 10 * time.Second}
	start := time.Now()
	r, _, err := c.Exchange(q, conf.Servers[0]+":"+conf.Port)
	if err != nil {
		fmt.Printf("lookup %s error %v after %s\n", name, err, time.Since(start).Round(time.Millisecond))
		return false
	}
	var addrs []string
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			addrs = append(addrs, a.A.String())
		}
	}
	fmt.Printf("lookup %s %s %s\n", name, dns.RcodeToString[r.Rcode], strings.Join(addrs, " "))
	return r.Rcode == dns.RcodeSuccess
}

func doGet(url string, cas files) bool {
	tc := &tls.Config{}
	if len(cas) > 0 {
		tc.RootCAs = x509.NewCertPool()
		for _, f := range cas {
			b, err := os.ReadFile(f)
			if err != nil {
				fmt.Printf("get error %v\n", err)
				return false
			}
			tc.RootCAs.AppendCertsFromPEM(b)
		}
	}
	cl := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{Proxy: nil, TLSClientConfig: tc}}
	resp, err := cl.Get(url)
	if err != nil {
		fmt.Printf("get error %v\n", err)
		return false
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	fmt.Printf("get %d %s\n", resp.StatusCode, b)
	return true
}
