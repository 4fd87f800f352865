package wasm

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/textproto"
	"slices"
	"strings"

	"github.com/tetratelabs/wazero/api"
)

// The host modules.
const (
	moduleHTTPHandler = "http_handler"
	moduleSandgate    = "sandgate"
)

// The ABI's header_kind and body_kind values.
const (
	kindRequest          = 0
	kindResponse         = 1
	kindRequestTrailers  = 2
	kindResponseTrailers = 3
)

type phase int

const (
	phaseStart    phase = iota // _initialize: no request yet
	phaseRequest               // handle_request
	phaseResponse              // handle_response: after the next handler
)

// callState is what the host functions of one guest call work on; it
// travels in the call's context.
type callState struct {
	m        *Module
	inst     *instance
	x        *Exchange // nil while the instance starts
	phase    phase
	features Features
	// frozen is set for the is_error=1 call made when the response will
	// not be sent as is: response writes are ignored.
	frozen bool

	reqReader  *bytes.Reader // this call's position in the request body
	respReader *bytes.Reader // and in the response body
	reqWrote   bool          // write_body(request) was called in this call
	respWrote  bool

	// violation is the first thing the module wrote that the proxy cannot
	// send; the write was ignored and the request fails after the call.
	violation string

	refused      bool
	refuseStatus int
	reason       string

	// startErrors are the messages the guest logged at error level while
	// it started, held back rather than logged: if the start then fails,
	// the last one is why (guest.Abort logs its message, then panics) and
	// becomes the load error, said once; if it succeeds, they are logged.
	startErrors []string
}

// maxStartErrors bounds the error messages held while a guest starts.
const maxStartErrors = 8

type stateKey struct{}

func state(ctx context.Context) *callState {
	st, _ := ctx.Value(stateKey{}).(*callState)
	if st == nil {
		trap("host function called outside a call from sandgate") // cannot happen: every call sets it
	}
	return st
}

func (st *callState) violate(msg string) {
	if st.violation == "" {
		st.violation = msg
	}
}

// needRequest traps a function that only makes sense during a request.
func (st *callState) needRequest(fn string) {
	if st.phase == phaseStart {
		trap("%s called while the module starts; call it from handle_request or handle_response", fn)
	}
}

// beforeNext traps a request write after the next handler, as the ABI says.
func (st *callState) beforeNext(fn string) {
	st.needRequest(fn)
	if st.phase == phaseResponse {
		trap("%s called in handle_response: the request was already sent", fn)
	}
}

// responseWritable reports whether a response write takes effect, and traps
// one that needs buffer_response after the next handler.
func (st *callState) responseWritable(fn string, needBuffer bool) bool {
	st.needRequest(fn)
	if st.phase == phaseResponse && needBuffer && !st.features.Has(FeatureBufferResponse) {
		trap("%s called in handle_response without feature buffer_response (2); call enable_features(2) first", fn)
	}
	return !st.frozen
}

// Memory access. The ABI says a host traps when a guest's memory range is
// out of bounds.

func mem(mod api.Module, off, n uint32, what string) []byte {
	if n == 0 {
		return nil
	}
	b, ok := mod.Memory().Read(off, n)
	if !ok {
		trap("%s: memory range [%d, %d+%d) is out of bounds", what, off, off, n)
	}
	return b
}

func str(mod api.Module, off, n uint32, what string) string { return string(mem(mod, off, n, what)) }

// writeIfFits writes v at buf when it fits in limit, and returns its
// length either way (the ABI's buf_limit convention).
func writeIfFits(mod api.Module, buf, limit uint32, v string, what string) uint32 {
	n := uint32(len(v))
	if n == 0 || n > limit {
		return n
	}
	if !mod.Memory().WriteString(buf, v) {
		trap("%s: memory range [%d, %d+%d) is out of bounds", what, buf, buf, n)
	}
	return n
}

// writeNULTerminated writes vs as NUL-terminated strings when they fit in
// limit, and returns count<<32 | len either way (the ABI's count_len).
func writeNULTerminated(mod api.Module, buf, limit uint32, vs []string, what string) uint64 {
	n := 0
	for _, v := range vs {
		n += len(v) + 1
	}
	if len(vs) == 0 {
		return 0
	}
	if uint64(n) <= uint64(limit) {
		b, ok := mod.Memory().Read(buf, uint32(n))
		if !ok {
			trap("%s: memory range [%d, %d+%d) is out of bounds", what, buf, buf, n)
		}
		i := 0
		for _, v := range vs {
			i += copy(b[i:], v)
			b[i] = 0
			i++
		}
	}
	return uint64(len(vs))<<32 | uint64(uint32(n))
}

