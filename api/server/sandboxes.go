package server

import (
	"context"
	"net/http"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
)

// dirs are the directories a sandbox gets made: its home and working
// directory.
func (s *Server) dirs(name string) []string {
	return []string{sandboxDir(s.cfg.Home, name), sandboxDir(s.cfg.WorkDir, name)}
}

func (s *Server) create(w http.ResponseWriter, r *http.Request) error {
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		return err
	}
	nb, err := o.network()
	if err != nil {
		return err
	}
	if err := checkSandboxName(nb.name); err != nil {
		return err
	}
	if _, given := o["template"]; given {
		if err := checkTemplateName(nb.template); err != nil {
			return err
		}
	}
	if _, err := s.b.Create(r.Context(), nb.name, appliance.CreateOptions{
		Network:  nb.spec(),
		Template: nb.template, Agent: s.agentConfig(nb.name), Dirs: s.dirs(nb.name),
		Limits: nb.limits,
	}); err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, s.describe(nb.name))
	return nil
}

// resume: a running sandbox gets its allowed hosts (or sandgate's whole
// policy) and base URLs replaced (its credential rules and processes
// kept); a suspended one starts with them and no credential rules
// (protocol 1: transformations do not survive a suspension). With
// sandgate's {"keepNetwork": true} instead of a network, the sandbox keeps
// the one it last had, and the answer says which that is.
func (s *Server) resume(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		return err
	}
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		return err
	}
	nb, err := o.network()
	if err != nil {
		return err
	}
	keep, err := o.boolean("keepNetwork")
	if err != nil {
		return err
	}
	if _, ok := o["policy"]; keep && (nb.hasAllowedHosts || ok || nb.baseURLs != nil) {
		return badRequest(`give "keepNetwork" or a network ("allowedHosts", "policy", "baseUrls"), not both`)
	}
	return s.progressed(w, r, func(ctx context.Context) (int, any, error) {
		var before appliance.Info
		if keep {
			var err error
			if before, err = s.b.Get(ctx, name); err != nil {
				return 0, nil, err
			}
		}
		if _, err := s.b.Resume(ctx, name, appliance.ResumeOptions{
			Network: nb.spec(), KeepNetwork: keep,
			Agent: s.agentConfig(name), Dirs: s.dirs(name),
		}); err != nil {
			return 0, nil, err
		}
		d := s.describe(name)
		if keep {
			// A suspended sandbox describes the network kept with it, a
			// running one the network it has.
			d.Network = &api.KeptNetwork{Kept: before.Policy != nil}
			if in, err := s.b.Get(ctx, name); err == nil && in.Policy != nil {
				d.Network.Policy, d.Network.BaseURLs = in.Policy, in.BaseURLs
			}
		}
		return http.StatusOK, d, nil
	})
}

func (s *Server) suspend(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	return s.progressed(w, r, func(ctx context.Context) (int, any, error) {
		if !namePattern.MatchString(name) {
			return http.StatusNoContent, nil, nil // no name check: such a sandbox cannot be running
		}
		if err := s.b.Suspend(ctx, name); err != nil {
			return 0, nil, err
		}
		return http.StatusNoContent, nil, nil
	})
}

func (s *Server) destroy(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		return err
	}
	if err := s.b.Destroy(r.Context(), name); err != nil {
		return err
	}
	noContent(w)
	return nil
}

// setNetwork replaces a running sandbox's allowed hosts (protocol 1; its
// base URLs are kept), or, with sandgate's {"policy": ...}, gives it a
// whole harness policy, CIDR rules and all.
func (s *Server) setNetwork(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := s.awake(r.Context(), name); err != nil {
		return err
	}
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		return err
	}
	nb, err := o.network()
	if err != nil {
		return err
	}
	spec := appliance.NetworkSpec{AllowedHosts: nb.allowedHosts, Policy: nb.policy}
	if err := s.b.SetNetwork(r.Context(), name, spec); err != nil {
		return err
	}
	noContent(w)
	return nil
}

