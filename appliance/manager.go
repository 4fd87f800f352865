package appliance

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/appliance/cluster"
	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/netpolicy"
	"github.com/sandgate/sandgate/relay"
	"github.com/sandgate/sandgate/relay/audit"
	"github.com/sandgate/sandgate/snapshot/store"
	"github.com/sandgate/sandgate/transforms"
	"github.com/sandgate/sandgate/transforms/wasm"
)

// Errors of the lifecycle, besides the launcher's (ErrExists, ErrNotFound,
// ...), to branch on with errors.Is.
var (
	// ErrNoTemplate: no template of that name in this service's namespace.
	// It matches ErrNotFound too.
	ErrNoTemplate error = notFound("no such template")
	// ErrCapacity: the service runs as many sandboxes as it may
	// (ManagerConfig.MaxRunning); suspend or destroy one first.
	ErrCapacity = errors.New("no capacity for another running sandbox")
	// ErrClosed: the manager is shutting down (Close was called).
	ErrClosed = errors.New("the sandbox service is shutting down")
	// ErrStore: the snapshot store failed; nothing was changed.
	ErrStore = errors.New("snapshot store failed")
)

// notFound is a thing other than a sandbox that is not there: its own
// words ("no such template", not "no such sandbox: no such template"), and
// it matches ErrNotFound (and what that matches).
type notFound string

func (e notFound) Error() string { return string(e) }

func (e notFound) Is(target error) bool { return errors.Is(ErrNotFound, target) }

// State is where a sandbox is in its life.
type State string

// States of a sandbox.
const (
	Starting   State = "starting"   // being created, resumed or forked
	Running    State = "running"    // its agent answers
	Suspending State = "suspending" // its layer is being saved
	Suspended  State = "suspended"  // its layer is in the store; nothing runs
)

// ManagerConfig is what a Manager is built from. Launcher, Proxy and Store
// are required.
type ManagerConfig struct {
	Launcher *Launcher
	Proxy    *relay.Proxy
	// Store holds snapshots and templates (snapshots/, templates/).
	Store store.Store
	// ImageID and Version name the template namespace: a digest of both,
	// so a template made on another image, or by another sandgate, is
	// never used. ImageID "" means "local".
	ImageID, Version string
	// WorkDir holds layers on their way between the sandbox CLI and the
	// store; "" means a directory under os.TempDir.
	WorkDir string
	// MaxRunning caps the sandboxes running (or starting) at once; 0 means
	// DefaultMaxRunning.
	MaxRunning int
	// IdleSuspend suspends a sandbox that had no call, no port connection
	// and no egress for this long; 0 means DefaultIdleSuspend, negative
	// means never.
	IdleSuspend time.Duration
	// Agent is the agent configuration every sandbox starts with, unless
	// its options give one.
	Agent agent.Config
	// AllowedHosts are host rules every sandbox's policy has (protocol 1's
	// SANDBOX_ALLOWED_HOSTS; "*" is allow-all), BaseURLs base URL
	// variables every sandbox gets (SANDBOX_BASE_URLS; a sandbox's own
	// overlay them; nil means agent.DefaultBaseURLs, an empty map none).
	// See NetworkSpec.
	AllowedHosts []string
	BaseURLs     map[string]string
	// OutputBytes is how much of each command's output is kept for
	// streams that start late or resume (Exec); 0 means
	// DefaultOutputBytes. ProcessRetention is how long a command is known
	// after it exits; 0 means DefaultProcessRetention. OutputBudget is
	// how much output is kept of all commands together: past it the
	// output of the commands that finished first is dropped first, then
	// running commands keep an equal share each (see outputBudget); 0
	// means DefaultOutputBudget, negative no bound.
	OutputBytes      int
	ProcessRetention time.Duration
	OutputBudget     int64
	// Modules compiles sandboxes' own WebAssembly transform modules
	// (SetModules); nil means the service runs none.
	Modules *wasm.Runtime
	// Audit keeps each running sandbox's egress decisions (the proxy
	// records them there, the manager opens and seals each sandbox's) and
	// writes them to Store beside its record (AuditStore, which Audit's
	// Writer must be); nil means none are kept.
	Audit *audit.Journals
	// AuditRetention is how long a sandbox's audit segments stay in the
	// store, whatever becomes of the sandbox (a destroy removes them at
	// once); 0 means DefaultAuditRetention, negative forever.
	AuditRetention time.Duration
	// Logger receives one event per operation; nil discards.
	Logger *slog.Logger
	// Metrics, when set, registers the lifecycle's metrics.
	Metrics prometheus.Registerer
	// Shard is this service's membership of the shards sharing the store:
	// a sandbox runs on at most one of them, the one holding its lease.
	Shard ShardConfig
	// Limits are every sandbox's limits where its own (CreateOptions)
	// leave a field zero. Memory and Pids zero mean the launcher's
	// (LauncherConfig.Memory, Pids: DefaultMemoryLimit, DefaultPidsLimit);
	// CPU zero means DefaultCPULimit (negative: none), CPUWeight zero
	// DefaultCPUWeight; the other zero fields mean none.
	Limits Limits
	// ExpirySweep is how often the store is swept for suspended sandboxes
	// past their time (Limits.Lifetime, KeepSuspended); 0 means
	// DefaultExpirySweep. A running sandbox's lifetime is enforced by the
	// shard running it, within the idle loop's tick.
	ExpirySweep time.Duration
	// CheckpointInterval is how often a running sandbox that changed is
	// saved as it runs (Checkpoint): what a crash of the service loses;
	// 0 means DefaultCheckpointInterval, negative never.
	CheckpointInterval time.Duration
	// TerminalGrace is how long a terminal whose client went away keeps
	// running, its output kept, for a client to come back to
	// (AttachTerminal); 0 means DefaultTerminalGrace, negative none (it
	// is hung up at once).
	TerminalGrace time.Duration
	// SealKey is the key material (at least transforms.MinSealKeyMaterial
	// bytes) of the key that seals, in a sandbox's record, the credentials
	// its rules have held, so that they stay scrubbed when it resumes:
	// every shard over one store needs the same. Empty means a key kept
	// in WorkDir (SealKeyFile, made if absent; one in memory without a
	// WorkDir).
	SealKey []byte
}

