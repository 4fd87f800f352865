package audit

import (
	"context"
	"io"
	"syscall"
	"testing"
	"time"
)

// discardWriter stores nothing: what a segment costs before the store.
type discardWriter struct{}

func (discardWriter) WriteSegment(context.Context, string, string, []byte) error { return nil }

func benchEvent() Event {
	e := goldenEvents()[0]
	e.Sandbox = "a"
	e.Time = time.Now()
	return e
}

// BenchmarkRecord: what recording an event costs the proxy's goroutine,
// the audit log alone and with the sandbox's journal (encoded once,
// segments compressed by the writing goroutine), one goroutine and
// several.
func BenchmarkRecord(b *testing.B) {
	e := benchEvent()
	b.Run("log", func(b *testing.B) {
		j := NewJSONLines(io.Discard)
		b.ReportAllocs()
		for b.Loop() {
			j.Record(e)
		}
	})
	b.Run("log+journal", func(b *testing.B) {
		js, _ := NewJournals(JournalsConfig{Writer: discardWriter{}, Log: NewJSONLines(io.Discard)})
		defer js.Close(context.Background())
		js.Open("a")
		b.ReportAllocs()
		for b.Loop() {
			js.Record(e)
		}
	})
	b.Run("log+journal/parallel", func(b *testing.B) {
		js, _ := NewJournals(JournalsConfig{Writer: discardWriter{}, Log: NewJSONLines(io.Discard)})
		defer js.Close(context.Background())
		js.Open("a")
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				js.Record(e)
			}
		})
	})
}

// BenchmarkSegment: compressing a full segment, per event in it.
func BenchmarkSegment(b *testing.B) {
	e := benchEvent()
	var lines []byte
	n := 0
	for len(lines) < 512<<10 {
		lines = AppendJSON(lines, &e)
		n++
	}
	b.SetBytes(int64(len(lines)))
	for b.Loop() {
		EncodeSegment(lines)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/event")
}

// BenchmarkRecordCPU: the process's CPU per event, several goroutines
// recording one sandbox's events at once (a proxy's connections), the
// writing goroutine included.
func BenchmarkRecordCPU(b *testing.B) {
	e := benchEvent()
	for _, name := range []string{"log", "log+journal"} {
		b.Run(name, func(b *testing.B) {
			var sink Sink = NewJSONLines(io.Discard)
			var js *Journals
			if name == "log+journal" {
				js, _ = NewJournals(JournalsConfig{Writer: discardWriter{}, Log: NewJSONLines(io.Discard)})
				js.Open("a")
				sink = js
			}
			c0 := processCPU()
			b.SetParallelism(4)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					sink.Record(e)
				}
			})
			if js != nil {
				js.Close(context.Background())
			}
			b.ReportMetric(float64(processCPU()-c0)/float64(b.N), "cpu-ns/event")
		})
	}
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