// hostFunc describes one host function for the builder.
type hostFunc struct {
	name    string
	fn      api.GoModuleFunc
	params  []api.ValueType
	results []api.ValueType
	names   []string
}

const (
	i32 = api.ValueTypeI32
	i64 = api.ValueTypeI64
)

func (r *Runtime) instantiateHost(ctx context.Context) error {
	h := &hostFuncs{rt: r}
	for mod, funcs := range map[string][]hostFunc{
		moduleHTTPHandler: {
			{"enable_features", h.enableFeatures, []api.ValueType{i32}, []api.ValueType{i32}, []string{"features"}},
			{"get_config", h.getConfig, []api.ValueType{i32, i32}, []api.ValueType{i32}, []string{"buf", "buf_limit"}},
			{"log", h.log, []api.ValueType{i32, i32, i32}, nil, []string{"level", "message", "message_len"}},
			{"log_enabled", h.logEnabled, []api.ValueType{i32}, []api.ValueType{i32}, []string{"level"}},
			{"get_method", h.getMethod, []api.ValueType{i32, i32}, []api.ValueType{i32}, []string{"buf", "buf_limit"}},
			{"set_method", h.setMethod, []api.ValueType{i32, i32}, nil, []string{"method", "method_len"}},
			{"get_uri", h.getURI, []api.ValueType{i32, i32}, []api.ValueType{i32}, []string{"buf", "buf_limit"}},
			{"set_uri", h.setURI, []api.ValueType{i32, i32}, nil, []string{"uri", "uri_len"}},
			{"get_protocol_version", h.getProtocolVersion, []api.ValueType{i32, i32}, []api.ValueType{i32}, []string{"buf", "buf_limit"}},
			{"get_header_names", h.getHeaderNames, []api.ValueType{i32, i32, i32}, []api.ValueType{i64}, []string{"kind", "buf", "buf_limit"}},
			{"get_header_values", h.getHeaderValues, []api.ValueType{i32, i32, i32, i32, i32}, []api.ValueType{i64}, []string{"kind", "name", "name_len", "buf", "buf_limit"}},
			{"set_header_value", h.setHeaderValue, []api.ValueType{i32, i32, i32, i32, i32}, nil, []string{"kind", "name", "name_len", "value", "value_len"}},
			{"add_header_value", h.addHeaderValue, []api.ValueType{i32, i32, i32, i32, i32}, nil, []string{"kind", "name", "name_len", "value", "value_len"}},
			{"remove_header", h.removeHeader, []api.ValueType{i32, i32, i32}, nil, []string{"kind", "name", "name_len"}},
			{"read_body", h.readBody, []api.ValueType{i32, i32, i32}, []api.ValueType{i64}, []string{"kind", "buf", "buf_limit"}},
			{"write_body", h.writeBody, []api.ValueType{i32, i32, i32}, nil, []string{"kind", "body", "body_len"}},
			{"get_status_code", h.getStatusCode, nil, []api.ValueType{i32}, nil},
			{"set_status_code", h.setStatusCode, []api.ValueType{i32}, nil, []string{"status_code"}},
			{"get_source_addr", h.getSourceAddr, []api.ValueType{i32, i32}, []api.ValueType{i32}, []string{"buf", "buf_limit"}},
		},
		moduleSandgate: {
			{"sandbox_id", h.sandboxID, []api.ValueType{i32, i32}, []api.ValueType{i32}, []string{"buf", "buf_limit"}},
			{"audit_note", h.auditNote, []api.ValueType{i32, i32}, nil, []string{"ptr", "len"}},
			{"refuse", h.refuse, []api.ValueType{i32, i32, i32}, nil, []string{"status", "reason_ptr", "reason_len"}},
		},
		// Called only by the checks bound adds to a guest's code.
		boundModule: {
			{boundYield, yield, nil, nil, nil},
		},
	} {
		b := r.wr.NewHostModuleBuilder(mod)
		for _, f := range funcs {
			b.NewFunctionBuilder().WithGoModuleFunction(f.fn, f.params, f.results).WithParameterNames(f.names...).Export(f.name)
		}
		if _, err := b.Instantiate(ctx); err != nil {
			return fmt.Errorf("wasm: instantiating host module %s: %w", mod, err)
		}
	}
	return nil
}

// hostFuncs implements the host modules' functions.
type hostFuncs struct{ rt *Runtime }

