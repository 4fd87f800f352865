package wasm

import (
	"errors"
	"fmt"
	"strings"
)

// A guest's running time is bounded by checks this host adds to its code
// when it is loaded, not by wazero's WithCloseOnContextDone, which in
// v1.12.0 starts a goroutine for every call and leaves the guest's code for
// Go at every loop back-edge (README.md, "Cost").
//
// bound rewrites a module so that, at the entry of every function and at
// the head of every loop, the guest
//
//   - counts in a global of its own ($tick), and
//   - reads a global of its own ($stop), which the runtime's watchdog sets
//     from another goroutine when the call must stop,
//
// and calls the host function sandgate:bound.yield when $stop is set or
// every yieldEvery counts. yield fails the call (panics with the exit error
// wazero returns as the call's error) when the watchdog stopped it, and
// otherwise just returns: the return to Go is where the Go scheduler can
// preempt a guest that has run for long (compiled code itself cannot be
// preempted), so that looping guests never starve the watchdog or anything
// else of the Ps they hold.
//
// A call that does not loop pays a few loads, adds and a branch per
// function and loop entry, and no goroutine, timer or channel.
//
// The checks are inserted as
//
//	global.get $tick; i32.const 1; i32.add; global.set $tick
//	global.get $tick; i32.const yieldEvery-1; i32.and; i32.eqz
//	global.get $stop; i32.or
//	if; call $yield; end
//
// which leaves the operand stack and every branch depth as they were, so
// nothing else in a function changes. Adding the import shifts the index
// of every function the module defines by one; every reference (calls,
// ref.func, exports, elements, global initialisers, the name section) is
// renumbered. A wasm start section, whose run could not be bounded (it runs
// inside instantiation, before the host has the instance), becomes an
// export the host calls under the watchdog instead. DWARF sections are
// dropped: their code offsets no longer hold.
const (
	boundModule    = "sandgate:bound" // the host module of yield
	boundYield     = "yield"
	boundStopName  = "sandgate:stop"  // the exported $stop
	boundStartName = "sandgate:start" // the former start function
	// yieldEvery is how many function and loop entries a guest makes
	// between two yields; a power of two.
	yieldEvery = 1 << 14
)

// boundError is a module bound cannot rewrite; Load reports it as not
// compiling (wazero would refuse it too, or it uses a feature this host
// does not enable).
type boundError struct{ msg string }

func (e *boundError) Error() string { return e.msg }

func boundErrorf(format string, args ...any) error {
	return &boundError{msg: fmt.Sprintf(format, args...)}
}

// bounded is a rewritten module.
type bounded struct {
	bin []byte
	// start says whether the module had a start section, now exported as
	// boundStartName.
	start bool
}

// wasm section ids.
const (
	secCustom    = 0
	secType      = 1
	secImport    = 2
	secFunction  = 3
	secTable     = 4
	secMemory    = 5
	secGlobal    = 6
	secExport    = 7
	secStart     = 8
	secElement   = 9
	secCode      = 10
	secData      = 11
	secDataCount = 12
	secTag       = 13
)

// sectionRank is the order non-custom sections must appear in.
var sectionRank = map[byte]int{secType: 1, secImport: 2, secFunction: 3, secTable: 4, secMemory: 5, secTag: 6,
	secGlobal: 7, secExport: 8, secStart: 9, secElement: 10, secDataCount: 11, secCode: 12, secData: 13}

type wsection struct {
	id   byte
	body []byte
}

