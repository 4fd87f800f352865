package netcapture

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// newNetns makes a network namespace with lo up and returns a descriptor
// of it; it goes when the test ends and nothing holds it any more.
func newNetns(t *testing.T) int {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: network namespaces and BPF")
	}
	type res struct {
		fd  int
		err error
	}
	ch := make(chan res, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- res{-1, err}
			return
		}
		defer unix.Close(orig)
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- res{-1, err}
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err == nil {
			err = loUp()
		}
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread() // else the thread ends locked, with this goroutine
		}
		ch <- res{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { unix.Close(r.fd) })
	return r.fd
}

func loUp() error {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(s)
	ifr, _ := unix.NewIfreq("lo")
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr)
}

// listenTCP listens on plain TCP (Go listens with MPTCP where it can,
// and an MPTCP socket cannot be a socket map's).
func listenTCP() (net.Listener, error) {
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	return lc.Listen(context.Background(), "tcp4", "127.0.0.1:0")
}

// in runs f in namespace ns.
func in(t *testing.T, ns int, f func() error) {
	t.Helper()
	if err := inNetns(ns, f); err != nil {
		t.Fatal(err)
	}
}

func listenerFD(t *testing.T, ln net.Listener) int {
	t.Helper()
	rc, err := ln.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	rc.Control(func(f uintptr) { fd = int(f) })
	return fd
}

func TestConnectionsToThePrefixOnAnyPortReachTheListener(t *testing.T) {
	ns := newNetns(t)
	var ln net.Listener
	in(t, ns, func() (err error) { ln, err = listenTCP(); return err })
	defer ln.Close()
	h, err := Attach(listenerFD(t, ln), DefaultPrefix)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, dst := range []string{"198.18.0.2:443", "198.19.255.254:22", "198.18.7.9:1"} {
		var c net.Conn
		in(t, ns, func() (err error) { c, err = net.DialTimeout("tcp4", dst, 10*time.Second); return err })
		ac, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		if got := ac.LocalAddr().String(); got != dst {
			t.Errorf("accepted connection's local address is %s, want the dialed %s", got, dst)
		}
		c.Write([]byte("x"))
		b := make([]byte, 1)
		ac.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := ac.Read(b); err != nil || b[0] != 'x' {
			t.Errorf("read %q, %v", b, err)
		}
		c.Close()
		ac.Close()
	}
	// Outside the prefix nothing is captured: no route at all.
	in(t, ns, func() error {
		_, err := net.DialTimeout("tcp4", "198.20.0.1:443", 10*time.Second)
		if err == nil {
			return errors.New("a connection outside the prefix went somewhere")
		}
		return nil
	})
	// Closed: connections to the prefix are refused at once.
	h.Close()
	in(t, ns, func() error {
		_, err := net.DialTimeout("tcp4", "198.18.0.2:443", 10*time.Second)
		if !errors.Is(err, unix.ECONNREFUSED) {
			return errors.New("after Close, a connection to the prefix was not refused: " + errString(err))
		}
		return nil
	})
}

func errString(err error) string {
	if err == nil {
		return "it connected"
	}
	return err.Error()
}

func TestAttachRefusesTheHostsOwnNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	ln, err := listenTCP()
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if h, err := Attach(listenerFD(t, ln), DefaultPrefix); err == nil {
		h.Close()
		t.Fatal("Attach accepted a listener in the caller's own network namespace")
	}
}

func TestAttachRefusesWhatIsNotAListeningTCPSocket(t *testing.T) {
	ns := newNetns(t)
	var ln net.Listener
	var udp net.PacketConn
	in(t, ns, func() (err error) {
		if ln, err = listenTCP(); err != nil {
			return err
		}
		udp, err = net.ListenPacket("udp4", "127.0.0.1:0")
		return err
	})
	defer ln.Close()
	defer udp.Close()
	var c net.Conn
	in(t, ns, func() (err error) { c, err = net.Dial("tcp4", ln.Addr().String()); return err })
	defer c.Close()
	f, _ := os.CreateTemp(t.TempDir(), "x")
	defer f.Close()
	rc, _ := udp.(*net.UDPConn).SyscallConn()
	var udpFD int
	rc.Control(func(fd uintptr) { udpFD = int(fd) })
	cc, _ := c.(*net.TCPConn).SyscallConn()
	var connFD int
	cc.Control(func(fd uintptr) { connFD = int(fd) })
	for name, fd := range map[string]int{"file": int(f.Fd()), "udp": udpFD, "connected tcp": connFD} {
		if h, err := Attach(fd, DefaultPrefix); err == nil {
			h.Close()
			t.Errorf("Attach accepted a %s", name)
		}
	}
	for _, p := range []string{"2001:db8::/64", "198.18.0.1/15", "10.0.0.0/4"} {
		if h, err := Attach(listenerFD(t, ln), netip.MustParsePrefix(p)); err == nil {
			h.Close()
			t.Errorf("Attach accepted prefix %s", p)
		}
	}
}