// Defaults of ManagerConfig.
const (
	DefaultIdleSuspend = 15 * time.Minute
	// DefaultMemoryLimit and DefaultPidsLimit are the limits of each
	// sandbox of a service: NewManager gives them to a launcher configured
	// without (LauncherConfig's zero means no limit).
	DefaultMemoryLimit = "2g"
	DefaultPidsLimit   = 4096
	// DefaultOutputBytes and DefaultProcessRetention: see ManagerConfig.
	DefaultOutputBytes      = 8 << 20
	DefaultProcessRetention = 10 * time.Minute
)

// DefaultMaxRunning is how many sandboxes fit this host: its memory over
// the per-sandbox memory limit, at least one.
func DefaultMaxRunning(memoryLimit int64) int {
	total := memTotal()
	if total <= 0 || memoryLimit <= 0 {
		return 16
	}
	return max(1, int(total*9/10/memoryLimit))
}

// CreateOptions are what Create starts a sandbox with.
type CreateOptions struct {
	// Network is where it may go (see NetworkSpec).
	Network NetworkSpec
	// Rules are its credential rules: kept in memory only, never saved,
	// dropped the moment it stops running; nil means none.
	Rules []transforms.Rule
	// Modules are its own WebAssembly transform modules (SetModules);
	// nil means none.
	Modules []ModuleSource
	// Template names a template (SaveTemplate) to start from; "" means
	// the image alone.
	Template string
	// Agent overrides ManagerConfig.Agent when not zero.
	Agent *agent.Config
	// Dirs are directories made (with parents) before Create returns,
	// such as the sandbox's home and working directory.
	Dirs []string
	// Limits are its own limits; a zero field means the service's
	// (ManagerConfig.Limits). They are kept with it for its whole life.
	Limits Limits
}

// ResumeOptions are what Resume gives a sandbox: a running one gets its
// network replaced (processes and credential rules kept); a suspended one
// starts with it and with the rules given (they were dropped at suspend).
type ResumeOptions struct {
	Network NetworkSpec
	// KeepNetwork gives the sandbox its last network instead of Network:
	// a running one keeps its own, a suspended one the network kept with
	// its snapshot (the service's hosts and base URLs alone when none was
	// kept: a snapshot of an older sandgate, or the reference service's).
	KeepNetwork bool
	Rules       []transforms.Rule
	Agent       *agent.Config
	Dirs        []string
}

// Info describes a sandbox.
type Info struct {
	ID    string `json:"id"`
	State State  `json:"state"`
	// Created is when the sandbox was first created (kept across
	// suspensions); LastActive when it last had a call, a port
	// connection or egress (running sandboxes only).
	Created    time.Time `json:"created"`
	LastActive time.Time `json:"lastActive,omitzero"`
	// LayerBytes is what its writable layer takes: its upper on disk
	// while it runs (where the CLI tells: `sandgate sandbox`), its
	// compressed snapshot while suspended.
	LayerBytes int64 `json:"layerBytes"`
	// Template is the template it was made from, if any.
	Template string `json:"template,omitempty"`
	// Policy is its egress policy: a running sandbox's, or the one a
	// suspended sandbox wakes with (none when its snapshot kept none).
	Policy   *netpolicy.Policy `json:"policy,omitempty"`
	BaseURLs map[string]string `json:"baseUrls,omitempty"`
	// Modules are its own WebAssembly modules (running or suspended);
	// OpenPorts the ports with a connection open now (running ones).
	Modules   []ModuleInfo `json:"modules,omitempty"`
	OpenPorts []int        `json:"openPorts,omitempty"`
	// Limits are what it may take (its own, over the service's defaults).
	Limits Limits `json:"limits"`
	// Usage is what it uses now (running sandboxes, where the sandbox
	// CLI lets the service read it: `sandgate sandbox`); nil otherwise.
	Usage *Usage `json:"usage,omitempty"`
	// Shard is the shard it runs on (running sandboxes): this service's,
	// or another sharing the store, which alone knows the rest of it.
	Shard string `json:"shard,omitempty"`
	// SuspendedBy says who suspended it (suspended sandboxes): its
	// caller, or the service on its own, when its next call wakes it
	// (SuspendReason.Wakes); "" when not known.
	SuspendedBy SuspendReason `json:"suspendedBy,omitempty"`
}

// Manager owns every sandbox of a service: it creates, resumes, suspends,
// forks and destroys them, saves their layers to the store and templates,
// suspends idle ones, and saves them all when the service stops. Every
// operation on one id is serialised; operations on different ids run in
// parallel, and no lock is held across I/O but the id's own.
type Manager struct {
	cfg   ManagerConfig
	c     *cluster.Cluster
	l     *Launcher
	proxy *relay.Proxy
	st    store.Store
	ns    string
	work  string
	log   *slog.Logger
	met   *metrics
	// output bounds the output kept of every command (OutputBudget).
	output *outputBudget
	seal   *transforms.SealKey // seals the credentials sandboxes' rules held

	mu       sync.Mutex
	boxes    map[string]*box
	nrunning int // boxes counted against MaxRunning
	closed   bool
	// baseRefs counts, per template layer, the sandboxes starting,
	// running or suspending on it: a layer they hold is not removed.
	baseRefs map[string]int

	tmu      sync.Mutex           // guards tlocks and imported
	tlocks   map[string]*nameLock // per template name
	imported map[string]bool      // templates `sandgate sandbox` holds

	stop      context.CancelFunc // ends the idle, audit and checkpoint loops
	loopDone  chan struct{}
	auditDone chan struct{}  // nil without an audit
	loops     sync.WaitGroup // the checkpoint loop

	audits *AuditStore
	// started is closed (and replaced) whenever a sandbox starts running:
	// what an audit stream waiting for a suspended sandbox waits on;
	// closing is closed by Close, which ends such waits.
	started chan struct{}
	closing chan struct{}

	// expired notes the sandboxes this shard expired (manager_expire.go),
	// orphans when the spent records of dead shards were first found;
	// guarded by mu. clockSkew moves the manager's clock (tests).
	expired   map[string]*ExpiredError
	orphans   map[string]time.Time
	clockSkew atomic.Int64
}

