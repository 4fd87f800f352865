package console

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sandgate/sandgate/api/server"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/sandboxcli"
	"github.com/sandgate/sandgate/relay/audit"
)

// errorf is an error answered with status: the console's own refusals
// (auth, a bad filter). Every error's status is the API's mapping
// (server.Status), in one place.
func errorf(status int, format string, args ...any) error {
	return server.Errorf(status, format, args...)
}

type errorData struct {
	pageData
	Status  int
	Message string
}

// writeError answers err: a page for a browser, JSON for the console's
// script and for the API's clients, text for a stream.
func (c *Console) writeError(w http.ResponseWriter, r *http.Request, err error) {
	code := server.Status(err)
	if code >= 500 {
		c.log.Warn("console: a request failed", "path", r.URL.Path, "status", code, "err", err)
	}
	if code == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "5")
	}
	w.Header().Set("Cache-Control", "no-store")
	if strings.HasSuffix(r.URL.Path, ".json") || strings.HasSuffix(r.URL.Path, "/events") || !wantsPage(r) && r.Method == http.MethodGet {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		json.NewEncoder(w).Encode(map[string]string{"error": err.Error()})
		return
	}
	d := errorData{pageData: c.page(r, http.StatusText(code)), Status: code, Message: err.Error()}
	if code == http.StatusUnauthorized || code == http.StatusForbidden {
		d.CSRF = "" // no forms on a refusal
	}
	c.render(w, r, code, "error.html", d)
}

// pageData is what every page's frame shows.
type pageData struct {
	Title   string
	CSRF    string
	SignOut bool // signed in with a cookie: a sign-out button
	Version string
	Shard   string
	Now     time.Time
	Nav     string
}

func (c *Console) page(r *http.Request, title string) pageData {
	s := sessionOf(r)
	shard, _ := c.b.Shard()
	return pageData{Title: title, CSRF: c.csrf(s), SignOut: s.id != "", Version: c.cfg.Version, Shard: shard, Now: c.cfg.Now().UTC()}
}

// render executes a page template into a buffer first, so a failure is a
// clean 500 rather than half a page.
func (c *Console) render(w http.ResponseWriter, r *http.Request, code int, name string, data any) error {
	var b bytes.Buffer
	if err := c.tmpl.ExecuteTemplate(&b, name, data); err != nil {
		c.log.Error("console: rendering a page failed", "page", name, "err", err)
		http.Error(w, "rendering the page failed", http.StatusInternalServerError)
		return nil
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(b.Len()))
	w.WriteHeader(code)
	if r.Method != http.MethodHead {
		w.Write(b.Bytes())
	}
	return nil
}

func checkName(name string) error {
	if err := sandboxcli.CheckID(name); err != nil {
		return errorf(http.StatusBadRequest, "sandbox name %q: use letters, digits and dashes, at most %d", audit.Truncate(name, 80), sandboxcli.MaxIDLength)
	}
	return nil
}

// row is one sandbox as the list shows it.
type row struct {
	Name, State, Shard string
	Elsewhere          bool // another shard runs it
	Created            time.Time
	Age, Idle          string
	Usage              usage
	Layer              string
	Limits             appliance.Limits
}

// usage is what a sandbox takes of the host, each "—" where the launcher
// does not report it.
type usage struct {
	CPU, Memory, Disk, Processes string
}

// usageOf is what the launcher reports of a sandbox's use, beside its
// limits. LEAD: wire appliance.Usage in here at merge (Info.Usage:
// CPUSeconds → CPU, MemoryBytes and MemoryPeakBytes → Memory, DiskBytes
// and DiskQuotaBytes → Disk, Processes); every page shows what this
// returns, and "—" is what a launcher that reports nothing gets.
func usageOf(in appliance.Info) usage {
	const none = "—"
	u := usage{CPU: none, Memory: none, Disk: none, Processes: none}
	return u
}

func (c *Console) rowOf(in appliance.Info, self string) row {
	now := c.cfg.Now()
	r := row{Name: in.ID, State: string(in.State), Shard: in.Shard, Created: in.Created, Usage: usageOf(in), Limits: in.Limits,
		Age: "—", Idle: "—", Layer: "—"}
	r.Elsewhere = in.Shard != "" && in.Shard != self
	if !in.Created.IsZero() {
		r.Age = ago(now.Sub(in.Created))
	}
	if in.State == appliance.Running && !in.LastActive.IsZero() {
		r.Idle = ago(now.Sub(in.LastActive))
	}
	if !r.Elsewhere && (in.LayerBytes > 0 || in.State != appliance.Running) {
		r.Layer = humanBytes(in.LayerBytes)
	}
	return r
}

