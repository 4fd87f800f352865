// Package testkit holds what tests and benchmarks stand up on loopback,
// and nothing production code imports: a DNS server (dnstest), a CA and
// TLS listeners (tlstest), a Cloud Storage emulator (gcstest), the
// sandgate binary built for tests (gobuild), a stand-in for Google's
// sandbox CLI (googlecli), the assembled service (stacktest, servetest)
// a goroutine-safe buffer (syncbuf) and a headless Chromium driven over the DevTools protocol (browser). internal/'s other packages are
// production helpers.
package testkit