// box is the manager's record of one id. sem serialises operations on it;
// the fields below it are written only by the holder of sem.
type box struct {
	id   string
	sem  chan struct{}
	refs int // guarded by Manager.mu: holders and waiters of sem

	state atomic.Value // State; "" when the id has nothing running
	live  atomic.Pointer[Sandbox]

	created  time.Time
	template string // template name, "" for none
	base     *record
	spec     NetworkSpec // what the caller said (running sandboxes)
	network  Network     // what applies: derived from spec and the rules
	modules  []heldModule
	limits   Limits // its own (CreateOptions); see effectiveLimits
	// lease is the sandbox's lease, held while it runs here; recGen the
	// generation of its record as this service last read or wrote it (0:
	// none), which its next write must find (fencing).
	lease  *cluster.Lease
	recGen int64
	// saved is when its state was last saved (resumed from, or
	// checkpointed); zero when never (a new sandbox).
	saved time.Time
	// held is every credential its rules hold or have held, sealed: what
	// its record and journal entry keep (see manager_held.go).
	held     []transforms.SealedSecret
	sessions sessionTable // its own lock; see manager_sessions.go
	// expires is when it reaches its lifetime while it runs (unix
	// nanoseconds; 0 never): read by the idle loop without the id's lock.
	expires atomic.Int64
}

func (b *box) getState() State {
	s, _ := b.state.Load().(State)
	return s
}

// NewManager builds a manager and recovers what a previous process of the
// service left (see Recover): sandboxes still running are saved and
// removed, orphaned objects in the store are removed. It starts the idle
// loop; Close stops it.
func NewManager(ctx context.Context, cfg ManagerConfig) (*Manager, error) {
	if cfg.Launcher == nil || cfg.Proxy == nil || cfg.Store == nil {
		return nil, errors.New("appliance: ManagerConfig needs a Launcher, a Proxy and a Store")
	}
	if cfg.ImageID == "" {
		cfg.ImageID = "local"
	}
	if cfg.Launcher.cfg.Memory == "" {
		cfg.Launcher.cfg.Memory = DefaultMemoryLimit
	}
	if cfg.Launcher.cfg.Pids == 0 {
		cfg.Launcher.cfg.Pids = DefaultPidsLimit
	}
	if cfg.Limits.Memory == 0 {
		cfg.Limits.Memory, _ = sandboxcli.ParseSize(cfg.Launcher.cfg.Memory)
	}
	if cfg.Limits.Pids == 0 {
		cfg.Limits.Pids = cfg.Launcher.cfg.Pids
	}
	switch {
	case cfg.Limits.CPU == 0:
		cfg.Limits.CPU = DefaultCPULimit()
	case cfg.Limits.CPU < 0:
		cfg.Limits.CPU = 0 // none
	}
	if cfg.Limits.CPUWeight == 0 {
		cfg.Limits.CPUWeight = DefaultCPUWeight
	}
	if err := cfg.Limits.Check(); err != nil {
		return nil, fmt.Errorf("the service's default limits: %w", err)
	}
	if cfg.MaxRunning <= 0 {
		cfg.MaxRunning = DefaultMaxRunning(cfg.Limits.Memory)
	}
	if cfg.IdleSuspend == 0 {
		cfg.IdleSuspend = DefaultIdleSuspend
	}
	if cfg.CheckpointInterval == 0 {
		cfg.CheckpointInterval = DefaultCheckpointInterval
	}
	if cfg.TerminalGrace == 0 {
		cfg.TerminalGrace = DefaultTerminalGrace
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.BaseURLs == nil {
		cfg.BaseURLs = agent.DefaultBaseURLs()
	}
	if _, err := parseHosts(cfg.AllowedHosts); err != nil {
		return nil, fmt.Errorf("the service's allowed hosts (SANDBOX_ALLOWED_HOSTS): %w", err)
	}
	if err := (NetworkSpec{BaseURLs: cfg.BaseURLs}).check(); err != nil {
		return nil, fmt.Errorf("the service's base URLs (SANDBOX_BASE_URLS): %w", err)
	}
	if cfg.OutputBytes <= 0 {
		cfg.OutputBytes = DefaultOutputBytes
	}
	if cfg.ProcessRetention <= 0 {
		cfg.ProcessRetention = DefaultProcessRetention
	}
	if cfg.OutputBudget == 0 {
		cfg.OutputBudget = DefaultOutputBudget
	}
	if cfg.AuditRetention == 0 {
		cfg.AuditRetention = DefaultAuditRetention
	}
	if cfg.ExpirySweep <= 0 {
		cfg.ExpirySweep = DefaultExpirySweep
	}
	output := newOutputBudget(cfg.OutputBudget)
	work := cfg.WorkDir
	if work == "" {
		work = os.TempDir()
	}
	if err := os.MkdirAll(work, 0o700); err != nil {
		return nil, fmt.Errorf("appliance: work directory: %w", err)
	}
	seal, err := openSealKey(cfg, work)
	if err != nil {
		return nil, err
	}
	m := &Manager{
		cfg: cfg, l: cfg.Launcher, proxy: cfg.Proxy, st: cfg.Store, work: work, seal: seal,
		ns:    TemplateNamespace(cfg.Version, cfg.ImageID),
		log:   cfg.Logger,
		met:   newMetrics(cfg.Metrics, output),
		boxes: map[string]*box{}, baseRefs: map[string]int{},
		tlocks: map[string]*nameLock{}, imported: map[string]bool{},
		audits: NewAuditStore(cfg.Store), started: make(chan struct{}), closing: make(chan struct{}),
		output: output, expired: map[string]*ExpiredError{},
	}
	if cfg.Metrics != nil {
		cfg.Metrics.MustRegister(newUsageCollector(m))
	}
	if err := m.joinShards(ctx); err != nil {
		return nil, err
	}
	if _, err := m.Recover(ctx); err != nil {
		m.c.Close(context.WithoutCancel(ctx))
		return nil, err
	}
	loopCtx, stop := context.WithCancel(context.Background())
	m.stop, m.loopDone = stop, make(chan struct{})
	go m.idleLoop(loopCtx)
	if cfg.Audit != nil {
		m.auditDone = make(chan struct{})
		go m.auditLoop(loopCtx)
	}
	if cfg.CheckpointInterval > 0 {
		m.loops.Go(func() { m.checkpointLoop(loopCtx) })
	}
	m.loops.Go(func() { m.expiryLoop(loopCtx) })
	return m, nil
}

// Namespace is the template namespace of this manager.
func (m *Manager) Namespace() string { return m.ns }

// acquire takes the id's lock, waiting under ctx. The returned box's
// fields are the caller's until release.
func (m *Manager) acquire(ctx context.Context, id string) (*box, func(), error) {
	if err := sandboxcli.CheckID(id); err != nil {
		return nil, nil, err
	}
	m.mu.Lock()
	b := m.boxes[id]
	if b == nil {
		b = &box{id: id, sem: make(chan struct{}, 1)}
		m.boxes[id] = b
	}
	b.refs++
	m.mu.Unlock()
	unref := func() {
		m.mu.Lock()
		if b.refs--; b.refs == 0 && b.getState() == "" {
			delete(m.boxes, id)
		}
		m.mu.Unlock()
	}
	select {
	case b.sem <- struct{}{}:
	case <-ctx.Done():
		unref()
		return nil, nil, fmt.Errorf("sandbox %s: waiting for the operation in progress on it: %w", id, context.Cause(ctx))
	}
	if err := m.c.Valid(); errors.Is(err, cluster.ErrFenced) {
		<-b.sem
		unref()
		return nil, nil, fmt.Errorf("sandbox %s: %w; it rejoins within seconds once the store answers", id, ErrFenced)
	}
	return b, func() { <-b.sem; unref() }, nil
}

// setBase makes base the template layer of b, counting the hold.
func (m *Manager) setBase(b *box, base *record) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if b.base != nil {
		if m.baseRefs[b.base.Layer]--; m.baseRefs[b.base.Layer] <= 0 {
			delete(m.baseRefs, b.base.Layer)
		}
	}
	b.base = base
	if base != nil {
		m.baseRefs[base.Layer]++
	}
}

