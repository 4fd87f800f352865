package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/localbox"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// download is one curl download's outcome: its rate and the CPU each
// process spent on it.
type download struct {
	rate     float64 // bytes per second, as curl measured it (size / time_total)
	curl     time.Duration
	bench    time.Duration // this process: relay.Proxy (and the link client)
	agent    time.Duration // the sandbox's agent (sandbox downloads only)
	upstream time.Duration
}

// curlScript downloads the URL in $1 and prints curl's size and total time,
// then the shell's `times` (its children's user and system CPU: curl's).
// Extra curl options come after the URL.
const curlScript = `url=$1; shift; curl -sS -o /dev/null -w '%{size_download} %{time_total}\n' "$@" "$url" && times`

// benchEgress measures curl's download rate through the relay from inside
// a sandbox, on the two ways egress leaves one: passed as a socket (our
// CLI's socketpair link) and as bytes over the agent's yamux link on pipes
// (how Google's CLI carries it); and, alternating, through the same
// relay.Proxy on a TCP listener from the host.
func (r *rig) benchEgress(bulk int64, rounds int, profile string) error {
	hostCurl, err := exec.LookPath("curl")
	if err != nil {
		return fmt.Errorf("the egress bench needs curl on the host (and so in the sandbox, whose image is /): %w", err)
	}
	pem, err := os.ReadFile(r.env.CAFile)
	if err != nil {
		return err
	}
	upPid := upstreamPid()
	bulkURL := func(n int64) string { return benchkit.DirectURL + "/bulk?n=" + strconv.FormatInt(n, 10) }

	// inSandbox starts a sandbox with l and returns its download function,
	// and the function of a download without the proxy variables
	// (captured in the sandbox).
	inSandbox := func(l *appliance.Launcher, kind string) (func(int64) (download, error), func(int64) (download, error), error) {
		_, _, sb, err := r.createWith(l, r.id(kind, 0))
		if err != nil {
			return nil, nil, err
		}
		r.closers = append(r.closers, func() {
			dctx, cancel := ctx(60 * time.Second)
			sb.Destroy(dctx)
			cancel()
		})
		c, cancel := ctx(30 * time.Second)
		_, err = sb.WriteFile(c, "/tmp/ca.pem", bytes.NewReader(pem), agent.WriteOptions{})
		cancel()
		if err != nil {
			return nil, nil, fmt.Errorf("writing the CA into the sandbox: %w", err)
		}
		agentPid, err := r.agentPid(sb.ID())
		if err != nil {
			return nil, nil, err
		}
		get := func(extra ...string) func(n int64) (download, error) {
			return func(n int64) (download, error) {
				url := bulkURL(n)
				return r.measure(sb.ID(), n, agentPid, upPid, func(c context.Context) ([]byte, error) {
					var out, errb bytes.Buffer
					args := append([]string{"/bin/sh", "-c", curlScript, "sh", url, "--cacert", "/tmp/ca.pem"}, extra...)
					st, err := sb.Run(c, agent.Cmd{Args: args, Stdout: &out, Stderr: &errb})
					if err == nil && !st.Success() {
						err = fmt.Errorf("curl in the sandbox ended with %v: %s", st, strings.TrimSpace(errb.String()))
					}
					return out.Bytes(), err
				})
			}
		}
		return get(), get("--noproxy", "*"), nil
	}
	passed, captured, err := inSandbox(r.launcher, "egress")
	if err != nil {
		return err
	}
	piped, _, err := inSandbox(r.pipes, "egresspipe")
	if err != nil {
		return err
	}
	standalone := func(n int64) (download, error) {
		url := bulkURL(n)
		return r.measure("standalone", n, 0, upPid, func(c context.Context) ([]byte, error) {
			cmd := exec.CommandContext(c, "/bin/sh", "-c", curlScript, "sh", url, "--cacert", r.env.CAFile, "-x", "http://"+r.standalone)
			cmd.Env = []string{"PATH=" + filepath.Dir(hostCurl) + ":/usr/bin:/bin"}
			var errb bytes.Buffer
			cmd.Stderr = &errb
			out, err := cmd.Output()
			if err != nil {
				err = fmt.Errorf("curl on the host: %v: %s", err, strings.TrimSpace(errb.String()))
			}
			return out, err
		})
	}

	paths := []struct {
		name string
		get  func(int64) (download, error)
		ds   []download
	}{
		{"standalone (host curl)", standalone, nil},
		{"sandbox, socket passed", passed, nil},
		{"sandbox, yamux on pipes", piped, nil},
		{"sandbox, captured", captured, nil},
	}
	// Warm up every path with a small download (TLS, DNS cache, pages).
	for _, p := range paths {
		if _, err := p.get(16 << 20); err != nil {
			return err
		}
	}
	for range rounds {
		for i := range paths {
			d, err := paths[i].get(bulk)
			if err != nil {
				return err
			}
			paths[i].ds = append(paths[i].ds, d)
		}
	}
	mb := func(ds []download, pick func([]float64) float64) float64 {
		var rs []float64
		for _, d := range ds {
			rs = append(rs, d.rate)
		}
		return pick(rs) / 1e6
	}
	median := func(v []float64) float64 { slices.Sort(v); return v[len(v)/2] }
	best := func(v []float64) float64 { return slices.Max(v) }
	worst := func(v []float64) float64 { return slices.Min(v) }
	fmt.Printf("egress through the relay, %d MiB × %d rounds each, curl's rate in MB/s:\n", bulk>>20, rounds)
	for _, p := range paths {
		fmt.Printf("  %-24s median %7.0f   best %7.0f   worst %7.0f\n", p.name, mb(p.ds, median), mb(p.ds, best), mb(p.ds, worst))
	}
	std := paths[0].ds
	for _, p := range paths[1:] {
		fmt.Printf("  ratio %-24s ÷ standalone   median %.2f   best %.2f   worst %.2f\n", p.name, mb(p.ds, median)/mb(std, median), mb(p.ds, best)/mb(std, best), mb(p.ds, worst)/mb(std, worst))
	}
	// Captured (curl --noproxy '*': its lookup answered by the agent's
	// DNS responder, its connection steered to the agent and passed to the
	// proxy) against CONNECT through the proxy variables, in the same
	// sandbox.
	via, capd := paths[1].ds, paths[3].ds
	fmt.Printf("  ratio captured ÷ CONNECT through the variables (same sandbox)   median %.2f   best %.2f   worst %.2f   (target >= 0.95)\n",
		mb(capd, median)/mb(via, median), mb(capd, best)/mb(via, best), mb(capd, worst)/mb(via, worst))
	fmt.Printf("  CPU s per GiB carried      %8s %8s %8s %8s %8s\n", "curl", "proxy*", "agent", "upstream", "total")
	totals := make([]float64, len(paths))
	for i, p := range paths {
		var cu, be, ag, up time.Duration
		for _, d := range p.ds {
			cu, be, ag, up = cu+d.curl, be+d.bench, ag+d.agent, up+d.upstream
		}
		gib := float64(int64(len(p.ds))*bulk) / (1 << 30)
		per := func(d time.Duration) string { return strconv.FormatFloat(d.Seconds()/gib, 'f', 2, 64) }
		agent := per(ag)
		if i == 0 {
			agent = "-"
		}
		totals[i] = (cu + be + ag + up).Seconds() / gib
		fmt.Printf("    %-24s %8s %8s %8s %8s %8.2f\n", p.name, per(cu), per(be), agent, per(up), totals[i])
	}
	fmt.Println("    * proxy = this bench process: relay.Proxy, plus the agent link client for the sandboxes")
	// When the cores are the bottleneck (2 cores, shared), throughput goes
	// as the inverse of the CPU a byte costs: this ratio is what the
	// throughput ratio tends to, and it is less disturbed by other load.
	for i, p := range paths[1:] {
		fmt.Printf("  CPU-cost ratio standalone ÷ %-24s %.2f   (what the throughput ratio tends to when CPU-bound)\n", p.name, totals[0]/totals[i+1])
	}
	fmt.Printf("  CPU-cost ratio CONNECT through the variables ÷ captured %.2f\n", totals[1]/totals[3])

	if profile != "" {
		f, err := os.Create(profile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return err
		}
		_, err = piped(bulk)
		pprof.StopCPUProfile()
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		fmt.Printf("  CPU profile of one download over the pipes written to %s (go tool pprof -top %s)\n", profile, profile)
	}
	return nil
}

