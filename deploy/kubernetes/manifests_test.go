// Package kubernetes holds the Kubernetes manifests of sandgate's shards
// (see README.md) and, here, their checks: offline, without a cluster or
// kubectl, every document is decoded strictly into the Kubernetes API's own
// Go types, and the invariants the shards depend on are checked.
package kubernetes

import (
	"encoding"
	"encoding/json"
	"fmt"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandgate/sandgate/api/forward"
	"github.com/sandgate/sandgate/appliance/sandboxcli"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

// contractEnv are the shard settings serve reads (issue 22's contract):
// the StatefulSet sets each of them.
var contractEnv = []string{
	"SANDGATE_SHARD_ID", "SANDGATE_SHARD_URL", "SANDGATE_SHARD_PEERS",
	"SANDGATE_LEASE_TIME", "SANDGATE_LEASE_RENEW", "SANDGATE_CHECKPOINT_INTERVAL",
}

// downwardEnv are set from the pod's own fields, for the values above to
// refer to; serve ignores them.
var downwardEnv = map[string]string{"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}

// kustomization is the part of kustomize's file these manifests use;
// anything else in one is refused, so that a new field is added here, and
// checked, on purpose.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace,omitempty"`
	Resources  []string `json:"resources"`
	Patches    []struct {
		Path string `json:"path"`
	} `json:"patches,omitempty"`
}

// manifests are the objects of one directory, by kind.
type manifests struct {
	kustomization kustomization
	namespaces    []*corev1.Namespace
	accounts      []*corev1.ServiceAccount
	services      []*corev1.Service
	claims        []*corev1.PersistentVolumeClaim
	statefulSets  []*appsv1.StatefulSet
}

// load reads every YAML file of dir: kustomization.yaml, and each resource
// it lists, which must be all the other YAML files there.
func load(t *testing.T, dir string) *manifests {
	t.Helper()
	m := &manifests{}
	decodeStrict(t, filepath.Join(dir, "kustomization.yaml"), readFile(t, filepath.Join(dir, "kustomization.yaml")), &m.kustomization)
	if m.kustomization.APIVersion != "kustomize.config.k8s.io/v1beta1" || m.kustomization.Kind != "Kustomization" {
		t.Errorf("%s: apiVersion %q, kind %q: want kustomize.config.k8s.io/v1beta1 Kustomization", dir, m.kustomization.APIVersion, m.kustomization.Kind)
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, r := range m.kustomization.Resources {
		p := filepath.Join(dir, r)
		if fi, err := os.Stat(p); err != nil {
			t.Errorf("%s/kustomization.yaml lists %s: %v", dir, r, err)
			continue
		} else if fi.IsDir() {
			continue // a base, loaded by its own test
		}
		listed[p] = true
	}
	for _, p := range m.kustomization.Patches {
		if _, err := os.Stat(filepath.Join(dir, p.Path)); err != nil {
			t.Errorf("%s/kustomization.yaml patches with %s: %v", dir, p.Path, err)
		}
		listed[filepath.Join(dir, p.Path)] = false // decoded by the test of its overlay
	}
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		if _, ok := listed[f]; !ok {
			t.Errorf("%s is not in %s/kustomization.yaml: kubectl apply -k would leave it out", f, dir)
		}
	}
	for f, resource := range listed {
		if !resource {
			continue
		}
		for i, d := range documents(readFile(t, f)) {
			name := fmt.Sprintf("%s (document %d)", f, i+1)
			var tm struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
			}
			if err := yaml.Unmarshal(d, &tm); err != nil {
				t.Errorf("%s: %v", name, err)
				continue
			}
			switch tm.APIVersion + " " + tm.Kind {
			case "v1 Namespace":
				m.namespaces = append(m.namespaces, decodeStrict(t, name, d, &corev1.Namespace{}))
			case "v1 ServiceAccount":
				m.accounts = append(m.accounts, decodeStrict(t, name, d, &corev1.ServiceAccount{}))
			case "v1 Service":
				m.services = append(m.services, decodeStrict(t, name, d, &corev1.Service{}))
			case "v1 PersistentVolumeClaim":
				m.claims = append(m.claims, decodeStrict(t, name, d, &corev1.PersistentVolumeClaim{}))
			case "apps/v1 StatefulSet":
				m.statefulSets = append(m.statefulSets, decodeStrict(t, name, d, &appsv1.StatefulSet{}))
			default:
				t.Errorf("%s: %s %s: this test does not know that kind; add it here, with its checks", name, tm.APIVersion, tm.Kind)
			}
		}
	}
	return m
}

