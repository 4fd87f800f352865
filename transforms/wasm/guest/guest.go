package guest

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"unsafe"

	"github.com/sandgate/sandgate/transforms/wasm/guest/internal/hostbuf"
)

// RequestHandler handles one request, called by the host's handle_request.
// It returns next=true to send the request on (to the upstream, through the
// rest of the chain), or next=false when it wrote a response itself or
// refused. reqCtx is any value the module wants back in its
// ResponseHandler for this request (ignored when next is false).
type RequestHandler func(req Request, resp Response) (next bool, reqCtx uint32)

// ResponseHandler handles the response to a request whose RequestHandler
// returned next=true, called by the host's handle_response. reqCtx is what
// the RequestHandler returned; isError is true when the host failed to
// produce a response (the handler should only clean up then).
type ResponseHandler func(reqCtx uint32, req Request, resp Response, isError bool)

var (
	requestHandler  RequestHandler
	responseHandler ResponseHandler
	// asked is set once the host asked whether handle_response does
	// anything (runResponseNoop): a response handler registered later
	// would never be called.
	asked bool
)

// HandleRequest registers the function the host calls for each request.
// Call it from an init function or a package variable's initialiser: the
// host runs the module's initialisation once, before any request. Without
// one, every request continues unchanged. A later call replaces the
// earlier handler.
func HandleRequest(h RequestHandler) { requestHandler = h }

// HandleResponse registers the function the host calls with each response
// whose request continued. Without one, responses pass unchanged (and
// sandgate returns the module's instance to its pool as soon as
// handle_request returns, instead of keeping it while the upstream
// answers). To read or change the response's status or body the module
// must enable [FeatureBufferResponse].
//
// Call it from an init function or a package variable's initialiser, as
// HandleRequest: once the host has started the module it asks whether a
// response handler exists, and registering the first one after that
// panics rather than be silently never called.
func HandleResponse(h ResponseHandler) {
	if asked && responseHandler == nil && h != nil {
		panic("guest.HandleResponse: register the response handler while the module initialises (in an init function or a package variable's initialiser), not once it serves requests")
	}
	responseHandler = h
}

// runResponseNoop is the body of the sandgate_response_noop export: 1 when
// no response handler is registered, so that handle_response does nothing.
func runResponseNoop() uint32 {
	asked = true
	if responseHandler == nil {
		return 1
	}
	return 0
}

// runRequest is the body of the handle_request export: it packs the
// handler's answer as the ABI's ctx_next, reqCtx<<32 | next.
func runRequest() uint64 {
	h := requestHandler
	if h == nil {
		return 1
	}
	next, reqCtx := h(Request{}, Response{})
	ctxNext := uint64(reqCtx) << 32
	if next {
		ctxNext |= 1
	}
	return ctxNext
}

// runResponse is the body of the handle_response export.
func runResponse(reqCtx uint32, isError bool) {
	if h := responseHandler; h != nil {
		h(reqCtx, Request{}, Response{}, isError)
	}
}

// Features is the http-wasm feature bit set: optional host behaviour a
// module must ask for, because it costs the host memory or latency.
type Features uint32

const (
	// FeatureBufferRequest makes the host buffer the request body so that
	// the module can read it (and write a replacement) and the upstream
	// still receives a body. Without it, reading the request body consumes
	// it. Hosts cap what they buffer; sandgate refuses a larger body with
	// 413 rather than truncate it.
	FeatureBufferRequest Features = 1
	// FeatureBufferResponse makes the host hold the response until
	// handle_response returns, so that the module can read and replace its
	// status, headers and body.
	FeatureBufferResponse Features = 2
	// FeatureTrailers lets the module read and write trailers. A host that
	// lacks trailer support leaves this bit out of EnableFeatures' answer.
	FeatureTrailers Features = 4
)

// Has reports whether every feature in want is in f.
func (f Features) Has(want Features) bool { return f&want == want }

