package audit

import (
	"math"
	"strconv"
	"time"
	"unicode/utf8"
)

// Version is the version of the event's JSON shape, written as its first
// key ("v"). A change that renames, removes or retypes a key makes another
// version; adding an optional key does not.
const Version = 1

// Unknown is what "cmd" says when the process that opened a connection is
// not known (see Event.Cmd).
const Unknown = "unknown"

// Caps of what one event's line may hold, so that a line, and what a
// sandbox keeps in memory, is bounded whatever a request carries: a string
// longer than maxField bytes is cut (at a character boundary, ending in
// "…"), a list longer than maxList entries keeps its first maxList.
const (
	maxField = 2048
	maxList  = 64
)

// AppendJSON appends e's line to b: the one encoding of an event, used
// byte for byte in the audit log, the store, the API and the CLI's --json.
// It is a JSON object on one line, ending in "\n", that Cloud Logging
// reads as a structured entry (time, severity by decision, message), with
// the keys in this order:
//
//	v, time, severity, message, sandbox, kind, decision, code, reason,
//	host, port, cmd, [pid], [method], [path], [rule], [module], [addr],
//	[status], bytes_in, bytes_out, duration_ms, [dns_ms], [transforms],
//	[notes], [notes_dropped], [error], [intercept]
//
// The bracketed keys are written only when set. It encodes straight into
// b without allocating (see RATIONALE.md, "The audit line is encoded by
// hand"); strings are escaped as encoding/json escapes them without HTML
// escaping.
func AppendJSON(b []byte, e *Event) []byte {
	b = append(b, `{"v":`...)
	b = strconv.AppendInt(b, Version, 10)
	b = append(b, `,"time":"`...)
	b = e.Time.UTC().AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","severity":"`...)
	b = append(b, e.Severity()...)
	b = append(b, `","message":"egress"`...)
	b = appendStr(b, "sandbox", e.Sandbox)
	b = appendStr(b, "kind", string(e.Kind))
	b = appendStr(b, "decision", e.Decision())
	b = appendStr(b, "code", e.Code)
	b = appendStr(b, "reason", e.Reason)
	b = appendStr(b, "host", e.Host)
	b = appendInt(b, "port", int64(e.Port))
	if e.Cmd == "" {
		b = appendStr(b, "cmd", Unknown)
	} else {
		b = appendStr(b, "cmd", e.Cmd)
	}
	if e.PID != 0 {
		b = appendInt(b, "pid", int64(e.PID))
	}
	if e.Method != "" {
		b = appendStr(b, "method", e.Method)
	}
	if e.Path != "" {
		b = appendStr(b, "path", e.Path)
	}
	if e.Rule != "" {
		b = appendStr(b, "rule", e.Rule)
	}
	if e.Module != "" {
		b = appendStr(b, "module", e.Module)
	}
	if e.Addr != "" {
		b = appendStr(b, "addr", e.Addr)
	}
	if e.Status != 0 {
		b = appendInt(b, "status", int64(e.Status))
	}
	b = appendInt(b, "bytes_in", e.BytesIn)
	b = appendInt(b, "bytes_out", e.BytesOut)
	b = appendFloat(b, "duration_ms", ms(e.Duration))
	if e.DNSTime != 0 {
		b = appendFloat(b, "dns_ms", ms(e.DNSTime))
	}
	if len(e.Transforms) > 0 {
		b = appendStrs(b, "transforms", e.Transforms)
	}
	if len(e.Notes) > 0 {
		b = appendStrs(b, "notes", e.Notes)
	}
	if e.NotesDropped != 0 {
		b = appendInt(b, "notes_dropped", int64(e.NotesDropped))
	}
	if e.Error != "" {
		b = appendStr(b, "error", e.Error)
	}
	if e.InterceptRule != "" {
		b = appendStr(b, "intercept", e.InterceptRule)
	}
	return append(b, "}\n"...)
}

// MarshalJSON encodes e as AppendJSON does (without the newline), so an
// Event inside any JSON document is the same bytes as its line.
func (e Event) MarshalJSON() ([]byte, error) {
	b := AppendJSON(nil, &e)
	return b[:len(b)-1], nil
}

// ms is d in milliseconds, to the microsecond: what a person reads, and
// enough to tell a cache hit from a lookup.
func ms(d time.Duration) float64 { return float64(d.Round(time.Microsecond)) / 1e6 }

func appendKey(b []byte, k string) []byte {
	b = append(b, ',', '"')
	b = append(b, k...)
	return append(b, '"', ':')
}

func appendStr(b []byte, k, v string) []byte { return appendJSONString(appendKey(b, k), v) }

func appendInt(b []byte, k string, v int64) []byte { return strconv.AppendInt(appendKey(b, k), v, 10) }

func appendStrs(b []byte, k string, vs []string) []byte {
	b = append(appendKey(b, k), '[')
	for i, v := range vs[:min(len(vs), maxList)] {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, v)
	}
	return append(b, ']')
}

// appendFloat formats f as encoding/json does.
func appendFloat(b []byte, k string, f float64) []byte {
	b = appendKey(b, k)
	if math.IsInf(f, 0) || math.IsNaN(f) {
		return append(b, `null`...)
	}
	format := byte('f')
	if abs := math.Abs(f); abs != 0 && (abs < 1e-6 || abs >= 1e21) {
		format = 'e'
	}
	b = strconv.AppendFloat(b, f, format, -1, 64)
	if format == 'e' { // e-09 → e-9, as encoding/json writes it
		if n := len(b); n >= 4 && b[n-4] == 'e' && b[n-3] == '-' && b[n-2] == '0' {
			b[n-2] = b[n-1]
			b = b[:n-1]
		}
	}
	return b
}

// Truncate cuts s to at most n bytes at a character boundary, ending it
// with "…" when it was cut.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := max(n-len("…"), 0)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// appendJSONString appends s (cut to maxField bytes) as a JSON string,
// escaped as encoding/json escapes it without HTML escaping: quotes,
// backslashes, control characters, U+2028 and U+2029; invalid UTF-8
// becomes U+FFFD.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	s = Truncate(s, maxField)
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
