package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// stateLockName is the file in serve's state directory that a running
// serve holds an exclusive lock on, and writes its PID into.
const stateLockName = "serve.lock"

// lockStateDir takes the exclusive lock on serve's state directory for the
// life of the process (the returned func releases it): two services over
// one state directory would each take the other's sandboxes for its own.
// A second serve is refused, naming the holder's PID. `sandgate sandbox`
// does not take it: the CLI's own commands keep working beside a serve.
func lockStateDir(dir string) (func(), error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	path := filepath.Join(dir, stateLockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			holder := "another process"
			if b, rerr := os.ReadFile(path); rerr == nil {
				if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); perr == nil && pid > 0 {
					holder = fmt.Sprintf("sandgate serve (pid %d)", pid)
				}
			}
			return nil, fmt.Errorf("state directory %s is in use by %s: stop it, or give this one a state directory of its own", dir, holder)
		}
		return nil, fmt.Errorf("locking %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return func() {
		f.Truncate(0)
		f.Close() // releases the lock
	}, nil
}
