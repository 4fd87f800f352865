package agent

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Peer is the process in the sandbox that opened an egress connection, as
// the agent found it: its pid in the sandbox and its arguments (at most
// maxPeerArgs of them, maxPeerBytes in all). The service renders them for
// the audit (relay.Peer); nothing is decided on them, since a process can
// rewrite its own command line.
type Peer struct {
	PID  int      `json:"pid"`
	Args []string `json:"args,omitempty"`
}

const (
	maxPeerArgs  = 64
	maxPeerBytes = 2048
	// peerLookupTime bounds the search for a connection's process: a
	// sandbox with more processes and descriptors than that allows gets
	// "unknown" rather than slower egress.
	peerLookupTime = 50 * time.Millisecond
)

// findPeer finds the process holding the other end of c, a connection
// accepted on the relay listener: the socket whose local address is c's
// remote one and whose remote address is c's local one (in /proc/net/tcp,
// or tcp6), then a process with a descriptor of it. Nil when it cannot
// tell: the process already closed it, the socket is held by a process the
// agent may not inspect, or the search took too long.
func findPeer(c net.Conn) *Peer {
	return findPeerIn("/proc", c, time.Now().Add(peerLookupTime))
}

func findPeerIn(proc string, c net.Conn, deadline time.Time) *Peer {
	local, err1 := netip.ParseAddrPort(c.RemoteAddr().String())
	remote, err2 := netip.ParseAddrPort(c.LocalAddr().String())
	if err1 != nil || err2 != nil {
		return nil
	}
	table := "/net/tcp"
	if local.Addr().Is6() && !local.Addr().Is4In6() {
		table = "/net/tcp6"
	}
	var inode string
	if proc == "/proc" {
		inode = diagInode(local, remote) // one lookup, where the kernel has sock_diag
	}
	if inode == "" {
		inode = socketInode(proc+table, local, remote)
	}
	if inode == "" {
		return nil
	}
	pid := socketOwner(proc, "socket:["+inode+"]", deadline)
	if pid == 0 {
		return nil
	}
	return &Peer{PID: pid, Args: cmdline(proc + "/" + strconv.Itoa(pid) + "/cmdline")}
}

// socketInode returns the inode of the TCP socket local→remote listed in
// table (/proc/net/tcp's format), or "".
func socketInode(table string, local, remote netip.AddrPort) string {
	f, err := os.Open(table)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(io.LimitReader(f, 64<<20))
	sc.Scan() // the header
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 {
			continue
		}
		l, ok1 := parseProcAddr(fields[1])
		r, ok2 := parseProcAddr(fields[2])
		if ok1 && ok2 && l == local && r == remote && fields[9] != "0" {
			return fields[9]
		}
	}
	return ""
}

// parseProcAddr reads an address of /proc/net/tcp ("0100007F:0CEA"): the
// address as the kernel holds it (network order), printed as native-endian
// 32-bit words, then the port.
func parseProcAddr(s string) (netip.AddrPort, bool) {
	a, p, ok := strings.Cut(s, ":")
	port, err := strconv.ParseUint(p, 16, 16)
	if !ok || err != nil || (len(a) != 8 && len(a) != 32) {
		return netip.AddrPort{}, false
	}
	raw, err := hex.DecodeString(a)
	if err != nil {
		return netip.AddrPort{}, false
	}
	var b [16]byte
	for i := 0; i < len(raw); i += 4 {
		binary.NativeEndian.PutUint32(b[i:], binary.BigEndian.Uint32(raw[i:]))
	}
	var addr netip.Addr
	if len(raw) == 4 {
		addr = netip.AddrFrom4([4]byte(b[:4]))
	} else {
		addr = netip.AddrFrom16(b).Unmap()
	}
	return netip.AddrPortFrom(addr, uint16(port)), true
}

// socketOwner returns a process holding a descriptor whose link is target
// ("socket:[inode]"), 0 if none is found before deadline. The agent
// itself is skipped: it holds the other end, never this one. The newest
// processes are looked at first: a connection just made is most often a
// process just started's (curl, git, an installer's worker).
func socketOwner(proc, target string, deadline time.Time) int {
	d, err := os.Open(proc)
	if err != nil {
		return 0
	}
	names, _ := d.Readdirnames(-1)
	d.Close()
	self := os.Getpid()
	pids := make([]int, 0, len(names))
	for _, n := range names {
		if pid, err := strconv.Atoi(n); err == nil && pid != self {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	for _, pid := range slices.Backward(pids) {
		if time.Now().After(deadline) {
			return 0
		}
		if holds(proc+"/"+strconv.Itoa(pid)+"/fd", target) {
			return pid
		}
	}
	return 0
}

// holds reports whether a descriptor in dir (/proc/<pid>/fd) links to
// target. A process the agent may not inspect holds nothing.
func holds(dir, target string) bool {
	d, err := os.Open(dir)
	if err != nil {
		return false
	}
	defer d.Close()
	for {
		names, err := d.Readdirnames(256)
		for _, n := range names {
			if l, lerr := os.Readlink(dir + "/" + n); lerr == nil && l == target {
				return true
			}
		}
		if err != nil {
			return false
		}
	}
}

// cmdline reads a process's arguments, within maxPeerArgs and
// maxPeerBytes.
func cmdline(path string) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, maxPeerBytes))
	b = bytes.TrimRight(b, "\x00")
	if len(b) == 0 {
		return nil
	}
	args := strings.Split(string(b), "\x00")
	return args[:min(len(args), maxPeerArgs)]
}
