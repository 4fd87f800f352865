package client_test

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/relay/audit"
)

// AuditEvent reads the service's event line (the client does not import
// the service's audit package, which brings Prometheus): every key the
// service writes is a field the client reads, of a matching type, and the
// client writes none the service does not; and the bytes it keeps are
// the line's.
func TestAuditEventMirrorsTheService(t *testing.T) {
	e := audit.Event{Time: time.Unix(1, 5).UTC(), Sandbox: "s", Kind: audit.Route, Allow: true, Code: "c", Reason: "r", Host: "h", Port: 443,
		PID: 1, Cmd: "npm i", Method: "GET", Path: "/", Rule: "x", Module: "m", Addr: "1.2.3.4:443", Status: 200, BytesIn: 1, BytesOut: 2,
		Duration: time.Millisecond, DNSTime: time.Microsecond, Transforms: []string{"t"}, Notes: []string{"n"}, NotesDropped: 1, Error: "e", InterceptRule: "i"}
	line := bytes.TrimSuffix(audit.AppendJSON(nil, &e), []byte("\n"))
	var svc map[string]any
	if err := json.Unmarshal(line, &svc); err != nil {
		t.Fatal(err)
	}
	cl := map[string]reflect.Kind{}
	for f := range reflect.TypeFor[client.AuditEvent]().Fields() {
		if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); f.IsExported() && name != "" {
			cl[name] = f.Type.Kind()
		}
	}
	kinds := map[string][]reflect.Kind{
		"string": {reflect.String, reflect.Struct}, "float64": {reflect.Int, reflect.Int64, reflect.Float64}, "[]interface {}": {reflect.Slice},
	}
	for k, v := range svc {
		got, ok := cl[k]
		if !ok || !slicesContains(kinds[reflect.TypeOf(v).String()], got) {
			t.Errorf("the service's key %q (%T) is %v in client.AuditEvent", k, v, got)
		}
	}
	for k := range cl {
		if _, ok := svc[k]; !ok {
			t.Errorf("client.AuditEvent has %q, which the service never writes", k)
		}
	}
	var ce client.AuditEvent
	if err := json.Unmarshal(line, &ce); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ce.JSON(), line) || ce.Cmd != "npm i" || !ce.Allow() || ce.DurationMS != 1 {
		t.Errorf("read as %+v, bytes %s", ce, ce.JSON())
	}
}

func slicesContains(ks []reflect.Kind, k reflect.Kind) bool {
	for _, x := range ks {
		if x == k {
			return true
		}
	}
	return false
}

// Limits are read and written as the service does (appliance.Limits):
// every field, both ways.
func TestLimitsMirrorTheService(t *testing.T) {
	svc := appliance.Limits{CPU: 0.5, CPUWeight: 50, Memory: 256 << 20, Pids: 128, Disk: 1 << 30, Lifetime: 24 * time.Hour, KeepSuspended: 90 * time.Minute}
	cl := client.Limits{CPU: 0.5, CPUWeight: 50, Memory: 256 << 20, Pids: 128, Disk: 1 << 30, Lifetime: 24 * time.Hour, KeepSuspended: 90 * time.Minute}
	for i := range reflect.TypeFor[client.Limits]().NumField() {
		if reflect.ValueOf(cl).Field(i).IsZero() {
			t.Fatalf("the sample leaves %s zero", reflect.TypeFor[client.Limits]().Field(i).Name)
		}
	}
	b, err := json.Marshal(svc)
	if err != nil {
		t.Fatal(err)
	}
	var got client.Limits
	if err := json.Unmarshal(b, &got); err != nil || got != cl {
		t.Errorf("the service's %s read as %+v, %v; want %+v", b, got, err, cl)
	}
	b, err = json.Marshal(cl)
	if err != nil {
		t.Fatal(err)
	}
	var back appliance.Limits
	if err := json.Unmarshal(b, &back); err != nil || back != svc {
		t.Errorf("the client's %s read by the service as %+v, %v; want %+v", b, back, err, svc)
	}
	if b, _ := json.Marshal(client.Limits{}); string(b) != "{}" {
		t.Errorf("no limits marshal as %s, want {}", b)
	}
}
