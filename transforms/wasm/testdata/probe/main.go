// Command probe is a test guest for sandgate's http-wasm host, written
// against the raw ABI (no guest library). Its config is a script, one
// command a line: "PHASE CMD ARGS…" where PHASE is init, req or resp and each
// argument is %-escaped (url.PathUnescape). What a command observes is
// reported as an audit note, so tests read the host's answers from the
// audit event.
package main

import (
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"unsafe"
)

//go:wasmimport http_handler enable_features
func enableFeatures(f uint32) uint32

//go:wasmimport http_handler get_config
func getConfig(buf, limit uint32) uint32

//go:wasmimport http_handler log
func logMsg(level int32, msg, n uint32)

//go:wasmimport http_handler log_enabled
func logEnabled(level int32) uint32

//go:wasmimport http_handler get_method
func getMethod(buf, limit uint32) uint32

//go:wasmimport http_handler set_method
func setMethod(p, n uint32)

//go:wasmimport http_handler get_uri
func getURI(buf, limit uint32) uint32

//go:wasmimport http_handler set_uri
func setURI(p, n uint32)

//go:wasmimport http_handler get_protocol_version
func getProtocolVersion(buf, limit uint32) uint32

//go:wasmimport http_handler get_source_addr
func getSourceAddr(buf, limit uint32) uint32

//go:wasmimport http_handler get_header_names
func getHeaderNames(kind, buf, limit uint32) uint64

//go:wasmimport http_handler get_header_values
func getHeaderValues(kind, name, nameLen, buf, limit uint32) uint64

//go:wasmimport http_handler set_header_value
func setHeaderValue(kind, name, nameLen, value, valueLen uint32)

//go:wasmimport http_handler add_header_value
func addHeaderValue(kind, name, nameLen, value, valueLen uint32)

//go:wasmimport http_handler remove_header
func removeHeader(kind, name, nameLen uint32)

//go:wasmimport http_handler read_body
func readBody(kind, buf, limit uint32) uint64

//go:wasmimport http_handler write_body
func writeBody(kind, p, n uint32)

//go:wasmimport http_handler get_status_code
func getStatusCode() uint32

//go:wasmimport http_handler set_status_code
func setStatusCode(code uint32)

//go:wasmimport sandgate sandbox_id
func sandboxID(buf, limit uint32) uint32

//go:wasmimport sandgate audit_note
func auditNote(p, n uint32)

//go:wasmimport sandgate refuse
func refuse(status, p, n uint32)

func ptr(b []byte) uint32 {
	if len(b) == 0 {
		return 0
	}
	return uint32(uintptr(unsafe.Pointer(&b[0])))
}

// The garbage collector does not move heap objects, so a pointer handed to
// the host stays valid while the slice is referenced.
var keep [][]byte

func note(format string, args ...any) {
	b := []byte(fmt.Sprintf(format, args...))
	auditNote(ptr(b), uint32(len(b)))
}

func arg(a []string, i int) string {
	if i >= len(a) {
		return ""
	}
	s, err := url.PathUnescape(a[i])
	if err != nil {
		return a[i]
	}
	return s
}

func num(a []string, i int) uint32 {
	n, _ := strconv.ParseInt(arg(a, i), 10, 64)
	return uint32(n)
}

var (
	script = map[string][][]string{}
	calls  int
	next   int64 = 1
	reqCtx int64
	hog    [][]byte
)

// probeBuf calls get with a buffer of limit bytes prefilled with 0xAA and
// reports the result and whether the host left the buffer untouched.
func probeBuf(limit uint32, get func(buf, limit uint32) uint64) (uint64, []byte, bool) {
	buf := make([]byte, limit+1)
	for i := range buf {
		buf[i] = 0xAA
	}
	var p uint32
	if limit > 0 {
		p = ptr(buf)
	} else {
		p = ptr(buf) // a valid address; nothing may be written
	}
	r := get(p, limit)
	untouched := true
	for _, c := range buf {
		if c != 0xAA {
			untouched = false
		}
	}
	if buf[limit] != 0xAA {
		note("overrun")
	}
	return r, buf[:limit], untouched
}