// reserve counts a sandbox about to start against MaxRunning.
func (m *Manager) reserve() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrClosed
	}
	if m.nrunning >= m.cfg.MaxRunning {
		return fmt.Errorf("%w: %d of %d running; suspend or destroy one, or raise the limit", ErrCapacity, m.nrunning, m.cfg.MaxRunning)
	}
	m.nrunning++
	m.met.running.Set(float64(m.nrunning))
	return nil
}

func (m *Manager) unreserve() {
	m.mu.Lock()
	m.nrunning--
	m.met.running.Set(float64(m.nrunning))
	m.mu.Unlock()
}

// Sandbox returns the running sandbox id, for commands, files and ports.
// A sandbox not running (suspended, unknown, or in the middle of a
// suspend) is ErrNotRunning.
func (m *Manager) Sandbox(id string) (*Sandbox, error) {
	if err := m.c.Valid(); errors.Is(err, cluster.ErrFenced) {
		return nil, fmt.Errorf("sandbox %s: %w; it rejoins within seconds once the store answers", id, ErrFenced)
	}
	m.mu.Lock()
	b := m.boxes[id]
	m.mu.Unlock()
	if b != nil {
		if sb := b.live.Load(); sb != nil {
			sb.touch()
			return sb, nil
		}
	}
	if err := m.localExpiry(id); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
}

// Create starts sandbox id from the image, or from opts.Template. It never
// resumes: an id that is running, starting or suspended is ErrExists, and
// of two concurrent creates of one id exactly one wins. On failure nothing
// of the sandbox is left.
func (m *Manager) Create(ctx context.Context, id string, opts CreateOptions) (sb *Sandbox, err error) {
	start := time.Now()
	defer func() { m.done("create", id, start, err, nil) }()
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return nil, err
	}
	defer release()
	if b.getState() != "" {
		return nil, fmt.Errorf("%w: sandbox %q is %s", ErrExists, id, b.getState())
	}
	if err := opts.Network.check(); err != nil {
		return nil, err
	}
	if err := opts.Limits.Check(); err != nil {
		return nil, err
	}
	if err := m.takeLease(ctx, b); err != nil {
		var held *cluster.HeldError
		if errors.As(err, &held) {
			return nil, fmt.Errorf("%w: sandbox %q runs on shard %s", ErrExists, id, held.Shard.ID)
		}
		return nil, err
	}
	defer func() {
		if err != nil {
			m.releaseLease(ctx, b)
		}
	}()
	if _, err := m.suspended(ctx, id); err == nil {
		return nil, fmt.Errorf("%w: sandbox %q is suspended (resume it, or destroy it first)", ErrExists, id)
	} else if !errors.Is(err, store.ErrNotFound) {
		return nil, err
	}
	m.mu.Lock()
	delete(m.expired, id) // the id is new again (the store's note goes at its destroy)
	m.mu.Unlock()
	network, err := m.effectiveNetwork(opts.Network, opts.Rules)
	if err != nil {
		return nil, err
	}
	var base *record
	if opts.Template != "" {
		if base, err = m.templateRecord(ctx, opts.Template); err != nil {
			return nil, err
		}
	}
	if err := m.reserve(); err != nil {
		return nil, err
	}
	held, err := m.storeSources(ctx, opts.Modules)
	if err != nil {
		m.unreserve()
		return nil, err
	}
	b.created, b.template, b.spec, b.network, b.saved = time.Now().UTC(), opts.Template, opts.Network, network, time.Time{}
	b.modules = held
	b.limits = opts.Limits
	m.setBase(b, base)
	sb, err = m.start(ctx, b, nil, startOptions{Rules: opts.Rules, Agent: opts.Agent, Dirs: opts.Dirs})
	if err != nil {
		m.setBase(b, nil)
		m.unreserve()
		return nil, err
	}
	return sb, nil
}

// Resume returns sandbox id running. A running one is returned as it is,
// its network replaced by opts (its processes and transformations kept). A
// suspended one is started from its snapshot with opts, and the snapshot
// is spent only once the sandbox runs: a failed restore leaves it in place.
// A spent snapshot stays in the store as the sandbox's last good state
// until its next save: if the service dies without saving it, a new
// service finds it suspended there. An id with neither is ErrNotFound.
func (m *Manager) Resume(ctx context.Context, id string, opts ResumeOptions) (sb *Sandbox, err error) {
	start := time.Now()
	var bytes int64
	defer func() { m.done("resume", id, start, err, func() []any { return []any{"bytes", bytes} }) }()
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return nil, err
	}
	defer release()
	sb, bytes, err = m.resumeLocked(ctx, b, nil, opts)
	return sb, err
}