// measure runs one download (get runs curl and returns its output) and
// the CPU the processes involved spent on it, and checks in the audit
// events of sandbox id that the bytes went through the relay.
func (r *rig) measure(id string, bulk int64, agentPid, upPid int, get func(context.Context) ([]byte, error)) (download, error) {
	c, cancel := ctx(5 * time.Minute)
	defer cancel()
	before := len(r.events(id))
	self := os.Getpid()
	b0, a0, u0 := benchkit.ProcCPU(self), benchkit.ProcCPU(agentPid), benchkit.ProcCPU(upPid)
	out, err := get(c)
	if err != nil {
		return download{}, err
	}
	d := download{bench: benchkit.ProcCPU(self) - b0, upstream: benchkit.ProcCPU(upPid) - u0}
	if agentPid > 0 {
		d.agent = benchkit.ProcCPU(agentPid) - a0
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var size int64
	var secs float64
	if len(lines) != 3 {
		return download{}, fmt.Errorf("curl in %s printed %q: want its size and time, then `times`", id, out)
	}
	if _, err := fmt.Sscan(lines[0], &size, &secs); err != nil || size != bulk || secs <= 0 {
		return download{}, fmt.Errorf("curl in %s downloaded %q (size, seconds): want %d bytes", id, lines[0], bulk)
	}
	d.rate = float64(size) / secs
	if d.curl, err = parseTimes(lines[2]); err != nil {
		return download{}, err
	}
	// The tunnel's audit event is written as it closes, just after curl
	// exits: wait for it, bounded.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		evs := r.events(id)
		if len(evs) > before && evs[len(evs)-1].Allow && evs[len(evs)-1].BytesOut >= bulk {
			break
		}
		if time.Now().After(deadline) {
			return download{}, fmt.Errorf("no audit event for %s shows the %d bytes going through the relay (events: %+v)", id, bulk, evs[before:])
		}
	}
	return d, nil
}

