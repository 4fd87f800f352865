//go:build !wasip1

package guest_test

import (
	"errors"
	"fmt"
	"strings"
)

// readSections reads what the tests need of a module — its imports,
// function exports with their signatures, and whether it exports memory —
// straight from the binary's type, import, function and export sections.
// (Compiling a Go guest with wazero to read them took ten seconds under the
// race detector.)
func readSections(bin []byte) (module, error) {
	m := module{imports: map[string]string{}, exports: map[string]string{}}
	if len(bin) < 8 || string(bin[:4]) != "\x00asm" {
		return m, errors.New("not a wasm module")
	}
	r := &wreader{b: bin[8:]}
	var types []string
	var funcTypes []uint32 // type of each function, imported first
	type export struct {
		name string
		kind byte
		idx  uint32
	}
	var exports []export
	for !r.done() {
		id := r.byte()
		size := r.u32()
		sec := &wreader{b: r.take(int(size))}
		switch id {
		case 1: // type
			for n := sec.u32(); n > 0; n-- {
				if sec.byte() != 0x60 {
					return m, errors.New("type section: not a function type")
				}
				params, results := sec.valtypes(), sec.valtypes()
				types = append(types, fmt.Sprintf("(%s) %s", params, results))
			}
		case 2: // import
			for n := sec.u32(); n > 0; n-- {
				mod, name := sec.name(), sec.name()
				switch kind := sec.byte(); kind {
				case 0:
					t := sec.u32()
					funcTypes = append(funcTypes, t)
					if mod != "wasi_snapshot_preview1" && int(t) < len(types) {
						m.imports[mod+"."+name] = types[t]
					}
				case 1: // table: reftype, limits
					sec.byte()
					sec.limits()
				case 2: // memory: limits
					sec.limits()
				case 3: // global: valtype, mutability
					sec.byte()
					sec.byte()
				default:
					return m, fmt.Errorf("import of kind %d", kind)
				}
			}
		case 3: // function
			for n := sec.u32(); n > 0; n-- {
				funcTypes = append(funcTypes, sec.u32())
			}
		case 7: // export
			for n := sec.u32(); n > 0; n-- {
				exports = append(exports, export{name: sec.name(), kind: sec.byte(), idx: sec.u32()})
			}
		}
		if sec.err != nil {
			return m, fmt.Errorf("section %d: %w", id, sec.err)
		}
	}
	for _, e := range exports {
		switch {
		case e.kind == 0 && int(e.idx) < len(funcTypes) && int(funcTypes[e.idx]) < len(types):
			m.exports[e.name] = types[funcTypes[e.idx]]
		case e.kind == 2 && e.name == "memory":
			m.memory = true
		}
	}
	return m, r.err
}

// wreader reads the wasm binary encoding.
type wreader struct {
	b   []byte
	err error
}

func (r *wreader) done() bool { return len(r.b) == 0 || r.err != nil }

func (r *wreader) fail(what string) {
	if r.err == nil {
		r.err = errors.New("truncated " + what)
	}
	r.b = nil
}

func (r *wreader) byte() byte {
	if len(r.b) == 0 {
		r.fail("byte")
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *wreader) u32() uint32 {
	var v uint32
	for shift := 0; shift < 35; shift += 7 {
		c := r.byte()
		v |= uint32(c&0x7f) << shift
		if c&0x80 == 0 {
			return v
		}
	}
	r.fail("LEB128")
	return 0
}

func (r *wreader) take(n int) []byte {
	if n > len(r.b) {
		r.fail("section")
		return nil
	}
	p := r.b[:n]
	r.b = r.b[n:]
	return p
}

func (r *wreader) name() string { return string(r.take(int(r.u32()))) }

func (r *wreader) limits() {
	flags := r.byte()
	r.u32() // min
	if flags&1 != 0 {
		r.u32() // max
	}
}

// valtypes reads a vector of value types as wazero names them.
func (r *wreader) valtypes() string {
	names := map[byte]string{0x7f: "i32", 0x7e: "i64", 0x7d: "f32", 0x7c: "f64", 0x7b: "v128", 0x70: "funcref", 0x6f: "externref"}
	var out []string
	for n := r.u32(); n > 0; n-- {
		out = append(out, names[r.byte()])
	}
	return strings.Join(out, ",")
}
