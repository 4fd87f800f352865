package wasm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"

	"github.com/sandgate/sandgate/transforms"
)

// Chain is an ordered list of modules, applied in order to a request and
// in reverse to its response. It is immutable; a nil *Chain has no modules.
type Chain struct{ mods []*Module }

// NewChain returns a chain of mods, in order.
func NewChain(mods ...*Module) *Chain { return &Chain{mods: slices.Clone(mods)} }

// Modules returns the chain's modules, in order.
func (c *Chain) Modules() []*Module {
	if c == nil {
		return nil
	}
	return slices.Clone(c.mods)
}

// Len returns the number of modules.
func (c *Chain) Len() int {
	if c == nil {
		return 0
	}
	return len(c.mods)
}

// Close closes every module of the chain.
func (c *Chain) Close(ctx context.Context) error {
	var errs []error
	for _, m := range c.Modules() {
		errs = append(errs, m.Close(ctx))
	}
	return errors.Join(errs...)
}

// RequestInfo is what the host knows of a request beyond the request
// itself; see [transforms.RequestInfo].
type RequestInfo = transforms.RequestInfo

// Answer is a response a module gave instead of letting the request go
// upstream; see [transforms.Answer].
type Answer = transforms.Answer

// Chains implement the modules of a transformation chain.
var _ transforms.Modules = (*Chain)(nil)

// HandleRequest runs req through the chain's modules; see the function
// [HandleRequest]. It makes *Chain a [transforms.Modules].
func (c *Chain) HandleRequest(ctx context.Context, req *http.Request, info RequestInfo) (transforms.ModuleExchange, error) {
	return HandleRequest(ctx, req, info, c)
}

// Join returns the chain of a's modules then b's (either may be nil); it
// returns a or b itself when the other has no modules.
func Join(a, b *Chain) *Chain {
	switch {
	case b.Len() == 0:
		return a
	case a.Len() == 0:
		return b
	}
	return &Chain{mods: slices.Concat(a.mods, b.mods)}
}

// Exchange is one request's passage through the modules: it remembers
// which modules continued (handle_request returned next=1), with their
// instances, so that their handle_response runs on the same instance, and
// collects the audit notes. It is used by one goroutine. Always Close it.
type Exchange struct {
	info RequestInfo
	req  *http.Request

	// sent is the request's header as the modules left it, which
	// handle_response reads: the caller changes req after HandleRequest
	// (the secret swap), and no module may see that.
	sent http.Header

	// The request body, once a module read (buffered) or wrote it.
	reqBody     []byte
	reqBuffered bool
	reqReplaced bool
	continued   bool // BeforeBodyRead was called

	// The response: the one a module builds in handle_request (status,
	// header, body), then the upstream's in HandleResponse.
	status       int
	header       http.Header
	body         []byte
	bodyBuffered bool
	bodyReplaced bool
	upstream     *http.Response

	notes   []string
	dropped int

	held   []held
	answer *Answer
	closed bool
}

// held is a module that continued, with the instance that will run its
// handle_response.
type held struct {
	m        *Module
	inst     *instance
	reqCtx   uint32
	features Features
	done     bool
}

// HandleRequest runs req through the modules of chains, in order: each
// module's handle_request may read and rewrite req (method, URI, headers,
// body), note, answer or refuse. req is the outbound request, after
// hop-by-hop headers were stripped and before any secret was swapped in;
// its URL carries the decided host, which no module can change. It is
// rewritten in place. Changes the caller makes to req afterwards (the
// secret swap) are never visible to the modules: handle_response reads the
// request headers as the modules left them. The returned Exchange is never nil; Close it when the
// response was handled.
//
// An error (an *Error naming the module) means the request fails with its
// Status. Otherwise, when Exchange.Answer is not nil a module answered and
// the request must not go upstream; else send req, and give the response to
// Exchange.HandleResponse before writing it.
func HandleRequest(ctx context.Context, req *http.Request, info RequestInfo, chains ...*Chain) (*Exchange, error) {
	x := &Exchange{info: info, req: req, status: http.StatusOK, header: http.Header{}}
	for _, c := range chains {
		if c == nil {
			continue
		}
		for _, m := range c.mods {
			if err := x.handleRequest(ctx, m); err != nil {
				return x, err
			}
			if x.answer != nil {
				return x, nil
			}
		}
	}
	x.finishRequest()
	return x, nil
}

