package server

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
)

// readBody parses data as a PUT …/modules body, with modules of at most
// maxModule bytes, returning each module's name, config and bytes.
func readBody(t testing.TB, data []byte, maxModule int64) ([]appliance.ModuleSource, error) {
	mb := &moduleBody{br: bufio.NewReader(bytes.NewReader(data)), dir: t.TempDir(), maxModule: maxModule}
	defer mb.cleanup()
	srcs, err := mb.read()
	for i, s := range srcs {
		rc, err := s.Open()
		if err != nil {
			t.Fatal(err)
		}
		srcs[i].Wasm, _ = io.ReadAll(rc)
		rc.Close()
		srcs[i].Open = nil
	}
	return srcs, err
}

// countingReader counts the bytes read of a body.
type countingReader struct {
	r io.Reader
	n atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// Six concurrent module uploads of 64 MiB pushed serve's heap to 1.2 GB:
// each body was read whole, then copied and decoded. A module over the cap
// is refused as its bytes arrive (413), the rest of the body unread.
func TestModuleUploadOverTheCapRefusedBeforeTheBodyIsRead(t *testing.T) {
	b := newFakeBackend()
	s, err := New(Config{Backend: b, Token: "tok", MaxModuleBytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(s)
	defer hs.Close()
	r := &routeRig{t: t, b: b, hs: hs}
	r.do("POST", "/v1/sandboxes", map[string]any{"name": "b"})
	big := base64.StdEncoding.EncodeToString(make([]byte, 16<<20))
	body := &countingReader{r: strings.NewReader(`{"modules":[{"name":"m","wasm":"` + big + `"}]}`)}
	req, _ := http.NewRequest("PUT", hs.URL+"/v1/sandboxes/b/modules", body)
	req.ContentLength = -1
	req.Header.Set(api.HeaderToken, "tok")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(msg), "over the 65536 bytes a module may be") {
		t.Errorf("a module over the cap: %d %s, want 413 naming the cap", resp.StatusCode, msg)
	}
	if n := body.n.Load(); n > 8<<20 {
		t.Errorf("the server read %d bytes of a body whose module was over the cap at byte %d", n, 90<<10)
	}
}

// The body streamed in: modules decoded whatever a JSON encoder escapes
// (\/ and \u in base64), names and configs with escapes, fields refused
// by name, malformed bodies refused as such.
func TestModuleBodyStreamed(t *testing.T) {
	wasm := []byte("\x00asm\x01\x00\x00\x00 ?>?>?>") // base64 with / and +
	b64 := base64.StdEncoding.EncodeToString(wasm)
	escaped := strings.ReplaceAll(b64, "/", `\/`)
	escaped = strings.Replace(escaped, "A", `\u0041`, 1)
	srcs, err := readBody(t, []byte(` { "modules" : [ {"config":"a\"b\u00e9","wasm":"`+escaped+`","name":"n\/1"}, {"name":"two","wasm":"`+b64+`"} ] } `), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if len(srcs) != 2 || srcs[0].Name != "n/1" || string(srcs[0].Config) != "a\"bé" || !bytes.Equal(srcs[0].Wasm, wasm) || srcs[1].Name != "two" || !bytes.Equal(srcs[1].Wasm, wasm) {
		t.Errorf("got %+v", srcs)
	}
	for _, c := range []struct{ body, want string }{
		{`{"modules":[]}`, ""},
		{`{}`, `field "modules" must be a list`},
		{`{"modules":{}}`, `field "modules" must be a list`},
		{`{"modules":[],"modlues":1}`, `unknown field "modlues"`},
		{`{"modules":[{"name":"m","wasm":"AA==","confg":"x"}]}`, `modules[0]: unknown field "confg" (it takes "name", "wasm" and "config")`},
		{`{"modules":["x"]}`, `modules[0]`},
		{`{"modules":[{"name":"m","wasm":"!"}]}`, `modules[0]: want a name and the module's bytes in base64`},
		{`{"modules":[{"name":"m"}]}`, `modules[0]: want a name and the module's bytes in base64`},
		{`{"modules":[{"name":"m","wasm":1}]}`, `modules[0]: field "wasm" must be a string`},
		{`{"modules":[{"name":"m","wasm":"AA=="}]} x`, `not JSON`},
		{`{"modules":[{"name":"m","wasm":"AA==`, `not JSON`},
		{`[]`, `must be a JSON object`},
		{``, `must be a JSON object`},
	} {
		_, err := readBody(t, []byte(c.body), 1<<20)
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", c.body, err, c.want)
		}
	}
}

// FuzzModuleBody: a body encoding/json reads as {"modules":[{name, wasm,
// config}]} with strings only is read the same, module by module; no
// input panics or is read as something else.
func FuzzModuleBody(f *testing.F) {
	f.Add([]byte(`{"modules":[{"name":"m","wasm":"AGFzbQ==","config":"c"}]}`))
	f.Add([]byte(`{"modules":[{"name":"\ud83d\ude00","wasm":"AG\/zbQ=="}]}`))
	f.Add([]byte(`{"modules":[{"name":"m","wasm":"AG\u0046zbQ=="},{"name":"x","wasm":"AA=="}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		srcs, err := readBody(t, data, 1<<16)
		var ref struct {
			Modules []map[string]string `json:"modules"`
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err != nil {
			return // refusing more than encoding/json is allowed: base64, names, sizes
		}
		if dec.Decode(&ref) != nil {
			t.Fatalf("read %q, which encoding/json refuses", data)
		}
		if len(ref.Modules) != len(srcs) {
			t.Fatalf("%d modules, encoding/json reads %d", len(srcs), len(ref.Modules))
		}
		for i, m := range ref.Modules {
			want, _ := base64.StdEncoding.DecodeString(m["wasm"])
			if srcs[i].Name != m["name"] || string(srcs[i].Config) != m["config"] || !bytes.Equal(srcs[i].Wasm, want) {
				t.Fatalf("module %d: %q %q %x, encoding/json reads %q", i, srcs[i].Name, srcs[i].Config, srcs[i].Wasm, m)
			}
		}
	})
}
