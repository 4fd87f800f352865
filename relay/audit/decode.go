package audit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"time"
)

// wireEvent is an event's line as encoding/json reads it.
type wireEvent struct {
	V            int      `json:"v"`
	Time         string   `json:"time"`
	Severity     string   `json:"severity"`
	Message      string   `json:"message"`
	Sandbox      string   `json:"sandbox"`
	Kind         Kind     `json:"kind"`
	Decision     string   `json:"decision"`
	Code         string   `json:"code"`
	Reason       string   `json:"reason"`
	Host         string   `json:"host"`
	Port         int      `json:"port"`
	Cmd          string   `json:"cmd"`
	PID          int      `json:"pid"`
	Method       string   `json:"method"`
	Path         string   `json:"path"`
	Rule         string   `json:"rule"`
	Module       string   `json:"module"`
	Addr         string   `json:"addr"`
	Status       int      `json:"status"`
	BytesIn      int64    `json:"bytes_in"`
	BytesOut     int64    `json:"bytes_out"`
	DurationMS   float64  `json:"duration_ms"`
	DNSMS        float64  `json:"dns_ms"`
	Transforms   []string `json:"transforms"`
	Notes        []string `json:"notes"`
	NotesDropped int      `json:"notes_dropped"`
	Error        string   `json:"error"`
	Intercept    string   `json:"intercept"`
}

// UnmarshalJSON reads an event's line (AppendJSON's encoding, version
// Version; unknown keys are ignored, so a newer minor shape reads). "cmd"
// "unknown" reads back as an empty Cmd.
func (e *Event) UnmarshalJSON(b []byte) error {
	var w wireEvent
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	if w.V != Version {
		return fmt.Errorf("audit event of version %d: this sandgate reads version %d", w.V, Version)
	}
	t, err := time.Parse(time.RFC3339Nano, w.Time)
	if err != nil {
		return fmt.Errorf("audit event time %q: %w", w.Time, err)
	}
	if w.Decision != "allow" && w.Decision != "deny" {
		return fmt.Errorf("audit event decision %q: want allow or deny", w.Decision)
	}
	*e = Event{
		Time: t, Sandbox: w.Sandbox, Kind: w.Kind, Allow: w.Decision == "allow", Code: w.Code, Reason: w.Reason,
		Host: w.Host, Port: w.Port, PID: w.PID, Cmd: w.Cmd, Method: w.Method, Path: w.Path, Rule: w.Rule,
		Module: w.Module, Addr: w.Addr, Status: w.Status, BytesIn: w.BytesIn, BytesOut: w.BytesOut,
		Duration: fromMS(w.DurationMS), DNSTime: fromMS(w.DNSMS), Transforms: w.Transforms, Notes: w.Notes,
		NotesDropped: w.NotesDropped, Error: w.Error, InterceptRule: w.Intercept,
	}
	if e.Cmd == Unknown {
		e.Cmd = ""
	}
	return nil
}

func fromMS(f float64) time.Duration { return time.Duration(math.Round(f * 1e6)) }

// lineKeys are the fields a query filters on, read from a line without
// decoding the rest into an Event.
type lineKeys struct {
	Time     time.Time `json:"time"`
	Decision string    `json:"decision"`
	Host     string    `json:"host"`
}

// readKeys reads what Query.match needs of a line.
func readKeys(line []byte) (lineKeys, error) {
	var k lineKeys
	err := json.Unmarshal(bytes.TrimSpace(line), &k)
	return k, err
}
