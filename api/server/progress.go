package server

import (
	"context"
	"encoding/json"
	"mime"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
)

// progressEvery is the least time between two progress lines.
const progressEvery = 250 * time.Millisecond

// wantsProgress reports whether the caller asked for a long route's
// progress: Accept names application/x-ndjson. Protocol 1's client never
// does, so its routes answer it exactly as the protocol says.
func wantsProgress(r *http.Request) bool {
	for _, v := range r.Header.Values("Accept") {
		for _, part := range strings.Split(v, ",") {
			if mt, _, err := mime.ParseMediaType(strings.TrimSpace(part)); err == nil && mt == api.MediaProgress {
				return true
			}
		}
	}
	return false
}

// progressed runs op, a long step (suspend, resume, a template's save)
// that answers code and body (nil: no body). A caller that asked for
// progress (wantsProgress) gets 200 and JSON lines: {"progress": …} while
// op runs, at most every progressEvery, then the outcome, {"status": code,
// "result": body} or {"status": code, "error": "…"}. Any other caller
// gets the route's own answer.
func (s *Server) progressed(w http.ResponseWriter, r *http.Request, op func(ctx context.Context) (int, any, error)) error {
	if !wantsProgress(r) {
		code, body, err := op(r.Context())
		switch {
		case err != nil:
			return err
		case body == nil:
			w.WriteHeader(code)
		default:
			writeJSON(w, code, body)
		}
		return nil
	}
	w.Header().Set("Content-Type", api.MediaProgress)
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	rc.Flush()
	enc := json.NewEncoder(w)
	var mu sync.Mutex
	var last time.Time
	over := false
	ctx := appliance.WithProgress(r.Context(), func(p appliance.Progress) {
		mu.Lock()
		defer mu.Unlock()
		if over || time.Since(last) < progressEvery {
			return
		}
		last = time.Now()
		if enc.Encode(api.ProgressLine{Progress: &api.Progress{Step: p.Step, Bytes: p.Bytes, Total: p.Total}}) == nil {
			rc.Flush()
		}
	})
	code, body, err := op(ctx)
	mu.Lock()
	defer mu.Unlock()
	over = true
	end := api.ProgressLine{Status: code, Result: body}
	if err != nil {
		end = api.ProgressLine{Status: status(err), Error: err.Error()}
	}
	enc.Encode(end)
	rc.Flush()
	return nil
}
