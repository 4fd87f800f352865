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
// id names the lock (lockID) for the shard's heartbeat.
func lockStateDir(dir string) (release func(), id string, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, "", err
	}
	path := filepath.Join(dir, stateLockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, "", err
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
			return nil, "", fmt.Errorf("state directory %s is in use by %s: stop it, or give this one a state directory of its own", dir, holder)
		}
		return nil, "", fmt.Errorf("locking %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return func() {
		f.Truncate(0)
		f.Close() // releases the lock
	}, lockID(f), nil
}

// lockID names the lock on f so that no two processes can hold locks of
// the same name at once: the running kernel (its boot id: a flock holds
// within one kernel) and the file's device and inode (two containers'
// state directories at the same path are different files). "" when the
// boot id cannot be read.
func lockID(f *os.File) string {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	var st syscall.Stat_t
	if err != nil || syscall.Fstat(int(f.Fd()), &st) != nil {
		return ""
	}
	return fmt.Sprintf("boot %s, file %d:%d", strings.TrimSpace(string(boot)), st.Dev, st.Ino)
}