type listData struct {
	pageData
	Rows                       []row
	Running, Suspended, Remote int
	Range                      string
	Ranges                     []string
}

func (c *Console) list(w http.ResponseWriter, r *http.Request) error {
	rng, _, err := chartSpan(r.URL.Query().Get("range"))
	if err != nil {
		return err
	}
	infos, err := c.b.List(r.Context())
	if err != nil {
		return err
	}
	self, _ := c.b.Shard()
	d := listData{pageData: c.page(r, "Sandboxes"), Range: rng, Ranges: rangeNames()}
	d.Nav = "list"
	for _, in := range infos {
		rw := c.rowOf(in, self)
		switch {
		case rw.Elsewhere:
			d.Remote++
		case in.State == appliance.Suspended:
			d.Suspended++
		default:
			d.Running++
		}
		d.Rows = append(d.Rows, rw)
	}
	return c.render(w, r, http.StatusOK, "list.html", d)
}

func rangeNames() []string {
	var out []string
	for _, r := range chartRanges {
		out = append(out, r.Name)
	}
	return out
}

type sandboxData struct {
	pageData
	Row       row
	Info      appliance.Info
	ShardURL  string // where the shard that runs it serves its console
	Policy    *policyView
	Rules     []appliance.RuleInfo
	RulesNote string
	Modules   []appliance.ModuleInfo
	Sessions  []sessionView
	SessNote  string
	Events    []eventView
	Capped    bool
	Filter    eventFilter
	Stream    string // the stream's URL
	Range     string
	Ranges    []string
	AuditNote string
	Codes     []string
}

// policyView is a network policy as the page lists it.
type policyView struct {
	Mode                                  string
	Hosts, AllowedCIDRs, DeniedCIDRs, Int []string
	BaseURLs                              []kv
}

type kv struct{ K, V string }

// sessionView is a session without its variables' values (they are the
// caller's, and may be anything).
type sessionView struct {
	Name, Dir string
	Vars      []string
}

func (c *Console) sandbox(w http.ResponseWriter, r *http.Request) error {
	name, f, err := nameAndFilter(r)
	if err != nil {
		return err
	}
	rng, _, err := chartSpan(r.URL.Query().Get("range"))
	if err != nil {
		return err
	}
	ctx := r.Context()
	in, err := c.b.Get(ctx, name)
	if err != nil {
		return err
	}
	self, _ := c.b.Shard()
	d := sandboxData{pageData: c.page(r, name), Info: in, Row: c.rowOf(in, self), Filter: f, Range: rng, Ranges: rangeNames(), Modules: in.Modules}
	d.Codes = []string{"no_rule", "deny_all", "address_class", "denied_cidr", "local_name", "port", "plain_http", "direct_lookup", "module_refused", "limit", "allowed_host", "route_host", "allow_all"}
	if d.Row.Elsewhere {
		d.ShardURL = c.shardURL(ctx, in.Shard)
	}
	if in.Policy != nil {
		d.Policy = policyOf(in)
	}
	switch rules, err := c.b.CredentialRules(name); {
	case err == nil:
		d.Rules = rules
	case errors.Is(err, appliance.ErrNotRunning):
		d.RulesNote = "none while it is not running here: a sandbox's credential rules live in the service's memory only, and are dropped when it stops"
	default:
		return err
	}
	if d.Row.Elsewhere {
		d.SessNote = "kept by the shard that runs it"
	} else if sess, err := c.b.Sessions(ctx, name); err != nil {
		d.SessNote = "could not be read: " + err.Error()
	} else {
		for _, k := range slices.Sorted(maps.Keys(sess)) {
			s := sess[k]
			d.Sessions = append(d.Sessions, sessionView{Name: k, Dir: s.Dir, Vars: slices.Sorted(maps.Keys(s.Env))})
		}
	}
	rows, cursor, capped, err := c.recent(ctx, name, f, c.cfg.MaxChartEvents)
	switch {
	case errors.Is(err, appliance.ErrNoAudit):
		d.AuditNote = "this service keeps no audit"
	case err != nil:
		return err
	default:
		d.Events, d.Capped = rows, capped
		v := f.Values()
		if !cursor.IsZero() {
			v.Set("cursor", cursor.String())
		}
		d.Stream = "/ui/sandboxes/" + name + "/events"
		if len(v) > 0 {
			d.Stream += "?" + v.Encode()
		}
	}
	return c.render(w, r, http.StatusOK, "sandbox.html", d)
}

