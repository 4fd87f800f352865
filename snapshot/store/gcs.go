package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"slices"
	"strings"

	"cloud.google.com/go/storage"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/iterator"
)

// digestMetadata is the object metadata key holding an object's sha256.
const digestMetadata = "sha256"

// GCS is a Store in a Cloud Storage bucket under a name prefix.
//
// A put streams to the final name; Cloud Storage makes the object visible
// only when the upload is finalised, so an interrupted put leaves the old
// object or none. IfNotExist is the DoesNotExist precondition (generation
// 0). The CRC32C the service computed is compared with the one computed
// while sending; the sha256 is then recorded in the object's metadata with
// a generation+metageneration precondition. Only conditional calls are
// retried (storage.RetryIdempotent). Get pins the generation it stat'ed
// and verifies size, CRC32C and, when recorded, sha256 at EOF.
type GCS struct {
	client    *storage.Client
	bucket    *storage.BucketHandle
	prefix    string // "" or ending in "/"
	ownClient bool
}

var _ Store = (*GCS)(nil)

// NewGCS returns a store in bucket under prefix using client. Closing the
// store does not close client.
func NewGCS(client *storage.Client, bucket, prefix string) *GCS {
	prefix = strings.Trim(prefix, "/")
	if prefix != "" {
		prefix += "/"
	}
	return &GCS{client: client, bucket: client.Bucket(bucket), prefix: prefix}
}

// OpenGCS returns a store in bucket under prefix with a client made from
// the default credentials; Close closes that client.
func OpenGCS(ctx context.Context, bucket, prefix string) (*GCS, error) {
	// JSON reads: one API for every call, which is also what the
	// emulator (STORAGE_EMULATOR_HOST) serves.
	c, err := storage.NewClient(ctx, storage.WithJSONReads())
	if err != nil {
		return nil, fmt.Errorf("gcs store: %w", err)
	}
	g := NewGCS(c, bucket, prefix)
	g.ownClient = true
	return g, nil
}

// Close implements Store.
func (g *GCS) Close() error {
	if g.ownClient {
		return g.client.Close()
	}
	return nil
}

func (g *GCS) object(name string) *storage.ObjectHandle {
	return g.bucket.Object(g.prefix + name).Retryer(storage.WithPolicy(storage.RetryIdempotent))
}