// Wake makes sandbox id run for a call that needs it running, and says
// whether it had to. A running one is left as it is. One the service
// suspended on its own (idle, stopping, restart recovery, a shard that
// died: SuspendReason.Wakes) is resumed as it was: with the network kept
// with its snapshot, its modules and its sessions (opts gives the agent's
// configuration and directories; its network is not used). One its caller
// suspended stays suspended until resumed: ErrNotRunning. A wake goes
// through the id's lock like any operation, so one that races a suspend
// in progress waits for it and then decides.
func (m *Manager) Wake(ctx context.Context, id string, opts ResumeOptions) (woke bool, err error) {
	if _, err := m.Sandbox(id); err == nil || errors.Is(err, ErrFenced) {
		return false, err
	}
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return false, err
	}
	defer release()
	if b.live.Load() != nil {
		return false, nil
	}
	rec, err := m.suspended(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		return false, fmt.Errorf("%w: sandbox %q is neither running nor suspended", ErrNotFound, id)
	}
	if err != nil {
		return false, err
	}
	why := rec.reason()
	if !why.Wakes() {
		return false, fmt.Errorf("%w: sandbox %q is suspended (resume it)", ErrNotRunning, id)
	}
	start := time.Now()
	opts.KeepNetwork = true
	_, bytes, err := m.resumeLocked(ctx, b, rec, opts)
	m.done("resume", id, start, err, func() []any { return []any{"bytes", bytes, "woken", true, "suspended_by", string(why)} })
	return err == nil, err
}

// resumeLocked is Resume under the id's lock; rec, when given, is the
// sandbox's snapshot as just read.
func (m *Manager) resumeLocked(ctx context.Context, b *box, rec *record, opts ResumeOptions) (sb *Sandbox, bytes int64, err error) {
	id := b.id
	if err := opts.Network.check(); err != nil {
		return nil, 0, err
	}
	if live := b.live.Load(); live != nil {
		if opts.KeepNetwork {
			return live, 0, nil
		}
		network, err := m.effectiveNetwork(opts.Network, live.relay.Transforms().Rules())
		if err != nil {
			return nil, 0, err
		}
		b.spec, b.network = opts.Network, network
		live.setNetwork(network)
		m.keepNetwork(ctx, b)
		return live, 0, nil
	}
	var network Network
	if !opts.KeepNetwork {
		if network, err = m.effectiveNetwork(opts.Network, opts.Rules); err != nil {
			return nil, 0, err
		}
	}
	if err := m.takeLease(ctx, b); err != nil {
		return nil, 0, err // *cluster.HeldError (ErrElsewhere): it runs there
	}
	defer func() {
		if err != nil {
			m.releaseLease(ctx, b)
		}
	}()
	if rec == nil {
		rec, err = m.suspended(ctx, id)
		if errors.Is(err, store.ErrNotFound) {
			if e := m.expiry(ctx, id); e != nil {
				return nil, 0, e
			}
			return nil, 0, fmt.Errorf("%w: sandbox %q is neither running nor suspended", ErrNotFound, id)
		}
		if err != nil {
			return nil, 0, err
		}
	}
	spec := opts.Network
	if opts.KeepNetwork {
		spec = rec.Network.spec()
		if err := spec.check(); err != nil {
			return nil, 0, fmt.Errorf("sandbox %s: the network kept with it: %w", id, err)
		}
		if network, err = m.effectiveNetwork(spec, opts.Rules); err != nil {
			return nil, 0, fmt.Errorf("sandbox %s: the network kept with it: %w", id, err)
		}
	}
	bytes = rec.Size
	if rec.Spent {
		m.log.Warn(fmt.Sprintf("sandbox %s was running when its shard stopped without saving it: it resumes from its last good state, saved %s", id, rec.Saved.Format(time.RFC3339)), "sandbox", id)
	}
	// Spent: it runs from this snapshot from now on, which stays in the
	// store as its last good state until its next save replaces it. The
	// write is conditional on the record read, and bumps its generation:
	// a shard that ran the sandbox before and lost it (fenced) can no
	// longer write its record (the reference service's object is left as
	// it is: its next save removes it). The record keeps the network it
	// runs with, so that it wakes with it if this shard dies.
	if !rec.legacy {
		rec.Spent, rec.Reason, rec.Network = true, "", saveNetwork(spec)
		if err := m.writeRecordIf(ctx, snapshotRecordKey(id), rec, rec.gen); err != nil {
			return nil, 0, err
		}
		b.recGen = rec.gen
		b.saved = time.Now()
	} else {
		m.log.Info("resuming a sandbox the reference service suspended; its next save is in sandgate's format", "sandbox", id, "object", rec.Layer)
	}
	if err := m.reserve(); err != nil {
		return nil, 0, err
	}
	mods, err := m.fetchModules(ctx, rec.Modules)
	if err != nil {
		m.unreserve()
		return nil, 0, err
	}
	b.created, b.template, b.spec, b.network, b.modules = rec.Created, rec.Template, spec, network, mods
	b.limits = rec.Limits
	m.setBase(b, rec.baseRecord())
	sb, err = m.start(ctx, b, rec, startOptions{Rules: opts.Rules, Agent: opts.Agent, Dirs: opts.Dirs, Held: rec.Held})
	if err != nil {
		m.setBase(b, nil)
		m.unreserve()
		return nil, 0, err
	}
	m.met.suspended.Dec()
	return sb, bytes, nil
}

// keepNetwork writes running sandbox b's network into its record, if it
// has one (b's lock held): a sandbox that wakes on another shard, after
// this one died, wakes with the network it had here. A record changed
// under this shard (another runs the sandbox now) is left as it is.
func (m *Manager) keepNetwork(ctx context.Context, b *box) {
	if err := m.journal(b); err != nil {
		m.log.Warn("recording the sandbox's network for restart recovery failed", "sandbox", b.id, "err", err)
	}
	if b.recGen == 0 {
		return // no record yet: its first save keeps it
	}
	rec, err := m.readRecord(ctx, snapshotRecordKey(b.id))
	if err == nil && rec.gen != b.recGen {
		err = fmt.Errorf("%w: %w", ErrStore, ErrRecordChanged)
	}
	if err == nil {
		rec.Network = saveNetwork(b.spec)
		if err = m.writeRecordIf(ctx, snapshotRecordKey(b.id), rec, b.recGen); err == nil {
			b.recGen = rec.gen
		}
	}
	if err != nil {
		m.log.Warn("keeping the sandbox's network with its record failed: if its shard dies, it wakes with the network of its last save", "sandbox", b.id, "err", err)
	}
}

