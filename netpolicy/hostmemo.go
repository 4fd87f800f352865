package netpolicy

import (
	"sync"
	"sync/atomic"
)

// hostMemo is what Decide learns from a host's spelling alone: its
// canonical form (or why it has none) and, for a name, why it is local.
// Both are pure functions of the spelling, so they are remembered: a
// sandbox names the same few hosts over and over, and parsing one costs
// more than the rest of a decision that the DNS cache answers.
type hostMemo struct {
	host  Host
	err   error
	local string // localNameReason of a name; "" for an address
}

// hostMemoMax bounds the memo; when it is full it starts again empty.
const hostMemoMax = 4096

var (
	hostMemos    atomic.Pointer[sync.Map] // raw spelling → hostMemo
	hostMemosLen atomic.Int64
)

func canonicalHostMemo(raw string) hostMemo {
	m := hostMemos.Load()
	if m == nil {
		hostMemos.CompareAndSwap(nil, new(sync.Map))
		m = hostMemos.Load()
	}
	if v, ok := m.Load(raw); ok {
		return v.(hostMemo)
	}
	var hm hostMemo
	hm.host, hm.err = CanonicalHost(raw)
	if hm.err == nil && !hm.host.IsIP() {
		hm.local = localNameReason(hm.host.Name)
	}
	if len(raw) <= 255 { // a name longer than DNS allows is not worth keeping
		if hostMemosLen.Add(1) > hostMemoMax {
			hostMemos.Store(new(sync.Map))
			hostMemosLen.Store(0)
		} else {
			m.Store(raw, hm)
		}
	}
	return hm
}
