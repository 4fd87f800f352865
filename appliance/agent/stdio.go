package agent

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// StdioLink returns the link `sandgate agent` serves on: its standard
// input and output. When both are one unix stream socket (the launcher of a
// local sandbox hands the agent one end of a socketpair), the link is that
// socket as a *net.UnixConn, over which Serve passes relay connections as
// descriptors; otherwise it is r and w (Cloud Run's CLI gives pipes). When w
// is the process's fd 1, fd 1 then points at stderr (and fd 0 at /dev/null
// when the link was taken from it), so nothing printed to standard output
// by mistake can corrupt the link.
func StdioLink(r io.Reader, w io.Writer) (io.ReadWriteCloser, error) {
	if r == nil {
		r = os.Stdin
	}
	rf, rok := r.(*os.File)
	wf, wok := w.(*os.File)
	if !wok || wf.Fd() != 1 {
		return stdio{r, w}, nil
	}
	if rok && rf.Fd() == 0 && sameUnixStream(0, 1) {
		fd, err := unix.FcntlInt(0, unix.F_DUPFD_CLOEXEC, 3)
		if err != nil {
			return nil, fmt.Errorf("agent: take the link from stdin: %w", err)
		}
		f := os.NewFile(uintptr(fd), "agent-link")
		c, err := net.FileConn(f)
		f.Close() // FileConn made its own duplicate
		if err != nil {
			return nil, fmt.Errorf("agent: use the stdio socket as the link: %w", err)
		}
		if err := pointAt(1, 2); err != nil {
			c.Close()
			return nil, err
		}
		if null, err := os.Open(os.DevNull); err == nil {
			unix.Dup3(int(null.Fd()), 0, 0)
			null.Close()
		}
		return c.(*net.UnixConn), nil
	}
	fd, err := unix.FcntlInt(1, unix.F_DUPFD_CLOEXEC, 3)
	if err != nil {
		return nil, fmt.Errorf("agent: move the link off fd 1: %w", err)
	}
	if err := pointAt(1, 2); err != nil {
		unix.Close(fd)
		return nil, err
	}
	out := os.NewFile(uintptr(fd), "agent-link")
	GrowPipe(out)
	if rok {
		GrowPipe(rf)
	}
	return stdio{r, out}, nil
}

// sameUnixStream reports whether descriptors a and b are one AF_UNIX
// SOCK_STREAM socket.
func sameUnixStream(a, b int) bool {
	var sa, sb unix.Stat_t
	if unix.Fstat(a, &sa) != nil || unix.Fstat(b, &sb) != nil {
		return false
	}
	return sa.Mode&unix.S_IFMT == unix.S_IFSOCK && sa.Dev == sb.Dev && sa.Ino == sb.Ino && isUnixStream(a)
}

// pointAt makes descriptor fd refer to what target refers to.
func pointAt(fd, target int) error {
	if err := unix.Dup3(target, fd, 0); err != nil { // Dup3: linux/arm64 has no dup2
		return fmt.Errorf("agent: point fd %d at fd %d: %w", fd, target, err)
	}
	return nil
}

// stdio joins a reader and a writer into the link's ReadWriteCloser.
type stdio struct {
	io.Reader
	io.Writer
}

func (s stdio) Close() error {
	var errs []error
	if c, ok := s.Reader.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	if c, ok := s.Writer.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}
