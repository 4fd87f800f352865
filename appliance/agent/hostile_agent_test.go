package agent

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
)

// hostileAgent is the agent end of a link played by code that took over
// the sandbox: it answers hello like a real agent, then does what it likes.
func hostileAgent(t *testing.T) (*Client, *yamux.Session) {
	t.Helper()
	a, b := net.Pipe()
	sess, err := yamux.Server(b, yamuxConfig(nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	go func() {
		st, err := sess.AcceptStream()
		if err != nil {
			return
		}
		var buf []byte
		if _, _, err := readFrame(st, &buf); err != nil {
			return
		}
		resp, _ := json.Marshal(response{Version: ProtocolVersion, RelayAddr: "127.0.0.1:3128", PID: 2})
		newFramer(st).frame(kindMsg, resp)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := NewClient(ctx, a, ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, sess
}

func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestFrameHeaderAloneAllocatesNoPayload: the service reads the first frame
// of every stream the agent opens with the 4 MiB message limit, and
// readFrame allocates the whole payload from the 5-byte header before a byte
// of it arrives. A hostile agent opens streams that send only such a header:
// each pins 4 MiB in the service for requestTimeout (30 s), and nothing
// bounds how many streams it opens. Egress is even refused here (no
// handler): the allocation comes before that check.
func TestFrameHeaderAloneAllocatesNoPayload(t *testing.T) {
	skipIfNotLinux(t)
	_, sess := hostileAgent(t)
	const streams = 32
	base := liveHeap()
	var hdr [headerBytes]byte
	hdr[0] = kindMsg
	binary.BigEndian.PutUint32(hdr[1:], maxMsgBytes)
	for range streams {
		st, err := sess.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Write(hdr[:]); err != nil {
			t.Fatal(err)
		}
	}
	// 5 bytes per stream were sent; allow the service a generous 16 MiB
	// for all of them. Poll (bounded) while its goroutines read the headers.
	const allowed = 16 << 20
	var grew uint64
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if h := liveHeap(); h > base {
			grew = max(grew, h-base)
		}
		if grew > allowed {
			break
		}
	}
	if grew > allowed {
		t.Errorf("%d streams of 5 bytes each made the service hold %d MiB (want under %d MiB)", streams, grew>>20, allowed>>20)
	}
}
