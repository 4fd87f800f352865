package appliance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
)

// The audit, as the store keeps it:
//
//	audit/<id>/<segment>.jsonl.zst   a segment of sandbox <id>'s events:
//	                                 zstd-compressed JSON lines, one event each
//
// Segments are named by the time of their first event (audit.Journals),
// so a listing of audit/<id>/ is in time order. They sit under a prefix
// of their own rather than beside the layers under snapshots/<id>/, so
// that listing snapshots does not list every segment; they go with the
// sandbox (Destroy) and are otherwise kept for ManagerConfig.AuditRetention.

const auditPrefix = "audit/"

func auditDir(id string) string { return auditPrefix + id + "/" }

const segmentExt = ".jsonl.zst"

// maxStoredSegment bounds a stored segment read back (compressed).
const maxStoredSegment = 32 << 20

// AuditStore keeps sandboxes' audit segments in a store: the
// audit.SegmentWriter of audit.Journals, and what the manager lists,
// reads and removes them with.
type AuditStore struct{ st store.Store }

// NewAuditStore keeps audit segments in st.
func NewAuditStore(st store.Store) *AuditStore { return &AuditStore{st: st} }

var _ audit.SegmentWriter = (*AuditStore)(nil)

// WriteSegment implements audit.SegmentWriter.
func (a *AuditStore) WriteSegment(ctx context.Context, sandbox, name string, data []byte) error {
	if err := audit.CheckSegmentName(name); err != nil {
		return err
	}
	key := auditDir(sandbox) + name + segmentExt
	if _, err := a.st.Put(ctx, key, bytes.NewReader(data), store.PutOptions{}); err != nil {
		return fmt.Errorf("%w: writing %s: %v", ErrStore, key, err)
	}
	return nil
}

// segments lists sandbox id's stored segments, for audit.Select.
func (a *AuditStore) segments(ctx context.Context, id string) ([]audit.Segment, error) {
	infos, err := a.st.List(ctx, auditDir(id))
	if err != nil {
		return nil, fmt.Errorf("%w: listing %s: %v", ErrStore, auditDir(id), err)
	}
	out := make([]audit.Segment, 0, len(infos))
	for _, in := range infos {
		name, ok := strings.CutSuffix(strings.TrimPrefix(in.Name, auditDir(id)), segmentExt)
		if !ok || audit.CheckSegmentName(name) != nil {
			continue
		}
		key := in.Name
		out = append(out, audit.Segment{Name: name, Modified: in.Modified, Lines: func(ctx context.Context) ([]byte, error) {
			return a.read(ctx, key)
		}})
	}
	return out, nil
}

// read reads a stored segment's lines.
func (a *AuditStore) read(ctx context.Context, key string) ([]byte, error) {
	rc, err := a.st.Get(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("%w: reading %s: %v", ErrStore, key, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, maxStoredSegment+1))
	if err == nil && len(b) > maxStoredSegment {
		err = fmt.Errorf("over %d bytes: not a segment this service wrote", maxStoredSegment)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: reading %s: %v", ErrStore, key, err)
	}
	return audit.DecodeSegment(b)
}

// remove deletes every segment of sandbox id.
func (a *AuditStore) remove(ctx context.Context, id string) error {
	infos, err := a.st.List(ctx, auditDir(id))
	if err != nil {
		return fmt.Errorf("%w: listing %s: %v", ErrStore, auditDir(id), err)
	}
	for _, in := range infos {
		if err := a.st.Delete(ctx, in.Name); err != nil && !errors.Is(err, store.ErrNotFound) {
			return fmt.Errorf("%w: removing %s: %v", ErrStore, in.Name, err)
		}
	}
	return nil
}

// sweep deletes the segments, of any sandbox, last written before cutoff.
func (a *AuditStore) sweep(ctx context.Context, cutoff time.Time) (int, error) {
	infos, err := a.st.List(ctx, auditPrefix)
	if err != nil {
		return 0, fmt.Errorf("%w: listing %s: %v", ErrStore, auditPrefix, err)
	}
	n := 0
	for _, in := range infos {
		if !strings.HasSuffix(in.Name, segmentExt) || !in.Modified.Before(cutoff) {
			continue
		}
		if err := a.st.Delete(ctx, in.Name); err != nil && !errors.Is(err, store.ErrNotFound) {
			return n, fmt.Errorf("%w: removing %s: %v", ErrStore, in.Name, err)
		}
		n++
	}
	return n, nil
}
