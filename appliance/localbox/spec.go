package localbox

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"github.com/sandgate/sandgate/appliance/sandboxcli"

	"cmp"
	"fmt"
	"math"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Errors callers branch on with errors.Is: the sandbox CLI's contract
// (see sandboxcli), named here too.
var (
	ErrBadInput   = sandboxcli.ErrBadInput
	ErrNotFound   = sandboxcli.ErrNotFound
	ErrExists     = sandboxcli.ErrExists
	ErrNotRunning = sandboxcli.ErrNotRunning
	ErrRunning    = sandboxcli.ErrRunning
	ErrBusy       = sandboxcli.ErrBusy
)

// MaxIDLength bounds ids (sandboxcli.MaxIDLength).
const MaxIDLength = sandboxcli.MaxIDLength

// CheckID reports whether id is a valid sandbox id (sandboxcli.CheckID).
func CheckID(id string) error { return sandboxcli.CheckID(id) }

// Mount is a bind mount of a host path into the sandbox.
type Mount struct {
	Source      string `json:"source"`      // host path (file or directory)
	Destination string `json:"destination"` // absolute path inside the sandbox
	ReadOnly    bool   `json:"readonly,omitempty"`
}

// ParseMount parses Cloud Run's mount syntax,
// "type=bind,source=S,destination=D[,readonly]" (also src=, dst=, target=,
// ro, readonly=true|false). Only bind mounts exist.
func ParseMount(s string) (Mount, error) {
	var m Mount
	typ := ""
	for _, kv := range strings.Split(s, ",") {
		k, v, hasValue := strings.Cut(kv, "=")
		switch strings.ToLower(strings.TrimSpace(k)) {
		case "type":
			typ = v
		case "source", "src":
			m.Source = v
		case "destination", "dst", "target":
			m.Destination = v
		case "readonly", "ro":
			if !hasValue {
				m.ReadOnly = true
				continue
			}
			b, err := strconv.ParseBool(v)
			if err != nil {
				return Mount{}, fmt.Errorf("%w: mount %q: readonly=%q: want true or false", ErrBadInput, s, v)
			}
			m.ReadOnly = b
		default:
			return Mount{}, fmt.Errorf("%w: mount %q: unknown key %q (want type, source, destination, readonly)", ErrBadInput, s, k)
		}
	}
	if typ != "bind" {
		return Mount{}, fmt.Errorf("%w: mount %q: want type=bind", ErrBadInput, s)
	}
	if err := m.check(); err != nil {
		return Mount{}, err
	}
	return m, nil
}

func (m Mount) check() error {
	if !filepath.IsAbs(m.Source) {
		return fmt.Errorf("%w: mount source %q must be an absolute host path", ErrBadInput, m.Source)
	}
	d := m.Destination
	if !path.IsAbs(d) || path.Clean(d) != d || d == "/" {
		return fmt.Errorf("%w: mount destination %q must be a clean absolute path other than /", ErrBadInput, d)
	}
	for _, reserved := range []string{"/proc", "/dev", "/sys"} {
		if d == reserved || strings.HasPrefix(d, reserved+"/") {
			return fmt.Errorf("%w: mount destination %q: %s is the sandbox's own", ErrBadInput, d, reserved)
		}
	}
	return nil
}

// ParseSize parses a byte count (sandboxcli.ParseSize).
func ParseSize(s string) (int64, error) { return sandboxcli.ParseSize(s) }

