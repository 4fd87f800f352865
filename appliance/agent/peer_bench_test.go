package agent

import (
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"testing"
	"time"
)

// BenchmarkFindPeer measures what attributing one egress connection costs
// the agent (findPeer: the socket in /proc/net/tcp, then the process
// holding it in /proc/<pid>/fd, here against the host's whole process
// table, which is larger than a sandbox's), beside BenchmarkLoopbackAccept,
// the dial and accept of a loopback connection the same process makes:
// their ratio is the attribution's share of a connection's set-up.
func BenchmarkFindPeer(b *testing.B) {
	skipIfNotLinux(b)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	// A process of its own holds the other end, as a command in a sandbox
	// would (the agent skips itself).
	cmd := exec.Command("bash", "-c", fmt.Sprintf("exec 3<>/dev/tcp/127.0.0.1/%d; sleep 600", ln.Addr().(*net.TCPAddr).Port))
	if err := cmd.Start(); err != nil {
		b.Skip("no bash to hold a connection:", err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	ln.(*net.TCPListener).SetDeadline(time.Now().Add(30 * time.Second))
	c, err := ln.Accept()
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	if p := findPeer(c); p == nil || p.PID != cmd.Process.Pid {
		b.Fatalf("findPeer = %+v, want pid %d", p, cmd.Process.Pid)
	}
	b.ResetTimer()
	for b.Loop() {
		if findPeer(c) == nil {
			b.Fatal("the peer was not found")
		}
	}
}

// BenchmarkLoopbackAccept is BenchmarkFindPeer's baseline: one loopback
// TCP connection dialled, accepted and closed.
func BenchmarkLoopbackAccept(b *testing.B) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	for b.Loop() {
		d, err := net.Dial("tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		a, err := ln.Accept()
		if err != nil {
			b.Fatal(err)
		}
		a.Close()
		d.Close()
	}
}

// The kernel's one lookup (sock_diag) and the read of /proc/net/tcp find
// the same socket, and the lookup finds none for a tuple no socket has.
func TestDiagInodeMatchesTheTable(t *testing.T) {
	skipIfNotLinux(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	local, remote := netip.MustParseAddrPort(d.LocalAddr().String()), netip.MustParseAddrPort(d.RemoteAddr().String())
	want := socketInode("/proc/net/tcp", local, remote)
	if want == "" {
		t.Skip("no /proc/net/tcp entry for the connection")
	}
	got := diagInode(local, remote)
	if got == "" {
		t.Skip("no sock_diag in this kernel: the table is read instead")
	}
	if got != want {
		t.Errorf("sock_diag says inode %s, /proc/net/tcp %s", got, want)
	}
	if other := diagInode(netip.AddrPortFrom(local.Addr(), 1), remote); other != "" {
		t.Errorf("a tuple no socket has: inode %s", other)
	}
}
