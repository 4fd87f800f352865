// Package netcapture steers every TCP connection made inside one network
// namespace to an IPv4 prefix, on any port, to one listening socket, with
// no packet filter: a local route makes the prefix local to the namespace,
// and an sk_lookup BPF program attached to the namespace (Linux 5.9+)
// hands each connection to the listener, which accepts it with the
// address and port the process dialed as its local address.
//
// Why not iptables or nftables (REDIRECT, TPROXY): they need rules in
// tables a sandbox's namespace shares a design with, a program or a
// netlink dialect of their own, and they rewrite packets. sk_lookup is the
// kernel's own answer to "one socket for many addresses and every port"
// (it is what it was added for): the program is twenty instructions, runs
// only when a connection to the prefix arrives, and rewrites nothing.
// Nothing changes outside the namespace: the route and the program live in
// it and go with it.
//
// Attaching needs CAP_NET_ADMIN and CAP_BPF in the host's user namespace
// (root on the host). The namespace is the listener's own: whoever gives
// the listener chooses nothing else, and a listener in the caller's own
// namespace is refused, so the host's network is never changed.
package netcapture

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DefaultPrefix is the range sandboxes' names are given addresses from:
// 198.18.0.0/15, reserved for benchmarking (RFC 2544) and so never a real
// destination; the range fake-address resolvers use.
var DefaultPrefix = netip.MustParsePrefix("198.18.0.0/15")

// ErrUnsupported matches an error of Attach that says the host cannot
// capture at all (no BPF, no sk_lookup, not root), as opposed to a bad
// listener.
var ErrUnsupported = errors.New("transparent capture is not supported here")

// Hook is a capture attached to one network namespace. Closing it detaches
// the program; the route stays with the namespace (it leads to nothing
// once no program hands its connections to a listener: they are refused).
type Hook struct {
	link, prog, sockmap int
	prefix              netip.Prefix
}

// Attach makes prefix local in the network namespace of the listening TCP
// socket fd (AF_INET) and steers every TCP connection to an address of
// prefix, on any port, to that socket. fd stays the caller's; the hook
// holds the socket by reference until it is closed or the socket is.
func Attach(fd int, prefix netip.Prefix) (*Hook, error) {
	if !prefix.Addr().Is4() || prefix.Bits() < 8 || prefix != prefix.Masked() {
		return nil, fmt.Errorf("netcapture: prefix %s: want an IPv4 prefix of /8 or longer, host bits clear", prefix)
	}
	if err := checkListener(fd); err != nil {
		return nil, err
	}
	ns, err := unix.IoctlRetInt(fd, unix.SIOCGSKNS)
	if err != nil {
		return nil, fmt.Errorf("%w: the listener's network namespace (SIOCGSKNS): %v", ErrUnsupported, err)
	}
	defer unix.Close(ns)
	if host, err := isHostNetns(ns); err != nil {
		return nil, err
	} else if host {
		return nil, errors.New("netcapture: the listener is in this process's own network namespace (or PID 1's); capture is only ever attached to a sandbox's")
	}
	if err := inNetns(ns, func() error { return addLocalRoute(prefix) }); err != nil {
		return nil, fmt.Errorf("netcapture: local route for %s: %w", prefix, err)
	}
	h := &Hook{link: -1, prog: -1, sockmap: -1, prefix: prefix}
	ok := false
	defer func() {
		if !ok {
			h.Close()
		}
	}()
	if h.sockmap, err = mapCreate(); err != nil {
		return nil, fmt.Errorf("%w: a socket map: %v", ErrUnsupported, err)
	}
	if err := mapUpdate(h.sockmap, 0, fd); err != nil {
		return nil, fmt.Errorf("netcapture: putting the listener in the socket map: %w", err)
	}
	if h.prog, err = progLoad(program(h.sockmap, prefix)); err != nil {
		return nil, fmt.Errorf("%w: loading the sk_lookup program: %v", ErrUnsupported, err)
	}
	if h.link, err = linkCreate(h.prog, ns); err != nil {
		return nil, fmt.Errorf("%w: attaching the sk_lookup program to the namespace: %v", ErrUnsupported, err)
	}
	ok = true
	return h, nil
}

// Prefix returns the captured prefix.
func (h *Hook) Prefix() netip.Prefix { return h.prefix }

