package console

import (
	"cmp"
	"context"
	"errors"
	"net/http"
	"slices"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/relay/audit"
)

// chartRanges are the spans a chart covers, by the name its link uses.
var chartRanges = []struct {
	Name string
	Span time.Duration
}{{"15m", 15 * time.Minute}, {"1h", time.Hour}, {"6h", 6 * time.Hour}, {"24h", 24 * time.Hour}, {"7d", 7 * 24 * time.Hour}}

// chartBuckets is how many points a chart has.
const chartBuckets = 60

// maxChartSandboxes bounds the sandboxes the service's chart reads.
const maxChartSandboxes = 200

func chartSpan(name string) (string, time.Duration, error) {
	if name == "" {
		name = "1h"
	}
	for _, r := range chartRanges {
		if r.Name == name {
			return r.Name, r.Span, nil
		}
	}
	return "", 0, errorf(http.StatusBadRequest, "range %q: want 15m, 1h, 6h, 24h or 7d", name)
}

// egress is a chart's data: the audit's events in equal buckets of time,
// aggregated on the server (uPlot's columns: times, then each series).
type egress struct {
	Range string  `json:"range"`
	Step  int64   `json:"step"`  // seconds per bucket
	Times []int64 `json:"times"` // each bucket's start, unix seconds
	// Allowed and Refused count the events (requests, tunnels,
	// connections) of each bucket by decision.
	Allowed []int `json:"allowed"`
	Refused []int `json:"refused"`
	// Sent and Received are the bytes from and to the sandboxes.
	Sent     []int64 `json:"sent"`
	Received []int64 `json:"received"`
	// Refusals are the refused events by code, the most frequent first.
	Refusals []refusalSeries `json:"refusals"`
	// Events is how many events were read; Capped says the read stopped at
	// the console's cap (MaxChartEvents, or maxChartSandboxes sandboxes):
	// the chart shows part of the span.
	Events    int    `json:"events"`
	Sandboxes int    `json:"sandboxes"`
	Capped    bool   `json:"capped"`
	Note      string `json:"note,omitempty"`
}

type refusalSeries struct {
	Code   string `json:"code"`
	Total  int    `json:"total"`
	Counts []int  `json:"counts"`
}

// Sum is the chart's totals, for the page that shows it as a table.
func (e *egress) Sum() egressRow {
	var t egressRow
	for i := range e.Times {
		t.Allowed, t.Refused, t.Sent, t.Received = t.Allowed+e.Allowed[i], t.Refused+e.Refused[i], t.Sent+e.Sent[i], t.Received+e.Received[i]
	}
	return t
}

// Rows are the chart's buckets, newest first, for the table.
func (e *egress) Rows() []egressRow {
	out := make([]egressRow, 0, len(e.Times))
	for i := len(e.Times) - 1; i >= 0; i-- {
		out = append(out, egressRow{Start: time.Unix(e.Times[i], 0).UTC(), Allowed: e.Allowed[i], Refused: e.Refused[i], Sent: e.Sent[i], Received: e.Received[i]})
	}
	return out
}

type egressRow struct {
	Start            time.Time
	Allowed, Refused int
	Sent, Received   int64
}

// egressOf aggregates the audit of the sandboxes named (all of the
// service's when names is nil) over span up to now, reading at most
// MaxChartEvents events: bounded work per request.
func (c *Console) egressOf(ctx context.Context, names []string, rangeName string, span time.Duration) (*egress, error) {
	now := c.cfg.Now().UTC()
	step := span / chartBuckets
	end := now.Truncate(step).Add(step)
	start := end.Add(-span)
	e := &egress{Range: rangeName, Step: int64(step / time.Second)}
	for i := range chartBuckets {
		e.Times = append(e.Times, start.Add(time.Duration(i)*step).Unix())
	}
	e.Allowed, e.Refused = make([]int, chartBuckets), make([]int, chartBuckets)
	e.Sent, e.Received = make([]int64, chartBuckets), make([]int64, chartBuckets)
	byCode := map[string][]int{}
	all := names == nil
	if all {
		infos, err := c.b.List(ctx)
		if err != nil {
			return nil, err
		}
		for _, in := range infos {
			names = append(names, in.ID)
		}
		e.Note = "from the audit of the sandboxes there are now (a destroy removes a sandbox's audit)"
	}
	if len(names) > maxChartSandboxes {
		names, e.Capped = names[:maxChartSandboxes], true
	}
	for _, name := range names {
		if e.Events >= c.cfg.MaxChartEvents {
			e.Capped = true
			break
		}
		q := audit.Query{Since: start, Until: end, Limit: audit.MaxLimit}
		for {
			p, err := c.b.AuditEvents(ctx, name, q)
			if err != nil {
				if all && isGone(err) {
					break // destroyed since it was listed
				}
				return nil, err
			}
			for _, l := range p.Lines {
				var ev audit.Event
				if ev.UnmarshalJSON(l) != nil {
					continue
				}
				i := int(ev.Time.Sub(start) / step)
				if i < 0 || i >= chartBuckets {
					continue
				}
				e.Events++
				e.Sent[i] += ev.BytesIn
				e.Received[i] += ev.BytesOut
				if ev.Allow {
					e.Allowed[i]++
					continue
				}
				e.Refused[i]++
				if byCode[ev.Code] == nil {
					byCode[ev.Code] = make([]int, chartBuckets)
				}
				byCode[ev.Code][i]++
			}
			q.After = p.Next
			if !p.More {
				break
			}
			if e.Events >= c.cfg.MaxChartEvents {
				e.Capped = true
				break
			}
		}
		e.Sandboxes++
	}
	for code, counts := range byCode {
		s := refusalSeries{Code: code, Counts: counts}
		for _, n := range counts {
			s.Total += n
		}
		e.Refusals = append(e.Refusals, s)
	}
	slices.SortFunc(e.Refusals, func(a, b refusalSeries) int {
		return cmp.Or(cmp.Compare(b.Total, a.Total), cmp.Compare(a.Code, b.Code))
	})
	return e, nil
}

// isGone says err is a sandbox that is not there (any more).
func isGone(err error) bool { return errors.Is(err, appliance.ErrNotFound) }