func (h *hostFuncs) enableFeatures(ctx context.Context, _ api.Module, stack []uint64) {
	st := state(ctx)
	f := Features(uint32(stack[0])) & supportedFeatures
	if st.phase == phaseStart {
		st.inst.features |= f
		stack[0] = uint64(st.inst.features)
		return
	}
	st.features |= f // for this request only, as the ABI says
	stack[0] = uint64(st.features)
}

func (h *hostFuncs) getConfig(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	stack[0] = uint64(writeIfFits(mod, uint32(stack[0]), uint32(stack[1]), string(st.m.config), "get_config"))
}

// slogLevel maps the ABI's log levels (-1 debug … 3 none).
func slogLevel(l int32) (slog.Level, bool) {
	switch {
	case l <= -1:
		return slog.LevelDebug, true
	case l == 0:
		return slog.LevelInfo, true
	case l == 1:
		return slog.LevelWarn, true
	case l == 2:
		return slog.LevelError, true
	}
	return 0, false
}

func (h *hostFuncs) log(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	level, ok := slogLevel(int32(uint32(stack[0])))
	if ok && level >= slog.LevelError && st.phase == phaseStart {
		msg := mem(mod, uint32(stack[1]), min(uint32(stack[2]), maxLogLen), "log")
		if len(st.startErrors) == maxStartErrors {
			st.startErrors = st.startErrors[1:]
		}
		st.startErrors = append(st.startErrors, strings.ToValidUTF8(string(msg), "?"))
		return
	}
	if !ok || !h.rt.cfg.Logger.Enabled(ctx, level) {
		return
	}
	msg := mem(mod, uint32(stack[1]), min(uint32(stack[2]), maxLogLen), "log")
	attrs := []slog.Attr{slog.String("module", st.m.name)}
	if st.x != nil {
		attrs = append(attrs, slog.String("sandbox", st.x.info.Sandbox))
	}
	h.rt.cfg.Logger.LogAttrs(context.Background(), level, strings.ToValidUTF8(string(msg), "?"), attrs...)
}

func (h *hostFuncs) logEnabled(ctx context.Context, _ api.Module, stack []uint64) {
	level, ok := slogLevel(int32(uint32(stack[0])))
	stack[0] = 0
	if ok && h.rt.cfg.Logger.Enabled(ctx, level) {
		stack[0] = 1
	}
}

func (h *hostFuncs) getMethod(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	st.needRequest("get_method")
	stack[0] = uint64(writeIfFits(mod, uint32(stack[0]), uint32(stack[1]), st.x.req.Method, "get_method"))
}

func (h *hostFuncs) setMethod(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	st.beforeNext("set_method")
	m := str(mod, uint32(stack[0]), uint32(stack[1]), "set_method")
	if v := checkMethod(m); v != "" {
		st.violate(v)
		return
	}
	st.x.req.Method = m
}

func (h *hostFuncs) getURI(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	st.needRequest("get_uri")
	stack[0] = uint64(writeIfFits(mod, uint32(stack[0]), uint32(stack[1]), st.x.req.URL.RequestURI(), "get_uri"))
}

func (h *hostFuncs) setURI(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	st.beforeNext("set_uri")
	u, v := parseURI(str(mod, uint32(stack[0]), uint32(stack[1]), "set_uri"))
	if v != "" {
		st.violate(v)
		return
	}
	out := st.x.req.URL
	out.Path, out.RawPath, out.RawQuery, out.ForceQuery = u.Path, u.RawPath, u.RawQuery, u.ForceQuery
}

func (h *hostFuncs) getProtocolVersion(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	st.needRequest("get_protocol_version")
	p := st.x.info.Proto
	if p == "" {
		p = "HTTP/1.1"
	}
	stack[0] = uint64(writeIfFits(mod, uint32(stack[0]), uint32(stack[1]), p, "get_protocol_version"))
}

func (h *hostFuncs) getSourceAddr(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	st.needRequest("get_source_addr")
	stack[0] = uint64(writeIfFits(mod, uint32(stack[0]), uint32(stack[1]), st.x.info.SourceAddr, "get_source_addr"))
}

// headers returns the header map of kind, or nil for trailers (not
// supported: empty on read, a trap on write).
func (st *callState) headers(kind uint32, fn string) http.Header {
	st.needRequest(fn)
	switch kind {
	case kindRequest:
		if st.phase == phaseResponse && st.x.sent != nil {
			return st.x.sent
		}
		return st.x.req.Header
	case kindResponse:
		return st.x.header
	case kindRequestTrailers, kindResponseTrailers:
		return nil
	}
	trap("%s: unknown header kind %d", fn, kind)
	return nil
}

