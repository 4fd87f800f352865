package appliance

import (
	"context"
	"io"
)

// Progress is how far a long step of the lifecycle has come: a suspend's
// or a template's save ("save": tar bytes packed, of about Total, what
// the writable layer takes on disk), a resume's fetch of its snapshot
// ("fetch": compressed bytes read, of Total). Total is 0 when unknown (a
// layer Google's CLI keeps).
type Progress struct {
	Step  string
	Bytes int64
	Total int64
}

// Steps of Progress.
const (
	StepSave  = "save"
	StepFetch = "fetch"
)

type progressKey struct{}

// WithProgress returns a context under which the manager's long steps
// (Suspend, SaveTemplate, Resume) report their progress to fn, as
// net/http/httptrace hands a trace down a request. fn is called from the
// goroutine doing the work, often: it must be quick.
func WithProgress(ctx context.Context, fn func(Progress)) context.Context {
	return context.WithValue(ctx, progressKey{}, fn)
}

// progressOf is the report function of step under ctx (nil without
// WithProgress), with the total filled in: total is only called when
// someone listens (it may walk a tree).
func progressOf(ctx context.Context, step string, total func() int64) func(int64) {
	fn, _ := ctx.Value(progressKey{}).(func(Progress))
	if fn == nil {
		return nil
	}
	t := total()
	return func(n int64) { fn(Progress{Step: step, Bytes: n, Total: t}) }
}

// progressReader reports the bytes read through it.
type progressReader struct {
	r      io.Reader
	n      int64
	report func(int64)
}

func (p *progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.n += int64(n)
	if n > 0 {
		p.report(p.n)
	}
	return n, err
}
