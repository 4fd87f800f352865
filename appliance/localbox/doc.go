// Package localbox is sandgate's own sandbox runtime for Linux hosts: the
// logic behind `sandgate sandbox`, a command line with the verbs of Cloud
// Run's `sandbox` CLI (run, exec, tar, fork, delete, and list), so that the
// appliance drives Google's CLI on Cloud Run and this one everywhere else
// through one code path.
//
// A sandbox is a directory under the state directory (config.json,
// state.json, the overlay upper and work directories, a scaffold layer
// that holds mount points, and ctl.sock) plus, while it runs, one init
// process: pid 1 of fresh mount, pid, net, uts, ipc and cgroup namespaces,
// whose root is an overlay of the rootfs (read-only) under the sandbox's own
// upper. The init forks every command of the sandbox, the first (run's CMD)
// and those of exec, from one locked OS thread that has dropped to Docker's
// default capabilities, set no_new_privs and loaded Docker's default
// seccomp profile, so that every command inherits exactly that containment.
// Callers hand the init their stdin, stdout and stderr as file descriptors
// over ctl.sock (SCM_RIGHTS): bytes never pass through sandgate.
//
// The init is not dumpable and holds no host file: a monitor process on the
// host (its parent, invisible from inside) keeps init.log and writes
// stopped.json when the init reports a stop. Both are the same binary
// re-executed with a marker in its environment: a program that uses this
// package calls IsInit and InitMain first thing in main (and in TestMain),
// before anything else runs.
//
// Every mount lives in the sandbox's mount namespace, so when its last
// process dies they go with it; a crashed host leaves only the directory
// and cgroups, which List reports as "crashed" and Delete removes.
package localbox