func (h *hostFuncs) getHeaderNames(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	kind := uint32(stack[0])
	hdr := st.headers(kind, "get_header_names")
	names := make([]string, 0, len(hdr)+1)
	for k, vs := range hdr {
		if len(vs) > 0 {
			names = append(names, strings.ToLower(k))
		}
	}
	if kind == kindRequest && st.x.req.Host != "" && hdr.Get("Host") == "" {
		names = append(names, "host")
	}
	slices.Sort(names)
	names = slices.Compact(names)
	stack[0] = writeNULTerminated(mod, uint32(stack[1]), uint32(stack[2]), names, "get_header_names")
}

// values returns the values of name in hdr, case-insensitively.
func values(hdr http.Header, name string) []string {
	if vs, ok := hdr[textproto.CanonicalMIMEHeaderKey(name)]; ok {
		return vs
	}
	var out []string
	for k, vs := range hdr {
		if strings.EqualFold(k, name) {
			out = append(out, vs...)
		}
	}
	return out
}

func (h *hostFuncs) getHeaderValues(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	kind := uint32(stack[0])
	hdr := st.headers(kind, "get_header_values")
	name := str(mod, uint32(stack[1]), uint32(stack[2]), "get_header_values")
	if name == "" {
		trap("get_header_values: empty header name")
	}
	vs := values(hdr, name)
	if kind == kindRequest && strings.EqualFold(name, "host") && len(vs) == 0 && st.x.req.Host != "" {
		vs = []string{st.x.req.Host}
	}
	stack[0] = writeNULTerminated(mod, uint32(stack[3]), uint32(stack[4]), vs, "get_header_values")
}

// headerWrite validates a header write and returns the map to write to, or
// nil when the write must be ignored.
func (st *callState) headerWrite(kind uint32, fn, name string, value *string) http.Header {
	hdr := st.headers(kind, fn)
	if hdr == nil {
		trap("%s: trailers are not supported by this host (feature 4 is never enabled)", fn)
	}
	if name == "" {
		trap("%s: empty header name", fn)
	}
	if kind == kindRequest {
		st.beforeNext(fn)
	} else if !st.responseWritable(fn, false) {
		return nil
	}
	if v := checkHeaderName(name); v != "" {
		st.violate(v)
		return nil
	}
	if value != nil {
		if v := checkHeaderValue(name, *value); v != "" {
			st.violate(v)
			return nil
		}
	}
	return hdr
}

func (h *hostFuncs) setHeaderValue(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	name := str(mod, uint32(stack[1]), uint32(stack[2]), "set_header_value")
	value := str(mod, uint32(stack[3]), uint32(stack[4]), "set_header_value")
	if hdr := st.headerWrite(uint32(stack[0]), "set_header_value", name, &value); hdr != nil {
		removeAll(hdr, name)
		hdr[textproto.CanonicalMIMEHeaderKey(name)] = []string{value}
	}
}

func (h *hostFuncs) addHeaderValue(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	name := str(mod, uint32(stack[1]), uint32(stack[2]), "add_header_value")
	value := str(mod, uint32(stack[3]), uint32(stack[4]), "add_header_value")
	hdr := st.headerWrite(uint32(stack[0]), "add_header_value", name, &value)
	if hdr == nil {
		return
	}
	n := 0
	for _, vs := range hdr {
		n += len(vs)
	}
	if n >= maxHeaderFields {
		st.violate(fmt.Sprintf("wrote more than %d header fields", maxHeaderFields))
		return
	}
	k := textproto.CanonicalMIMEHeaderKey(name)
	// Never append in place: the slice may be shared with the request the
	// sandbox sent.
	hdr[k] = append(slices.Clip(hdr[k]), value)
}

func (h *hostFuncs) removeHeader(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	name := str(mod, uint32(stack[1]), uint32(stack[2]), "remove_header")
	if hdr := st.headerWrite(uint32(stack[0]), "remove_header", name, nil); hdr != nil {
		removeAll(hdr, name)
	}
}

func removeAll(hdr http.Header, name string) {
	delete(hdr, textproto.CanonicalMIMEHeaderKey(name))
	for k := range hdr {
		if strings.EqualFold(k, name) {
			delete(hdr, k)
		}
	}
}