// Config is what a sandbox is made of. It is saved as config.json when the
// sandbox is created, so that fork can make another one like it.
type Config struct {
	ID string `json:"id"`
	// Rootfs is the host directory seen read-only under the sandbox's
	// upper, as it is: everything in it is the sandbox's to read. "" means
	// the default image, made from an allowlist of the host's (see
	// image.go): its programs and libraries, and an /etc of the sandbox's
	// own.
	Rootfs string `json:"rootfs"`
	// Masks are host paths no sandbox may see, beside the state
	// directory (always hidden): wherever the image shows one, it is
	// covered (an empty directory, an empty file). An image inside one is
	// refused.
	Masks []string `json:"masks,omitempty"`
	// UserNS says whether the sandbox runs in a user namespace of its own:
	// UserNSAuto (where the kernel allows), UserNSOn, UserNSOff.
	UserNS string `json:"userns,omitempty"`
	// Template names a template of the state directory (see
	// ImportTemplate) mounted read-only between the sandbox's upper and
	// the rootfs; "" means none.
	Template string `json:"template,omitempty"`
	// Write makes the root writable (into the upper); without it only
	// /tmp (a tmpfs) and read-write mounts can be written.
	Write  bool     `json:"write,omitempty"`
	Env    []string `json:"env,omitempty"` // K=V, for run's CMD and every exec
	Dir    string   `json:"dir,omitempty"` // working directory; "" means /
	Mounts []Mount  `json:"mounts,omitempty"`
	// Memory and Pids are cgroup limits; 0 means none.
	Memory int64 `json:"memory,omitempty"`
	Pids   int64 `json:"pids,omitempty"`
	// CPU is how many cores' worth of time the sandbox's processes may use
	// together (cgroup v2 cpu.max, v1 cpu.cfs_quota_us over a 100 ms
	// period); past it they wait for the next period (throttled, never
	// killed). 0, or the host's cores or more, means no limit.
	CPU float64 `json:"cpu,omitempty"`
	// CPUWeight is the sandbox's share of the cores when sandboxes contend
	// for them, 1 to 10000 (cgroup v2 cpu.weight; v1 cpu.shares scaled as
	// systemd scales it, 100 ↔ 1024); 0 means the kernel's default, 100.
	CPUWeight int `json:"cpuWeight,omitempty"`
	// SandboxesCPUWeight is the CPU weight of what all the state
	// directory's sandboxes weigh together against the processes beside
	// them (their parent cgroup; cgroup v1: in the cgroup of the process
	// that runs `sandgate sandbox`, the service's), 1 to 10000: 100 is as
	// much as one of them, 25 a quarter, so that the service runs first
	// when it has work. 0 leaves the parent's as it is (the kernel's
	// default, 100, where nothing set it).
	SandboxesCPUWeight int `json:"sandboxesCpuWeight,omitempty"`
	// Disk is the bytes the sandbox's writable layer may take on the host:
	// the size of the file system of its own that holds it (see disk.go),
	// past which its writes fail with ENOSPC. 0 means no quota: the layer
	// lives in the state directory's file system, as large as that lets it.
	Disk int64 `json:"disk,omitempty"`
	// TmpSize and ShmSize bound the tmpfs on /tmp and /dev/shm, in bytes;
	// 0 means DefaultTmpSize and DefaultShmSize. Without a size a tmpfs may
	// take half the host's memory; its pages count against the memory
	// cgroup (--memory) where there is one, and against the host where not.
	TmpSize int64 `json:"tmpSize,omitempty"`
	ShmSize int64 `json:"shmSize,omitempty"`
	// TrustCA is PEM certificates (a CA's, never a key) the default
	// image's /etc trusts beside the host's roots: appended to its system
	// bundles and written as ssl/certs/sandgate-ca.pem (sandgate's
	// interception CA). Ignored with a Rootfs, whose /etc is its own.
	TrustCA []byte `json:"trustCa,omitempty"`
	// Cmd is run's command; when it exits the sandbox stops.
	Cmd     []string  `json:"cmd"`
	Created time.Time `json:"created"`
}

// Default sizes of a sandbox's tmpfs mounts (Config.TmpSize, ShmSize):
// room for builds and package caches in /tmp, Docker's --shm-size default
// for /dev/shm.
const (
	DefaultTmpSize = 512 << 20
	DefaultShmSize = 64 << 20
)

// tmpSize and shmSize are the sizes the init mounts.
func (c *Config) tmpSize() int64 { return cmp.Or(c.TmpSize, DefaultTmpSize) }
func (c *Config) shmSize() int64 { return cmp.Or(c.ShmSize, DefaultShmSize) }

// defaultPath is the PATH a command gets when its environment has none.
const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

