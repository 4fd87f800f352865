package agent

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// pipeBufferSize is the buffer asked for a link's pipes (Linux's default
// cap for unprivileged processes, /proc/sys/fs/pipe-max-size). Over a link
// of pipes (Google's CLI) egress bytes cross the link in yamux data frames
// of up to 256 KiB; with the default 64 KiB a frame's writer parks and is
// woken four times while the reader drains it.
const pipeBufferSize = 1 << 20

// GrowPipe asks for pipeBufferSize bytes of buffer on c when it is a pipe;
// failing that, the pipe keeps its size (nothing else changes).
func GrowPipe(c syscall.Conn) {
	if c == nil {
		return
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return
	}
	rc.Control(func(fd uintptr) {
		var st unix.Stat_t
		if unix.Fstat(int(fd), &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFIFO {
			unix.FcntlInt(fd, unix.F_SETPIPE_SZ, pipeBufferSize)
		}
	})
}
