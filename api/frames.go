package api

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// Exec frames: a response streams a command as frames of a 9-byte header
// (type, channel, payload length, big-endian) and a payload.
const (
	FrameOpen = 1 // channel 0, payload: the process id
	FrameData = 2 // channel 1 stdout, 2 stderr
	FrameEnd  = 3 // never sent on an exec response
	FrameExit = 4 // channel 0, payload: the exit code in ASCII decimal; last

	// Channels of FrameData.
	ChannelStdout = 1
	ChannelStderr = 2

	// FrameHeaderSize is the bytes of a frame's header.
	FrameHeaderSize = 9
	// MaxFramePayload is the largest payload a frame may carry; longer
	// output is split.
	MaxFramePayload = 1 << 20
)

// Frame is one frame of an exec stream.
type Frame struct {
	Type    byte
	Channel uint32
	Payload []byte
}

// ErrFrameTooLarge is a frame header announcing more than MaxFramePayload.
var ErrFrameTooLarge = errors.New("frame payload over 1 MiB")

// WriteFrame writes one frame (a payload over MaxFramePayload is the
// caller's bug: split it with WriteData).
func WriteFrame(w io.Writer, typ byte, channel uint32, payload []byte) error {
	if len(payload) > MaxFramePayload {
		return ErrFrameTooLarge
	}
	var h [FrameHeaderSize]byte
	h[0] = typ
	binary.BigEndian.PutUint32(h[1:5], channel)
	binary.BigEndian.PutUint32(h[5:9], uint32(len(payload)))
	if _, err := w.Write(h[:]); err != nil {
		return err
	}
	if len(payload) == 0 {
		return nil
	}
	_, err := w.Write(payload)
	return err
}

// WriteData writes output as Data frames on channel, split at
// MaxFramePayload; empty output writes nothing.
func WriteData(w io.Writer, channel uint32, p []byte) error {
	for len(p) > 0 {
		n := min(len(p), MaxFramePayload)
		if err := WriteFrame(w, FrameData, channel, p[:n]); err != nil {
			return err
		}
		p = p[n:]
	}
	return nil
}

// FrameReader reads frames, accepting any chunking of the stream.
type FrameReader struct {
	r   io.Reader
	buf []byte
}

// NewFrameReader reads frames from r.
func NewFrameReader(r io.Reader) *FrameReader { return &FrameReader{r: r} }

// Next returns the next frame; its payload is valid until the next call.
// A stream that ends between frames is io.EOF; inside one,
// io.ErrUnexpectedEOF. A header announcing more than MaxFramePayload is
// ErrFrameTooLarge, refused before reading the payload.
func (fr *FrameReader) Next() (Frame, error) {
	var h [FrameHeaderSize]byte
	if _, err := io.ReadFull(fr.r, h[:]); err != nil {
		return Frame{}, err
	}
	n := binary.BigEndian.Uint32(h[5:9])
	if n > MaxFramePayload {
		return Frame{}, fmt.Errorf("%w: a header announces %d bytes", ErrFrameTooLarge, n)
	}
	if cap(fr.buf) < int(n) {
		fr.buf = make([]byte, n)
	}
	p := fr.buf[:n]
	if _, err := io.ReadFull(fr.r, p); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return Frame{}, err
	}
	return Frame{Type: h[0], Channel: binary.BigEndian.Uint32(h[1:5]), Payload: p}, nil
}

// ExecOutput is a whole exec stream, read.
type ExecOutput struct {
	PID            string
	Stdout, Stderr []byte
	// ExitCode is the Exit frame's code; Exited is false when the stream
	// ended without one (the service stopped, the connection broke).
	ExitCode int
	Exited   bool
}

// ReadExec reads an exec stream to its end: an Open frame, Data frames on
// stdout and stderr, an Exit frame, then nothing. A stream out of that
// order is an error saying where; one that ends cleanly before its Exit is
// not (Exited is false), since a stream cut by the service ends so.
func ReadExec(r io.Reader) (ExecOutput, error) {
	var out ExecOutput
	fr := NewFrameReader(r)
	for i := 0; ; i++ {
		f, err := fr.Next()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, fmt.Errorf("frame %d: %w", i, err)
		}
		switch {
		case out.Exited:
			return out, fmt.Errorf("frame %d (type %d) after the Exit frame", i, f.Type)
		case f.Type == FrameOpen && i == 0:
			out.PID = string(f.Payload)
		case i == 0:
			return out, fmt.Errorf("frame 0 is of type %d, not Open", f.Type)
		case f.Type == FrameData && f.Channel == ChannelStdout:
			out.Stdout = append(out.Stdout, f.Payload...)
		case f.Type == FrameData && f.Channel == ChannelStderr:
			out.Stderr = append(out.Stderr, f.Payload...)
		case f.Type == FrameExit:
			if out.ExitCode, err = strconv.Atoi(string(f.Payload)); err != nil {
				return out, fmt.Errorf("Exit frame %q: not a number", f.Payload)
			}
			out.Exited = true
		default:
			return out, fmt.Errorf("frame %d: unexpected type %d on channel %d", i, f.Type, f.Channel)
		}
	}
}