// SetNetwork replaces running sandbox id's network: every new connection
// is judged by the new policy at once, and new commands get the new base
// URLs. A spec without BaseURLs (nil) keeps the sandbox's (protocol 1's
// network route replaces only the allowed hosts).
func (m *Manager) SetNetwork(ctx context.Context, id string, spec NetworkSpec) error {
	if err := spec.check(); err != nil {
		return err
	}
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	sb := b.live.Load()
	if sb == nil {
		return fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
	}
	if spec.BaseURLs == nil {
		spec.BaseURLs = b.spec.BaseURLs
	}
	n, err := m.effectiveNetwork(spec, sb.relay.Transforms().Rules())
	if err != nil {
		return err
	}
	b.spec, b.network = spec, n
	sb.setNetwork(n)
	m.keepNetwork(ctx, b)
	return nil
}

// SetRules replaces running sandbox id's credential rules, or adds rules
// after them: the proxy applies them from the next request on, the hosts
// they target become reachable by its routes, and the credential guard
// searches what goes into the sandbox for their secrets. They are held in
// memory only and dropped the moment the sandbox stops running. The
// secrets of rules replaced stay scrubbed from the answers of their hosts
// for the sandbox's life: its record keeps them sealed, and is written
// before the change when the sandbox is to hold a new secret (a sandbox
// that would hold more than transforms.MaxHeldSecrets is refused).
func (m *Manager) SetRules(ctx context.Context, id string, rules []transforms.Rule, add bool) error {
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	sb := b.live.Load()
	if sb == nil {
		return fmt.Errorf("%w: sandbox %q is not running", ErrNotRunning, id)
	}
	rs := sb.relay.Transforms()
	all := rules
	if add {
		all = append(rs.Rules(), rules...)
	}
	n, err := m.effectiveNetwork(b.spec, all)
	if err != nil {
		return err
	}
	if h := rs.HeldWith(all...); h > transforms.MaxHeldSecrets {
		return tooManyHeld(id, h)
	}
	if held := rs.SealWith(m.seal, id, all...); heldChanged(b.held, held) {
		if err := m.writeHeld(ctx, b, held); err != nil {
			return err
		}
	}
	rs.Set(all...)
	b.network = n
	sb.setNetwork(n)
	return nil
}

// Suspend saves sandbox id's layer to the store and removes the sandbox:
// its processes are stopped, its layer exported and saved (compressed,
// with its digest and manifest; a save cut short leaves nothing a resume
// would trust), then it is deleted. A failed save leaves it running. Its
// transformations are forgotten; its network is kept with its snapshot
// (ResumeOptions.KeepNetwork). It stays suspended until resumed: a call
// does not wake it (SuspendedByCaller). A sandbox not running is no error
// (idempotent).
func (m *Manager) Suspend(ctx context.Context, id string) error {
	return m.suspend(ctx, id, SuspendedByCaller)
}

// suspend is Suspend for a reason.
func (m *Manager) suspend(ctx context.Context, id string, reason SuspendReason) (err error) {
	start := time.Now()
	var saved *record
	defer func() {
		m.done("suspend", id, start, err, func() []any {
			if saved == nil {
				return nil
			}
			return []any{"bytes", saved.Size, "reason", string(reason)}
		})
	}()
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	saved, err = m.suspendLocked(ctx, b, reason)
	return err
}

// suspendLocked is Suspend under the id's lock.
func (m *Manager) suspendLocked(ctx context.Context, b *box, reason SuspendReason) (*record, error) {
	sb := b.live.Load()
	if sb == nil {
		if reason == SuspendedByCaller {
			return nil, m.markSuspendedByCaller(ctx, b.id)
		}
		return nil, nil
	}
	b.live.Store(nil)
	b.state.Store(Suspending)
	m.met.states.WithLabelValues(string(Suspending)).Inc()
	defer m.met.states.WithLabelValues(string(Suspending)).Dec()
	restore := func() {
		b.live.Store(sb)
		b.state.Store(Running)
	}
	if _, err := sb.KillAll(ctx); err != nil && sb.Context().Err() == nil {
		restore()
		return nil, fmt.Errorf("sandbox %s: stopping its processes before saving: %w", b.id, err)
	}
	// Its audit is sealed (written whole to the store) beside the save.
	sealed := make(chan struct{})
	go func() {
		defer close(sealed)
		m.sealAudit(ctx, sb)
	}()
	rec, err := m.saveSnapshot(ctx, b, reason)
	<-sealed
	if err != nil {
		m.openAudit(b.id) // it runs on
		restore()
		return nil, err
	}
	if err := sb.Destroy(context.WithoutCancel(ctx)); err != nil {
		m.log.Warn("sandbox saved, but removing it failed", "sandbox", b.id, "err", err)
	}
	b.state.Store(State(""))
	m.setBase(b, nil) // the record holds it now
	m.unjournal(b.id)
	m.unreserve()
	m.releaseLease(ctx, b)
	m.met.suspended.Inc()
	return rec, nil
}

// markSuspendedByCaller records that the caller wants sandbox id, which
// does not run here, suspended (id's lock held): one the service
// suspended on its own no longer wakes on its next call. A sandbox another
// live shard runs is left to it (its owner answers the suspend); one
// with no snapshot, or only the reference service's, is left as it is.
func (m *Manager) markSuspendedByCaller(ctx context.Context, id string) error {
	rec, err := m.readRecord(ctx, snapshotRecordKey(id))
	if errors.Is(err, store.ErrNotFound) || err == nil && rec.reason() == SuspendedByCaller {
		return nil
	}
	if err != nil {
		return err
	}
	if _, held, err := m.c.Holder(ctx, id); err != nil {
		return fmt.Errorf("%w: who runs %s: %v", ErrStore, id, err)
	} else if held {
		return nil // running: a spent record is its last good state
	}
	rec.Spent, rec.Reason = false, SuspendedByCaller
	return m.writeRecordIf(ctx, snapshotRecordKey(id), rec, rec.gen)
}

// Destroy removes sandbox id, running or suspended, and its snapshot.
// Destroying an id with neither is no error (idempotent).
func (m *Manager) Destroy(ctx context.Context, id string) (err error) {
	start := time.Now()
	defer func() { m.done("destroy", id, start, err, nil) }()
	b, release, err := m.acquire(ctx, id)
	if err != nil {
		return err
	}
	defer release()
	m.forgetExpiry(ctx, id)
	_, err = m.destroyLocked(ctx, b, destroyOptions{})
	return err
}