// String lists the features by their ABI names, "|"-separated, e.g.
// "buffer_request|trailers"; unknown bits are shown as a number.
func (f Features) String() string {
	if f == 0 {
		return "none"
	}
	var names []string
	for _, ft := range []struct {
		bit  Features
		name string
	}{{FeatureBufferRequest, "buffer_request"}, {FeatureBufferResponse, "buffer_response"}, {FeatureTrailers, "trailers"}} {
		if f&ft.bit != 0 {
			names = append(names, ft.name)
			f &^= ft.bit
		}
	}
	if f != 0 {
		names = append(names, fmt.Sprintf("0x%x", uint32(f)))
	}
	return strings.Join(names, "|")
}

// EnableFeatures asks the host for features and returns every feature the
// host now has enabled for this module, so a module that needs one can
// check with Has. Called during initialisation, it applies to every
// request; called inside a RequestHandler, to that request only (a module
// can buffer only the bodies it cares about).
func EnableFeatures(f Features) Features { return Features(hostEnableFeatures(uint32(f))) }

var (
	configOnce sync.Once
	config     []byte
)

// Config returns the module's configuration bytes: in sandgate, what
// follows "?" in --transform-module FILE?config (empty when nothing does).
// The ABI leaves the format to the module. It is read from the host once
// and cached; do not modify the returned slice.
func Config() []byte {
	configOnce.Do(func() { config = hostbuf.Get("get_config", hostGetConfig) })
	return config
}

// LogLevel is the http-wasm log level. Lower is more verbose.
type LogLevel int32

// The ABI's log levels. Debug is -1 so that a zero value is Info, not the
// most voluminous level.
const (
	LogDebug LogLevel = -1
	LogInfo  LogLevel = 0
	LogWarn  LogLevel = 1
	LogError LogLevel = 2
	LogNone  LogLevel = 3
)

// Log writes msg to the host's log at level. Hosts drop messages below
// their level; use LogEnabled to skip building an expensive message.
func Log(level LogLevel, msg string) { hostLog(int32(level), msg) }

// LogEnabled reports whether the host records messages at level.
func LogEnabled(level LogLevel) bool { return hostLogEnabled(int32(level)) == 1 }

// Abort logs msg at LogError and then panics with it, trapping the module.
// Called while the module initialises (say, on a config it cannot use),
// it makes the host refuse the module at load; called in a handler, it
// fails that request (sandgate answers 502 naming the module). The message
// goes through the host's log because hosts, sandgate included, may give a
// module no stderr, where a bare panic's message would be lost.
func Abort(msg string) {
	Log(LogError, msg)
	panic(msg)
}

// headerKind and bodyKind are the ABI's enums for which message part a
// header or body call addresses.
const (
	kindRequest          = 0
	kindResponse         = 1
	kindRequestTrailers  = 2
	kindResponseTrailers = 3
)

// Request is the HTTP request being handled. It holds no state: every
// method asks the host, so edits made by one call are seen by the next.
type Request struct{}

// Method returns the request method, e.g. "GET".
func (Request) Method() string { return string(hostbuf.Get("get_method", hostGetMethod)) }

// SetMethod replaces the request method. Hosts refuse what is not an HTTP
// token.
func (Request) SetMethod(method string) { hostSetMethod(method) }

// URI returns the request target in origin form, path and query,
// percent-encoded as sent, e.g. "/v1/messages?beta=true". In sandgate it is
// the path on the upstream host (the /https/<host> prefix of a base-URL
// route is not part of it).
func (Request) URI() string { return string(hostbuf.Get("get_uri", hostGetURI)) }

// SetURI replaces the path and query. uri must be percent-encoded and
// start with "/"; the host cannot be changed this way.
func (Request) SetURI(uri string) { hostSetURI(uri) }

// ProtocolVersion returns the request's protocol, e.g. "HTTP/1.1".
func (Request) ProtocolVersion() string {
	return string(hostbuf.Get("get_protocol_version", hostGetProtocolVersion))
}

// SourceAddr returns the client's address, e.g. "127.0.0.1:50312".
func (Request) SourceAddr() string {
	return string(hostbuf.Get("get_source_addr", hostGetSourceAddr))
}

// Header returns the request's headers.
func (Request) Header() Header { return Header{kind: kindRequest} }