// bound returns bin with the time checks added (see above).
func bound(bin []byte) (bounded, error) {
	if len(bin) < 8 || string(bin[:4]) != "\x00asm" || string(bin[4:8]) != "\x01\x00\x00\x00" {
		return bounded{}, boundErrorf("not a WebAssembly 1.0 binary module (bad magic or version)")
	}
	var secs []wsection
	r := &wreader{b: bin, pos: 8}
	for !r.done() {
		id := r.byte1()
		n := r.u32()
		body := r.take(int(n))
		if r.err != nil {
			return bounded{}, r.fail("section %d", id)
		}
		secs = append(secs, wsection{id, body})
	}
	find := func(id byte) int {
		for i, s := range secs {
			if s.id == id {
				return i
			}
		}
		return -1
	}
	// insert adds an empty section of id where the order puts it.
	insert := func(id byte) int {
		at := len(secs)
		for i, s := range secs {
			if s.id != secCustom && sectionRank[s.id] > sectionRank[id] {
				at = i
				break
			}
		}
		secs = append(secs[:at], append([]wsection{{id: id, body: []byte{0}}}, secs[at:]...)...)
		return at
	}

	b := &binder{}
	for _, id := range []byte{secType, secImport, secGlobal, secExport} {
		if find(id) < 0 {
			insert(id)
		}
	}
	var err error
	// Types and imports first: they fix the indices the rest needs.
	i := find(secType)
	if secs[i].body, err = b.types(secs[i].body); err != nil {
		return bounded{}, err
	}
	i = find(secImport)
	if secs[i].body, err = b.imports(secs[i].body); err != nil {
		return bounded{}, err
	}
	i = find(secGlobal)
	if secs[i].body, err = b.globals(secs[i].body); err != nil {
		return bounded{}, err
	}
	if i := find(secStart); i >= 0 {
		sr := &wreader{b: secs[i].body}
		b.startFunc, b.hasStart = sr.u32(), true
		if sr.err != nil || !sr.done() {
			return bounded{}, boundErrorf("malformed start section")
		}
		secs = append(secs[:i], secs[i+1:]...)
	}
	out := append([]byte(nil), bin[:8]...)
	for _, s := range secs {
		body := s.body
		switch s.id {
		case secExport:
			body, err = b.exports(body)
		case secElement:
			body, err = b.elements(body)
		case secCode:
			body, err = b.code(body)
		case secFunction:
			err = b.functions(body)
		case secCustom:
			var keep bool
			body, keep, err = b.custom(body)
			if !keep {
				continue
			}
		}
		if err != nil {
			return bounded{}, err
		}
		out = append(out, s.id)
		out = appendU32(out, uint32(len(body)))
		out = append(out, body...)
	}
	return bounded{bin: out, start: b.hasStart}, nil
}

// binder carries what the rewrite of one module needs across sections.
type binder struct {
	yieldType   uint32 // index of the type () -> ()
	nTypes      uint32 // the guest's own type count
	importFuncs uint32 // functions imported by the guest: the yield's index
	stop, tick  uint32 // global indices
	hasStart    bool
	startFunc   uint32 // the start section's function, old index
}

// functions checks the function section's type indices (see instrs: the
// yield's type may be new, and no guest function may take it unless the
// guest declared it).
func (b *binder) functions(body []byte) error {
	r := &wreader{b: body}
	n := r.u32()
	for k := uint32(0); k < n && r.err == nil; k++ {
		if t := r.u32(); r.err == nil && t >= b.nTypes {
			return boundErrorf("function %d has type %d: the module has %d types", k, t, b.nTypes)
		}
	}
	if r.err != nil || !r.done() {
		return r.fail("function section")
	}
	return nil
}

// fn renumbers a function index for the inserted import.
func (b *binder) fn(i uint32) uint32 {
	if i >= b.importFuncs {
		return i + 1
	}
	return i
}

func (b *binder) types(body []byte) ([]byte, error) {
	r := &wreader{b: body}
	n := r.u32()
	found := false
	for k := uint32(0); k < n && r.err == nil; k++ {
		start := r.pos
		if r.byte1() != 0x60 {
			return nil, boundErrorf("type %d is not a function type", k)
		}
		np := r.u32()
		r.take(int(np))
		nr := r.u32()
		r.take(int(nr))
		if !found && np == 0 && nr == 0 && r.pos-start == 3 {
			b.yieldType, found = k, true
		}
	}
	if r.err != nil || !r.done() {
		return nil, r.fail("type section")
	}
	b.nTypes = n
	if found {
		return body, nil
	}
	b.yieldType = n
	out := appendU32(nil, n+1)
	out = append(out, body[r.start(n):]...)
	return append(out, 0x60, 0, 0), nil
}

