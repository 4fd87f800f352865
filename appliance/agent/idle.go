package agent

import (
	"context"
	"os"
	"os/signal"

	"golang.org/x/sys/unix"
)

// Idle is what `sandgate agent --idle` runs as a sandbox's main process:
// it holds the sandbox open and reaps every orphan re-parented to it (as
// PID 1 of the sandbox or as a child subreaper), so nothing a command
// leaves behind stays a zombie. It returns when ctx ends or on SIGTERM or
// SIGINT. The service's agent is started beside it with `exec`.
func Idle(ctx context.Context) error {
	if os.Getpid() != 1 {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			return err
		}
	}
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, unix.SIGCHLD, unix.SIGTERM, unix.SIGINT)
	defer signal.Stop(sigs)
	for {
		reapAll()
		select {
		case <-ctx.Done():
			return nil
		case s := <-sigs:
			if s != unix.SIGCHLD {
				return nil
			}
		}
	}
}

// reapAll collects every exited child without blocking.
func reapAll() {
	for range 1 << 16 { // bounded: at most one pass over every possible pid
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
