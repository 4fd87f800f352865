package agent

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"testing"
)

// frame builds one frame for the fuzz seeds.
func frame(kind byte, p []byte) []byte {
	b := make([]byte, headerBytes+len(p))
	b[0] = kind
	binary.BigEndian.PutUint32(b[1:], uint32(len(p)))
	copy(b[headerBytes:], p)
	return b
}

// FuzzFrames feeds arbitrary bytes to everything that parses what the other
// side sends: the frame reader, request and response decoding, and the data
// reader. It must never panic, never allocate beyond the frame limits, and
// either decode a message or say why not.
//
//	go test -run '^$' -fuzz FuzzFrames -fuzztime 60s ./appliance/agent
func FuzzFrames(f *testing.F) {
	msg := func(v any) []byte { b, _ := json.Marshal(v); return frame(kindMsg, b) }
	f.Add(msg(request{Op: "hello", Version: 1, Config: &Config{RelayAddr: "127.0.0.1:3128"}}))
	f.Add(msg(request{Op: "exec", Args: []string{"sh", "-c", "true"}, Env: []string{"A=b"}, Stdin: true}))
	f.Add(append(frame(kindData, []byte("abc")), msg(response{End: true})...))
	f.Add(append(frame(kindStderr, []byte("x")), msg(response{Exit: &wireExit{Code: 1}})...))
	f.Add(msg(response{Error: &wireError{Code: "not_found", Message: "m"}}))
	f.Add([]byte{kindMsg, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{9, 0, 0, 0, 0})
	f.Add(frame(kindMsg, []byte(`{"op":"exec","bogus":1}`)))
	f.Fuzz(func(t *testing.T, in []byte) {
		var buf []byte
		r := bytes.NewReader(in)
		for {
			kind, p, err := readFrame(r, &buf)
			if err != nil {
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, errProtocol) {
					t.Fatalf("readFrame: unexpected error %v", err)
				}
				break
			}
			if (kind == kindMsg && len(p) > maxMsgBytes) || (kind != kindMsg && len(p) > maxDataBytes) {
				t.Fatalf("frame of %d bytes passed the limits", len(p))
			}
			if kind == kindMsg {
				if req, err := decodeRequest(p); err == nil {
					// What we decode, we can send again.
					b, err := json.Marshal(req)
					if err != nil {
						t.Fatalf("re-encoding %+v: %v", req, err)
					}
					if _, err := decodeRequest(b); err != nil {
						t.Fatalf("re-decoding %s: %v", b, err)
					}
					continue
				}
				var resp response
				if err := decodeMsg(p, &resp); err == nil && resp.Error != nil {
					_ = resp.Error.toError("fuzz").Error()
				}
			}
		}
		d := &dataReader{r: bytes.NewReader(in)}
		n, err := io.Copy(io.Discard, d)
		if err == nil && !d.final.End {
			t.Fatalf("data reader returned EOF after %d bytes without an End message", n)
		}
	})
}