// start returns where the entries of a section that begins with its count
// n begin.
func (r *wreader) start(n uint32) int { return len(appendU32(nil, n)) }

func (b *binder) imports(body []byte) ([]byte, error) {
	r := &wreader{b: body}
	n := r.u32()
	for k := uint32(0); k < n && r.err == nil; k++ {
		mod := r.name()
		r.name()
		if mod == boundModule {
			return nil, boundErrorf("imports from %s, a name this host reserves", boundModule)
		}
		switch kind := r.byte1(); kind {
		case 0: // function
			if t := r.u32(); r.err == nil && t >= b.nTypes { // see functions
				return nil, boundErrorf("import %d has type %d: the module has %d types", k, t, b.nTypes)
			}
			b.importFuncs++
		case 1: // table
			r.byte1()
			r.limits()
		case 2: // memory
			r.limits()
		case 3: // global
			r.byte1()
			r.byte1()
			b.stop++
		case 4: // tag
			r.byte1()
			r.u32()
		default:
			return nil, boundErrorf("import %d has unknown kind %d", k, kind)
		}
	}
	if r.err != nil || !r.done() {
		return nil, r.fail("import section")
	}
	out := appendU32(nil, n+1)
	out = append(out, body[r.start(n):]...)
	out = appendName(out, boundModule)
	out = appendName(out, boundYield)
	out = append(out, 0)
	return appendU32(out, b.yieldType), nil
}

// globals renumbers the initialisers and appends $stop and $tick.
// b.stop holds the number of imported globals on entry.
func (b *binder) globals(body []byte) ([]byte, error) {
	r := &wreader{b: body}
	n := r.u32()
	out := appendU32(nil, n+2)
	for k := uint32(0); k < n && r.err == nil; k++ {
		out = append(out, r.take(2)...) // value type, mutability
		var err error
		if out, err = b.expr(out, r); err != nil {
			return nil, err
		}
	}
	if r.err != nil || !r.done() {
		return nil, r.fail("global section")
	}
	b.stop += n
	b.tick = b.stop + 1
	for range 2 {
		out = append(out, 0x7f, 1, 0x41, 0, 0x0b) // mut i32 = 0
	}
	return out, nil
}

func (b *binder) exports(body []byte) ([]byte, error) {
	r := &wreader{b: body}
	n := r.u32()
	extra := uint32(1)
	if b.hasStart {
		extra++
	}
	out := appendU32(nil, n+extra)
	for k := uint32(0); k < n && r.err == nil; k++ {
		name := r.name()
		if strings.HasPrefix(name, "sandgate:") {
			return nil, boundErrorf("exports %q, a name this host reserves", name)
		}
		kind := r.byte1()
		idx := r.u32()
		switch kind {
		case 0:
			idx = b.fn(idx)
		case 3:
			if idx >= b.stop { // see instrs
				return nil, boundErrorf("exports global %d: the module has %d globals", idx, b.stop)
			}
		}
		out = appendName(out, name)
		out = append(out, kind)
		out = appendU32(out, idx)
	}
	if r.err != nil || !r.done() {
		return nil, r.fail("export section")
	}
	out = appendName(out, boundStopName)
	out = append(out, 3)
	out = appendU32(out, b.stop)
	if b.hasStart {
		out = appendName(out, boundStartName)
		out = append(out, 0)
		out = appendU32(out, b.fn(b.startFunc))
	}
	return out, nil
}

func (b *binder) elements(body []byte) ([]byte, error) {
	r := &wreader{b: body}
	n := r.u32()
	out := appendU32(nil, n)
	var err error
	for k := uint32(0); k < n && r.err == nil; k++ {
		flags := r.u32()
		out = appendU32(out, flags)
		if flags > 7 {
			return nil, boundErrorf("element segment %d has unknown flags %d", k, flags)
		}
		if flags&2 != 0 && flags&1 == 0 { // explicit table index
			out = appendU32(out, r.u32())
		}
		if flags&1 == 0 { // active: an offset
			if out, err = b.expr(out, r); err != nil {
				return nil, err
			}
		}
		if flags&3 != 0 { // element kind or reference type
			out = append(out, r.byte1())
		}
		m := r.u32()
		out = appendU32(out, m)
		for j := uint32(0); j < m && r.err == nil; j++ {
			if flags&4 == 0 {
				out = appendU32(out, b.fn(r.u32()))
			} else if out, err = b.expr(out, r); err != nil {
				return nil, err
			}
		}
	}
	if r.err != nil || !r.done() {
		return nil, r.fail("element section")
	}
	return out, nil
}