// Close detaches the program and releases the listener. It is idempotent.
func (h *Hook) Close() error {
	for _, fd := range []*int{&h.link, &h.prog, &h.sockmap} {
		if *fd >= 0 {
			unix.Close(*fd)
			*fd = -1
		}
	}
	return nil
}

// checkListener refuses anything but a listening IPv4 TCP socket.
func checkListener(fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("netcapture: listener: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return errors.New("netcapture: the listener is not a socket")
	}
	for _, c := range []struct {
		opt  int
		want int
		what string
	}{
		{unix.SO_DOMAIN, unix.AF_INET, "an IPv4 socket"},
		{unix.SO_TYPE, unix.SOCK_STREAM, "a stream socket"},
		{unix.SO_PROTOCOL, unix.IPPROTO_TCP, "a TCP socket"},
		{unix.SO_ACCEPTCONN, 1, "a listening socket"},
	} {
		v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, c.opt)
		if err != nil {
			return fmt.Errorf("netcapture: listener: %w", err)
		}
		if v != c.want {
			return fmt.Errorf("netcapture: the listener is not %s", c.what)
		}
	}
	return nil
}

// hostNetns are the network namespaces capture is never attached to: this
// process's own, as it was when the program started (a thread may join
// another namespace for a moment, and /proc/self follows the main thread,
// which could be one), and that of PID 1 where it is visible.
var hostNetns = func() (ids [][2]uint64) {
	for _, p := range []string{"/proc/thread-self/ns/net", "/proc/self/ns/net", "/proc/1/ns/net"} {
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil {
			ids = append(ids, [2]uint64{st.Dev, st.Ino})
		}
	}
	return ids
}()

// isHostNetns reports whether ns is one of hostNetns (or cannot be told).
func isHostNetns(ns int) (bool, error) {
	var st unix.Stat_t
	if err := unix.Fstat(ns, &st); err != nil {
		return true, err
	}
	if len(hostNetns) == 0 {
		return true, errors.New("netcapture: this process's network namespace is unknown (no /proc)")
	}
	for _, id := range hostNetns {
		if id == [2]uint64{st.Dev, st.Ino} {
			return true, nil
		}
	}
	return false, nil
}

