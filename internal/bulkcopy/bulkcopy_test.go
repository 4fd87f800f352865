package bulkcopy

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"testing"
	"testing/iotest"
)

// Copy moves every byte, in order, across the switch to the large buffer,
// whatever sizes the reads return.
func TestCopy(t *testing.T) {
	data := make([]byte, 3<<20+12345)
	for i := range data {
		data[i] = byte(rand.N(256))
	}
	for _, size := range []int{Large256K, Large1M} {
		for name, src := range map[string]io.Reader{
			"whole reads": bytes.NewReader(data),
			"one byte":    iotest.OneByteReader(bytes.NewReader(data[:100<<10])),
			"half reads":  iotest.HalfReader(bytes.NewReader(data)),
		} {
			var dst bytes.Buffer
			reads := 0
			n, err := Copy(&dst, src, size, func() { reads++ })
			want := data
			if name == "one byte" {
				want = data[:100<<10]
			}
			if err != nil || n != int64(len(want)) || !bytes.Equal(dst.Bytes(), want) {
				t.Errorf("%d %s: copied %d of %d, err %v, equal %v", size, name, n, len(want), err, bytes.Equal(dst.Bytes(), want))
			}
			if reads == 0 {
				t.Errorf("%d %s: onRead never called", size, name)
			}
		}
	}
}

// A read error other than EOF, and a write error, end the copy and are
// returned with the bytes written so far.
func TestCopyErrors(t *testing.T) {
	boom := errors.New("boom")
	n, err := Copy(io.Discard, io.MultiReader(bytes.NewReader(make([]byte, 10)), iotest.ErrReader(boom)), Large1M, nil)
	if n != 10 || !errors.Is(err, boom) {
		t.Errorf("read error: %d %v", n, err)
	}
	n, err = Copy(failAfter{5}, bytes.NewReader(make([]byte, 10)), Large1M, nil)
	if n != 5 || !errors.Is(err, io.ErrShortWrite) {
		t.Errorf("write error: %d %v", n, err)
	}
}

type failAfter struct{ n int }

func (f failAfter) Write(p []byte) (int, error) {
	if len(p) > f.n {
		return f.n, io.ErrShortWrite
	}
	return len(p), nil
}