// check appends the inserted check (see the package comment above).
func (b *binder) check(out []byte) []byte {
	out = append(out, 0x23)
	out = appendU32(out, b.tick)
	out = append(out, 0x41, 1, 0x6a, 0x24)
	out = appendU32(out, b.tick)
	out = append(out, 0x23)
	out = appendU32(out, b.tick)
	out = append(out, 0x41)
	out = appendS64(out, yieldEvery-1)
	out = append(out, 0x71, 0x45, 0x23)
	out = appendU32(out, b.stop)
	out = append(out, 0x72, 0x04, 0x40, 0x10)
	out = appendU32(out, b.importFuncs) // the yield's index
	return append(out, 0x0b)
}

func (b *binder) code(body []byte) ([]byte, error) {
	r := &wreader{b: body}
	n := r.u32()
	out := appendU32(make([]byte, 0, len(body)+len(body)/4), n) // checks add about a fifth
	var fb []byte
	for k := uint32(0); k < n && r.err == nil; k++ {
		size := r.u32()
		fr := &wreader{b: r.take(int(size))}
		if r.err != nil {
			break
		}
		fb = fb[:0]
		nl := fr.u32()
		for j := uint32(0); j < nl && fr.err == nil; j++ {
			fr.u32()
			fr.byte1()
		}
		fb = append(fb, fr.b[:fr.pos]...)
		fb = b.check(fb)
		var err error
		if fb, err = b.instrs(fb, fr, false); err != nil {
			return nil, fmt.Errorf("function %d: %w", k, err)
		}
		if !fr.done() {
			return nil, boundErrorf("function %d: bytes after its end", k)
		}
		out = appendU32(out, uint32(len(fb)))
		out = append(out, fb...)
	}
	if r.err != nil || !r.done() {
		return nil, r.fail("code section")
	}
	return out, nil
}

// expr copies a constant expression (an initialiser or offset), renumbering
// ref.func.
func (b *binder) expr(out []byte, r *wreader) ([]byte, error) {
	return b.instrs(out, r, true)
}

// instrs copies instructions from r to out up to the end of the block they
// are in (the function body, or one constant expression when expr),
// renumbering function indices and adding the check after each loop head.
func (b *binder) instrs(out []byte, r *wreader, expr bool) ([]byte, error) {
	depth := 0
	for {
		if r.done() || r.err != nil {
			return nil, r.fail("instructions")
		}
		at := r.pos
		op := r.byte1()
		switch {
		case op == 0x0b: // end
			out = append(out, op)
			if depth == 0 {
				return out, nil
			}
			depth--
			continue
		case op == 0x02 || op == 0x03 || op == 0x04: // block, loop, if
			if expr {
				return nil, boundErrorf("block in a constant expression")
			}
			if t, ok := r.blockType(); ok && t >= uint64(b.nTypes) {
				return nil, boundErrorf("block type %d at byte %d: the module has %d types", t, at, b.nTypes)
			}
			out = append(out, r.b[at:r.pos]...)
			depth++
			if op == 0x03 {
				out = b.check(out)
			}
			continue
		case op == 0x10 || op == 0x12 || op == 0xd2: // call, return_call, ref.func
			out = append(out, op)
			out = appendU32(out, b.fn(r.u32()))
			continue
		case op == 0x11 || op == 0x13: // call_indirect, return_call_indirect
			if t := r.u32(); r.err == nil && t >= b.nTypes { // see global.get below
				return nil, boundErrorf("call type %d at byte %d: the module has %d types", t, at, b.nTypes)
			}
			r.u32()
			out = append(out, r.b[at:r.pos]...)
			continue
		case op == 0x23 || op == 0x24: // global.get, global.set
			// The checks' globals take the indices just past the
			// guest's: an index there is invalid in the guest's module
			// but would be valid, and reach $stop or $tick, in the
			// rewritten one. b.stop is the guest's own count here
			// (the imported ones while its initialisers are read).
			if g := r.u32(); r.err == nil && g >= b.stop {
				return nil, boundErrorf("global %d at byte %d: the module has %d globals", g, at, b.stop)
			} else {
				out = append(out, op)
				out = appendU32(out, g)
			}
			continue
		}
		if err := r.skipImmediates(op); err != nil {
			return nil, err
		}
		out = append(out, r.b[at:r.pos]...)
	}
}