func (h *hostFuncs) readBody(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	kind, buf, limit := uint32(stack[0]), uint32(stack[1]), uint32(stack[2])
	st.needRequest("read_body")
	if limit == 0 {
		trap("read_body: buf_limit is 0")
	}
	var r **bytes.Reader
	var body []byte
	switch kind {
	case kindRequest:
		if !st.features.Has(FeatureBufferRequest) {
			trap("read_body(request) without feature buffer_request (1): reading would take the body from the upstream; call enable_features(1) first")
		}
		if !st.x.reqBuffered && !st.x.reqReplaced {
			if err := st.x.bufferRequest(st.m); err != nil {
				panic(err)
			}
		}
		r, body = &st.reqReader, st.x.reqBody
	case kindResponse:
		if st.phase == phaseResponse {
			if !st.features.Has(FeatureBufferResponse) {
				trap("read_body(response) in handle_response without feature buffer_response (2); call enable_features(2) first")
			}
			if !st.x.bodyBuffered && !st.x.bodyReplaced {
				if err := st.x.bufferResponse(st.m); err != nil {
					panic(err)
				}
			}
		}
		r, body = &st.respReader, st.x.body
	default:
		trap("read_body: unknown body kind %d", kind)
	}
	if *r == nil {
		*r = bytes.NewReader(body)
	}
	dst := mem(mod, buf, limit, "read_body")
	n, _ := (*r).Read(dst)
	var eof uint64
	if (*r).Len() == 0 {
		eof = 1
	}
	stack[0] = eof<<32 | uint64(uint32(n))
}

func (h *hostFuncs) writeBody(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	kind := uint32(stack[0])
	b := mem(mod, uint32(stack[1]), uint32(stack[2]), "write_body")
	limit := st.m.rt.cfg.MaxBodyBytes
	switch kind {
	case kindRequest:
		st.beforeNext("write_body(request)")
		if !st.reqWrote { // the first write in a call replaces the body
			st.reqWrote, st.x.reqReplaced, st.x.reqBody = true, true, nil
		}
		if len(st.x.reqBody)+len(b) > limit {
			st.violate(fmt.Sprintf("wrote a request body over %d bytes", limit))
			return
		}
		st.x.reqBody = append(st.x.reqBody, b...)
	case kindResponse:
		if !st.responseWritable("write_body(response)", true) {
			return
		}
		if !st.respWrote {
			st.respWrote, st.x.bodyReplaced, st.x.body = true, true, nil
		}
		if len(st.x.body)+len(b) > limit {
			st.violate(fmt.Sprintf("wrote a response body over %d bytes", limit))
			return
		}
		st.x.body = append(st.x.body, b...)
	default:
		trap("write_body: unknown body kind %d", kind)
	}
}

func (h *hostFuncs) getStatusCode(ctx context.Context, _ api.Module, stack []uint64) {
	st := state(ctx)
	st.needRequest("get_status_code")
	stack[0] = uint64(uint32(st.x.status))
}

func (h *hostFuncs) setStatusCode(ctx context.Context, _ api.Module, stack []uint64) {
	st := state(ctx)
	code := uint32(stack[0])
	if !st.responseWritable("set_status_code", true) {
		return
	}
	if code < 200 || code > 599 {
		st.violate(fmt.Sprintf("set status code %d; the proxy sends 200 to 599", code))
		return
	}
	st.x.status = int(code)
}

func (h *hostFuncs) sandboxID(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	id := ""
	if st.x != nil {
		id = st.x.info.Sandbox
	}
	stack[0] = uint64(writeIfFits(mod, uint32(stack[0]), uint32(stack[1]), id, "sandbox_id"))
}

func (h *hostFuncs) auditNote(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	n := uint32(stack[1])
	if st.x == nil {
		return // no request to note on while starting
	}
	if int(n) > st.m.rt.cfg.MaxNoteBytes {
		mem(mod, uint32(stack[0]), n, "audit_note") // still an ABI check
		st.x.dropped++
		return
	}
	st.x.addNote(st.m, mem(mod, uint32(stack[0]), n, "audit_note"))
}

func (h *hostFuncs) refuse(ctx context.Context, mod api.Module, stack []uint64) {
	st := state(ctx)
	st.needRequest("refuse")
	status := int(uint32(stack[0]))
	reason := mem(mod, uint32(stack[1]), uint32(stack[2]), "refuse")
	if st.phase != phaseRequest {
		trap("refuse called in handle_response: the request was already sent")
	}
	if st.refused {
		return // the first refusal stands
	}
	if status < 400 || status > 599 {
		status = http.StatusForbidden
	}
	if len(reason) > maxReasonLen {
		reason = reason[:maxReasonLen]
	}
	st.refused, st.refuseStatus, st.reason = true, status, strings.ToValidUTF8(string(reason), "?")
}
