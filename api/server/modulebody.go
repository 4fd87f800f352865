package server

import (
	"bufio"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/sandgate/sandgate/appliance"
)

// Bounds of a PUT …/modules body besides each module's size.
const (
	maxModulesPerBody = 16
	maxModuleName     = 256
	maxModuleConfig   = 1 << 20
)

// moduleBody reads a PUT …/modules body as it streams in:
// {"modules":[{"name":…, "wasm": base64, "config": string}, …]}. Each
// module's bytes are decoded as they arrive into a temporary file in dir
// (at most maxModule bytes; more is 413), so neither the body nor a
// decoded module is ever held in memory: the manager reads each file when
// its turn to compile comes. Fields it does not know are refused by name,
// as sandgate's bodies are. Remove the files with cleanup, whatever the
// error.
type moduleBody struct {
	br        *bufio.Reader
	dir       string
	maxModule int64
	files     []string
}

func (mb *moduleBody) cleanup() {
	for _, f := range mb.files {
		os.Remove(f)
	}
}

var errNotJSON = errors.New("not JSON")

func (mb *moduleBody) read() ([]appliance.ModuleSource, error) {
	srcs, err := mb.body()
	if errors.Is(err, errNotJSON) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return nil, badRequest("the body is not JSON: %v", err)
	}
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return nil, errorf(http.StatusRequestEntityTooLarge, "the request body is over %d bytes", mbe.Limit)
	}
	return srcs, err
}

func (mb *moduleBody) body() ([]appliance.ModuleSource, error) {
	if err := mb.expect('{'); err != nil {
		return nil, badRequest("the body must be a JSON object")
	}
	var srcs []appliance.ModuleSource
	seen := false
	err := mb.members(func(key string) error {
		if key != "modules" {
			return badRequest("modules: unknown field %q (it takes \"modules\")", key)
		}
		if seen {
			return badRequest("field \"modules\" is given twice")
		}
		seen = true
		if c, err := mb.peek(); err != nil || c != '[' {
			return badRequest("field \"modules\" must be a list of {name, wasm (base64), config}")
		}
		var err error
		srcs, err = mb.modules()
		return err
	})
	if err != nil {
		return nil, err
	}
	if !seen {
		return nil, badRequest("field \"modules\" must be a list of {name, wasm (base64), config}")
	}
	if c, err := mb.peek(); err != io.EOF {
		return nil, fmt.Errorf("%w: %q after the object", errNotJSON, c)
	}
	return srcs, nil
}

// members reads an object's members after its '{', calling value for each
// key with the reader at its value; value must read it whole.
func (mb *moduleBody) members(value func(key string) error) error {
	c, err := mb.peek()
	if err != nil {
		return err
	}
	if c == '}' {
		mb.br.ReadByte()
		return nil
	}
	for {
		if err := mb.expect('"'); err != nil {
			return err
		}
		key, err := mb.smallString(maxModuleName, "a field's name")
		if err != nil {
			return err
		}
		if err := mb.expect(':'); err != nil {
			return err
		}
		if err := value(key); err != nil {
			return err
		}
		c, err := mb.next()
		if err != nil {
			return err
		}
		switch c {
		case ',':
		case '}':
			return nil
		default:
			return fmt.Errorf("%w: %q where , or } belongs", errNotJSON, c)
		}
	}
}

func (mb *moduleBody) modules() ([]appliance.ModuleSource, error) {
	mb.expect('[')
	var srcs []appliance.ModuleSource
	if c, err := mb.peek(); err != nil {
		return nil, err
	} else if c == ']' {
		mb.br.ReadByte()
		return srcs, nil
	}
	for i := 0; ; i++ {
		if i == maxModulesPerBody {
			return nil, badRequest("modules: at most %d modules", maxModulesPerBody)
		}
		src, err := mb.module(i)
		if err != nil {
			return nil, err
		}
		srcs = append(srcs, src)
		c, err := mb.next()
		if err != nil {
			return nil, err
		}
		switch c {
		case ',':
		case ']':
			return srcs, nil
		default:
			return nil, fmt.Errorf("%w: %q where , or ] belongs", errNotJSON, c)
		}
	}
}

func (mb *moduleBody) module(i int) (appliance.ModuleSource, error) {
	var src appliance.ModuleSource
	if err := mb.expect('{'); err != nil {
		return src, badRequest("modules[%d]: want {name, wasm (base64), config}", i)
	}
	var file string
	var size int64
	err := mb.members(func(key string) error {
		if key != "name" && key != "wasm" && key != "config" {
			return badRequest("modules[%d]: unknown field %q (it takes \"name\", \"wasm\" and \"config\")", i, key)
		}
		if err := mb.expect('"'); err != nil {
			return badRequest("modules[%d]: field %q must be a string", i, key)
		}
		var err error
		switch key {
		case "name":
			src.Name, err = mb.smallString(maxModuleName, fmt.Sprintf("modules[%d].name", i))
		case "config":
			var c string
			c, err = mb.smallString(maxModuleConfig, fmt.Sprintf("modules[%d].config", i))
			src.Config = []byte(c)
		case "wasm":
			if file != "" {
				return badRequest("modules[%d]: field \"wasm\" is given twice", i)
			}
			file, size, err = mb.wasm(i)
		}
		return err
	})
	if err != nil {
		return src, err
	}
	if src.Name == "" || size == 0 {
		return src, badRequest("modules[%d]: want a name and the module's bytes in base64", i)
	}
	src.Open = func() (io.ReadCloser, error) { return os.Open(file) }
	return src, nil
}

