package client_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/sandgate/sandgate/api/client"
	"github.com/sandgate/sandgate/relay/audit"
)

// AuditEvent mirrors relay/audit.Event on the wire (the client does not
// import the service's audit package, which brings Prometheus): every JSON
// field the service writes is one the client reads, with the same type.
func TestAuditEventMirrorsTheService(t *testing.T) {
	fields := func(typ reflect.Type) map[string]string {
		out := map[string]string{}
		for f := range typ.Fields() {
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			kind := f.Type.Kind().String()
			if f.Type.Kind() == reflect.Slice {
				kind += " of " + f.Type.Elem().Kind().String()
			}
			out[name] = kind
		}
		return out
	}
	svc, cl := fields(reflect.TypeFor[audit.Event]()), fields(reflect.TypeFor[client.AuditEvent]())
	for name, kind := range svc {
		if cl[name] != kind {
			t.Errorf("the service's audit field %q (%s) is %q in client.AuditEvent", name, kind, cl[name])
		}
	}
	for name := range cl {
		if _, ok := svc[name]; !ok {
			t.Errorf("client.AuditEvent has %q, which the service never writes", name)
		}
	}
}
