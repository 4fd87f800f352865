package client

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/sandgate/sandgate/api"
)

// Progress is how far a long call has come while the service works:
// Step "save" (a suspend's or a template's layer packed: Bytes of the
// uncompressed tar, of about Total, what the layer takes on disk) or
// "fetch" (a resume's snapshot read from the store: compressed Bytes, of
// Total). Total is 0 when the service cannot tell.
type Progress struct {
	Step  string
	Bytes int64
	Total int64
}

type progressKey struct{}

// WithProgress returns a context under which the long calls (Suspend,
// Session.Stop, Resume, Session.SaveTemplate, the save of a template
// EnsureTemplate builds) ask the service for their progress and report
// it to fn as it comes (a few times a second, from the calling
// goroutine). Without it they ask for nothing, as protocol 1's client
// does.
func WithProgress(ctx context.Context, fn func(Progress)) context.Context {
	return context.WithValue(ctx, progressKey{}, fn)
}

// progressLine is api.ProgressLine with its result kept raw.
type progressLine struct {
	Progress *api.Progress   `json:"progress"`
	Status   int             `json:"status"`
	Result   json.RawMessage `json:"result"`
	Error    string          `json:"error"`
}

// doLong is doJSON for a long route: under WithProgress it asks for the
// route's progress (Accept: application/x-ndjson), hands each progress
// line to the callback, and reads the outcome from the last line, an
// error status there being the error it would have been (a 502, 503 or
// 504 of an idempotent call is tried again, as do would).
func (c *Client) doLong(ctx context.Context, cl call, out any) (int, error) {
	fn, _ := ctx.Value(progressKey{}).(func(Progress))
	if fn == nil {
		return c.doJSON(ctx, cl, out)
	}
	cl.header = cl.header.Clone()
	if cl.header == nil {
		cl.header = http.Header{}
	}
	cl.header.Set("Accept", api.MediaProgress)
	for attempt := 0; ; attempt++ {
		st, err := c.readProgress(ctx, cl, out, fn)
		var se *ServiceError
		retry := st == http.StatusBadGateway || st == http.StatusServiceUnavailable || st == http.StatusGatewayTimeout
		if err != nil && retry && cl.idempotent && attempt < c.retries && errors.As(err, &se) {
			if err := sleepCtx(ctx, backoff(attempt, 0)); err != nil {
				return 0, fmt.Errorf("%s: %w", cl, err)
			}
			continue
		}
		return st, err
	}
}

func (c *Client) readProgress(ctx context.Context, cl call, out any, fn func(Progress)) (int, error) {
	resp, err := c.do(ctx, cl)
	if err != nil {
		return statusOf(err), err
	}
	defer drain(resp)
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), api.MediaProgress) {
		// The route's own answer: a service that streams no progress.
		if out != nil && resp.StatusCode != http.StatusNoContent {
			if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(out); err != nil {
				return resp.StatusCode, fmt.Errorf("%s: reading the answer: %w", cl, err)
			}
		}
		return resp.StatusCode, nil
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var l progressLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return 0, fmt.Errorf("%s: a progress line that is not JSON: %w", cl, err)
		}
		switch {
		case l.Progress != nil:
			fn(Progress{Step: l.Progress.Step, Bytes: l.Progress.Bytes, Total: l.Progress.Total})
		case l.Status >= 200 && l.Status < 300:
			if out != nil && len(l.Result) > 0 {
				if err := json.Unmarshal(l.Result, out); err != nil {
					return l.Status, fmt.Errorf("%s: reading the answer: %w", cl, err)
				}
			}
			return l.Status, nil
		case l.Status != 0:
			return l.Status, &ServiceError{Request: cl.String(), Status: l.Status, Message: l.Error}
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("%s: %w", cl, err)
	}
	return 0, fmt.Errorf("%s: the service's answer ended before its outcome: %w", cl, io.ErrUnexpectedEOF)
}