func get32(f func(buf, limit uint32) uint32) func(uint32, uint32) uint64 {
	return func(b, l uint32) uint64 { return uint64(f(b, l)) }
}

func run(phase string) {
	for _, a := range script[phase] {
		do(a)
	}
}

func do(a []string) {
	switch a[0] {
	case "enable":
		note("features=%d", enableFeatures(num(a, 1)))
	case "names", "values":
		kind, limit := num(a, 1), num(a, 2)
		var r uint64
		var buf []byte
		var untouched bool
		if a[0] == "names" {
			r, buf, untouched = probeBuf(limit, func(b, l uint32) uint64 { return getHeaderNames(kind, b, l) })
		} else {
			name := []byte(arg(a, 3))
			keep = append(keep, name)
			r, buf, untouched = probeBuf(limit, func(b, l uint32) uint64 { return getHeaderValues(kind, ptr(name), uint32(len(name)), b, l) })
		}
		count, n := uint32(r>>32), uint32(r)
		shown := buf
		if n <= uint32(len(buf)) {
			shown = buf[:n]
		}
		note("%s count=%d len=%d untouched=%v buf=%q", a[0], count, n, untouched, shown)
	case "get":
		what, limit := arg(a, 1), num(a, 2)
		f := map[string]func(uint32, uint32) uint32{
			"method": getMethod, "uri": getURI, "proto": getProtocolVersion, "source": getSourceAddr,
			"config": getConfig, "sandbox": sandboxID,
		}[what]
		r, buf, untouched := probeBuf(limit, get32(f))
		shown := buf
		if uint32(r) <= limit {
			shown = buf[:r]
		}
		note("%s len=%d untouched=%v buf=%q", what, r, untouched, shown)
	case "set", "add":
		name, value := []byte(arg(a, 2)), []byte(arg(a, 3))
		keep = append(keep, name, value)
		if a[0] == "set" {
			setHeaderValue(num(a, 1), ptr(name), uint32(len(name)), ptr(value), uint32(len(value)))
		} else {
			addHeaderValue(num(a, 1), ptr(name), uint32(len(name)), ptr(value), uint32(len(value)))
		}
	case "remove":
		name := []byte(arg(a, 2))
		removeHeader(num(a, 1), ptr(name), uint32(len(name)))
	case "setmethod":
		m := []byte(arg(a, 1))
		setMethod(ptr(m), uint32(len(m)))
	case "seturi":
		u := []byte(arg(a, 1))
		setURI(ptr(u), uint32(len(u)))
	case "read1":
		kind, limit := num(a, 1), num(a, 2)
		buf := make([]byte, max(limit, 1))
		r := readBody(kind, ptr(buf), limit)
		note("read eof=%d len=%d buf=%q", r>>32, uint32(r), buf[:min(uint32(r), limit)])
	case "read":
		kind, limit := num(a, 1), num(a, 2)
		var body []byte
		buf := make([]byte, limit)
		reads := 0
		for reads < 1<<20 {
			r := readBody(kind, ptr(buf), limit)
			reads++
			body = append(body, buf[:uint32(r)]...)
			if r>>32 == 1 {
				break
			}
		}
		note("body=%q reads=%d", body, reads)
	case "write":
		b := []byte(arg(a, 2))
		writeBody(num(a, 1), ptr(b), uint32(len(b)))
	case "status":
		note("status=%d", getStatusCode())
	case "setstatus":
		setStatusCode(num(a, 1))
	case "refuse":
		r := []byte(arg(a, 2))
		refuse(num(a, 1), ptr(r), uint32(len(r)))
	case "note":
		note("%s", arg(a, 1))
	case "notes":
		n, size := int(num(a, 1)), int(num(a, 2))
		for i := 0; i < n; i++ {
			note("%0*d", size, i)
		}
	case "log":
		m := []byte(arg(a, 2))
		logMsg(int32(num(a, 1)), ptr(m), uint32(len(m)))
	case "logenabled":
		note("log_enabled(%d)=%d", int32(num(a, 1)), logEnabled(int32(num(a, 1))))
	case "copyheaders":
		r := getHeaderNames(0, 0, 0)
		buf := make([]byte, uint32(r))
		getHeaderNames(0, ptr(buf), uint32(len(buf)))
		for _, name := range strings.Split(strings.TrimSuffix(string(buf), "\x00"), "\x00") {
			nb := []byte(name)
			vr := getHeaderValues(0, ptr(nb), uint32(len(nb)), 0, 0)
			vb := make([]byte, uint32(vr))
			getHeaderValues(0, ptr(nb), uint32(len(nb)), ptr(vb), uint32(len(vb)))
			note("%s: %s", name, strings.ReplaceAll(strings.TrimSuffix(string(vb), "\x00"), "\x00", ", "))
		}
	case "next":
		next = int64(num(a, 1))
	case "ctx":
		reqCtx = int64(num(a, 1))
	case "calls":
		note("calls=%d", calls)
	case "panic":
		panic("probe was told to panic")
	case "loop":
		for {
			calls++
		}
	case "grow":
		hog = append(hog, make([]byte, int(num(a, 1))<<20))
		note("grew")
	case "exit":
		os.Exit(int(num(a, 1)))
	case "fuzz":
		fuzz()
	case "echo": // echo NAME: copy request header NAME into response header X-Echo-NAME
		name := []byte(arg(a, 1))
		r := getHeaderValues(0, ptr(name), uint32(len(name)), 0, 0)
		vb := make([]byte, uint32(r)+1)
		getHeaderValues(0, ptr(name), uint32(len(name)), ptr(vb), uint32(r))
		out, v := []byte("X-Echo-"+string(name)), []byte(strings.TrimSuffix(string(vb[:uint32(r)]), "\x00"))
		setHeaderValue(1, ptr(out), uint32(len(out)), ptr(v), uint32(len(v)))
	case "if": // if NAME CMD ARGS…: run CMD only when request header NAME is present
		name := []byte(arg(a, 1))
		if getHeaderValues(0, ptr(name), uint32(len(name)), 0, 0) != 0 {
			do(a[2:])
		}
	default:
		note("unknown command %q", a[0])
	}
}