func (x *Exchange) handleRequest(ctx context.Context, m *Module) error {
	if m.features.Has(FeatureBufferRequest) && !x.reqBuffered && !x.reqReplaced {
		// Read the body before taking an instance, and outside the call's
		// time limit: the sandbox may be slow to send it.
		if err := x.bufferRequest(m); err != nil {
			return err
		}
	}
	inst, err := m.borrow(ctx)
	if err != nil {
		return err
	}
	st := &callState{m: m, inst: inst, x: x, phase: phaseRequest, features: inst.features}
	ctxNext := uint64(1)
	if m.hasRequest {
		if ctxNext, err = m.call(ctx, inst, inst.handleRequest, st, exportHandleRequest); err != nil {
			m.put(inst)
			return err
		}
	}
	next, reqCtx := uint32(ctxNext), uint32(ctxNext>>32)
	if next == 1 && m.hasResponse && !inst.responseNoop {
		x.held = append(x.held, held{m: m, inst: inst, reqCtx: reqCtx, features: st.features})
	} else {
		m.put(inst)
	}
	if st.violation != "" {
		return failure(http.StatusBadGateway, m.name, "wasm module %s %s", m.name, st.violation)
	}
	if st.refused {
		x.answer = &Answer{Module: m.name, Refused: true, Reason: st.reason, Status: st.refuseStatus, Header: x.header, Body: x.ownBody()}
		return nil
	}
	if next != 1 {
		x.answer = &Answer{Module: m.name, Status: x.status, Header: x.header, Body: x.ownBody()}
		if x.answer.Body == nil {
			x.answer.Body = []byte{}
		}
	}
	return nil
}

// ownBody is the response body a module wrote in handle_request, or nil.
func (x *Exchange) ownBody() []byte {
	if !x.bodyReplaced {
		return nil
	}
	return x.body
}

// bufferRequest reads the whole request body (up to MaxBodyBytes) so that
// modules can read it and the upstream still gets it.
func (x *Exchange) bufferRequest(m *Module) error {
	x.reqBuffered = true
	if x.req.Body == nil || x.req.Body == http.NoBody || x.req.ContentLength == 0 {
		return nil
	}
	if x.info.BeforeBodyRead != nil && !x.continued {
		x.continued = true
		x.info.BeforeBodyRead()
	}
	limit := m.rt.cfg.MaxBodyBytes
	b, err := io.ReadAll(io.LimitReader(x.req.Body, int64(limit)+1))
	if err != nil {
		return &Error{Module: m.name, Status: http.StatusBadRequest, Reason: fmt.Sprintf("reading the request body for wasm module %s", m.name), Err: err}
	}
	if len(b) > limit {
		return failure(http.StatusRequestEntityTooLarge, m.name, "request body is over the %d-byte buffer of wasm module %s (buffer_request)", limit, m.name)
	}
	x.reqBody = b
	return nil
}

// bufferResponse reads the whole upstream response body (up to
// MaxBodyBytes) for a module that enabled buffer_response.
func (x *Exchange) bufferResponse(m *Module) error {
	x.bodyBuffered = true
	if x.upstream == nil || x.upstream.Body == nil || x.upstream.Body == http.NoBody {
		return nil
	}
	limit := m.rt.cfg.MaxBodyBytes
	b, err := io.ReadAll(io.LimitReader(x.upstream.Body, int64(limit)+1))
	if err != nil {
		return &Error{Module: m.name, Status: http.StatusBadGateway, Reason: fmt.Sprintf("reading the upstream response for wasm module %s", m.name), Err: err}
	}
	if len(b) > limit {
		return failure(http.StatusBadGateway, m.name, "response body is over the %d-byte buffer of wasm module %s (buffer_response)", limit, m.name)
	}
	x.body = b
	return nil
}

// finishRequest gives the request the body the modules buffered or wrote.
func (x *Exchange) finishRequest() {
	if len(x.held) > 0 {
		x.sent = x.req.Header.Clone()
	}
	if !x.reqBuffered && !x.reqReplaced {
		return
	}
	b := x.reqBody
	x.req.ContentLength = int64(len(b))
	x.req.TransferEncoding = nil
	if len(b) == 0 {
		x.req.Body = http.NoBody
		x.req.GetBody = func() (io.ReadCloser, error) { return http.NoBody, nil }
	} else {
		x.req.Body = io.NopCloser(bytes.NewReader(b))
		x.req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	}
	if x.req.Header.Get("Content-Length") != "" || len(b) > 0 {
		x.req.Header.Set("Content-Length", strconv.Itoa(len(b)))
	}
}

