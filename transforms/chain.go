package transforms

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
)

// Chain is the transformation chain of a base-URL route, in the one order
// that keeps secrets safe: on the way out, user modules first (they see
// placeholders only), then the rules with the secret swap; on the way back,
// the scrub (secret → placeholder) first, then the modules' response pass
// (so a module never sees a secret either way). A Chain is a small value
// built per request from what is live at that moment; its zero value
// changes nothing.
type Chain struct {
	// Modules are the user modules (transforms/wasm's *Chain), in order;
	// nil means none.
	Modules Modules
	// Rules are the transformation rules; nil means none.
	Rules *RuleSet
}

// Modules is an ordered list of user modules, as the chain drives them.
// transforms/wasm's *Chain implements it.
type Modules interface {
	// Len returns the number of modules; a chain with none is skipped.
	Len() int
	// HandleRequest runs req through the modules (see wasm.HandleRequest):
	// they may rewrite it in place, note, answer or refuse. The returned
	// exchange is never nil, even with an error, and must be closed.
	HandleRequest(ctx context.Context, req *http.Request, info RequestInfo) (ModuleExchange, error)
}

// ModuleExchange is one request's passage through Modules.
type ModuleExchange interface {
	// Answer returns the response a module gave instead of letting the
	// request go upstream, or nil.
	Answer() *Answer
	// HandleResponse runs the modules' response pass on resp.
	HandleResponse(ctx context.Context, resp *http.Response) error
	// Notes and NotesDropped are the audit notes the modules attached.
	Notes() []string
	NotesDropped() int
	// Close gives the modules whose response pass has not run their
	// error pass, and releases them. It is idempotent.
	Close()
}

// RequestInfo is what the chain knows of a request beyond the request
// itself, for the modules.
type RequestInfo struct {
	// Sandbox is the id of the sandbox that sent the request
	// (sandgate.sandbox_id).
	Sandbox string
	// SourceAddr is the address the request came from
	// (http_handler.get_source_addr).
	SourceAddr string
	// Proto is the protocol the sandbox spoke, e.g. "HTTP/1.1"
	// (http_handler.get_protocol_version); empty means HTTP/1.1.
	Proto string
	// BeforeBodyRead, when set, is called once before the request body is
	// first read, so the proxy can answer "Expect: 100-continue" first.
	BeforeBodyRead func()
}

// Answer is a response a module gave instead of letting the request go
// upstream: a refusal (sandgate.refuse) or its own response
// (handle_request returned next=0).
type Answer struct {
	// Module is the name of the module that answered.
	Module string
	// Refused is true for a refusal; Reason then says why.
	Refused bool
	Reason  string
	// Status is the HTTP status: the refusal's, or what the module set
	// (default 200).
	Status int
	// Header holds the response headers the module set.
	Header http.Header
	// Body is what the module wrote as the response body; nil when it wrote
	// none (for a refusal the proxy then answers with its own error body).
	Body []byte
}

// ModuleFailure is implemented by the errors of a module that failed a
// request (transforms/wasm's *Error): the name goes to the audit event.
type ModuleFailure interface {
	error
	ModuleName() string
}

// ErrScrub wraps the error of a response the chain could not scrub of the
// secrets its host may have been sent (an encoding it cannot decode): it
// must not reach the sandbox. Any other error of [Exchange.Response] is the modules' (a
// [ModuleFailure]) or the upstream body's.
var ErrScrub = errors.New("response could not be scrubbed of the sandbox's credentials")

// Exchange is one request's passage through a [Chain]: what the request
// pass did (the rules that matched, the secrets swapped, a module's
// answer), the response pass, and the facts the audit event records. It
// is used by one goroutine. Close it when the response was written.
type Exchange struct {
	mods    ModuleExchange // nil when there are no modules
	applied Applied
	answer  *Answer
	module  string // the module that answered, refused or failed
	closed  bool
}

