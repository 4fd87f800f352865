// Package wasmbin makes small WebAssembly binaries for tests and benches:
// the smallest module sandgate's runtime loads, and a module padded with a
// custom section (a Go guest's DWARF, or a hostile upload's padding).
package wasmbin

import (
	"fmt"
	"slices"
)

// pass is a memory, and handle_request returning 1 (pass the request on).
var pass = []byte{
	0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, // magic, version
	0x01, 0x05, 0x01, 0x60, 0x00, 0x01, 0x7e, // type 0: () -> i64
	0x03, 0x02, 0x01, 0x00, // func 0: type 0
	0x05, 0x03, 0x01, 0x00, 0x01, // memory 0: 1 page
	0x07, 0x1b, 0x02, // exports:
	0x06, 'm', 'e', 'm', 'o', 'r', 'y', 0x02, 0x00,
	0x0e, 'h', 'a', 'n', 'd', 'l', 'e', '_', 'r', 'e', 'q', 'u', 'e', 's', 't', 0x00, 0x00,
	0x0a, 0x06, 0x01, 0x04, 0x00, 0x42, 0x01, 0x0b, // code: i64.const 1
}

// Pass is the smallest module the runtime loads: a memory of one page, and
// handle_request returning 1. Its instances start in microseconds.
func Pass() []byte { return slices.Clone(pass) }

// Padded is bin with a custom section named "padding" of size bytes, its
// first bytes "padding <n>" (each n its own digest).
func Padded(bin []byte, size, n int) []byte {
	body := append(uleb(nil, len("padding")), "padding"...)
	pad := make([]byte, size)
	copy(pad, fmt.Sprintf("padding %d", n))
	body = append(body, pad...)
	out := append(slices.Clone(bin), 0x00) // section id 0: custom
	out = uleb(out, len(body))
	return append(out, body...)
}

func uleb(b []byte, v int) []byte {
	for ; v >= 0x80; v >>= 7 {
		b = append(b, byte(v)|0x80)
	}
	return append(b, byte(v))
}