func (s *Server) saveTemplate(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		return err
	}
	id, err := o.required("id")
	if err != nil {
		return err
	}
	if err := checkTemplateName(id); err != nil {
		return err
	}
	return s.progressed(w, r, func(ctx context.Context) (int, any, error) {
		if err := s.awake(ctx, name); err != nil {
			return 0, nil, err
		}
		if err := s.b.SaveTemplate(ctx, name, id); err != nil {
			return 0, nil, err
		}
		return http.StatusNoContent, nil, nil
	})
}

func (s *Server) templateExists(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if err := checkTemplateName(id); err != nil {
		return err
	}
	ok, err := s.b.TemplateExists(r.Context(), id)
	if err != nil {
		return err
	}
	if !ok {
		return errorf(http.StatusNotFound, "no template %s in this service's namespace (%s)", id, s.b.Namespace())
	}
	writeJSON(w, http.StatusOK, map[string]string{"id": id})
	return nil
}

func (s *Server) listTemplates(w http.ResponseWriter, r *http.Request) error {
	list, err := s.b.ListTemplates(r.Context())
	if err != nil {
		return err
	}
	out := api.TemplateList{Templates: []api.Template{}}
	for _, t := range list {
		out.Templates = append(out.Templates, api.Template{ID: t.Name, Created: t.Created.UTC().Truncate(time.Millisecond), LayerBytes: t.LayerBytes})
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) deleteTemplate(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if err := checkTemplateName(id); err != nil {
		return err
	}
	if err := s.b.DeleteTemplate(r.Context(), id); err != nil {
		return err
	}
	noContent(w)
	return nil
}

// sandboxInfo is the wire form of a sandbox (never a secret).
func (s *Server) sandboxInfo(in appliance.Info) api.Sandbox {
	out := api.Sandbox{
		Name: in.ID, State: string(in.State), Created: in.Created, LayerBytes: in.LayerBytes, Template: in.Template,
		BaseURLs: in.BaseURLs, Home: sandboxDir(s.cfg.Home, in.ID), WorkDir: sandboxDir(s.cfg.WorkDir, in.ID),
		Ports: in.OpenPorts, Shard: in.Shard, Limits: in.Limits, SuspendedBy: string(in.SuspendedBy),
	}
	if u := in.Usage; u != nil {
		out.Usage = &api.Usage{CPUSeconds: u.CPUSeconds, MemoryBytes: u.MemoryBytes, MemoryPeakBytes: u.MemoryPeakBytes,
			DiskBytes: u.DiskBytes, DiskQuotaBytes: u.DiskQuotaBytes, Processes: u.Processes}
	}
	if !in.LastActive.IsZero() {
		t := in.LastActive.UTC().Truncate(time.Millisecond)
		out.LastActive = &t
	}
	if in.Policy != nil {
		out.Policy = in.Policy
	}
	for _, m := range in.Modules {
		out.Modules = append(out.Modules, api.Module{Name: m.Name, Digest: m.Digest, Bytes: m.Bytes})
	}
	return out
}

func (s *Server) list(w http.ResponseWriter, r *http.Request) error {
	infos, err := s.b.List(r.Context())
	if err != nil {
		return err
	}
	out := api.SandboxList{Sandboxes: []api.Sandbox{}}
	for _, in := range infos {
		out.Sandboxes = append(out.Sandboxes, s.sandboxInfo(in))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) get(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if err := checkSandboxName(name); err != nil {
		return err
	}
	in, err := s.b.Get(r.Context(), name)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, s.sandboxInfo(in))
	return nil
}

// fork copies a sandbox: a running one's copy runs with its network (its
// credentials stay with it), a suspended one's is suspended.
func (s *Server) fork(w http.ResponseWriter, r *http.Request) error {
	src := r.PathValue("name")
	if err := checkSandboxName(src); err != nil {
		return err
	}
	o, err := readObject(r, api.MaxJSONBody)
	if err != nil {
		return err
	}
	if err := o.only("fork", "name"); err != nil {
		return err
	}
	dst, err := o.required("name")
	if err != nil {
		return err
	}
	if err := checkSandboxName(dst); err != nil {
		return err
	}
	state, err := s.b.Fork(r.Context(), src, dst, appliance.ForkOptions{Agent: s.agentConfig(dst)})
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, api.ForkResult{Name: dst, State: string(state), Home: sandboxDir(s.cfg.Home, dst), WorkingDirectory: sandboxDir(s.cfg.WorkDir, dst)})
	return nil
}