func readFile(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

var separator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// documents splits a YAML stream, dropping documents of comments only.
func documents(b []byte) [][]byte {
	var out [][]byte
	for _, d := range separator.Split(string(b), -1) {
		for _, l := range strings.Split(d, "\n") {
			if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, "#") {
				out = append(out, []byte(d))
				break
			}
		}
	}
	return out
}

// decodeStrict decodes one document into obj as the API server would
// refuse it: an unknown or duplicate field, a value of the wrong type, a
// malformed quantity, and (which encoding/json alone lets pass) a field
// name spelled in another case.
func decodeStrict[T any](t *testing.T, name string, doc []byte, obj T) T {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		t.Errorf("%s: %v", name, err)
		return obj
	}
	var generic any
	if err := yaml.Unmarshal(doc, &generic); err != nil {
		t.Errorf("%s: %v", name, err)
		return obj
	}
	var wrong []string
	checkFieldNames("", generic, reflect.TypeOf(obj), &wrong)
	for _, w := range wrong {
		t.Errorf("%s: field %s: no such field (names are case-sensitive)", name, w)
	}
	return obj
}

var (
	jsonUnmarshaler = reflect.TypeFor[json.Unmarshaler]()
	textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()
)

// checkFieldNames appends to wrong the path of every key of v, a decoded
// YAML document, that is not exactly the JSON name of a field of t. Types
// that decode themselves (quantities, IntOrString, times) are theirs to
// check.
func checkFieldNames(path string, v any, t reflect.Type, wrong *[]string) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if reflect.PointerTo(t).Implements(jsonUnmarshaler) || reflect.PointerTo(t).Implements(textUnmarshaler) {
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		obj, ok := v.(map[string]any)
		if !ok {
			return
		}
		fields := jsonFields(t)
		for _, k := range slices.Sorted(maps.Keys(obj)) {
			ft, ok := fields[k]
			if !ok {
				*wrong = append(*wrong, path+"."+k)
				continue
			}
			checkFieldNames(path+"."+k, obj[k], ft, wrong)
		}
	case reflect.Slice, reflect.Array:
		list, _ := v.([]any)
		for i, e := range list {
			checkFieldNames(fmt.Sprintf("%s[%d]", path, i), e, t.Elem(), wrong)
		}
	case reflect.Map:
		obj, _ := v.(map[string]any)
		for k, e := range obj {
			checkFieldNames(path+"."+k, e, t.Elem(), wrong)
		}
	}
}

// jsonFields maps the JSON names of t's fields (inlined structs' included)
// to their types.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if f.Anonymous && name == "" {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				maps.Copy(out, jsonFields(ft))
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out[name] = f.Type
	}
	return out
}

// serveEnv lists the environment variables sandgate's commands read, from
// their flag definitions: a misspelt setting in a manifest would be
// ignored, silently, by serve.
func serveEnv(t *testing.T) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("..", "..", "cmd", "sandgate", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	decl := regexp.MustCompile(`EnvVars:\s*\[\]string\{([^}]*)\}`)
	quoted := regexp.MustCompile(`"([A-Z0-9_]+)"`)
	out := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		for _, d := range decl.FindAllStringSubmatch(string(readFile(t, f)), -1) {
			for _, q := range quoted.FindAllStringSubmatch(d[1], -1) {
				out[q[1]] = true
			}
		}
	}
	if !out["SNAPSHOT_BUCKET"] || !out["SANDGATE_STATE_DIR"] {
		t.Fatalf("found no flag definitions in cmd/sandgate (got %d names): has their form changed?", len(out))
	}
	return out
}

// only returns the one element of list, failing the test otherwise.
func only[T any](t *testing.T, what string, list []T) T {
	t.Helper()
	if len(list) != 1 {
		t.Fatalf("%d %s, want exactly 1", len(list), what)
	}
	return list[0]
}

func container(t *testing.T, spec *corev1.PodSpec, name string) *corev1.Container {
	t.Helper()
	for i := range spec.Containers {
		if spec.Containers[i].Name == name {
			return &spec.Containers[i]
		}
	}
	t.Fatalf("no container %q", name)
	return nil
}

