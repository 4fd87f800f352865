package server

import (
	"errors"
	"net/http"
	"slices"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/netpolicy"
)

func (s *Server) create(w http.ResponseWriter, r *http.Request) {
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		writeError(w, err)
		return
	}
	nb, err := o.network()
	if err != nil {
		writeError(w, err)
		return
	}
	if err := checkSandboxName(nb.name); err != nil {
		writeError(w, err)
		return
	}
	if _, given := o["template"]; given {
		if err := checkTemplateName(nb.template); err != nil {
			writeError(w, err)
			return
		}
	}
	st := &sandboxState{allowedHosts: nb.allowedHosts, baseURLs: nb.baseURLs, procs: map[string]*process{}, ports: map[int]int{}}
	n, err := s.network(st)
	if err != nil {
		writeError(w, err)
		return
	}
	_, err = s.m.Create(r.Context(), nb.name, appliance.CreateOptions{
		Network: n, Template: nb.template, Agent: s.agentConfig(nb.name),
		Dirs: []string{sandboxDir(s.cfg.Home, nb.name), sandboxDir(s.cfg.WorkDir, nb.name)},
	})
	if err != nil {
		writeError(w, err)
		return
	}
	s.mu.Lock()
	s.boxes[nb.name] = st
	s.mu.Unlock()
	writeJSON(w, http.StatusCreated, s.describe(nb.name))
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		writeError(w, err)
		return
	}
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		writeError(w, err)
		return
	}
	nb, err := o.network()
	if err != nil {
		writeError(w, err)
		return
	}
	st := s.state(name)
	st.mu.Lock()
	defer st.mu.Unlock()
	_, running := s.m.Sandbox(name)
	wasRunning := running == nil
	// Replaced: allowed hosts and base URLs (a whole policy given to the
	// network route goes too). Kept, if it runs: its transformations.
	prevHosts, prevURLs, prevPolicy, prevRules, prevGuard := st.allowedHosts, st.baseURLs, st.policy, st.rules, st.guard
	undo := func() {
		st.allowedHosts, st.baseURLs, st.policy, st.rules, st.guard = prevHosts, prevURLs, prevPolicy, prevRules, prevGuard
	}
	st.allowedHosts, st.baseURLs, st.policy = nb.allowedHosts, nb.baseURLs, nil
	if !wasRunning {
		st.rules, st.guard = nil, nil
	}
	n, err := s.network(st)
	if err != nil {
		undo()
		writeError(w, err)
		return
	}
	sb, err := s.m.Resume(r.Context(), name, appliance.ResumeOptions{
		Network: n, Agent: s.agentConfig(name),
		Dirs: []string{sandboxDir(s.cfg.Home, name), sandboxDir(s.cfg.WorkDir, name)},
	})
	if err != nil {
		undo()
		if errors.Is(err, appliance.ErrNotFound) {
			s.forget(name)
		}
		writeError(w, err)
		return
	}
	if !wasRunning {
		sb.Relay().Transforms().Set()
	}
	writeJSON(w, http.StatusOK, s.describe(name))
}

func (s *Server) suspend(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if !namePattern.MatchString(name) {
		noContent(w) // no name check: such a sandbox cannot be running
		return
	}
	if err := s.m.Suspend(r.Context(), name); err != nil {
		writeError(w, err)
		return
	}
	s.forget(name)
	noContent(w)
}

func (s *Server) destroy(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		writeError(w, err)
		return
	}
	if err := s.m.Destroy(r.Context(), name); err != nil {
		writeError(w, err)
		return
	}
	s.forget(name)
	noContent(w)
}

func (s *Server) setNetwork(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if _, err := s.m.Sandbox(name); err != nil {
		writeError(w, errNoSandbox(name))
		return
	}
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		writeError(w, err)
		return
	}
	nb, err := o.network()
	if err != nil {
		writeError(w, err)
		return
	}
	var whole *netpolicy.Policy
	if raw, ok := o["policy"]; ok { // sandgate's: the whole harness policy, CIDRs too
		p, err := netpolicy.ParsePolicy(raw)
		if err != nil {
			writeError(w, badRequest("policy: %v", err))
			return
		}
		whole = &p
	}
	st := s.state(name)
	st.mu.Lock()
	defer st.mu.Unlock()
	prevHosts, prevPolicy := st.allowedHosts, st.policy
	st.allowedHosts, st.policy = nb.allowedHosts, whole
	n, err := s.network(st)
	if err == nil {
		err = s.m.SetNetwork(r.Context(), name, n)
	}
	if err != nil {
		st.allowedHosts, st.policy = prevHosts, prevPolicy
		writeError(w, err)
		return
	}
	noContent(w)
}