// Request runs out through the chain: the modules, then (unless a module
// answered or failed) the rules and the secret swap. out is the outbound
// request, after hop-by-hop headers were stripped; it is rewritten in
// place. The returned Exchange is never nil, even with an error, and must
// be closed.
//
// An error is a module's (a [ModuleFailure] carrying the status the
// request fails with), or an [*UnscrubbableError]: a held secret this
// service cannot open targets the request's host. When Answer is not nil a module answered: send
// that, not the request. Otherwise send out, and give its response to
// Response before writing it.
func (c Chain) Request(ctx context.Context, out *http.Request, info RequestInfo) (*Exchange, error) {
	x := &Exchange{}
	if c.Rules != nil {
		// A host whose answers could carry a held secret this service
		// cannot scrub them of is refused before anything is done.
		host := out.Host
		if out.URL != nil && out.URL.Host != "" {
			host = out.URL.Host
		}
		if ue, ok := c.Rules.Unscrubbable(host); ok {
			return x, ue
		}
	}
	if c.Modules != nil && c.Modules.Len() > 0 {
		mx, err := c.Modules.HandleRequest(ctx, out, info)
		x.mods = mx
		if err != nil {
			x.noteFailure(err)
			return x, err
		}
		if a := mx.Answer(); a != nil {
			x.answer, x.module = a, a.Module
			return x, nil // nothing goes upstream: no secret goes in
		}
	}
	if c.Rules != nil {
		x.applied = c.Rules.Apply(out)
	}
	return x, nil
}

func (x *Exchange) noteFailure(err error) {
	var mf ModuleFailure
	if errors.As(err, &mf) {
		x.module = mf.ModuleName()
	}
}

// Answer returns the response a module gave instead of the upstream's, or
// nil.
func (x *Exchange) Answer() *Answer { return x.answer }

// Swapped reports whether a secret went into the request.
func (x *Exchange) Swapped() bool { return len(x.applied.Secrets) > 0 }

// Scrubs reports whether the response and anything quoting it (an error, a
// module's note) are scrubbed: whether a rule with a secret targets the
// request's host (see [Applied]), whether or not a secret went into this
// request.
func (x *Exchange) Scrubs() bool { return len(x.applied.Scrub) > 0 }

// wholeBodyMax is the largest response that is scrubbed whole rather than
// streamed: small answers keep an exact Content-Length (one write, no
// chunking) after the secret is replaced.
const wholeBodyMax = 256 << 10

// Response runs the response pass on resp, the upstream's response to the
// request (or one built from a module's Answer that is not a refusal):
// when a rule with a secret targets the request's host, the response is
// scrubbed of those secrets first, whether or not the request carried one
// (see [Applied] and [ScrubResponse]; a
// small body of known length is scrubbed whole and keeps an exact
// Content-Length), then the modules may rewrite it. An error means resp
// must not be sent: it wraps [ErrScrub], is a [ModuleFailure], or is the
// upstream body's read error.
func (x *Exchange) Response(ctx context.Context, resp *http.Response) error {
	if x.answer != nil && x.answer.Refused {
		return nil // a refusal is the proxy's own answer; Close tells the modules
	}
	if x.Scrubs() {
		if err := scrubWhole(resp, x.applied); err != nil {
			return err
		}
	}
	if x.mods != nil {
		if err := x.mods.HandleResponse(ctx, resp); err != nil {
			x.noteFailure(err)
			return err
		}
	}
	return nil
}