func envValue(c *corev1.Container, name string) (corev1.EnvVar, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e, true
		}
	}
	return corev1.EnvVar{}, false
}

// mountOf returns the volume mount holding path, if one does.
func mountOf(c *corev1.Container, path string) (corev1.VolumeMount, bool) {
	for _, m := range c.VolumeMounts {
		if path == m.MountPath || strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/") {
			return m, true
		}
	}
	return corev1.VolumeMount{}, false
}

// portNumber resolves a probe's or a Service's target port against the
// container's ports.
func portNumber(c *corev1.Container, p intstr.IntOrString) (int32, bool) {
	for _, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return cp.ContainerPort, true
		}
	}
	return 0, false
}

var reference = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// TestManifestsDecodeStrictly decodes every manifest, the overlay's too,
// and checks names the API server would refuse.
func TestManifestsDecodeStrictly(t *testing.T) {
	for _, dir := range []string{".", "volume-store"} {
		m := load(t, dir)
		for _, p := range m.kustomization.Patches {
			f := filepath.Join(dir, p.Path)
			decodeStrict(t, f, readFile(t, f), &appsv1.StatefulSet{})
		}
		for _, s := range m.services {
			for _, e := range validation.IsDNS1035Label(s.Name) {
				t.Errorf("Service %q: %s", s.Name, e)
			}
			for _, p := range s.Spec.Ports {
				for _, e := range validation.IsValidPortName(p.Name) {
					t.Errorf("Service %q port %q: %s", s.Name, p.Name, e)
				}
			}
		}
		for _, s := range m.statefulSets {
			for _, e := range validation.IsDNS1123Label(s.Name) {
				t.Errorf("StatefulSet %q: %s", s.Name, e)
			}
			for _, c := range s.Spec.Template.Spec.Containers {
				for _, p := range c.Ports {
					for _, e := range validation.IsValidPortName(p.Name) {
						t.Errorf("container %q port %q: %s", c.Name, p.Name, e)
					}
				}
				for _, e := range c.Env {
					for _, msg := range validation.IsEnvVarName(e.Name) {
						t.Errorf("container %q env %q: %s", c.Name, e.Name, msg)
					}
				}
			}
		}
	}
}

