package agent

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"
)

// openPTY allocates a pseudo-terminal in the sandbox: its master (the
// agent's end, non-blocking so that reads take deadlines) and its slave
// (the command's terminal). The slave is opened from the master itself
// (TIOCGPTPEER) where the kernel can, so no path lookup in /dev/pts is
// involved; else by the number the master names.
func openPTY() (master, slave *os.File, err error) {
	m, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	if err := unix.IoctlSetPointerInt(m, unix.TIOCSPTLCK, 0); err != nil {
		unix.Close(m)
		return nil, nil, fmt.Errorf("unlock the terminal: %w", err)
	}
	sfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(m), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		n, err := unix.IoctlGetUint32(m, unix.TIOCGPTN)
		if err != nil {
			unix.Close(m)
			return nil, nil, fmt.Errorf("the terminal's number: %w", err)
		}
		fd, err := unix.Open("/dev/pts/"+strconv.FormatUint(uint64(n), 10), unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
		if err != nil {
			unix.Close(m)
			return nil, nil, fmt.Errorf("open the terminal /dev/pts/%d: %w", n, err)
		}
		sfd = uintptr(fd)
	}
	return os.NewFile(uintptr(m), "ptmx"), os.NewFile(sfd, "pts"), nil
}

// setWinsize sets a terminal's size; a zero size is left as the kernel
// made it.
func setWinsize(master *os.File, size wireSize) error {
	if size.Rows == 0 || size.Cols == 0 {
		return nil
	}
	rc, err := master.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: size.Rows, Col: size.Cols})
	}); err != nil {
		return err
	}
	return serr
}

// execPTY runs a resolved command on a terminal of its own: a new session
// whose controlling terminal is the slave of a PTY allocated here, so that
// shells, editors and pagers behave as at a console. The stream carries,
// after the response (id, pid), the terminal's output as data frames, then
// the Exit message; from the client, data frames are typed into the
// terminal and a message with Size resizes it (End is ignored: a terminal's
// input has no end but a hangup). The client closing the stream before the
// exit kills the command's process group (its session leader's), as exec
// does.
func (s *server) execPTY(st *yamux.Stream, f *framer, cmd command, size wireSize) {
	fail := func(err error) { f.msg(response{Error: toWire(err)}) }
	master, slave, err := openPTY()
	if err != nil {
		fail(fmt.Errorf("exec: allocating a terminal: %w", err))
		return
	}
	if err := setWinsize(master, size); err != nil {
		closeAll(master, slave)
		fail(fmt.Errorf("exec: sizing the terminal: %w", err))
		return
	}
	p, err := s.procs.start(cmd.exe, cmd.args, &os.ProcAttr{
		Dir:   cmd.dir,
		Env:   cmd.env,
		Files: []*os.File{slave, slave, slave},
		// A session of its own (so its pid is its process group's id too,
		// which signal reaches) with the terminal as its controlling one.
		Sys: &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0},
	})
	slave.Close() // the command has its own; the master reads EIO once it is gone
	if err != nil {
		master.Close()
		fail(fmt.Errorf("exec %s: %w", cmd.args[0], err))
		return
	}
	defer s.procs.remove(p)
	if err := f.msg(response{ID: p.id, PID: p.pid}); err != nil {
		p.signal(syscall.SIGKILL)
	}

	var exitSent atomic.Bool
	go terminalInput{st: st, master: master, p: p, exitSent: &exitSent}.run()

	var pumps sync.WaitGroup
	pumps.Add(1)
	go outputPump{r: master, f: f, kind: kindData}.run(&pumps)

	ps, werr := p.p.Wait()
	p.exited.Store(true)
	master.SetReadDeadline(time.Now().Add(cmd.waitDelay))
	pumps.Wait()
	master.Close()

	exitSent.Store(true)
	sendExit(f, cmd.args[0], ps, werr)
}

// terminalInput types what the client sends into a terminal and applies
// its resizes, until the stream ends; a stream that ends before the exit
// was sent kills the command.
type terminalInput struct {
	st       *yamux.Stream
	master   *os.File
	p        *proc
	exitSent *atomic.Bool
}

func (t terminalInput) run() {
	var buf []byte
	for {
		kind, payload, err := readFrame(t.st, &buf)
		if err != nil {
			if !t.exitSent.Load() {
				t.p.signal(syscall.SIGKILL)
			}
			return
		}
		switch kind {
		case kindData:
			// Once the command ended (the master closed), what comes late
			// is dropped.
			t.master.Write(payload)
		case kindMsg:
			var m response
			if decodeMsg(payload, &m) == nil && m.Size != nil {
				setWinsize(t.master, *m.Size)
			}
		}
	}
}