// destroyOptions are what destroyLocked keeps or checks: an expiry keeps
// the audit, and removes a suspended sandbox only at the generation of
// its record it judged (ifGen; 0: whatever it is).
type destroyOptions struct {
	keepAudit bool
	ifGen     int64
}

// destroyLocked is Destroy under the id's lock. It reports whether the
// sandbox was there to destroy, running or suspended.
func (m *Manager) destroyLocked(ctx context.Context, b *box, o destroyOptions) (bool, error) {
	id := b.id
	if o.ifGen != 0 && b.getState() != "" {
		return false, nil // judged suspended, it runs here now
	}
	if err := m.takeLease(ctx, b); err != nil {
		return false, err // *cluster.HeldError (ErrElsewhere): it runs there
	}
	defer m.releaseLease(ctx, b)
	sb := b.live.Load()
	var rec *record
	if o.ifGen != 0 {
		// Judged suspended at that generation: a resume, a save or a
		// destroy since has changed it, and it stays as it is now.
		r, err := m.suspended(ctx, id)
		if errors.Is(err, store.ErrNotFound) {
			return false, nil
		}
		if err != nil || r.gen != o.ifGen {
			return false, err
		}
		rec = r
	}
	if sb != nil {
		b.live.Store(nil)
		if o.keepAudit {
			sb.KillAll(ctx)
			m.sealAudit(ctx, sb)
		}
		if err := sb.Destroy(ctx); err != nil && !errors.Is(err, ErrNotFound) {
			b.live.Store(sb)
			return false, err
		}
		b.state.Store(State(""))
		m.setBase(b, nil)
		m.unjournal(id)
		m.unreserve()
	} else if m.l.Templates() {
		// A sandbox the CLI still has that the manager does not know (a
		// restart could not save it): remove it too.
		if err := m.l.Delete(ctx, id); err != nil && !errors.Is(err, ErrNotFound) {
			return false, err
		}
	}
	if !o.keepAudit {
		if err := m.removeAudit(ctx, id, sb); err != nil {
			return sb != nil, err
		}
	}
	if err := m.dropSessions(ctx, b); err != nil {
		return sb != nil, err
	}
	if rec == nil {
		r, err := m.suspended(ctx, id)
		switch {
		case errors.Is(err, store.ErrNotFound):
			return sb != nil, nil
		case err != nil:
			return sb != nil, err
		}
		rec = r
	}
	if !rec.legacy {
		if err := m.deleteRecord(ctx, snapshotRecordKey(id), rec); err != nil {
			return sb != nil, err
		}
	}
	if err := m.dropLegacy(ctx, id); err != nil {
		return true, err
	}
	m.met.suspended.Dec()
	return true, nil
}

// ForkOptions are what Fork gives the new sandbox. A zero Network takes
// the source's (a running source's network; a suspended one keeps none,
// so deny-all).
type ForkOptions struct {
	Network *NetworkSpec
	Rules   []transforms.Rule
	Agent   *agent.Config
}

// Fork makes sandbox dst a copy of src. A running src is copied by the
// sandbox CLI (its files as they are now; it keeps running) and dst runs;
// a suspended src's snapshot is copied (it stays) and dst is suspended, to
// be resumed. dst must be free, as for Create. It returns dst's state.
func (m *Manager) Fork(ctx context.Context, src, dst string, opts ForkOptions) (state State, err error) {
	start := time.Now()
	defer func() { m.done("fork", dst, start, err, func() []any { return []any{"from", src} }) }()
	if src == dst {
		return "", fmt.Errorf("%w: fork %s onto itself", ErrBadInput, src)
	}
	// Locks in id order: two forks between the same pair cannot deadlock.
	first, second := src, dst
	if second < first {
		first, second = second, first
	}
	b1, rel1, err := m.acquire(ctx, first)
	if err != nil {
		return "", err
	}
	defer rel1()
	b2, rel2, err := m.acquire(ctx, second)
	if err != nil {
		return "", err
	}
	defer rel2()
	sb, db := b1, b2
	if sb.id != src {
		sb, db = b2, b1
	}
	if db.getState() != "" {
		return "", fmt.Errorf("%w: sandbox %q is %s", ErrExists, dst, db.getState())
	}
	if sb.live.Load() == nil {
		// A suspended source is copied here; a source another shard runs
		// is forked there.
		if s, here, err := m.Owner(ctx, src); err != nil {
			return "", err
		} else if !here {
			return "", &cluster.HeldError{Sandbox: src, Shard: s}
		}
	}
	if err := m.takeLease(ctx, db); err != nil {
		var held *cluster.HeldError
		if errors.As(err, &held) {
			return "", fmt.Errorf("%w: sandbox %q runs on shard %s", ErrExists, dst, held.Shard.ID)
		}
		return "", err
	}
	// dst keeps its lease only if it runs here: a suspended one is
	// anyone's to resume.
	defer func() {
		if err != nil || db.live.Load() == nil {
			m.releaseLease(ctx, db)
		}
	}()
	if _, err := m.suspended(ctx, dst); err == nil {
		return "", fmt.Errorf("%w: sandbox %q is suspended", ErrExists, dst)
	} else if !errors.Is(err, store.ErrNotFound) {
		return "", err
	}
	if live := sb.live.Load(); live != nil {
		spec := sb.spec // the source box's
		if opts.Network != nil {
			spec = *opts.Network
		}
		if err := spec.check(); err != nil {
			return "", err
		}
		network, err := m.effectiveNetwork(spec, opts.Rules)
		if err != nil {
			return "", err
		}
		held := m.resealHeld(src, dst, sb.held)
		if err := m.checkHeld(dst, opts.Rules, held); err != nil {
			return "", err
		}
		if err := m.reserve(); err != nil {
			return "", err
		}
		if err := m.l.Fork(ctx, src, dst); err != nil {
			m.unreserve()
			return "", err
		}
		db.created, db.template, db.spec, db.network, db.modules = time.Now().UTC(), sb.template, spec, network, slices.Clone(sb.modules)
		db.limits = sb.limits
		m.setBase(db, sb.base)
		if _, err := m.attach(ctx, db, startOptions{Rules: opts.Rules, Agent: opts.Agent, Held: held}); err != nil {
			m.setBase(db, nil)
			m.unreserve()
			return "", err
		}
		return Running, nil
	}
	rec, err := m.suspended(ctx, src)
	if errors.Is(err, store.ErrNotFound) {
		return "", fmt.Errorf("%w: sandbox %q is neither running nor suspended", ErrNotFound, src)
	}
	if err != nil {
		return "", err
	}
	copy := m.copySnapshot
	if rec.legacy {
		copy = m.copyLegacy
	}
	rec.Held = m.resealHeld(src, dst, rec.Held)
	if err := copy(ctx, rec, dst); err != nil {
		return "", err
	}
	m.met.suspended.Inc()
	return Suspended, nil
}

