package localbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The control protocol between sandgate processes on the host and a
// sandbox's init: JSON messages on a SOCK_SEQPACKET unix socket (one
// message per datagram, so no framing), the first carrying the caller's
// stdin, stdout and stderr as SCM_RIGHTS.
//
//	client → init  {"op":"exec","argv":[...],"env":[...],"dir":"/","main":false} + 3 fds
//	init → client  {"pid":N} or {"error":"..."}
//	client → init  {"op":"signal","signal":15} | {"op":"detach"}   (any number)
//	init → client  {"exited":true,"code":C}      (C = exit status, or 128+signal)
//
// A client that goes away without detaching takes its command's process
// group with it (SIGKILL): a dropped exec never leaves an orphan behind.
type request struct {
	Op     string   `json:"op"`
	Argv   []string `json:"argv,omitempty"`
	Env    []string `json:"env,omitempty"`
	Dir    string   `json:"dir,omitempty"`
	Main   bool     `json:"main,omitempty"`
	Signal int      `json:"signal,omitempty"`
}

type reply struct {
	Pid    int    `json:"pid,omitempty"`
	Error  string `json:"error,omitempty"`
	Exited bool   `json:"exited,omitempty"`
	Code   int    `json:"code,omitempty"`
}

// noDeadline clears a deadline.
var noDeadline time.Time

// sockAddr returns an address for the socket in dir that fits sun_path
// (108 bytes): long paths go through /proc/self/fd of an O_PATH handle on
// dir, which the caller closes after bind or connect.
func sockAddr(dir string) (string, func(), error) {
	p := filepath.Join(dir, sockFile)
	if len(p) < 100 {
		return p, func() {}, nil
	}
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", nil, err
	}
	return "/proc/self/fd/" + strconv.Itoa(fd) + "/" + sockFile, func() { unix.Close(fd) }, nil
}

// Stdio is what a command's standard streams are connected to. A nil file
// means /dev/null.
type Stdio struct {
	Stdin, Stdout, Stderr *os.File
}

func (s Stdio) fds() ([]int, func(), error) {
	var opened []*os.File
	done := func() {
		for _, f := range opened {
			f.Close()
		}
	}
	out := make([]int, 3)
	for i, f := range []*os.File{s.Stdin, s.Stdout, s.Stderr} {
		if f == nil {
			flag := os.O_WRONLY
			if i == 0 {
				flag = os.O_RDONLY
			}
			n, err := os.OpenFile(os.DevNull, flag, 0)
			if err != nil {
				done()
				return nil, nil, err
			}
			opened = append(opened, n)
			f = n
		}
		out[i] = int(f.Fd())
	}
	return out, done, nil
}

// Process is a command running in a sandbox, started by Run, Exec or Fork.
type Process struct {
	// Pid is the command's pid inside the sandbox's pid namespace.
	Pid int

	conn     *net.UnixConn
	mu       sync.Mutex // serialises writes
	waitOnce sync.Once
	code     int
	err      error
}

func dialInit(dir string) (*net.UnixConn, error) {
	addr, done, err := sockAddr(dir)
	if err != nil {
		return nil, err
	}
	defer done()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: addr, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("%w: its control socket: %v", ErrNotRunning, err)
	}
	return c, nil
}

// start sends an exec request to the init of the sandbox in dir.
func start(ctx context.Context, dir string, req request, stdio Stdio) (*Process, error) {
	conn, err := dialInit(dir)
	if err != nil {
		return nil, err
	}
	fds, done, err := stdio.fds()
	if err != nil {
		conn.Close()
		return nil, err
	}
	defer done()
	b, err := json.Marshal(req)
	if err != nil {
		conn.Close()
		return nil, err
	}
	if ctx != nil {
		if dl, ok := ctx.Deadline(); ok {
			conn.SetDeadline(dl)
		}
	}
	if _, _, err := conn.WriteMsgUnix(b, unix.UnixRights(fds...), nil); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: %v", ErrNotRunning, err)
	}
	var r reply
	if err := readReply(conn, &r); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: %v", ErrNotRunning, err)
	}
	conn.SetDeadline(noDeadline)
	if r.Error != "" {
		conn.Close()
		return nil, errors.New(r.Error)
	}
	return &Process{Pid: r.Pid, conn: conn}, nil
}

func readReply(conn *net.UnixConn, r *reply) error {
	buf := make([]byte, 4096)
	n, err := conn.Read(buf)
	if err != nil {
		return err
	}
	if n == 0 {
		return errors.New("the sandbox's init closed the connection")
	}
	return json.Unmarshal(buf[:n], r)
}

func (p *Process) send(req request) error {
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	_, err = p.conn.Write(b)
	return err
}

// Signal sends sig to the command's process group.
func (p *Process) Signal(sig syscall.Signal) error {
	return p.send(request{Op: "signal", Signal: int(sig)})
}

// Detach lets the command run on without this Process: closing the
// connection afterwards no longer kills it. Wait must not be called after.
func (p *Process) Detach() error {
	err := p.send(request{Op: "detach"})
	p.conn.Close()
	return err
}

// Wait waits for the command to exit and returns its exit code (128+signal
// when a signal killed it). It returns an error wrapping ErrNotRunning if
// the sandbox went away first.
func (p *Process) Wait() (int, error) {
	p.waitOnce.Do(func() {
		defer p.conn.Close()
		var r reply
		for {
			if err := readReply(p.conn, &r); err != nil {
				p.err = fmt.Errorf("%w: lost the command's exit status: %v", ErrNotRunning, err)
				return
			}
			if r.Exited {
				p.code = r.Code
				return
			}
		}
	})
	return p.code, p.err
}

// Close ends the Process's link to the command; the sandbox kills the
// command unless Detach was called.
func (p *Process) Close() error { return p.conn.Close() }