var timesField = regexp.MustCompile(`^(\d+)m([0-9.]+)s$`)

// parseTimes reads the children's line of the shell's `times` ("0m1.23s
// 0m0.45s": user, system) and returns their sum.
func parseTimes(line string) (time.Duration, error) {
	var sum time.Duration
	f := strings.Fields(line)
	if len(f) != 2 {
		return 0, fmt.Errorf("`times` printed %q: want user and system time", line)
	}
	for _, s := range f {
		m := timesField.FindStringSubmatch(s)
		if m == nil {
			return 0, fmt.Errorf("`times` printed %q: want user and system time as 0m0.00s", line)
		}
		mins, _ := strconv.Atoi(m[1])
		sec, _ := strconv.ParseFloat(m[2], 64)
		sum += time.Duration(mins)*time.Minute + time.Duration(sec*float64(time.Second))
	}
	return sum, nil
}

// agentPid finds the host pid of sandbox id's agent: the child of the
// sandbox's init whose command line is `AgentPath agent` (the main process
// is `agent --idle`).
func (r *rig) agentPid(id string) (int, error) {
	c, cancel := ctx(30 * time.Second)
	defer cancel()
	cmd := exec.CommandContext(c, r.env.Bin, "sandbox", "--state-dir", r.state, "list", "--json")
	out, err := cmd.Output()
	if err != nil {
		return 0, fmt.Errorf("sandgate sandbox list: %w", err)
	}
	var infos []localbox.Info
	if err := json.Unmarshal(out, &infos); err != nil {
		return 0, fmt.Errorf("sandgate sandbox list --json: %w", err)
	}
	init := 0
	for _, in := range infos {
		if in.ID == id {
			init = in.Pid
		}
	}
	if init == 0 {
		return 0, fmt.Errorf("sandbox %s is not running according to `sandgate sandbox list`", id)
	}
	want := appliance.AgentPath + "\x00agent\x00"
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || ppid(pid) != init {
			continue
		}
		if cl, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); string(cl) == want {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no `%s agent` process under the init (pid %d) of sandbox %s", appliance.AgentPath, init, id)
}

// upstreamPid finds benchkit's upstream: this program's own executable
// re-run as a child of this process. 0 (its CPU then reads 0) if not found.
func upstreamPid() int {
	self, err := os.Executable()
	if err != nil {
		return 0
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || ppid(pid) != os.Getpid() {
			continue
		}
		if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); exe == self {
			return pid
		}
	}
	return 0
}

// ppid returns a process's parent pid, 0 if it cannot be read.
func ppid(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 2 {
		return 0
	}
	p, _ := strconv.Atoi(f[1])
	return p
}