// Answer returns the response a module gave instead of continuing, or nil.
func (x *Exchange) Answer() *Answer {
	if x == nil {
		return nil
	}
	return x.answer
}

// Notes returns the audit notes the modules attached (sandgate.audit_note),
// each prefixed with its module's name.
func (x *Exchange) Notes() []string {
	if x == nil {
		return nil
	}
	return x.notes
}

// NotesDropped returns how many notes were over the caps and dropped.
func (x *Exchange) NotesDropped() int {
	if x == nil {
		return 0
	}
	return x.dropped
}

// HandleResponse runs handle_response, in reverse order, on each module
// that continued, with the response resp (the upstream's, after the secret
// was scrubbed from it, or one built from an Answer). Each module's
// instance is returned to the pool as soon as its handle_response is done.
// Modules may rewrite resp's headers; with buffer_response also its status
// and body. An error means resp must not be sent: the request fails with
// the error's Status.
func (x *Exchange) HandleResponse(ctx context.Context, resp *http.Response) error {
	if x == nil || len(x.held) == 0 {
		return nil
	}
	for k, vs := range x.header { // headers set for the response in handle_request
		resp.Header[k] = vs
	}
	x.upstream, x.status, x.header = resp, resp.StatusCode, resp.Header
	x.body, x.bodyBuffered, x.bodyReplaced = nil, false, false
	for i := len(x.held) - 1; i >= 0; i-- {
		h := &x.held[i]
		if h.done {
			continue
		}
		if h.features.Has(FeatureBufferResponse) && !x.bodyBuffered && !x.bodyReplaced {
			if err := x.bufferResponse(h.m); err != nil {
				return err
			}
		}
		h.done = true
		st := &callState{m: h.m, inst: h.inst, x: x, phase: phaseResponse, features: h.features}
		if _, err := h.m.call(ctx, h.inst, h.inst.handleResponse, st, exportHandleResponse, uint64(h.reqCtx), 0); err != nil {
			h.m.put(h.inst)
			return err
		}
		h.m.put(h.inst)
		if st.violation != "" {
			return failure(http.StatusBadGateway, h.m.name, "wasm module %s %s", h.m.name, st.violation)
		}
	}
	resp.StatusCode = x.status
	resp.Status = strconv.Itoa(x.status) + " " + http.StatusText(x.status)
	if x.bodyBuffered || x.bodyReplaced {
		resp.Body = io.NopCloser(bytes.NewReader(x.body))
		resp.ContentLength = int64(len(x.body))
		resp.TransferEncoding = nil
		resp.Header.Del("Content-Length")
	}
	return nil
}

// Close ends the exchange: a module that continued but whose
// handle_response has not run (the upstream failed, a later module
// refused or failed) gets handle_response with is_error=1, as the ABI
// requires, with the response frozen (its writes are ignored); then every
// instance goes back to its pool. Close is idempotent and safe on nil.
func (x *Exchange) Close() {
	if x == nil || x.closed {
		return
	}
	x.closed = true
	if x.status == 0 || x.upstream == nil && x.answer == nil {
		x.status = http.StatusBadGateway
	}
	for i := len(x.held) - 1; i >= 0; i-- {
		h := &x.held[i]
		if h.done {
			continue
		}
		h.done = true
		st := &callState{m: h.m, inst: h.inst, x: x, phase: phaseResponse, features: h.features, frozen: true}
		if _, err := h.m.call(context.Background(), h.inst, h.inst.handleResponse, st, exportHandleResponse, uint64(h.reqCtx), 1); err != nil {
			h.m.put(h.inst)
			continue
		}
		h.m.put(h.inst)
	}
}

// addNote records a note under the caps.
func (x *Exchange) addNote(m *Module, b []byte) {
	cfg := m.rt.cfg
	if len(x.notes) >= cfg.MaxNotes || len(b) > cfg.MaxNoteBytes {
		x.dropped++
		return
	}
	x.notes = append(x.notes, m.name+": "+string(b))
}