// TestShards checks what the shards depend on: names that agree, the
// settings of issue 22's contract, the privileges, the store.
func TestShards(t *testing.T) {
	m := load(t, ".")
	ns := only(t, "Namespaces", m.namespaces)
	if m.kustomization.Namespace != ns.Name {
		t.Errorf("kustomization.yaml puts everything in namespace %q, but namespace.yaml makes %q", m.kustomization.Namespace, ns.Name)
	}
	if got := ns.Labels["pod-security.kubernetes.io/enforce"]; got != "privileged" {
		t.Errorf("namespace %q: pod-security.kubernetes.io/enforce is %q: the shards' pods are privileged, and Pod Security would refuse them", ns.Name, got)
	}

	ss := only(t, "StatefulSets", m.statefulSets)
	spec := &ss.Spec.Template.Spec
	podLabels := ss.Spec.Template.Labels
	if ss.Spec.Selector == nil || len(ss.Spec.Selector.MatchLabels) == 0 {
		t.Fatal("the StatefulSet has no selector")
	}
	for k, v := range ss.Spec.Selector.MatchLabels {
		if podLabels[k] != v {
			t.Errorf("the StatefulSet selects %s=%s, which its pods do not carry", k, v)
		}
	}

	var headless, front []*corev1.Service
	for _, s := range m.services {
		if s.Spec.ClusterIP == corev1.ClusterIPNone {
			headless = append(headless, s)
		} else {
			front = append(front, s)
		}
		if len(s.Spec.Selector) == 0 {
			t.Errorf("Service %q selects nothing", s.Name)
		}
		for k, v := range s.Spec.Selector {
			if podLabels[k] != v {
				t.Errorf("Service %q selects %s=%s, which the shards' pods do not carry", s.Name, k, v)
			}
		}
	}
	peers := only(t, "headless Services", headless)
	only(t, "Services in front", front)
	if ss.Spec.ServiceName != peers.Name {
		t.Errorf("the StatefulSet's serviceName is %q, the headless Service is %q: the shards' names would not resolve", ss.Spec.ServiceName, peers.Name)
	}
	if !peers.Spec.PublishNotReadyAddresses {
		t.Errorf("the headless Service %q does not publish not-ready addresses: a shard that announced itself could not be reached until ready", peers.Name)
	}

	c := container(t, spec, "sandgate")
	httpPort, ok := portNumber(c, intstr.FromString("http"))
	if !ok {
		t.Fatal(`the container has no port named "http"`)
	}
	for _, s := range m.services {
		for _, p := range s.Spec.Ports {
			if n, ok := portNumber(c, p.TargetPort); !ok || n != httpPort {
				t.Errorf("Service %q port %q targets %s, not the container's http port %d", s.Name, p.Name, p.TargetPort.String(), httpPort)
			}
		}
	}
	for name, probe := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if probe == nil || probe.HTTPGet == nil {
			t.Errorf("no HTTP %s probe", name)
			continue
		}
		if probe.HTTPGet.Path != "/health" {
			t.Errorf("the %s probe asks %q, want /health (the only route answered without the service token)", name, probe.HTTPGet.Path)
		}
		if n, ok := portNumber(c, probe.HTTPGet.Port); !ok || n != httpPort {
			t.Errorf("the %s probe asks port %s, not the http port %d", name, probe.HTTPGet.Port.String(), httpPort)
		}
	}

	// The environment: every name one serve reads (or a pod field for the
	// others to refer to), each once; references only to names defined
	// before them, which is all Kubernetes expands.
	known := serveEnv(t)
	defined := map[string]bool{}
	for _, e := range c.Env {
		if defined[e.Name] {
			t.Errorf("env %s is set twice", e.Name)
		}
		if !known[e.Name] && !slices.Contains(contractEnv, e.Name) && downwardEnv[e.Name] == "" {
			t.Errorf("env %s: serve reads no such variable", e.Name)
		}
		if field := downwardEnv[e.Name]; field != "" && (e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != field) {
			t.Errorf("env %s: want it from the pod's %s", e.Name, field)
		}
		for _, r := range reference.FindAllStringSubmatch(e.Value, -1) {
			if !defined[r[1]] {
				t.Errorf("env %s refers to $(%s), not defined before it: Kubernetes would leave it as written", e.Name, r[1])
			}
		}
		defined[e.Name] = true
	}
	for _, arg := range slices.Concat(c.Command, c.Args) {
		if strings.Contains(arg, "$$") {
			t.Errorf("command %q: Kubernetes turns $$ into $", arg)
		}
		for _, r := range reference.FindAllStringSubmatch(arg, -1) {
			if !defined[r[1]] {
				t.Errorf("command %q refers to $(%s), which is not in the environment", arg, r[1])
			}
		}
	}
	get := func(name string) string {
		e, ok := envValue(c, name)
		if !ok {
			t.Errorf("env %s is not set", name)
		}
		return e.Value
	}
	for _, name := range contractEnv {
		get(name)
	}
	if got := get("SANDGATE_SHARD_ID"); got != "$(POD_NAME)" {
		t.Errorf("SANDGATE_SHARD_ID is %q, want $(POD_NAME): the StatefulSet's stable names are the shards' ids", got)
	}
	want := fmt.Sprintf("http://$(POD_NAME).%s.$(POD_NAMESPACE).svc.cluster.local:%d", peers.Name, httpPort)
	if got := get("SANDGATE_SHARD_URL"); got != want {
		t.Errorf("SANDGATE_SHARD_URL is %q, want %q: the pod's name under the headless Service, at its http port", got, want)
	} else if u, err := url.Parse(strings.NewReplacer("$(POD_NAME)", "sandgate-0", "$(POD_NAMESPACE)", "sandgate").Replace(got)); err != nil || u.Port() != strconv.Itoa(int(httpPort)) {
		t.Errorf("SANDGATE_SHARD_URL %q does not parse to the http port: %v", got, err)
	}
	// The peers admit every shard's URL, and nothing beside the headless
	// Service's pods.
	peerList, err := forward.ParsePeers(strings.Split(strings.ReplaceAll(get("SANDGATE_SHARD_PEERS"), "$(POD_NAMESPACE)", "sandgate"), ","))
	if err != nil {
		t.Errorf("SANDGATE_SHARD_PEERS: %v", err)
	}
	for i := range 2 * int(*ss.Spec.Replicas) {
		u, _ := url.Parse(strings.NewReplacer("$(POD_NAME)", fmt.Sprintf("%s-%d", ss.Name, i), "$(POD_NAMESPACE)", "sandgate").Replace(want))
		if err := peerList.Allow(u); err != nil {
			t.Errorf("SANDGATE_SHARD_PEERS does not admit shard %d's URL %s: %v", i, u, err)
		}
	}
	for _, other := range []string{"http://sandgate.sandgate.svc.cluster.local:8080", "http://evil.example:8080", "http://127.0.0.1:8080"} {
		u, _ := url.Parse(other)
		if peerList.Allow(u) == nil {
			t.Errorf("SANDGATE_SHARD_PEERS admits %s, which is no shard", other)
		}
	}
	duration := func(name string) time.Duration {
		d, err := time.ParseDuration(get(name))
		if err != nil {
			t.Errorf("env %s: %v", name, err)
		}
		return d
	}
	if lease, renew := duration("SANDGATE_LEASE_TIME"), duration("SANDGATE_LEASE_RENEW"); renew <= 0 || 2*renew > lease {
		t.Errorf("SANDGATE_LEASE_RENEW %v against SANDGATE_LEASE_TIME %v: a lease must be renewed at least twice within its time", renew, lease)
	}
	if d := duration("SANDGATE_CHECKPOINT_INTERVAL"); d < 0 {
		t.Errorf("SANDGATE_CHECKPOINT_INTERVAL %v: want 0 (off) or more", d)
	}
	if got := get("HOST"); got != "0.0.0.0" {
		t.Errorf("HOST is %q, want 0.0.0.0: serve listens on loopback by default, where no peer or Service reaches it", got)
	}
	if got := get("PORT"); got != strconv.Itoa(int(httpPort)) {
		t.Errorf("PORT is %q, the container's http port %d", got, httpPort)
	}
	if tok, _ := envValue(c, "SANDBOX_SERVICE_TOKEN"); tok.Value != "" || tok.ValueFrom == nil || tok.ValueFrom.SecretKeyRef == nil {
		t.Error("SANDBOX_SERVICE_TOKEN must come from a Secret (secretKeyRef), never be written here")
	}
	if get("SNAPSHOT_BUCKET") == "" {
		t.Error("SNAPSHOT_BUCKET is empty: every shard would keep a store of its own on its pod's volume")
	}

	// Shutdown: serve saves within its grace, and Kubernetes must wait
	// longer than that before SIGKILL.
	grace := duration("SANDGATE_SHUTDOWN_GRACE")
	tgp := int64(corev1.DefaultTerminationGracePeriodSeconds)
	if spec.TerminationGracePeriodSeconds != nil {
		tgp = *spec.TerminationGracePeriodSeconds
	}
	if time.Duration(tgp)*time.Second < grace+10*time.Second {
		t.Errorf("terminationGracePeriodSeconds %d leaves less than 10 s beyond SANDGATE_SHUTDOWN_GRACE %v to drain and exit", tgp, grace)
	}

	// The state directory: on a volume of the pod's own (never the
	// container's overlayfs, which overlayfs refuses as an upper layer),
	// named for the pod.
	state := get("SANDGATE_STATE_DIR")
	if !strings.Contains(state, "$(POD_NAME)") {
		t.Errorf("SANDGATE_STATE_DIR %q does not hold $(POD_NAME): sandbox cgroups are named after it, and two shards on one node would share names", state)
	}
	if vm, ok := mountOf(c, state); !ok {
		t.Errorf("SANDGATE_STATE_DIR %q is on no volume", state)
	} else if !slices.ContainsFunc(ss.Spec.VolumeClaimTemplates, func(p corev1.PersistentVolumeClaim) bool { return p.Name == vm.Name }) {
		t.Errorf("SANDGATE_STATE_DIR %q is on volume %q, not one of the StatefulSet's claims", state, vm.Name)
	}

	// Memory: the pod holds every sandbox it may run.
	maxRunning, err := strconv.Atoi(get("SANDGATE_MAX_SANDBOXES"))
	if err != nil || maxRunning < 1 {
		t.Errorf("SANDGATE_MAX_SANDBOXES: %v", err)
	}
	each, err := sandboxcli.ParseSize(get("SANDGATE_SANDBOX_MEMORY"))
	if err != nil {
		t.Errorf("SANDGATE_SANDBOX_MEMORY: %v", err)
	}
	for what, list := range map[string]corev1.ResourceList{"requests": c.Resources.Requests, "limits": c.Resources.Limits} {
		mem := list[corev1.ResourceMemory]
		if mem.Value() < int64(maxRunning)*each {
			t.Errorf("memory %s %s < %d sandboxes of %d bytes", what, mem.String(), maxRunning, each)
		}
	}

	// Privileges and the process tree.
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Error("the container is not privileged: sandboxes need namespaces, mounts, cgroups and their own seccomp filter")
	}
	if spec.ShareProcessNamespace != nil && *spec.ShareProcessNamespace {
		t.Error("shareProcessNamespace: sandboxes would outlive a crashed serve (the pod's pid namespace would keep them)")
	}
	if len(c.Command) < 4 || c.Command[0] != "tini" || !slices.Equal(c.Command[len(c.Command)-2:], []string{"sandgate", "serve"}) {
		t.Errorf("command %q: want tini -- sandgate serve (pid 1 must reap and pass SIGTERM on)", c.Command)
	}
	if spec.EnableServiceLinks == nil || *spec.EnableServiceLinks {
		t.Error("enableServiceLinks is not false: the Service named sandgate would put SANDGATE_* variables in serve's environment")
	}
	if a := only(t, "ServiceAccounts", m.accounts); spec.ServiceAccountName != a.Name {
		t.Errorf("the pods run as service account %q, not %q", spec.ServiceAccountName, a.Name)
	}
}