func (c *Config) check() error {
	if err := CheckID(c.ID); err != nil {
		return err
	}
	if err := checkTrustCA(c.TrustCA); err != nil {
		return err
	}
	if !isDefaultImage(c.Rootfs) && !filepath.IsAbs(c.Rootfs) {
		return fmt.Errorf("%w: rootfs %q must be an absolute path (or empty, for the default image)", ErrBadInput, c.Rootfs)
	}
	for _, p := range c.Masks {
		if !filepath.IsAbs(p) {
			return fmt.Errorf("%w: hidden path %q must be an absolute host path", ErrBadInput, p)
		}
	}
	if err := checkUserNS(c.UserNS); err != nil {
		return err
	}
	if len(c.Cmd) == 0 || c.Cmd[0] == "" {
		return fmt.Errorf("%w: no command: put it after --", ErrBadInput)
	}
	if err := checkEnv(c.Env); err != nil {
		return err
	}
	if err := checkDir(c.Dir); err != nil {
		return err
	}
	seen := map[string]bool{}
	for _, m := range c.Mounts {
		if err := m.check(); err != nil {
			return err
		}
		if seen[m.Destination] {
			return fmt.Errorf("%w: two mounts on %q", ErrBadInput, m.Destination)
		}
		seen[m.Destination] = true
		if _, err := os.Stat(m.Source); err != nil {
			return fmt.Errorf("%w: mount source: %v", ErrBadInput, err)
		}
	}
	if c.Disk != 0 {
		if err := checkDiskSize(c.Disk); err != nil {
			return err
		}
	}
	if c.Memory < 0 || c.Pids < 0 {
		return fmt.Errorf("%w: memory and pids limits must not be negative", ErrBadInput)
	}
	if err := checkCPU(c.CPU, c.CPUWeight); err != nil {
		return err
	}
	if c.SandboxesCPUWeight < 0 || c.SandboxesCPUWeight > sandboxcli.MaxCPUWeight {
		return fmt.Errorf("%w: --sandboxes-cpu-weight %d: give 1 to %d (%d weighs as much as one process beside them), or 0 to leave it", ErrBadInput, c.SandboxesCPUWeight, sandboxcli.MaxCPUWeight, sandboxcli.DefaultCPUWeight)
	}
	if c.TmpSize < 0 || c.ShmSize < 0 {
		return fmt.Errorf("%w: --tmp-size and --shm-size must not be negative (0 means the default)", ErrBadInput)
	}
	return nil
}

// checkCPU refuses a CPU limit or weight the kernel would not take.
func checkCPU(cpu float64, weight int) error {
	if math.IsNaN(cpu) || math.IsInf(cpu, 0) || cpu < 0 || (cpu > 0 && cpu < sandboxcli.MinCPU) {
		return fmt.Errorf("%w: --cpus %v: give the cores' worth of time the sandbox may use, at least %v (e.g. 0.5, 2), or 0 for no limit", ErrBadInput, cpu, sandboxcli.MinCPU)
	}
	if weight < 0 || weight > sandboxcli.MaxCPUWeight {
		return fmt.Errorf("%w: --cpu-weight %d: give 1 to %d (%d is an equal share), or 0 for the default", ErrBadInput, weight, sandboxcli.MaxCPUWeight, sandboxcli.DefaultCPUWeight)
	}
	return nil
}

func checkEnv(env []string) error {
	for _, kv := range env {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.ContainsRune(kv, 0) {
			return fmt.Errorf("%w: environment entry %q: want KEY=VALUE", ErrBadInput, kv)
		}
	}
	return nil
}

func checkDir(dir string) error {
	if dir != "" && !path.IsAbs(dir) {
		return fmt.Errorf("%w: working directory %q must be an absolute path inside the sandbox", ErrBadInput, dir)
	}
	return nil
}

// mergeEnv returns base overridden by over (later keys win), with PATH and
// HOME defaults when neither sets them.
func mergeEnv(base, over []string) []string {
	var out []string
	idx := map[string]int{}
	add := func(kv string) {
		k, _, _ := strings.Cut(kv, "=")
		if i, ok := idx[k]; ok {
			out[i] = kv
			return
		}
		idx[k] = len(out)
		out = append(out, kv)
	}
	for _, kv := range base {
		add(kv)
	}
	for _, kv := range over {
		add(kv)
	}
	if _, ok := idx["PATH"]; !ok {
		add(defaultPath)
	}
	if _, ok := idx["HOME"]; !ok {
		add("HOME=/root")
	}
	return out
}

// maxTrustCA bounds Config.TrustCA.
const maxTrustCA = 64 << 10

// checkTrustCA accepts PEM certificates only: never a key, nothing else.
func checkTrustCA(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if len(b) > maxTrustCA {
		return fmt.Errorf("%w: the CA certificates to trust are over %d bytes", ErrBadInput, maxTrustCA)
	}
	n := 0
	for rest := b; ; {
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			if len(bytes.TrimSpace(rest)) > 0 {
				return fmt.Errorf("%w: the CA file holds something that is not a PEM certificate", ErrBadInput)
			}
			break
		}
		if blk.Type != "CERTIFICATE" {
			return fmt.Errorf("%w: the CA file holds a PEM %q block; give certificates only (never a key)", ErrBadInput, blk.Type)
		}
		if _, err := x509.ParseCertificate(blk.Bytes); err != nil {
			return fmt.Errorf("%w: the CA file: %v", ErrBadInput, err)
		}
		n++
	}
	if n == 0 {
		return fmt.Errorf("%w: the CA file holds no PEM certificate", ErrBadInput)
	}
	return nil
}