// wasm decodes a module's base64 string, after its opening quote, into a
// new temporary file.
func (mb *moduleBody) wasm(i int) (string, int64, error) {
	f, err := os.CreateTemp(mb.dir, "module-*.wasm")
	if err != nil {
		return "", 0, fmt.Errorf("spooling modules[%d]: %w", i, err)
	}
	mb.files = append(mb.files, f.Name())
	sr := &jsonString{br: mb.br}
	n, err := io.Copy(f, io.LimitReader(base64.NewDecoder(base64.StdEncoding, sr), mb.maxModule+1))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	var ce base64.CorruptInputError
	switch {
	case n > mb.maxModule:
		return "", 0, errorf(http.StatusRequestEntityTooLarge, "modules[%d]: over the %d bytes a module may be", i, mb.maxModule)
	case errors.As(err, &ce), errors.Is(err, errBadString), sr.done && err != nil: // a string cut short is the base64's fault
		return "", 0, badRequest("modules[%d]: want a name and the module's bytes in base64", i)
	case err != nil:
		return "", 0, err
	case !sr.done:
		return "", 0, badRequest("modules[%d]: want a name and the module's bytes in base64", i)
	}
	return f.Name(), n, nil
}

// smallString reads a string, after its opening quote, of at most limit
// bytes.
func (mb *moduleBody) smallString(limit int, what string) (string, error) {
	b, err := io.ReadAll(io.LimitReader(&jsonString{br: mb.br}, int64(limit)+1))
	if errors.Is(err, errBadString) {
		return "", fmt.Errorf("%w: %v", errNotJSON, err)
	}
	if err != nil {
		return "", err
	}
	if len(b) > limit {
		return "", errorf(http.StatusRequestEntityTooLarge, "%s is over %d bytes", what, limit)
	}
	if !utf8.Valid(b) {
		return "", badRequest("%s is not UTF-8", what)
	}
	return string(b), nil
}

// next is the next byte past white space.
func (mb *moduleBody) next() (byte, error) {
	for {
		c, err := mb.br.ReadByte()
		if err == io.EOF {
			return 0, io.ErrUnexpectedEOF
		}
		if err != nil || (c != ' ' && c != '\t' && c != '\n' && c != '\r') {
			return c, err
		}
	}
}

// peek is next without reading it; io.EOF at the end of the body.
func (mb *moduleBody) peek() (byte, error) {
	for {
		b, err := mb.br.Peek(1)
		if err != nil {
			return 0, err
		}
		if c := b[0]; c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			return c, nil
		}
		mb.br.ReadByte()
	}
}

func (mb *moduleBody) expect(want byte) error {
	c, err := mb.next()
	if err != nil {
		return err
	}
	if c != want {
		return fmt.Errorf("%w: %q where %q belongs", errNotJSON, c, want)
	}
	return nil
}

var errBadString = errors.New("a malformed JSON string")

// jsonString reads a JSON string's value, its escapes undone, from after
// its opening quote to its closing one (then io.EOF, done set).
type jsonString struct {
	br      *bufio.Reader
	pending []byte // bytes of an escape not yet handed over
	done    bool
}

func (s *jsonString) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		if len(s.pending) > 0 {
			k := copy(p[n:], s.pending)
			s.pending, n = s.pending[k:], n+k
			continue
		}
		if s.done {
			return n, io.EOF
		}
		c, err := s.br.ReadByte()
		if err == io.EOF {
			return n, io.ErrUnexpectedEOF
		}
		if err != nil {
			return n, err
		}
		switch {
		case c == '"':
			s.done = true
		case c == '\\':
			if err := s.escape(); err != nil {
				return n, err
			}
		case c < 0x20:
			return n, fmt.Errorf("%w: a control character in it", errBadString)
		default:
			p[n] = c
			n++
		}
		if n > 0 && s.br.Buffered() == 0 && !s.done && len(s.pending) == 0 {
			return n, nil // hand over what is here rather than wait
		}
	}
	return n, nil
}

func (s *jsonString) escape() error {
	c, err := s.br.ReadByte()
	if err != nil {
		return io.ErrUnexpectedEOF
	}
	switch c {
	case '"', '\\', '/':
		s.pending = []byte{c}
	case 'b':
		s.pending = []byte{'\b'}
	case 'f':
		s.pending = []byte{'\f'}
	case 'n':
		s.pending = []byte{'\n'}
	case 'r':
		s.pending = []byte{'\r'}
	case 't':
		s.pending = []byte{'\t'}
	case 'u':
		r, err := s.hex4()
		if err != nil {
			return err
		}
		if utf16.IsSurrogate(r) {
			if b, err := s.br.Peek(2); err == nil && string(b) == `\u` {
				s.br.Discard(2)
				r2, err := s.hex4()
				if err != nil {
					return err
				}
				if d := utf16.DecodeRune(r, r2); d != utf8.RuneError {
					r = d
				} else { // not a pair: each stands alone
					if utf16.IsSurrogate(r2) {
						r2 = utf8.RuneError
					}
					s.pending = utf8.AppendRune(utf8.AppendRune(nil, utf8.RuneError), r2)
					return nil
				}
			} else {
				r = utf8.RuneError
			}
		}
		s.pending = utf8.AppendRune(nil, r)
	default:
		return fmt.Errorf("%w: the escape \\%c", errBadString, c)
	}
	return nil
}

func (s *jsonString) hex4() (rune, error) {
	var r rune
	for range 4 {
		c, err := s.br.ReadByte()
		if err != nil {
			return 0, io.ErrUnexpectedEOF
		}
		var v byte
		switch {
		case '0' <= c && c <= '9':
			v = c - '0'
		case 'a' <= c && c <= 'f':
			v = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			v = c - 'A' + 10
		default:
			return 0, fmt.Errorf("%w: \\u with %q", errBadString, c)
		}
		r = r<<4 | rune(v)
	}
	return r, nil
}
