package wasm

// A tiny WebAssembly binary encoder for hand-written failure cases (wazero
// cannot assemble the text format). Only what the tests need: function
// types, function imports, functions, one memory, exports.

const (
	tI32 = 0x7f
	tI64 = 0x7e
)

type wfunc struct {
	typ  int
	body []byte // instructions, without locals and the final end
}

type wmodule struct {
	types   [][2][]byte // params, results
	imports [][3]any    // module, name, type index
	funcs   []wfunc
	memory  int      // pages; -1 for none
	exports [][3]any // name, kind (0 func, 2 memory), index
}

func uleb(n uint64) []byte {
	var b []byte
	for {
		c := byte(n & 0x7f)
		n >>= 7
		if n != 0 {
			b = append(b, c|0x80)
			continue
		}
		return append(b, c)
	}
}

func wname(s string) []byte { return append(uleb(uint64(len(s))), s...) }

func vec(items ...[]byte) []byte {
	b := uleb(uint64(len(items)))
	for _, it := range items {
		b = append(b, it...)
	}
	return b
}

func section(id byte, content []byte) []byte {
	return append(append([]byte{id}, uleb(uint64(len(content)))...), content...)
}

func (m wmodule) bytes() []byte {
	out := []byte("\x00asm\x01\x00\x00\x00")
	var types [][]byte
	for _, t := range m.types {
		types = append(types, append(append([]byte{0x60}, append(uleb(uint64(len(t[0]))), t[0]...)...), append(uleb(uint64(len(t[1]))), t[1]...)...))
	}
	out = append(out, section(1, vec(types...))...)
	if len(m.imports) > 0 {
		var imps [][]byte
		for _, im := range m.imports {
			imps = append(imps, append(append(wname(im[0].(string)), wname(im[1].(string))...), append([]byte{0}, uleb(uint64(im[2].(int)))...)...))
		}
		out = append(out, section(2, vec(imps...))...)
	}
	var fidx, codes [][]byte
	for _, f := range m.funcs {
		fidx = append(fidx, uleb(uint64(f.typ)))
		body := append(append([]byte{0}, f.body...), 0x0b) // no locals
		codes = append(codes, append(uleb(uint64(len(body))), body...))
	}
	out = append(out, section(3, vec(fidx...))...)
	if m.memory >= 0 {
		out = append(out, section(5, vec(append([]byte{0}, uleb(uint64(m.memory))...)))...)
	}
	var exps [][]byte
	for _, e := range m.exports {
		exps = append(exps, append(wname(e[0].(string)), append([]byte{byte(e[1].(int))}, uleb(uint64(e[2].(int)))...)...))
	}
	out = append(out, section(7, vec(exps...))...)
	out = append(out, section(10, vec(codes...))...)
	return out
}

// Instructions used below.
var (
	opUnreachable = []byte{0x00}
	opLoopForever = []byte{0x03, 0x40, 0x0c, 0x00, 0x0b} // loop br 0 end
	opI64Const1   = []byte{0x42, 0x01}
	opI64Const0   = []byte{0x42, 0x00}
)

// handler returns a module exporting memory and handle_request with body.
func handler(body ...byte) wmodule {
	return wmodule{
		types:   [][2][]byte{{nil, {tI64}}, {{tI32, tI32}, nil}},
		funcs:   []wfunc{{0, body}, {1, nil}},
		memory:  1,
		exports: [][3]any{{"memory", 2, 0}, {"handle_request", 0, 0}, {"handle_response", 0, 1}},
	}
}

func cat(bs ...[]byte) []byte {
	var out []byte
	for _, b := range bs {
		out = append(out, b...)
	}
	return out
}