// scrubWhole scrubs resp of applied.Scrub; a small body of known
// length is read and scrubbed whole, so it keeps a Content-Length; anything
// else (streams, SSE, large downloads) is scrubbed as it streams.
func scrubWhole(resp *http.Response, applied Applied) error {
	known := resp.ContentLength
	if resp.Body == nil || resp.Body == http.NoBody || resp.Request != nil && resp.Request.Method == http.MethodHead {
		known = -1 // no body to read whole; a HEAD keeps the length it announced
	}
	if known >= 0 && known <= wholeBodyMax {
		if coding, err := contentCoding(resp.Header); err == nil && coding == "" {
			return scrubSmall(resp, applied.scrubber(), known)
		}
	}
	if err := applied.ScrubResponse(resp); err != nil {
		return &scrubError{err}
	}
	if known < 0 || known > wholeBodyMax {
		return nil
	}
	// The decoded, scrubbed body may be larger than the wire length (gzip):
	// read at most wholeBodyMax, and stream the rest if there is more.
	buf, err := io.ReadAll(io.LimitReader(resp.Body, wholeBodyMax+1))
	if err != nil {
		return err
	}
	if len(buf) > wholeBodyMax {
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), resp.Body), resp.Body}
		return nil
	}
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(buf))
	resp.ContentLength = int64(len(buf))
	return nil
}

// scrubSmall scrubs an identity-encoded response whose body of known
// length n (at most wholeBodyMax) is read whole: what ScrubResponse and
// the read of its scrubbing reader would do, in one read and one scan
// (none when the secret is not in the body, which is the rule).
func scrubSmall(resp *http.Response, m *scrubber, n int64) error {
	m.scrubHeader(resp.Header)
	m.scrubHeader(resp.Trailer)
	buf := make([]byte, n)
	_, err := io.ReadFull(resp.Body, buf)
	if err == nil {
		// A body longer than announced is the upstream's error, as a
		// streaming read would have found.
		var one [1]byte
		if k, _ := resp.Body.Read(one[:]); k > 0 {
			err = errors.New("upstream sent more body than its Content-Length")
		}
	}
	if err != nil {
		return err
	}
	resp.Body.Close()
	buf = m.scrubBytes(buf)
	resp.Header.Del("Content-Length")
	resp.Body = io.NopCloser(bytes.NewReader(buf))
	resp.ContentLength = int64(len(buf))
	return nil
}

// scrubError is a response that could not be scrubbed; it is ErrScrub.
type scrubError struct{ err error }

func (e *scrubError) Error() string        { return e.err.Error() }
func (e *scrubError) Unwrap() error        { return e.err }
func (e *scrubError) Is(target error) bool { return target == ErrScrub }

// ScrubString returns s scrubbed of the secrets the response is scrubbed of
// (see [Exchange.Scrubs]): for an error message that may quote what the
// upstream sent.
func (x *Exchange) ScrubString(s string) string { return x.applied.ScrubString(s) }

// Close ends the exchange: modules whose response pass has not run (the
// upstream failed, a later module refused or failed, the request was
// refused) get their error pass, and every module instance is released.
// Call it once the response was written, before [Exchange.Audit]. It is
// idempotent.
func (x *Exchange) Close() {
	if x.closed {
		return
	}
	x.closed = true
	if x.mods != nil {
		x.mods.Close()
	}
}

// Audit is what a request's passage through the chain adds to its audit
// event. It holds no secret: rules are named, and the modules' notes are
// scrubbed like the response (a note may quote the upstream's answer).
type Audit struct {
	// Transforms names the rules that matched, in order.
	Transforms []string
	// Module is the module that answered, refused or failed the request.
	Module string
	// Notes are the modules' audit notes ("module: text"); NotesDropped
	// counts those over the caps.
	Notes        []string
	NotesDropped int
}

// Audit returns the audit facts; read them after Close (a module's error
// pass may add notes).
func (x *Exchange) Audit() Audit {
	a := Audit{Transforms: x.applied.Rules, Module: x.module}
	if x.mods != nil {
		a.Notes, a.NotesDropped = x.mods.Notes(), x.mods.NotesDropped()
		if x.Scrubs() {
			for i, n := range a.Notes {
				a.Notes[i] = x.applied.ScrubString(n)
			}
		}
	}
	return a
}