// policyOf reads a sandbox's policy in its JSON shape (netpolicy's one
// rendering of it), and its base URLs.
func policyOf(in appliance.Info) *policyView {
	var pj struct {
		Mode                                               string
		AllowedHosts, AllowedCIDRs, DeniedCIDRs, Intercept []string
	}
	if b, err := json.Marshal(in.Policy); err == nil {
		json.Unmarshal(b, &pj)
	}
	v := &policyView{Mode: pj.Mode, Hosts: pj.AllowedHosts, AllowedCIDRs: pj.AllowedCIDRs, DeniedCIDRs: pj.DeniedCIDRs, Int: pj.Intercept}
	for _, k := range slices.Sorted(maps.Keys(in.BaseURLs)) {
		v.BaseURLs = append(v.BaseURLs, kv{k, in.BaseURLs[k]})
	}
	return v
}

// shardURL is where shard serves its console, "" when it gave no URL.
func (c *Console) shardURL(ctx context.Context, shard string) string {
	shards, err := c.b.Shards(ctx)
	if err != nil {
		return ""
	}
	for _, s := range shards {
		if s.ID == shard && (strings.HasPrefix(s.URL, "https://") || strings.HasPrefix(s.URL, "http://")) {
			return strings.TrimSuffix(s.URL, "/") + Prefix
		}
	}
	return ""
}

type confirmData struct {
	pageData
	Name, Action, Verb, What string
}

// actions are what the console's buttons do, each said before it is done.
var actions = map[string]struct{ verb, what string }{
	"suspend": {"Suspend", "Its processes are stopped and its files saved to the store; it keeps nothing else (its network policy, credential rules and open connections go). Resume starts it again with its files."},
	"resume":  {"Resume", "It starts again from its saved files, with the service's network policy and base URLs (its own, and its credential rules, were not kept while it was suspended: give them again through the API)."},
	"destroy": {"Destroy", "It is removed with its files, its snapshot, its sessions and its audit. This cannot be undone."},
}

// act suspends, resumes or destroys a sandbox: once confirmed (the
// confirmation page's form, or the script's confirm() adding confirm=yes),
// and only a sandbox this shard can act on.
func (c *Console) act(w http.ResponseWriter, r *http.Request) error {
	name, action := r.PathValue("name"), r.PathValue("action")
	if err := checkName(name); err != nil {
		return err
	}
	a, ok := actions[action]
	if !ok {
		return errorf(http.StatusNotFound, "no action %q: the console suspends, resumes and destroys", audit.Truncate(action, 40))
	}
	ctx := r.Context()
	in, err := c.b.Get(ctx, name)
	if err != nil {
		if action == "destroy" && errors.Is(err, appliance.ErrNotFound) {
			http.Redirect(w, r, Prefix, http.StatusSeeOther) // gone already
			return nil
		}
		return err
	}
	if self, _ := c.b.Shard(); in.Shard != "" && in.Shard != self {
		where := in.Shard
		if u := c.shardURL(ctx, in.Shard); u != "" {
			where += " (" + u + ")"
		}
		return errorf(http.StatusConflict, "sandbox %s runs on shard %s: act on it from that shard's console", name, where)
	}
	if r.PostFormValue("confirm") != "yes" {
		return c.render(w, r, http.StatusOK, "confirm.html", confirmData{pageData: c.page(r, a.verb+" "+name), Name: name, Action: action, Verb: a.verb, What: a.what})
	}
	// The work goes on if the browser leaves: a half-done suspend is for
	// the manager to finish, not for a closed tab to cut.
	ctx = context.WithoutCancel(ctx)
	start := c.cfg.Now()
	switch action {
	case "suspend":
		err = c.b.Suspend(ctx, name)
	case "resume":
		if in.State != appliance.Suspended {
			return errorf(http.StatusConflict, "sandbox %s is %s, not suspended: resuming it would replace its network policy", name, in.State)
		}
		opts := appliance.ResumeOptions{}
		if c.cfg.Agent != nil {
			opts.Agent = c.cfg.Agent(name)
		}
		if c.cfg.Dirs != nil {
			opts.Dirs = c.cfg.Dirs(name)
		}
		_, err = c.b.Resume(ctx, name, opts)
	case "destroy":
		err = c.b.Destroy(ctx, name)
	}
	c.log.Info("console: "+action, "sandbox", name, "ms", c.cfg.Now().Sub(start).Milliseconds(), "ok", err == nil)
	if err != nil {
		return err
	}
	if action == "destroy" {
		http.Redirect(w, r, Prefix, http.StatusSeeOther)
	} else {
		http.Redirect(w, r, "/ui/sandboxes/"+name, http.StatusSeeOther)
	}
	return nil
}

