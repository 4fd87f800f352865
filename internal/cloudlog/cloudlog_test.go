package cloudlog

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
)

func TestKeys(t *testing.T) {
	var buf bytes.Buffer
	l := New(&buf, slog.LevelDebug)
	l.Warn("hello", "k", 1)
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
		t.Fatal(err)
	}
	if m["severity"] != "WARNING" || m["message"] != "hello" || m["time"] == nil || m["k"] != 1.0 {
		t.Errorf("got %v, want severity WARNING, message hello, a time and k=1", m)
	}
}

func TestText(t *testing.T) {
	var buf bytes.Buffer
	l := NewText(&buf, slog.LevelInfo).With("sandbox", "s1")
	l.Debug("hidden")
	l.Warn("hello world", "k", 1, "why", "two words")
	line := buf.String()
	if !strings.Contains(line, " WARNING hello world sandbox=s1 k=1 why=\"two words\"\n") || strings.Count(line, "\n") != 1 {
		t.Errorf("got %q", line)
	}
}
