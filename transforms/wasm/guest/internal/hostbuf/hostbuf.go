// Package hostbuf implements the buffer convention of the http-wasm ABI for
// the guest packages: a host function is given a buffer and its limit,
// writes the value only if it fits, and always returns the value's length,
// so a caller whose buffer was too small retries with one of that length.
package hostbuf

import (
	"fmt"
	"sync"
	"unsafe"
)

// scratchSize is the size of the shared first-try buffer: large enough for
// a method, most URIs and header lists, so that the common call is one
// host call and one copy.
const scratchSize = 2048

// maxTries bounds the retries of a host that keeps reporting a longer
// value than the buffer it was just given (a host bug): the guest panics
// rather than loop.
const maxTries = 4

var (
	// mu guards scratch: a module's goroutines share one thread, but the
	// scheduler may switch between them at any call, and two calls must
	// not read each other's result.
	mu      sync.Mutex
	scratch = make([]byte, scratchSize)
)

// Ptr returns the address of b's first byte as the ABI's i32 offset, or
// nil for an empty slice.
func Ptr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(unsafe.SliceData(b))
}

// Get calls a host function of the (buf, buf_limit) -> len shape and
// returns a copy of the value it wrote. what names the function in the
// panic raised if the host never settles on a length.
func Get(what string, get func(buf unsafe.Pointer, limit uint32) uint32) []byte {
	mu.Lock()
	defer mu.Unlock()
	buf := scratch
	for range maxTries {
		n := get(Ptr(buf), uint32(len(buf)))
		if uint64(n) <= uint64(len(buf)) {
			return append([]byte(nil), buf[:n]...)
		}
		buf = make([]byte, n)
	}
	panic(fmt.Sprintf("http-wasm host function %s reported a longer value on each of %d tries", what, maxTries))
}

// GetList calls a host function of the (buf, buf_limit) -> count_len
// shape (count in the high 32 bits, byte length in the low 32) and returns
// the NUL-terminated strings it wrote.
func GetList(what string, get func(buf unsafe.Pointer, limit uint32) uint64) []string {
	mu.Lock()
	defer mu.Unlock()
	buf := scratch
	for range maxTries {
		countLen := get(Ptr(buf), uint32(len(buf)))
		count, n := uint32(countLen>>32), uint32(countLen)
		if uint64(n) <= uint64(len(buf)) {
			return Split(buf[:n], count)
		}
		buf = make([]byte, n)
	}
	panic(fmt.Sprintf("http-wasm host function %s reported a longer value on each of %d tries", what, maxTries))
}

// Split decodes count NUL-terminated strings from b. The count decides
// where the list ends, so an empty last value ("a\x00\x00" is "a" and "")
// survives, and a host that separates rather than terminates the strings
// is read the same way.
func Split(b []byte, count uint32) []string {
	if count == 0 {
		return nil
	}
	out := make([]string, 0, min(count, uint32(len(b))+1))
	for len(out) < int(count) {
		i := 0
		for i < len(b) && b[i] != 0 {
			i++
		}
		out = append(out, string(b[:i]))
		if i == len(b) {
			break
		}
		b = b[i+1:]
	}
	return out
}
