package agent

import (
	"encoding/binary"
	"net/netip"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// diagInode asks the kernel (NETLINK_SOCK_DIAG, one exact lookup) for the
// inode of the TCP socket local→remote in this network namespace: what
// socketInode finds by reading all of /proc/net/tcp, whose cost grows
// with every socket the namespace has (TIME_WAIT ones included). "" when
// the kernel cannot tell (no sock_diag, as in gVisor; no such socket):
// then the caller reads the table.
func diagInode(local, remote netip.AddrPort) string {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return ""
	}
	defer unix.Close(fd)
	tv := unix.NsecToTimeval(int64(100 * time.Millisecond))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if err := unix.Sendto(fd, diagRequest(local, remote), 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return ""
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return ""
	}
	return diagReplyInode(buf[:n])
}

// diagRequest is a SOCK_DIAG_BY_FAMILY request (struct nlmsghdr, then
// struct inet_diag_req_v2) for the one TCP socket local→remote, in any
// state.
func diagRequest(local, remote netip.AddrPort) []byte {
	const hdr, req = 16, 56
	b := make([]byte, hdr+req)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], hdr+req)
	ne.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(b[8:], 1) // sequence
	r := b[hdr:]
	r[0] = unix.AF_INET
	if local.Addr().Is6() && !local.Addr().Is4In6() {
		r[0] = unix.AF_INET6
	}
	r[1] = syscall.IPPROTO_TCP
	ne.PutUint32(r[4:], 0xffffffff) // every state
	id := r[8:]
	binary.BigEndian.PutUint16(id[0:], local.Port())
	binary.BigEndian.PutUint16(id[2:], remote.Port())
	put := func(dst []byte, a netip.Addr) {
		if a.Is4() || a.Is4In6() {
			v4 := a.Unmap().As4()
			copy(dst, v4[:])
			return
		}
		v6 := a.As16()
		copy(dst, v6[:])
	}
	put(id[4:20], local.Addr())
	put(id[20:36], remote.Addr())
	ne.PutUint32(id[40:], 0xffffffff) // INET_DIAG_NOCOOKIE
	ne.PutUint32(id[44:], 0xffffffff)
	return b
}

// diagReplyInode reads the inode out of a reply to diagRequest: a message
// of type SOCK_DIAG_BY_FAMILY whose struct inet_diag_msg has it at offset
// 68; "" for an error message or anything shorter.
func diagReplyInode(b []byte) string {
	const hdr, inodeAt = 16, 68
	ne := binary.NativeEndian
	if len(b) < hdr+inodeAt+4 || ne.Uint16(b[4:]) != unix.SOCK_DIAG_BY_FAMILY || int(ne.Uint32(b[0:])) > len(b) {
		return ""
	}
	inode := ne.Uint32(b[hdr+inodeAt:])
	if inode == 0 {
		return ""
	}
	return strconv.FormatUint(uint64(inode), 10)
}
