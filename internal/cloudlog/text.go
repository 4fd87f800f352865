package cloudlog

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// NewText returns a logger writing text lines "<time> <SEVERITY>
// <message> key=value…" (protocol 1's LOG_FORMAT other than json) at the
// given minimum level.
func NewText(w io.Writer, level slog.Leveler) *slog.Logger {
	return slog.New(&textHandler{w: w, level: level, mu: &sync.Mutex{}})
}

type textHandler struct {
	w      io.Writer
	level  slog.Leveler
	mu     *sync.Mutex
	prefix string // group prefix of attrs added by WithAttrs and later ones
	attrs  string // preformatted attrs from WithAttrs
}

func (h *textHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= h.level.Level() }

func (h *textHandler) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	t := r.Time
	if t.IsZero() {
		t = time.Now()
	}
	fmt.Fprintf(&b, "%s %s %s", t.UTC().Format(time.RFC3339Nano), severity(r.Level), r.Message)
	b.WriteString(h.attrs)
	r.Attrs(func(a slog.Attr) bool {
		writeAttr(&b, h.prefix, a)
		return true
	})
	b.WriteByte('\n')
	h.mu.Lock()
	defer h.mu.Unlock()
	_, err := io.WriteString(h.w, b.String())
	return err
}

func writeAttr(b *strings.Builder, prefix string, a slog.Attr) {
	a.Value = a.Value.Resolve()
	if a.Equal(slog.Attr{}) {
		return
	}
	if a.Value.Kind() == slog.KindGroup {
		p := prefix
		if a.Key != "" {
			p += a.Key + "."
		}
		for _, g := range a.Value.Group() {
			writeAttr(b, p, g)
		}
		return
	}
	v := a.Value.String()
	if strings.ContainsAny(v, " \t\n\"=") || v == "" {
		v = fmt.Sprintf("%q", v)
	}
	fmt.Fprintf(b, " %s%s=%s", prefix, a.Key, v)
}

func (h *textHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	var b strings.Builder
	for _, a := range attrs {
		writeAttr(&b, h.prefix, a)
	}
	n := *h
	n.attrs += b.String()
	return &n
}

func (h *textHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	n := *h
	n.prefix += name + "."
	return &n
}