// inNetns runs f on an OS thread that joined network namespace ns, and
// brings the thread back. Should it fail to come back, the thread is left
// locked, and so ends with its goroutine: no other goroutine ever runs in
// the sandbox's namespace.
func inNetns(ns int, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer unix.Close(self)
		if err := unix.Setns(ns, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("joining the namespace: %w", err)
			return
		}
		ferr := f()
		if err := unix.Setns(self, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("leaving the namespace: %w", err) // the thread dies locked
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// addLocalRoute adds "local <prefix> dev lo" to the local table of the
// current thread's network namespace (EEXIST is success).
func addLocalRoute(prefix netip.Prefix) error {
	lo, err := loIndex()
	if err != nil {
		return err
	}
	s, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer unix.Close(s)
	if err := unix.Bind(s, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	dst := prefix.Addr().As4()
	var b []byte
	b = binary.NativeEndian.AppendUint32(b, 0) // length, set below
	b = binary.NativeEndian.AppendUint16(b, unix.RTM_NEWROUTE)
	b = binary.NativeEndian.AppendUint16(b, unix.NLM_F_REQUEST|unix.NLM_F_ACK|unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	b = binary.NativeEndian.AppendUint32(b, 1) // seq
	b = binary.NativeEndian.AppendUint32(b, 0) // pid
	// struct rtmsg
	b = append(b, unix.AF_INET, byte(prefix.Bits()), 0, 0, unix.RT_TABLE_LOCAL, unix.RTPROT_BOOT, unix.RT_SCOPE_HOST, unix.RTN_LOCAL)
	b = binary.NativeEndian.AppendUint32(b, 0) // flags
	b = appendAttr(b, unix.RTA_DST, dst[:])
	b = appendAttr(b, unix.RTA_OIF, binary.NativeEndian.AppendUint32(nil, uint32(lo)))
	b = appendAttr(b, unix.RTA_TABLE, binary.NativeEndian.AppendUint32(nil, unix.RT_TABLE_LOCAL))
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	if err := unix.Sendto(s, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(s, buf, 0)
	if err != nil {
		return err
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if m.Header.Type != unix.NLMSG_ERROR || len(m.Data) < 4 {
			continue
		}
		errno := -int32(binary.NativeEndian.Uint32(m.Data))
		switch errno {
		case 0, int32(unix.EEXIST):
			return nil
		default:
			return unix.Errno(errno)
		}
	}
	return errors.New("no answer from the kernel")
}

func appendAttr(b []byte, typ uint16, data []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(4+len(data)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// loIndex returns the index of the loopback interface of the current
// thread's network namespace.
func loIndex() (int, error) {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(s)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return 0, err
	}
	if err := unix.IoctlIfreq(s, unix.SIOCGIFINDEX, ifr); err != nil {
		return 0, fmt.Errorf("the loopback interface: %w", err)
	}
	return int(ifr.Uint32()), nil
}

// BPF instructions, as the kernel reads them (struct bpf_insn).
type insn struct {
	code uint8
	regs uint8 // dst in the low nibble, src in the high one
	off  int16
	imm  int32
}

// Opcodes and registers used by program.
const (
	r0, r1, r2, r3, r6, r7, r10 = 0, 1, 2, 3, 6, 7, 10

	ldxW    = unix.BPF_LDX | unix.BPF_MEM | unix.BPF_W
	stW     = unix.BPF_ST | unix.BPF_MEM | unix.BPF_W
	movX    = unix.BPF_ALU64 | unix.BPF_MOV | unix.BPF_X
	movK    = unix.BPF_ALU64 | unix.BPF_MOV | unix.BPF_K
	addK    = unix.BPF_ALU64 | unix.BPF_ADD | unix.BPF_K
	and32K  = unix.BPF_ALU | unix.BPF_AND | unix.BPF_K
	jneK    = unix.BPF_JMP | unix.BPF_JNE | unix.BPF_K
	jeqK    = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
	call    = unix.BPF_JMP | unix.BPF_CALL
	exit    = unix.BPF_JMP | unix.BPF_EXIT
	ldImm64 = unix.BPF_LD | unix.BPF_DW | unix.BPF_IMM

	// Helper ids (enum bpf_func_id).
	fnMapLookupElem = 1
	fnSkRelease     = 86
	fnSkAssign      = 124

	// struct bpf_sk_lookup offsets.
	offFamily   = 8
	offProtocol = 12
	offLocalIP4 = 40

	skPass = 1
)

func ins(code uint8, dst, src uint8, off int16, imm int32) insn {
	return insn{code: code, regs: dst | src<<4, off: off, imm: imm}
}

// program is the sk_lookup program: a TCP/IPv4 connection to prefix gets
// the socket in slot 0 of sockmap; anything else (or no socket there) is
// looked up as usual.
//
//	if ctx.family != AF_INET || ctx.protocol != TCP || ctx.local_ip4 & mask != net: pass
//	sk = map_lookup_elem(sockmap, &0); if !sk: pass
//	sk_assign(ctx, sk, 0); sk_release(sk); pass
func program(sockmap int, prefix netip.Prefix) []insn {
	a := prefix.Addr().As4()
	m := netip.PrefixFrom(netip.AddrFrom4([4]byte{255, 255, 255, 255}), prefix.Bits()).Masked().Addr().As4()
	// local_ip4 is in network byte order: read as a native u32, so are
	// the address and mask it is compared with.
	net := int32(binary.NativeEndian.Uint32(a[:]))
	mask := int32(binary.NativeEndian.Uint32(m[:]))
	p := []insn{
		ins(movX, r6, r1, 0, 0),
		ins(ldxW, r2, r6, offFamily, 0),
		ins(jneK, r2, 0, 0, unix.AF_INET), // → pass (patched)
		ins(ldxW, r2, r6, offProtocol, 0),
		ins(jneK, r2, 0, 0, unix.IPPROTO_TCP), // → pass
		ins(ldxW, r2, r6, offLocalIP4, 0),
		ins(and32K, r2, 0, 0, mask),
		ins(jneK, r2, 0, 0, net), // → pass
		ins(ldImm64, r1, unix.BPF_PSEUDO_MAP_FD, 0, int32(sockmap)),
		ins(0, 0, 0, 0, 0),
		ins(stW, r10, 0, -4, 0),
		ins(movX, r2, r10, 0, 0),
		ins(addK, r2, 0, 0, -4),
		ins(call, 0, 0, 0, fnMapLookupElem),
		ins(jeqK, r0, 0, 0, 0), // → pass
		ins(movX, r7, r0, 0, 0),
		ins(movX, r1, r6, 0, 0),
		ins(movX, r2, r7, 0, 0),
		ins(movK, r3, 0, 0, 0),
		ins(call, 0, 0, 0, fnSkAssign),
		ins(movX, r1, r7, 0, 0),
		ins(call, 0, 0, 0, fnSkRelease),
	}
	pass := len(p)
	for i := range p {
		if (p[i].code == jneK || p[i].code == jeqK) && p[i].off == 0 {
			p[i].off = int16(pass - i - 1)
		}
	}
	return append(p, ins(movK, r0, 0, 0, skPass), ins(exit, 0, 0, 0, 0))
}

func bpf(cmd int, attr unsafe.Pointer, size uintptr) (int, error) {
	r, _, errno := unix.Syscall(unix.SYS_BPF, uintptr(cmd), uintptr(attr), size)
	runtime.KeepAlive(attr)
	if errno != 0 {
		return -1, errno
	}
	return int(r), nil
}

func mapCreate() (int, error) {
	attr := struct {
		mapType, keySize, valueSize, maxEntries, flags uint32
	}{unix.BPF_MAP_TYPE_SOCKMAP, 4, 8, 1, 0}
	fd, err := bpf(unix.BPF_MAP_CREATE, unsafe.Pointer(&attr), unsafe.Sizeof(attr))
	if err == nil {
		unix.CloseOnExec(fd)
	}
	return fd, err
}

func mapUpdate(m int, key uint32, sock int) error {
	val := uint64(sock)
	attr := struct {
		mapFD uint32
		_     uint32
		key   uint64
		value uint64
		flags uint64
	}{mapFD: uint32(m), key: uint64(uintptr(unsafe.Pointer(&key))), value: uint64(uintptr(unsafe.Pointer(&val)))}
	_, err := bpf(unix.BPF_MAP_UPDATE_ELEM, unsafe.Pointer(&attr), unsafe.Sizeof(attr))
	runtime.KeepAlive(&key)
	runtime.KeepAlive(&val)
	return err
}

func progLoad(p []insn) (int, error) {
	license := []byte("Dual MIT/GPL\x00")
	logBuf := make([]byte, 16<<10)
	attr := struct {
		progType, insnCnt uint32
		insns, license    uint64
		logLevel, logSize uint32
		logBuf            uint64
		kernVersion       uint32
		progFlags         uint32
		name              [16]byte
		ifindex           uint32
		expectedAttach    uint32
	}{
		progType: unix.BPF_PROG_TYPE_SK_LOOKUP, insnCnt: uint32(len(p)),
		insns: uint64(uintptr(unsafe.Pointer(&p[0]))), license: uint64(uintptr(unsafe.Pointer(&license[0]))),
		expectedAttach: unix.BPF_SK_LOOKUP,
	}
	copy(attr.name[:], "sandgate_cap")
	fd, err := bpf(unix.BPF_PROG_LOAD, unsafe.Pointer(&attr), unsafe.Sizeof(attr))
	if err != nil {
		// Load again with the verifier's log, to say why.
		attr.logLevel, attr.logSize, attr.logBuf = 1, uint32(len(logBuf)), uint64(uintptr(unsafe.Pointer(&logBuf[0])))
		if fd2, err2 := bpf(unix.BPF_PROG_LOAD, unsafe.Pointer(&attr), unsafe.Sizeof(attr)); err2 == nil {
			return fd2, nil
		}
		runtime.KeepAlive(logBuf)
		if n := indexNUL(logBuf); n > 0 {
			err = fmt.Errorf("%w (verifier: %s)", err, logBuf[:n])
		}
	}
	runtime.KeepAlive(p)
	runtime.KeepAlive(license)
	if err == nil {
		unix.CloseOnExec(fd)
	}
	return fd, err
}

func indexNUL(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return len(b)
}

func linkCreate(prog, netns int) (int, error) {
	attr := struct {
		progFD, targetFD, attachType, flags uint32
		_                                   [32]byte
	}{progFD: uint32(prog), targetFD: uint32(netns), attachType: unix.BPF_SK_LOOKUP}
	fd, err := bpf(unix.BPF_LINK_CREATE, unsafe.Pointer(&attr), unsafe.Sizeof(attr))
	if err == nil {
		unix.CloseOnExec(fd)
	}
	return fd, err
}
