package appliance

import (
	"context"
	"io"
	"syscall"
	"testing"
	"time"

	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
)

// BenchmarkAuditCPU: the process's CPU per event (every goroutine's: the
// segments' compression and the store's writes included), the audit log
// alone against the log and the durable audit over a directory store.
func BenchmarkAuditCPU(b *testing.B) {
	e := audit.Event{Sandbox: "a", Kind: audit.Route, Allow: true, Code: "allowed_host", Reason: "api.example.com matched allowed host rule api.example.com",
		Host: "api.example.com", Port: 443, PID: 4242, Cmd: "npm install left-pad", Method: "POST", Path: "/v1/messages", Rule: "allowedHosts:api.example.com",
		Addr: "93.184.216.34:443", Status: 200, BytesIn: 1234, BytesOut: 56789, Duration: 3 * time.Millisecond, DNSTime: 120 * time.Microsecond}
	cpu := func() time.Duration {
		var ru syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	b.Run("log", func(b *testing.B) {
		log := audit.NewJSONLines(io.Discard)
		c0 := cpu()
		for i := 0; b.Loop(); i++ {
			e.Time, e.BytesOut = time.Now(), int64(i)
			log.Record(e)
		}
		b.ReportMetric(float64(cpu()-c0)/float64(b.N), "cpu-ns/event")
	})
	b.Run("log+store", func(b *testing.B) {
		st, err := store.NewDir(b.TempDir())
		if err != nil {
			b.Fatal(err)
		}
		js, _ := audit.NewJournals(audit.JournalsConfig{Writer: NewAuditStore(st), Log: audit.NewJSONLines(io.Discard)})
		js.Open("a")
		c0 := cpu()
		for i := 0; b.Loop(); i++ {
			e.Time, e.BytesOut = time.Now(), int64(i)
			js.Record(e)
		}
		js.Close(context.Background())
		b.ReportMetric(float64(cpu()-c0)/float64(b.N), "cpu-ns/event")
	})
}