// TestVolumeStore checks the overlay that makes the store a ReadWriteMany
// volume.
func TestVolumeStore(t *testing.T) {
	m := load(t, "volume-store")
	if !slices.Contains(m.kustomization.Resources, "..") {
		t.Errorf("volume-store/kustomization.yaml does not build on the base (..): %q", m.kustomization.Resources)
	}
	claim := only(t, "PersistentVolumeClaims", m.claims)
	if !slices.Equal(claim.Spec.AccessModes, []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}) {
		t.Errorf("claim %q is %v: every shard mounts the store, so ReadWriteMany", claim.Name, claim.Spec.AccessModes)
	}
	base := only(t, "StatefulSets", load(t, ".").statefulSets)
	p := only(t, "patches", m.kustomization.Patches)
	patch := decodeStrict(t, p.Path, readFile(t, filepath.Join("volume-store", p.Path)), &appsv1.StatefulSet{})
	if patch.Name != base.Name || patch.Kind != "StatefulSet" {
		t.Fatalf("the patch is for %s %q, not the StatefulSet %q", patch.Kind, patch.Name, base.Name)
	}
	c := container(t, &patch.Spec.Template.Spec, "sandgate")
	if b, ok := envValue(c, "SNAPSHOT_BUCKET"); !ok || b.Value != "" || b.ValueFrom != nil {
		t.Error("the patch does not empty SNAPSHOT_BUCKET: the shards would keep using the bucket")
	}
	dir, _ := envValue(c, "SNAPSHOT_DIRECTORY")
	vm, ok := mountOf(c, dir.Value)
	if !ok || !filepath.IsAbs(dir.Value) {
		t.Fatalf("SNAPSHOT_DIRECTORY %q is on no volume the patch mounts", dir.Value)
	}
	idx := slices.IndexFunc(patch.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == vm.Name })
	if idx < 0 || patch.Spec.Template.Spec.Volumes[idx].PersistentVolumeClaim == nil ||
		patch.Spec.Template.Spec.Volumes[idx].PersistentVolumeClaim.ClaimName != claim.Name {
		t.Errorf("SNAPSHOT_DIRECTORY %q is on volume %q, not the claim %q", dir.Value, vm.Name, claim.Name)
	}
	baseState, _ := envValue(container(t, &base.Spec.Template.Spec, "sandgate"), "SANDGATE_STATE_DIR")
	for _, m := range base.Spec.Template.Spec.Containers[0].VolumeMounts {
		if m.MountPath == vm.MountPath || m.Name == vm.Name {
			t.Errorf("the store's mount %q collides with the base's %q", vm.MountPath, m.MountPath)
		}
	}
	if strings.HasPrefix(baseState.Value, vm.MountPath+"/") {
		t.Errorf("the state directory %q would be on the shared store", baseState.Value)
	}
}