// custom rewrites the name section's function indices and drops DWARF
// (whose code offsets no longer hold); it reports whether to keep the
// section.
func (b *binder) custom(body []byte) ([]byte, bool, error) {
	r := &wreader{b: body}
	name := r.name()
	if r.err != nil {
		return nil, false, r.fail("custom section")
	}
	switch {
	case strings.HasPrefix(name, ".debug_"):
		return nil, false, nil
	case name != "name":
		return body, true, nil
	}
	out := append([]byte(nil), body[:r.pos]...)
	for !r.done() {
		id := r.byte1()
		sub := &wreader{b: r.take(int(r.u32()))}
		if r.err != nil {
			return nil, false, nil // a malformed name section is only names: drop it
		}
		var nb []byte
		switch id {
		case 1: // function names: namemap
			nb = b.nameMap(sub, false)
		case 2, 3: // local and label names: indirect namemaps by function
			nb = b.nameMap(sub, true)
		default:
			nb = sub.b
		}
		if sub.err != nil {
			return nil, false, nil
		}
		out = append(out, id)
		out = appendU32(out, uint32(len(nb)))
		out = append(out, nb...)
	}
	return out, true, nil
}

// nameMap renumbers the function indices of a namemap, or of an indirect
// namemap (whose inner maps are copied).
func (b *binder) nameMap(r *wreader, indirect bool) []byte {
	n := r.u32()
	out := appendU32(nil, n)
	for k := uint32(0); k < n && r.err == nil; k++ {
		out = appendU32(out, b.fn(r.u32()))
		if !indirect {
			out = appendName(out, r.name())
			continue
		}
		m := r.u32()
		out = appendU32(out, m)
		for j := uint32(0); j < m && r.err == nil; j++ {
			out = appendU32(out, r.u32())
			out = appendName(out, r.name())
		}
	}
	return out
}

// wreader reads a wasm binary; the first error sticks.
type wreader struct {
	b   []byte
	pos int
	err error
}

var errTruncated = errors.New("unexpected end")

func (r *wreader) done() bool { return r.pos >= len(r.b) }

func (r *wreader) fail(what string, args ...any) error {
	msg := fmt.Sprintf(what, args...)
	if r.err != nil {
		return boundErrorf("malformed %s at byte %d: %v", msg, r.pos, r.err)
	}
	return boundErrorf("malformed %s at byte %d", msg, r.pos)
}

func (r *wreader) byte1() byte {
	if r.pos >= len(r.b) {
		r.err = errTruncated
		return 0
	}
	c := r.b[r.pos]
	r.pos++
	return c
}

func (r *wreader) take(n int) []byte {
	if n < 0 || r.pos+n > len(r.b) {
		r.err = errTruncated
		r.pos = len(r.b)
		return nil
	}
	s := r.b[r.pos : r.pos+n]
	r.pos += n
	return s
}