// fuzz reads the request body and applies it as NUL-separated fields:
// method, URI, header name, header value, body.
func fuzz() {
	var body []byte
	buf := make([]byte, 4096)
	for i := 0; i < 1024; i++ {
		r := readBody(0, ptr(buf), uint32(len(buf)))
		body = append(body, buf[:uint32(r)]...)
		if r>>32 == 1 {
			break
		}
	}
	f := strings.SplitN(string(body), "\x00", 5)
	for len(f) < 5 {
		f = append(f, "")
	}
	bs := [][]byte{[]byte(f[0]), []byte(f[1]), []byte(f[2]), []byte(f[3]), []byte(f[4])}
	keep = append(keep, bs...)
	if len(bs[0]) > 0 {
		setMethod(ptr(bs[0]), uint32(len(bs[0])))
	}
	setURI(ptr(bs[1]), uint32(len(bs[1])))
	if len(bs[2]) > 0 {
		addHeaderValue(0, ptr(bs[2]), uint32(len(bs[2])), ptr(bs[3]), uint32(len(bs[3])))
	}
	writeBody(0, ptr(bs[4]), uint32(len(bs[4])))
}

func init() {
	n := getConfig(0, 0)
	cfg := make([]byte, n)
	if n > 0 {
		getConfig(ptr(cfg), n)
	}
	for _, line := range strings.Split(string(cfg), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		script[f[0]] = append(script[f[0]], f[1:])
	}
	run("init")
}

//go:wasmexport handle_request
func handleRequest() int64 {
	calls++
	keep = keep[:0]
	next, reqCtx = 1, 0
	run("req")
	return reqCtx<<32 | next
}

//go:wasmexport handle_response
func handleResponse(ctx, isError int32) {
	if len(script["resp"]) > 0 {
		note("reqctx=%d is_error=%d", ctx, isError)
	}
	run("resp")
}

func main() {}
