package audit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func TestRingsKeepNewestInOrder(t *testing.T) {
	r := NewRings(3)
	for i := range 5 {
		r.Record(Event{Sandbox: "a", Path: fmt.Sprint(i)})
	}
	r.Record(Event{Sandbox: "b", Path: "x"})
	var got []string
	for _, e := range r.Events("a") {
		got = append(got, e.Path)
	}
	if strings.Join(got, ",") != "2,3,4" {
		t.Errorf("got %v, want the newest three oldest first: 2,3,4", got)
	}
	if evs := r.Events("b"); len(evs) != 1 || evs[0].Path != "x" {
		t.Errorf("sandbox b events = %v", evs)
	}
	r.Forget("a")
	if evs := r.Events("a"); evs != nil {
		t.Errorf("forgotten sandbox still has %v", evs)
	}
	if evs := NewRings(2).Events("none"); evs != nil {
		t.Errorf("unknown sandbox has %v", evs)
	}
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	m.Record(Event{Kind: Connect, Allow: true, Code: "allowed_host", BytesIn: 5, BytesOut: 7, DNSTime: time.Millisecond})
	m.Record(Event{Kind: Route, Allow: false, Code: "no_rule"})
	m.TunnelOpened()
	if got := value(t, m.decisions.WithLabelValues("allow", "allowed_host", "connect")); got != 1 {
		t.Errorf("allow decisions = %v", got)
	}
	if got := value(t, m.decisions.WithLabelValues("deny", "no_rule", "route")); got != 1 {
		t.Errorf("deny decisions = %v", got)
	}
	if got := value(t, m.tunnelBytes.WithLabelValues("out")); got != 7 {
		t.Errorf("tunnel bytes out = %v", got)
	}
	if got := value(t, m.activeTunnels); got != 1 {
		t.Errorf("active tunnels = %v", got)
	}
	m.TunnelClosed()
	if got := value(t, m.activeTunnels); got != 0 {
		t.Errorf("active tunnels after close = %v", got)
	}
}

// value reads a counter's or gauge's current value.
func value(t *testing.T, c prometheus.Metric) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	if m.Counter != nil {
		return m.Counter.GetValue()
	}
	return m.Gauge.GetValue()
}

// Concurrent records each get one whole line, whoever writes it.
func TestJSONLinesConcurrent(t *testing.T) {
	var buf lockedBuffer
	j := NewJSONLines(&buf)
	const n, workers = 200, 8
	done := make(chan struct{})
	for w := range workers {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := range n {
				j.Record(Event{Sandbox: fmt.Sprintf("w%d", w), Path: fmt.Sprint(i), Allow: true})
			}
		}()
	}
	for range workers {
		<-done
	}
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	if len(lines) != n*workers {
		t.Fatalf("got %d lines, want %d", len(lines), n*workers)
	}
	next := map[string]int{}
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		w, p := m["sandbox"].(string), m["path"].(string)
		if p != fmt.Sprint(next[w]) {
			t.Fatalf("worker %s: path %s after %d: lines reordered", w, p, next[w])
		}
		next[w]++
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A Record that finds another one writing waits until its own line has
// been written: the event of an answered request is never only in memory.
func TestJSONLinesRecordReturnsOnceWritten(t *testing.T) {
	w := &gatedWriter{entered: make(chan struct{}, 4), gate: make(chan struct{})}
	j := NewJSONLines(w)
	first := make(chan struct{})
	go func() { j.Record(Event{Sandbox: "a"}); close(first) }()
	<-w.entered // the first line's write is in progress, held at the gate
	second := make(chan struct{})
	go func() { j.Record(Event{Sandbox: "b"}); close(second) }()
	select {
	case <-second:
		t.Fatal("the second Record returned while its line was not written")
	case <-time.After(100 * time.Millisecond):
	}
	close(w.gate)
	for _, c := range []chan struct{}{first, second} {
		select {
		case <-c:
		case <-time.After(time.Minute):
			t.Fatal("a Record did not return within a minute of the writer going on")
		}
	}
	if got := w.String(); !strings.Contains(got, `"sandbox":"a"`) || !strings.Contains(got, `"sandbox":"b"`) || strings.Count(got, "\n") != 2 {
		t.Errorf("written: %q", got)
	}
}

// gatedWriter holds every write until gate is closed.
type gatedWriter struct {
	lockedBuffer
	entered chan struct{}
	gate    chan struct{}
}

func (g *gatedWriter) Write(p []byte) (int, error) {
	g.entered <- struct{}{}
	<-g.gate
	return g.lockedBuffer.Write(p)
}