func (s *Server) saveTemplate(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		writeError(w, err)
		return
	}
	id, err := o.required("id")
	if err != nil {
		writeError(w, err)
		return
	}
	if err := checkTemplateName(id); err != nil {
		writeError(w, err)
		return
	}
	if _, err := s.m.Sandbox(name); err != nil {
		writeError(w, errNoSandbox(name))
		return
	}
	if err := s.m.SaveTemplate(r.Context(), name, id); err != nil {
		writeError(w, err)
		return
	}
	noContent(w)
}

func (s *Server) templateExists(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if err := checkTemplateName(id); err != nil {
		writeError(w, err)
		return
	}
	ok, err := s.m.TemplateExists(r.Context(), id)
	if err != nil {
		writeError(w, err)
		return
	}
	if !ok {
		writeJSON(w, http.StatusNotFound, api.Error{Error: "no template " + id + " in this service's namespace (" + s.m.Namespace() + ")"})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"id": id})
}

func (s *Server) listTemplates(w http.ResponseWriter, r *http.Request) {
	list, err := s.m.ListTemplates(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	out := api.TemplateList{Templates: []api.Template{}}
	for _, t := range list {
		out.Templates = append(out.Templates, api.Template{ID: t.Name, Created: t.Created.UTC().Truncate(time.Millisecond), LayerBytes: t.LayerBytes})
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if err := checkTemplateName(id); err != nil {
		writeError(w, err)
		return
	}
	if err := s.m.DeleteTemplate(r.Context(), id); err != nil {
		writeError(w, err)
		return
	}
	noContent(w)
}

// sandboxInfo is the wire form of a sandbox (never a secret).
func (s *Server) sandboxInfo(in appliance.Info) api.Sandbox {
	out := api.Sandbox{
		Name: in.ID, State: string(in.State), Created: in.Created, LayerBytes: in.LayerBytes, Template: in.Template,
		BaseURLs: in.BaseURLs, Home: sandboxDir(s.cfg.Home, in.ID), WorkDir: sandboxDir(s.cfg.WorkDir, in.ID),
	}
	if !in.LastActive.IsZero() {
		t := in.LastActive.UTC().Truncate(time.Millisecond)
		out.LastActive = &t
	}
	if in.Policy != nil {
		out.Policy = in.Policy
	}
	s.mu.Lock()
	if st := s.boxes[in.ID]; st != nil {
		st.pmu.Lock()
		for p, n := range st.ports {
			if n > 0 {
				out.Ports = append(out.Ports, p)
			}
		}
		st.pmu.Unlock()
	}
	s.mu.Unlock()
	slices.Sort(out.Ports)
	return out
}

func (s *Server) list(w http.ResponseWriter, r *http.Request) {
	infos, err := s.m.List(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	out := api.SandboxList{Sandboxes: []api.Sandbox{}}
	for _, in := range infos {
		out.Sandboxes = append(out.Sandboxes, s.sandboxInfo(in))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) get(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		writeError(w, err)
		return
	}
	in, err := s.m.Get(r.Context(), name)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, s.sandboxInfo(in))
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request) {
	src := r.PathValue("name")
	if err := checkSandboxName(src); err != nil {
		writeError(w, err)
		return
	}
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		writeError(w, err)
		return
	}
	dst, err := o.required("name")
	if err != nil {
		writeError(w, err)
		return
	}
	if err := checkSandboxName(dst); err != nil {
		writeError(w, err)
		return
	}
	// The copy gets the source's network (its credentials stay with it).
	var n *appliance.Network
	var fromSrc *sandboxState
	if _, err := s.m.Sandbox(src); err == nil {
		st := s.state(src)
		st.mu.Lock()
		cp := &sandboxState{allowedHosts: st.allowedHosts, baseURLs: st.baseURLs, policy: st.policy}
		st.mu.Unlock()
		nn, err := s.network(cp)
		if err != nil {
			writeError(w, err)
			return
		}
		n = &nn
		fromSrc = cp
	}
	state, err := s.m.Fork(r.Context(), src, dst, appliance.ForkOptions{Network: n, Agent: s.agentConfig(dst)})
	if err != nil {
		writeError(w, err)
		return
	}
	if fromSrc != nil {
		s.mu.Lock()
		s.boxes[dst] = &sandboxState{allowedHosts: fromSrc.allowedHosts, baseURLs: fromSrc.baseURLs, policy: fromSrc.policy, procs: map[string]*process{}, ports: map[int]int{}}
		s.mu.Unlock()
	}
	writeJSON(w, http.StatusCreated, api.ForkResult{Name: dst, State: string(state), Home: sandboxDir(s.cfg.Home, dst), WorkingDirectory: sandboxDir(s.cfg.WorkDir, dst)})
}
