package relay

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/relay/audit"
)

// TestDNSFailureIsNotAuditedAsADenial: a name the policy allows whose lookup
// fails was audited as "deny" (code dns_error), while a failure of the
// upstream after an allow was audited as "allow". The policy allowed both:
// the event says allow, and what went wrong is its code (dns_failure),
// status and error, alike in the event, the JSON line and the metrics.
func TestDNSFailureIsNotAuditedAsADenial(t *testing.T) {
	reg := prometheus.NewRegistry()
	metrics := audit.NewMetrics(reg)
	e := newEnv(t, `{"mode":"custom","allowedHosts":["nx.example.com"]}`, "", func(c *Config) {
		c.Audit = audit.Multi{c.Audit, metrics}
	})
	const lookupErr = "lookup nx.example.com: no such host"
	for _, req := range []string{
		"GET /https/nx.example.com/x HTTP/1.1\r\nHost: p\r\n\r\n",
		"CONNECT nx.example.com:443 HTTP/1.1\r\nHost: nx.example.com:443\r\n\r\n",
	} {
		resp := e.raw(req)
		if b := body(t, resp); resp.StatusCode != http.StatusBadGateway || !strings.Contains(resp.Header.Get("X-Sandgate-Error"), lookupErr) {
			t.Errorf("%q: %d %q (X-Sandgate-Error %q), want 502 with %q", req, resp.StatusCode, b, resp.Header.Get("X-Sandgate-Error"), lookupErr)
		}
	}
	for i, kind := range []audit.Kind{audit.Route, audit.Connect} {
		ev := e.event(i + 1)
		if ev.Kind != kind || !ev.Allow || ev.Code != CodeDNSFailure || ev.Rule != "allowedHosts:nx.example.com" ||
			ev.Reason != "nx.example.com matched allowed host rule nx.example.com" || ev.Status != http.StatusBadGateway || ev.Error != lookupErr {
			t.Errorf("%s event = %+v; want allow, code %s, the rule and its reason, status 502, error %q", kind, ev, CodeDNSFailure, lookupErr)
		}
	}

	// The JSON lines (written before the ring is, so both are there).
	var lines int
	for _, l := range strings.Split(e.log.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) != nil || m["message"] != "egress" {
			continue
		}
		lines++
		if m["decision"] != "allow" || m["code"] != CodeDNSFailure || m["error"] != lookupErr || m["status"] != 502.0 {
			t.Errorf("audit line %s; want decision allow, code %s, error %q, status 502", l, CodeDNSFailure, lookupErr)
		}
	}
	if lines != 2 {
		t.Errorf("%d egress lines, want 2:\n%s", lines, e.log.String())
	}

	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != "sandgate_egress_decisions_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				labels = append(labels, lp.GetName()+"="+lp.GetValue())
			}
			got[strings.Join(labels, ",")] = m.GetCounter().GetValue()
		}
	}
	for _, want := range []string{"code=dns_failure,decision=allow,kind=route", "code=dns_failure,decision=allow,kind=connect"} {
		if got[want] != 1 {
			t.Errorf("sandgate_egress_decisions_total{%s} = %v, want 1 (all: %v)", want, got[want], got)
		}
	}
}