// leb reads an LEB128 number of at most maxBytes bytes, returning it
// unsigned (sign extension is not needed to skip or copy it).
func (r *wreader) leb(maxBytes int) uint64 {
	var v uint64
	for i := 0; i < maxBytes; i++ {
		c := r.byte1()
		if r.err != nil {
			return 0
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c&0x80 == 0 {
			return v
		}
	}
	r.err = errors.New("LEB128 number too long")
	return 0
}

func (r *wreader) u32() uint32 { return uint32(r.leb(5)) }

func (r *wreader) name() string { return string(r.take(int(r.u32()))) }

func (r *wreader) limits() {
	flags := r.byte1()
	r.leb(10)
	if flags&1 != 0 {
		r.leb(10)
	}
}

// blockType skips a block type: empty (0x40), a value type, or a type
// index (a signed LEB128 of up to 33 bits), which it returns.
func (r *wreader) blockType() (index uint64, isIndex bool) {
	if r.pos < len(r.b) {
		switch r.b[r.pos] {
		case 0x40, 0x7f, 0x7e, 0x7d, 0x7c, 0x7b, 0x70, 0x6f:
			r.pos++
			return 0, false
		}
	}
	return r.leb(5), r.err == nil
}

func (r *wreader) memarg() {
	align := r.u32()
	if align&0x40 != 0 { // multi-memory: a memory index follows
		r.u32()
	}
	r.leb(10)
}

// skipImmediates skips the immediates of op (its opcode byte read), for
// every instruction of WebAssembly 2.0 (this host's wazero features) and
// tail calls. Block instructions, calls and ref.func are handled by instrs.
func (r *wreader) skipImmediates(op byte) error {
	switch {
	case op == 0x00 || op == 0x01 || op == 0x05 || op == 0x0f || op == 0x1a || op == 0x1b || op == 0xd1:
	case op >= 0x45 && op <= 0xc4: // numeric, sign extension
	case op == 0x0c || op == 0x0d: // br, br_if
		r.u32()
	case op == 0x0e: // br_table
		n := r.u32()
		for i := uint32(0); i <= n && r.err == nil; i++ {
			r.u32()
		}
	case op == 0x1c: // select t*
		r.take(int(r.u32()))
	case op >= 0x20 && op <= 0x26: // local.*, global.*, table.get/set
		r.u32()
	case op >= 0x28 && op <= 0x3e: // loads, stores
		r.memarg()
	case op == 0x3f || op == 0x40: // memory.size, memory.grow
		r.u32()
	case op == 0x41: // i32.const
		r.leb(5)
	case op == 0x42: // i64.const
		r.leb(10)
	case op == 0x43:
		r.take(4)
	case op == 0x44:
		r.take(8)
	case op == 0xd0: // ref.null
		r.blockType()
	case op == 0xfc:
		switch sub := r.u32(); {
		case sub <= 7: // saturating truncations
		case sub == 8 || sub == 10 || sub == 12 || sub == 14: // memory.init, memory.copy, table.init, table.copy
			r.u32()
			r.u32()
		case sub == 9 || sub == 11 || sub == 13 || sub == 15 || sub == 16 || sub == 17:
			r.u32()
		default:
			return boundErrorf("unsupported instruction 0xfc %d at byte %d", sub, r.pos)
		}
	case op == 0xfd: // SIMD
		switch sub := r.u32(); {
		case sub <= 11 || sub == 92 || sub == 93: // loads, stores
			r.memarg()
		case sub == 12 || sub == 13: // v128.const, i8x16.shuffle
			r.take(16)
		case sub >= 21 && sub <= 34: // extract/replace lane
			r.take(1)
		case sub >= 84 && sub <= 91: // load/store lane
			r.memarg()
			r.take(1)
		}
	default:
		return boundErrorf("unsupported instruction 0x%02x at byte %d", op, r.pos-1)
	}
	if r.err != nil {
		return r.fail("instruction 0x%02x", op)
	}
	return nil
}

func appendU32(b []byte, v uint32) []byte {
	for {
		c := byte(v & 0x7f)
		v >>= 7
		if v == 0 {
			return append(b, c)
		}
		b = append(b, c|0x80)
	}
}

// appendS64 appends v as a signed LEB128.
func appendS64(b []byte, v int64) []byte {
	for {
		c := byte(v & 0x7f)
		v >>= 7
		if v == 0 && c&0x40 == 0 || v == -1 && c&0x40 != 0 {
			return append(b, c)
		}
		b = append(b, c|0x80)
	}
}

func appendName(b []byte, s string) []byte {
	return append(appendU32(b, uint32(len(s))), s...)
}