// chartTarget reads which sandbox a chart is of ("" the service's) and
// its range.
func (c *Console) chartTarget(r *http.Request) (names []string, rng string, span time.Duration, err error) {
	if rng, span, err = chartSpan(r.URL.Query().Get("range")); err != nil {
		return nil, "", 0, err
	}
	if name := r.URL.Query().Get("sandbox"); name != "" {
		if err := checkName(name); err != nil {
			return nil, "", 0, err
		}
		names = []string{name}
	}
	return names, rng, span, nil
}

// egressJSON is a chart's data (egress) as JSON, for the script; with
// the page's Accept, egressPage renders the same as a table.
func (c *Console) egressJSON(w http.ResponseWriter, r *http.Request) error {
	return c.egressOut(w, r, false)
}

// egressPage is a chart's data as a table: what the charts show, for a
// browser without scripts, and to read exact figures.
func (c *Console) egressPage(w http.ResponseWriter, r *http.Request) error {
	return c.egressOut(w, r, true)
}

type egressData struct {
	pageData
	Sandbox string
	E       *egress
	Ranges  []string
}

func (c *Console) egressOut(w http.ResponseWriter, r *http.Request, page bool) error {
	names, rng, span, err := c.chartTarget(r)
	if err != nil {
		return err
	}
	e, err := c.egressOf(r.Context(), names, rng, span)
	if err != nil {
		return err
	}
	if !page {
		w.Header().Set("Content-Type", "application/json")
		return json.NewEncoder(w).Encode(e)
	}
	d := egressData{pageData: c.page(r, "Egress"), E: e, Ranges: rangeNames()}
	if names != nil {
		d.Sandbox = names[0]
	}
	return c.render(w, r, http.StatusOK, "egress.html", d)
}

// funcs are the templates' helpers.
var funcs = template.FuncMap{
	"bytes": humanBytes,
	"utc":   func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05 UTC") },
	"limits": func(l appliance.Limits) []kv {
		var out []kv
		add := func(k, v string) { out = append(out, kv{k, v}) }
		if l.CPU > 0 {
			add("CPU", strconv.FormatFloat(l.CPU, 'f', -1, 64)+" cores")
		}
		if l.CPUWeight > 0 {
			add("CPU weight", strconv.Itoa(l.CPUWeight))
		}
		if l.Memory > 0 {
			add("memory", humanBytes(l.Memory))
		}
		if l.Pids > 0 {
			add("processes", strconv.Itoa(l.Pids))
		}
		if l.Disk > 0 {
			add("disk", humanBytes(l.Disk))
		}
		if l.Lifetime > 0 {
			add("lifetime", l.Lifetime.String())
		}
		if l.KeepSuspended > 0 {
			add("kept suspended", l.KeepSuspended.String())
		}
		return out
	},
	"limitOr": func(v int64) string {
		if v <= 0 {
			return "no limit"
		}
		return humanBytes(v)
	},
	"cores": func(v float64) string {
		if v <= 0 {
			return "no limit"
		}
		return strconv.FormatFloat(v, 'f', -1, 64) + " cores"
	},
	"join": strings.Join,
	"sel":  func(a, b string) bool { return a == b },
}

// humanBytes is n in B, KB, MB, GB (powers of 1024, as the limits are
// given).
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return strconv.FormatInt(n, 10) + " B"
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	return strconv.FormatFloat(float64(n)/float64(div), 'f', 1, 64) + " " + string("KMGTP"[exp]) + "B"
}

// ago is a duration as a person reads it: 45s, 12m, 3h 5m, 2d 4h.
func ago(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return strconv.Itoa(int(d.Seconds())) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d.Minutes())) + "m"
	case d < 24*time.Hour && int(d.Minutes())%60 == 0:
		return fmt.Sprintf("%dh", int(d.Hours()))
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh %dm", int(d.Hours()), int(d.Minutes())%60)
	case int(d.Hours())%24 == 0:
		return fmt.Sprintf("%dd", int(d.Hours())/24)
	}
	return fmt.Sprintf("%dd %dh", int(d.Hours())/24, int(d.Hours())%24)
}