// Trailers returns the request's trailers; they need [FeatureTrailers].
func (Request) Trailers() Header { return Header{kind: kindRequestTrailers} }

// Body returns the request body. Reading it needs [FeatureBufferRequest]
// if the upstream is to receive it too; writing replaces it.
func (Request) Body() Body { return Body{kind: kindRequest} }

// Response is the HTTP response: in a RequestHandler, the one the module
// may write itself (returning next=false); in a ResponseHandler, the one
// the upstream sent. Like Request, it holds no state.
type Response struct{}

// StatusCode returns the response status. Hosts answer 200 before any
// status was set.
func (Response) StatusCode() int { return int(hostGetStatusCode()) }

// SetStatusCode sets the response status. In a ResponseHandler it needs
// [FeatureBufferResponse].
func (Response) SetStatusCode(code int) { hostSetStatusCode(uint32(code)) }

// Header returns the response's headers.
func (Response) Header() Header { return Header{kind: kindResponse} }

// Trailers returns the response's trailers; they need [FeatureTrailers].
func (Response) Trailers() Header { return Header{kind: kindResponseTrailers} }

// Body returns the response body: written in a RequestHandler to answer
// directly, read or replaced in a ResponseHandler with
// [FeatureBufferResponse].
func (Response) Body() Body { return Body{kind: kindResponse} }

// Header is one set of header fields of the message: request or response
// headers or trailers. Names are case-insensitive; the host returns them
// in lowercase.
type Header struct {
	kind uint32
}

// Names returns the names of the fields present, lowercase, each once.
func (h Header) Names() []string {
	return hostbuf.GetList("get_header_names", func(buf unsafe.Pointer, limit uint32) uint64 {
		return hostGetHeaderNames(h.kind, buf, limit)
	})
}

// Values returns every value of the named field, in order, or nil if it
// is absent.
func (h Header) Values(name string) []string {
	return hostbuf.GetList("get_header_values", func(buf unsafe.Pointer, limit uint32) uint64 {
		return hostGetHeaderValues(h.kind, name, buf, limit)
	})
}

// Get returns the first value of the named field, or "" if it is absent
// (use Has to tell an absent field from an empty one).
func (h Header) Get(name string) string {
	if v := h.Values(name); len(v) > 0 {
		return v[0]
	}
	return ""
}

// Has reports whether the named field is present, without copying its
// values.
func (h Header) Has(name string) bool { return hostGetHeaderValues(h.kind, name, nil, 0) != 0 }

// Set replaces every value of the named field with value.
func (h Header) Set(name, value string) { hostSetHeaderValue(h.kind, name, value) }

// Add appends value to the named field.
func (h Header) Add(name, value string) { hostAddHeaderValue(h.kind, name, value) }

// Del removes the named field and all its values.
func (h Header) Del(name string) { hostRemoveHeader(h.kind, name) }

// Body is a request or response body. Reads and writes stream: each Read
// continues where the last stopped, and the first Write of a handler call
// replaces the body, later ones append.
type Body struct {
	kind uint32
}

var (
	_ io.Reader       = Body{}
	_ io.Writer       = Body{}
	_ io.StringWriter = Body{}
)

// Read reads the next bytes of the body into p, returning io.EOF (possibly
// with the last bytes) at its end. Use io.ReadAll for the whole body.
func (b Body) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil // a zero buf_limit is a host trap in the ABI
	}
	eofLen := hostReadBody(b.kind, hostbuf.Ptr(p), uint32(len(p)))
	n := int(uint32(eofLen))
	if eofLen>>32 != 0 {
		return n, io.EOF
	}
	return n, nil
}

// Write appends p to the body being written; it never fails short (a host
// that cannot take the bytes traps).
func (b Body) Write(p []byte) (int, error) {
	hostWriteBody(b.kind, hostbuf.Ptr(p), uint32(len(p)))
	return len(p), nil
}

// WriteString is Write for a string, without copying it.
func (b Body) WriteString(s string) (int, error) {
	hostWriteBody(b.kind, unsafe.Pointer(unsafe.StringData(s)), uint32(len(s)))
	return len(s), nil
}
