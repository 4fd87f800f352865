package transforms

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
)

// ErrUnsupportedEncoding is returned by [ScrubResponse] for a body whose
// Content-Encoding it cannot decode (br, deflate, compress, stacked codings,
// anything unknown). Such a body could carry a secret the scrubber cannot
// see, so it must not reach the sandbox: the proxy answers 502 instead.
var ErrUnsupportedEncoding = errors.New("response content encoding cannot be scrubbed")

// zstdMaxWindow is the largest zstd window accepted: RFC 9659 limits the
// "zstd" content coding to 8 MiB, which also bounds the decoder's memory.
const zstdMaxWindow = 8 << 20

// ScrubResponse makes resp safe to hand to the sandbox when it comes from a
// host the secrets may have been sent to: every occurrence of each secret
// in the header values (and names), in the body and in the trailers is
// replaced by its placeholder, and every run of [MinPartialRun] or more
// consecutive bytes of a secret by [PartialMask] bytes.
//
// The body is wrapped, not read: scrubbing happens as the caller reads, a
// streaming response (text/event-stream) stays streaming, and a secret split
// across reads is still caught (see [NewScrubReader]). Trailers are scrubbed
// when the body reaches io.EOF, before EOF is returned.
//
// A body with Content-Encoding gzip (or x-gzip) or zstd is decoded, scrubbed
// and delivered identity-encoded: Content-Encoding is removed and
// resp.Uncompressed set. Content-Length is always removed (and
// resp.ContentLength set to -1) when the body is scrubbed, because a
// placeholder need not have its secret's length and decoding changes the
// length anyway; the proxy then sends the response chunked. Any other
// encoding, or more than one, is refused with an error wrapping
// [ErrUnsupportedEncoding] and resp is left unchanged: the caller must close
// the body and answer 502, never forward it. A response without a body
// (nil or http.NoBody) has only its headers scrubbed.
//
// With no secrets ScrubResponse does nothing. Closing the new body closes
// the decoder and the original body.
func ScrubResponse(resp *http.Response, secrets []*Secret) error {
	return scrubResponse(resp, newScrubber(secrets))
}

func scrubResponse(resp *http.Response, m *scrubber) error {
	if m == nil || resp == nil {
		return nil
	}
	hasBody := resp.Body != nil && resp.Body != http.NoBody
	var coding string
	if hasBody {
		var err error
		if coding, err = contentCoding(resp.Header); err != nil {
			return fmt.Errorf("transforms: %w: %s", ErrUnsupportedEncoding, m.scrubString(err.Error()))
		}
	}
	m.scrubHeader(resp.Header)
	m.scrubHeader(resp.Trailer)
	if !hasBody {
		return nil
	}
	var src io.Reader = resp.Body
	var dec *decodeReader
	if coding != "" {
		dec = &decodeReader{src: resp.Body, coding: coding}
		src = dec
		resp.Header.Del("Content-Encoding")
		resp.Uncompressed = true
	}
	resp.Header.Del("Content-Length")
	resp.ContentLength = -1
	resp.Body = &scrubBody{
		r:    newScrubReader(src, m),
		m:    m,
		resp: resp,
		dec:  dec,
		orig: resp.Body,
	}
	return nil
}

// contentCoding returns "" for identity, "gzip" or "zstd", or an error
// describing an encoding that cannot be decoded.
func contentCoding(h http.Header) (string, error) {
	vs := h.Values("Content-Encoding")
	var codings []string
	for _, v := range vs {
		for c := range strings.SplitSeq(v, ",") {
			if c = strings.ToLower(strings.TrimSpace(c)); c != "" && c != "identity" {
				codings = append(codings, c)
			}
		}
	}
	switch {
	case len(codings) == 0:
		return "", nil
	case len(codings) > 1:
		return "", fmt.Errorf("stacked codings %q; only a single gzip or zstd coding can be decoded", strings.Join(vs, ", "))
	case codings[0] == "gzip" || codings[0] == "x-gzip":
		return "gzip", nil
	case codings[0] == "zstd":
		return "zstd", nil
	default:
		return "", fmt.Errorf("%q; only gzip and zstd can be decoded", codings[0])
	}
}

// scrubBody is the body ScrubResponse installs.
type scrubBody struct {
	r    *scrubReader
	m    *scrubber
	resp *http.Response
	dec  *decodeReader // nil for identity
	orig io.ReadCloser
	once sync.Once
	cerr error
}

func (b *scrubBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if err == io.EOF {
		// net/http fills resp.Trailer as the body reaches EOF, in this
		// goroutine, so it is complete now.
		b.m.scrubHeader(b.resp.Trailer)
	}
	return n, err
}

func (b *scrubBody) Close() error {
	b.once.Do(func() {
		b.cerr = b.orig.Close() // first: it unblocks a Read waiting on upstream
		if b.dec != nil {
			b.dec.close()
		}
	})
	return b.cerr
}

// decodeReader decodes gzip or zstd. The decoder is made on the first Read,
// so ScrubResponse does no I/O and a decoding error surfaces as a read error.
type decodeReader struct {
	src    io.Reader
	coding string
	r      io.Reader     // used only inside Read
	mu     sync.Mutex    // guards the fields below, never held across I/O
	zr     *zstd.Decoder // to release on close
	busy   bool          // a Read is in progress
	closed bool
}

func (d *decodeReader) Read(p []byte) (int, error) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return 0, errors.New("transforms: read on closed response body")
	}
	d.busy = true
	d.mu.Unlock()
	n, err := d.read(p)
	d.mu.Lock()
	d.busy = false
	if d.closed && d.zr != nil { // closed while we read: release now
		d.zr.Close()
		d.zr = nil
	}
	d.mu.Unlock()
	return n, err
}

func (d *decodeReader) read(p []byte) (int, error) {
	if d.r == nil {
		switch d.coding {
		case "gzip":
			zr, err := gzip.NewReader(d.src)
			if err == io.EOF { // an empty body is empty, not an error
				d.r = strings.NewReader("")
				break
			}
			if err != nil {
				return 0, fmt.Errorf("transforms: decode gzip response: %w", err)
			}
			d.r = zr
		case "zstd":
			zr, err := zstd.NewReader(d.src,
				zstd.WithDecoderConcurrency(1), // synchronous: no read-ahead, so streams stay streams
				zstd.WithDecoderMaxWindow(zstdMaxWindow))
			if err != nil {
				return 0, fmt.Errorf("transforms: decode zstd response: %w", err)
			}
			d.r = zr
			d.mu.Lock()
			d.zr = zr
			d.mu.Unlock()
		}
	}
	n, err := d.r.Read(p)
	if err != nil && err != io.EOF {
		err = fmt.Errorf("transforms: decode %s response: %w", d.coding, err)
	}
	return n, err
}

// close releases the decoder, now or, if a Read is in progress (blocked on
// the body the caller is closing), when it returns.
func (d *decodeReader) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	if !d.busy && d.zr != nil {
		d.zr.Close()
		d.zr = nil
	}
}
