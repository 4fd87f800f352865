// Package cloudlog builds slog loggers that write JSON lines Cloud Logging
// reads: "severity", "message" and "time" keys.
package cloudlog

import (
	"io"
	"log/slog"
)

// New returns a JSON logger writing to w at the given minimum level.
func New(w io.Writer, level slog.Leveler) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) > 0 {
				return a
			}
			switch a.Key {
			case slog.MessageKey:
				a.Key = "message"
			case slog.LevelKey:
				a.Key = "severity"
				a.Value = slog.StringValue(severity(a.Value.Any().(slog.Level)))
			}
			return a
		},
	}))
}

// severity maps slog levels to Cloud Logging's LogSeverity names.
func severity(l slog.Level) string {
	switch {
	case l < slog.LevelInfo:
		return "DEBUG"
	case l < slog.LevelWarn:
		return "INFO"
	case l < slog.LevelError:
		return "WARNING"
	default:
		return "ERROR"
	}
}
