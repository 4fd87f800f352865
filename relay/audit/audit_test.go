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

	"github.com/sandgate/sandgate/internal/cloudlog"
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

func TestLoggerLine(t *testing.T) {
	var buf bytes.Buffer
	Logger{L: cloudlog.New(&buf, nil)}.Record(Event{
		Time: time.Now(), Sandbox: "sb1", Kind: Route, Host: "api.example.com", Port: 443, Method: "POST",
		Path: "/v1/messages", Allow: true, Code: "allowed_host", Reason: "matched", Rule: "allowedHosts:api.example.com",
		Addr: "1.2.3.4:443", Status: 200, BytesIn: 10, BytesOut: 20, Duration: 3 * time.Millisecond,
		DNSTime: time.Millisecond, Transforms: []string{"rule[0] api.example.com"},
	})
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"message": "egress", "severity": "INFO", "sandbox": "sb1", "kind": "route", "decision": "allow",
		"code": "allowed_host", "host": "api.example.com", "port": 443.0, "method": "POST", "path": "/v1/messages",
		"rule": "allowedHosts:api.example.com", "addr": "1.2.3.4:443", "status": 200.0, "bytes_in": 10.0, "bytes_out": 20.0,
		"duration_ms": 3.0, "dns_ms": 1.0}
	for k, v := range want {
		if m[k] != v {
			t.Errorf("%s = %v, want %v", k, m[k], v)
		}
	}
	buf.Reset()
	Logger{L: cloudlog.New(&buf, nil)}.Record(Event{Sandbox: "sb1", Kind: Connect, Code: "no_rule", Reason: "no"})
	if !strings.Contains(buf.String(), `"severity":"WARNING"`) || !strings.Contains(buf.String(), `"decision":"deny"`) {
		t.Errorf("a denial is logged as %s", buf.String())
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

func TestFollow(t *testing.T) {
	r := NewRings(4)
	f, stop := r.Follow("a")
	r.Record(Event{Sandbox: "b", Path: "other"})
	r.Record(Event{Sandbox: "a", Path: "1"})
	if e := <-f.C; e.Path != "1" {
		t.Errorf("followed %q", e.Path)
	}
	stop()
	r.Record(Event{Sandbox: "a", Path: "2"})
	select {
	case e := <-f.C:
		t.Errorf("after stop: %q", e.Path)
	default:
	}
}

// JSONLines writes the line Logger writes through cloudlog: the same keys
// and values (the time aside), for every kind of field and awkward string.
func TestJSONLinesMatchesLogger(t *testing.T) {
	events := []Event{
		{Sandbox: "sb1", Kind: Route, Host: "api.example.com", Port: 443, Method: "POST", Path: "/v1/messages", Allow: true,
			Code: "allowed_host", Reason: "matched", Rule: "allowedHosts:api.example.com", Addr: "1.2.3.4:443", Status: 200,
			BytesIn: 10, BytesOut: 20, Duration: 3*time.Millisecond + 7, DNSTime: time.Nanosecond,
			Transforms: []string{"rule[0] api.example.com"}, Module: "m", Notes: []string{"m: a", "m: \"b\"\n"}, NotesDropped: 2},
		{Sandbox: "sb\x01\"2\\", Kind: Refused, Code: "bad_request", Reason: "bad \xff byte \u2028 line \u2029 é <&>", Error: "tab\there\r"},
		{Sandbox: "sb3", Kind: Connect, Duration: 1, Error: "x"},
		{Sandbox: "sb4", Kind: Connect, Duration: 1 << 62},
	}
	for i, e := range events {
		var want, got bytes.Buffer
		Logger{L: cloudlog.New(&want, nil)}.Record(e)
		e.Time = time.Now()
		NewJSONLines(&got).Record(e)
		var wm, gm map[string]any
		if err := json.Unmarshal(want.Bytes(), &wm); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(got.Bytes(), &gm); err != nil {
			t.Fatalf("event %d: %v in %s", i, err, got.Bytes())
		}
		if _, err := time.Parse(time.RFC3339Nano, gm["time"].(string)); err != nil {
			t.Errorf("event %d: time %v: %v", i, gm["time"], err)
		}
		delete(wm, "time")
		delete(gm, "time")
		if fmt.Sprint(wm) != fmt.Sprint(gm) {
			t.Errorf("event %d:\n got %s\nwant %s", i, got.Bytes(), want.Bytes())
		}
		if n := bytes.Count(got.Bytes(), []byte("\n")); n != 1 || !bytes.HasSuffix(got.Bytes(), []byte("\n")) {
			t.Errorf("event %d: %d newlines, want one line", i, n)
		}
	}
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
