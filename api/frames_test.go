package api

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

func TestFramesRoundTrip(t *testing.T) {
	var b bytes.Buffer
	big := bytes.Repeat([]byte("x"), MaxFramePayload+10)
	WriteFrame(&b, FrameOpen, 0, []byte("pid-1"))
	WriteData(&b, ChannelStdout, big)
	WriteData(&b, ChannelStderr, nil) // nothing
	WriteFrame(&b, FrameExit, 0, []byte("5"))
	fr := NewFrameReader(iotestOneByte{&b})
	var got []Frame
	for {
		f, err := fr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		f.Payload = bytes.Clone(f.Payload)
		got = append(got, f)
	}
	if len(got) != 4 || got[0].Type != FrameOpen || string(got[0].Payload) != "pid-1" ||
		len(got[1].Payload) != MaxFramePayload || len(got[2].Payload) != 10 || got[3].Type != FrameExit || string(got[3].Payload) != "5" {
		t.Errorf("frames: %d, %+v", len(got), got[0])
	}
}

func TestFrameHeaderOverLimitRefused(t *testing.T) {
	hdr := []byte{FrameData, 0, 0, 0, 1, 0, 0x10, 0, 1} // 1 MiB + 1
	if _, err := NewFrameReader(bytes.NewReader(hdr)).Next(); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("got %v, want ErrFrameTooLarge", err)
	}
	if _, err := NewFrameReader(bytes.NewReader([]byte{FrameData, 0, 0, 0, 1, 0, 0, 0, 5, 'a'})).Next(); err != io.ErrUnexpectedEOF {
		t.Errorf("truncated payload: %v", err)
	}
}

// iotestOneByte reads one byte at a time: any chunking must be accepted.
type iotestOneByte struct{ r io.Reader }

func (o iotestOneByte) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	return o.r.Read(p[:1])
}

// FuzzFrameReader: any bytes are frames, an error, or EOF; never a panic,
// never a payload over the limit.
func FuzzFrameReader(f *testing.F) {
	var b bytes.Buffer
	WriteFrame(&b, FrameOpen, 0, []byte("x"))
	WriteFrame(&b, FrameExit, 0, []byte("0"))
	f.Add(b.Bytes())
	f.Add([]byte{2, 0, 0, 0, 1, 255, 255, 255, 255})
	f.Fuzz(func(t *testing.T, in []byte) {
		fr := NewFrameReader(bytes.NewReader(in))
		for range 1000 {
			fr, err := fr.Next()
			if err != nil {
				return
			}
			if len(fr.Payload) > MaxFramePayload {
				t.Fatalf("payload of %d bytes", len(fr.Payload))
			}
		}
	})
}