// Put implements Store.
func (g *GCS) Put(ctx context.Context, name string, r io.Reader, opts PutOptions) (Info, error) {
	if err := CheckName(name); err != nil {
		return Info{}, err
	}
	obj := g.object(name)
	switch {
	case opts.IfNotExist && opts.IfGenerationMatch != 0:
		return Info{}, fmt.Errorf("put %s: IfNotExist and IfGenerationMatch together: %w", name, ErrPreconditionFailed)
	case opts.IfNotExist:
		obj = obj.If(storage.Conditions{DoesNotExist: true})
	case opts.IfGenerationMatch != 0:
		obj = obj.If(storage.Conditions{GenerationMatch: opts.IfGenerationMatch})
	}
	// Cancelling wctx is how an upload is abandoned without finalising it.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w := obj.NewWriter(wctx)
	w.ContentType = "application/octet-stream"
	sha := sha256.New()
	var crc uint32
	_, err := io.CopyBuffer(w, io.TeeReader(r, writerFunc(func(p []byte) (int, error) {
		if opts.Digest == nil {
			sha.Write(p)
		}
		crc = crc32.Update(crc, castagnoli, p)
		return len(p), nil
	})), make([]byte, 1<<20))
	if err != nil {
		cancel()
		w.Close()
		return Info{}, fmt.Errorf("put %s: %w", name, err)
	}
	if err := w.Close(); err != nil {
		return Info{}, g.mapErr("put", name, err)
	}
	attrs := w.Attrs()
	pinned := g.object(name).If(storage.Conditions{GenerationMatch: attrs.Generation, MetagenerationMatch: attrs.Metageneration})
	if attrs.CRC32C != crc {
		pinned.Delete(ctx)
		return Info{}, fmt.Errorf("put %s: service crc32c %08x, sent %08x: %w", name, attrs.CRC32C, crc, ErrDigestMismatch)
	}
	digest := "sha256:" + hex.EncodeToString(sha.Sum(nil))
	if opts.Digest != nil {
		digest = opts.Digest()
	}
	updated, err := pinned.Update(ctx, storage.ObjectAttrsToUpdate{Metadata: map[string]string{digestMetadata: digest}})
	if err != nil {
		err = g.mapErr("put (record digest)", name, err)
		if errors.Is(err, ErrPreconditionFailed) {
			// Another put replaced this generation after it was written:
			// this put happened (a compare-and-swap that succeeded), and
			// what it wrote is gone, as if replaced a moment later.
			info := g.info(name, attrs)
			info.Digest = digest
			return info, nil
		}
		return Info{}, err
	}
	return g.info(name, updated), nil
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func (g *GCS) info(name string, a *storage.ObjectAttrs) Info {
	return Info{Name: name, Size: a.Size, Digest: a.Metadata[digestMetadata], Modified: a.Updated, Generation: a.Generation}
}

// Get implements Store.
func (g *GCS) Get(ctx context.Context, name string) (io.ReadCloser, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	attrs, err := g.object(name).Attrs(ctx)
	if err != nil {
		return nil, g.mapErr("get", name, err)
	}
	r, err := g.object(name).Generation(attrs.Generation).NewReader(ctx)
	if err != nil {
		return nil, g.mapErr("get", name, err)
	}
	crc := attrs.CRC32C
	return newVerifyingReader(r, name, attrs.Size, attrs.Metadata[digestMetadata], &crc), nil
}

// Stat implements Store.
func (g *GCS) Stat(ctx context.Context, name string) (Info, error) {
	if err := CheckName(name); err != nil {
		return Info{}, err
	}
	attrs, err := g.object(name).Attrs(ctx)
	if err != nil {
		return Info{}, g.mapErr("stat", name, err)
	}
	return g.info(name, attrs), nil
}

// Delete implements Store.
func (g *GCS) Delete(ctx context.Context, name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return g.mapErr("delete", name, g.object(name).Delete(ctx))
}

// DeleteIf implements Store.
func (g *GCS) DeleteIf(ctx context.Context, name string, generation int64) error {
	if err := CheckName(name); err != nil {
		return err
	}
	if generation == 0 {
		return fmt.Errorf("delete %s: generation 0: %w", name, ErrPreconditionFailed)
	}
	return g.mapErr("delete", name, g.object(name).If(storage.Conditions{GenerationMatch: generation}).Delete(ctx))
}

// Read implements Store.
func (g *GCS) Read(ctx context.Context, name string, max int64) ([]byte, Info, error) {
	if err := CheckName(name); err != nil {
		return nil, Info{}, err
	}
	// A generation replaced between its attributes and its read is gone
	// (the bucket keeps no old versions): read the new one. A name changed
	// that often by others is a contention the caller sees as an error.
	for try := 0; ; try++ {
		attrs, err := g.object(name).Attrs(ctx)
		if err != nil {
			return nil, Info{}, g.mapErr("get", name, err)
		}
		if attrs.Size > max {
			return nil, Info{}, fmt.Errorf("read %s: %d bytes, over %d", name, attrs.Size, max)
		}
		r, err := g.object(name).Generation(attrs.Generation).NewReader(ctx)
		if errors.Is(err, storage.ErrObjectNotExist) && try < 10 {
			continue
		}
		if err != nil {
			return nil, Info{}, g.mapErr("get", name, err)
		}
		crc := attrs.CRC32C
		b, err := readMax(newVerifyingReader(r, name, attrs.Size, attrs.Metadata[digestMetadata], &crc), name, max)
		r.Close()
		if err != nil {
			return nil, Info{}, g.mapErr("get", name, err)
		}
		return b, g.info(name, attrs), nil
	}
}

// List implements Store.
func (g *GCS) List(ctx context.Context, prefix string) ([]Info, error) {
	it := g.bucket.Objects(ctx, &storage.Query{Prefix: g.prefix + prefix})
	var out []Info
	for {
		a, err := it.Next()
		if errors.Is(err, iterator.Done) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("list %q: %w", prefix, err)
		}
		name := strings.TrimPrefix(a.Name, g.prefix)
		if CheckName(name) != nil {
			continue
		}
		out = append(out, g.info(name, a))
	}
	slices.SortFunc(out, func(a, b Info) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

func (g *GCS) mapErr(op, name string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, storage.ErrObjectNotExist) {
		return fmt.Errorf("%s %s: %w", op, name, ErrNotFound)
	}
	var ge *googleapi.Error
	if errors.As(err, &ge) {
		switch ge.Code {
		case http.StatusPreconditionFailed:
			return fmt.Errorf("%s %s: %w (%v)", op, name, ErrPreconditionFailed, err)
		case http.StatusNotFound:
			return fmt.Errorf("%s %s: %w", op, name, ErrNotFound)
		}
	}
	return fmt.Errorf("%s %s: %w", op, name, err)
}