// Get describes sandbox id; an id neither running nor suspended is
// ErrNotFound.
func (m *Manager) Get(ctx context.Context, id string) (Info, error) {
	if err := sandboxcli.CheckID(id); err != nil {
		return Info{}, err
	}
	m.mu.Lock()
	b := m.boxes[id]
	m.mu.Unlock()
	if b != nil && b.getState() != "" {
		return m.liveInfo(b), nil
	}
	if s, here, err := m.Owner(ctx, id); err != nil {
		return Info{}, err
	} else if !here {
		return Info{ID: id, State: Running, Shard: s.ID}, nil
	}
	rec, err := m.suspended(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		if e := m.expiry(ctx, id); e != nil {
			return Info{}, e
		}
		return Info{}, fmt.Errorf("%w: sandbox %q is neither running nor suspended", ErrNotFound, id)
	}
	if err != nil {
		return Info{}, err
	}
	return m.suspendedInfo(id, rec), nil
}

// suspendedInfo describes suspended sandbox id: its record, and the
// network it wakes with.
func (m *Manager) suspendedInfo(id string, rec *record) Info {
	inf := rec.info(id)
	inf.Limits = m.effectiveLimits(rec.Limits)
	if rec.Network != nil {
		if n, err := m.effectiveNetwork(rec.Network.spec(), nil); err == nil {
			inf.Policy, inf.BaseURLs = &n.Policy, n.BaseURLs
		}
	}
	return inf
}

// List describes every sandbox, running and suspended, by id.
func (m *Manager) List(ctx context.Context) ([]Info, error) {
	m.mu.Lock()
	var live []*box
	for _, b := range m.boxes {
		if b.getState() != "" {
			live = append(live, b)
		}
	}
	m.mu.Unlock()
	out := make([]Info, 0, len(live))
	seen := map[string]bool{}
	for _, b := range live {
		out = append(out, m.liveInfo(b))
		seen[b.id] = true
	}
	// What the other live shards run, as their heartbeats say.
	shards, err := m.c.Shards(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: listing the shards: %v", ErrStore, err)
	}
	for _, s := range shards {
		if s.ID == m.c.ID() {
			continue
		}
		for _, id := range s.Sandboxes {
			if !seen[id] {
				out = append(out, Info{ID: id, State: Running, Shard: s.ID})
				seen[id] = true
			}
		}
	}
	ids, err := m.suspendedIDs(ctx)
	if err != nil {
		return nil, err
	}
	for _, id := range ids {
		if seen[id] {
			continue // resumed meanwhile
		}
		rec, err := m.suspended(ctx, id)
		if err != nil {
			continue // destroyed or resumed meanwhile
		}
		out = append(out, m.suspendedInfo(id, rec))
	}
	slices.SortFunc(out, func(a, b Info) int {
		switch {
		case a.ID < b.ID:
			return -1
		case a.ID > b.ID:
			return 1
		}
		return 0
	})
	return out, nil
}

func (m *Manager) liveInfo(b *box) Info {
	inf := Info{ID: b.id, State: b.getState(), Created: b.created, Template: b.template, Shard: m.c.ID(), Limits: m.effectiveLimits(b.limits)}
	if sb := b.live.Load(); sb != nil {
		pol := sb.relay.Policy()
		inf.Policy = &pol
		inf.BaseURLs = b.network.BaseURLs
		inf.Modules = moduleInfos(b.modules)
		inf.OpenPorts = sb.OpenPorts()
		inf.LastActive = time.Now().Add(-sb.Idle(time.Now())).UTC()
		inf.Usage, inf.LayerBytes = m.usage(b)
	}
	return inf
}

// effectiveLimits are a sandbox's own limits over the service's defaults:
// what applies to it now. A sandbox keeps only its own (its record), so a
// change of the service's defaults applies at its next start.
func (m *Manager) effectiveLimits(own Limits) Limits { return own.Or(m.cfg.Limits) }

// Capacity is what the service holds.
type Capacity struct {
	Running, MaxRunning int
	Suspended           int
	// MemoryLimitBytes is the memory the running sandboxes may take
	// together (their limits); LayerBytes what their layers take on
	// disk (running, where the CLI tells) and in the store (suspended).
	MemoryLimitBytes int64
	LayerBytes       int64
}

// Capacity reports what the service holds now.
func (m *Manager) Capacity(ctx context.Context) (Capacity, error) {
	infos, err := m.List(ctx)
	if err != nil {
		return Capacity{}, err
	}
	c := Capacity{MaxRunning: m.cfg.MaxRunning}
	limit, _ := sandboxcli.ParseSize(m.l.cfg.Memory)
	for _, in := range infos {
		if in.State == Suspended {
			c.Suspended++
		} else {
			c.Running++
			c.MemoryLimitBytes += limit
		}
		c.LayerBytes += in.LayerBytes
	}
	return c, nil
}

// done logs an operation's one event and counts it.
func (m *Manager) done(op, id string, start time.Time, err error, attrs func() []any) {
	took := time.Since(start)
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.met.ops.WithLabelValues(op, result).Inc()
	m.met.durations.WithLabelValues(op).Observe(took.Seconds())
	args := []any{"sandbox", id, "op", op, "ms", took.Milliseconds()}
	if attrs != nil {
		args = append(args, attrs()...)
	}
	if err != nil {
		m.log.Warn(fmt.Sprintf("%s %s failed after %d ms", id, op, took.Milliseconds()), append(args, "err", err)...)
		return
	}
	verb := map[string]string{"create": "created", "resume": "resumed", "suspend": "suspended", "destroy": "destroyed", "fork": "forked", "template": "saved as a template"}[op]
	m.log.Info(fmt.Sprintf("%s %s in %d ms", id, verb, took.Milliseconds()), args...)
}
