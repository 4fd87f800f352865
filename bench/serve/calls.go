package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/agent"
	"github.com/sandgate/sandgate/bench/internal/benchkit"
)

// exec runs command in sandbox name through the protocol 1 exec route, as
// the TypeScript client does (a JSON line, a newline, no stdin), reads the
// frame stream to its end and returns the exit code and the output.
func (r *rig) exec(ctx context.Context, name, command string) (int, []byte, error) {
	line, err := json.Marshal(api.ExecRequest{Command: command})
	if err != nil {
		return 0, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.addr+"/v1/sandboxes/"+name+"/exec", bytes.NewReader(append(line, '\n')))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set(api.HeaderProtocol, "1")
	req.Header.Set(api.HeaderToken, token)
	resp, err := r.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		data, _ := io.ReadAll(resp.Body)
		return 0, nil, fmt.Errorf("exec %q in %s: status %d: %s", command, name, resp.StatusCode, bytes.TrimSpace(data))
	}
	fr := api.NewFrameReader(resp.Body)
	var out []byte
	opened := false
	for {
		f, err := fr.Next()
		if err != nil {
			return 0, nil, fmt.Errorf("exec %q in %s: the frame stream broke: %w", command, name, err)
		}
		switch f.Type {
		case api.FrameOpen:
			if string(f.Payload) != resp.Header.Get(api.HeaderProcessID) {
				return 0, nil, fmt.Errorf("exec: Open frame %q, x-process-id %q", f.Payload, resp.Header.Get(api.HeaderProcessID))
			}
			opened = true
		case api.FrameData:
			out = append(out, f.Payload...)
		case api.FrameExit:
			code, err := strconv.Atoi(string(f.Payload))
			if err != nil || !opened {
				return 0, nil, fmt.Errorf("exec: Exit frame %q (after Open: %v)", f.Payload, opened)
			}
			// The stream ends after Exit: read to EOF so the connection is
			// reused, as a client's would be.
			if _, err := fr.Next(); !errors.Is(err, io.EOF) {
				return 0, nil, fmt.Errorf("exec: something after the Exit frame (%v)", err)
			}
			return code, out, nil
		default:
			return 0, nil, fmt.Errorf("exec: unexpected frame type %d", f.Type)
		}
	}
}

// execOK is exec for a command that must exit 0.
func (r *rig) execOK(ctx context.Context, name, command string) error {
	code, out, err := r.exec(ctx, name, command)
	if err == nil && code != 0 {
		err = fmt.Errorf("exec %q in %s: exit %d: %s", command, name, code, out)
	}
	return err
}

// directCreate is Manager.Create with the options the server's create
// route passes for a body of just a name (and a template): the service's
// (empty) network, the agent configuration, the home and working
// directory.
func (r *rig) directCreate(ctx context.Context, name, template string) error {
	_, err := r.m.Create(ctx, name, appliance.CreateOptions{
		Network:  appliance.NetworkSpec{BaseURLs: map[string]string{}},
		Template: template,
		Agent:    &agent.Config{RelayAddr: "127.0.0.1:3128", Path: agent.DefaultPath, Home: "/home/agent", OnlyBaseURLs: true},
		Dirs:     []string{"/home/agent", "/workspace"},
	})
	return err
}

// benchCreate measures creates from the image and from a template, over
// HTTP and through Manager.Create, interleaved; each sandbox is destroyed
// after (unmeasured). One round of each, unmeasured, comes first: it warms
// the page cache and the cgroup tree, and imports the template on this
// host once.
func (r *rig) benchCreate(n int) error {
	c, cancel := ctx(30 * time.Minute)
	defer cancel()
	fmt.Fprintln(os.Stderr, "making a template...")
	if _, err := r.must(c, http.StatusCreated, http.MethodPost, "/v1/sandboxes", map[string]string{"name": "tpl-src"}); err != nil {
		return err
	}
	if err := r.execOK(c, "tpl-src", "mkdir -p /workspace/tpl && head -c 1048576 /dev/urandom > /workspace/tpl/blob"); err != nil {
		return err
	}
	if _, err := r.must(c, http.StatusNoContent, http.MethodPost, "/v1/sandboxes/tpl-src/template", map[string]string{"id": "bench-tpl"}); err != nil {
		return err
	}
	if _, err := r.must(c, http.StatusNoContent, http.MethodDelete, "/v1/sandboxes/tpl-src", nil); err != nil {
		return err
	}

	type kind struct {
		name, template string
		http, direct   []time.Duration
		transport      []time.Duration // HTTP's own share of each HTTP create
	}
	kinds := []*kind{{name: "img"}, {name: "tpl", template: "bench-tpl"}}
	var transport time.Duration
	viaHTTP := func(k *kind, id string) (time.Duration, error) {
		body := map[string]string{"name": id}
		if k.template != "" {
			body["template"] = k.template
		}
		t0 := time.Now()
		if _, err := r.must(c, http.StatusCreated, http.MethodPost, "/v1/sandboxes", body); err != nil {
			return 0, err
		}
		d := time.Since(t0)
		transport = d - time.Duration(r.handled.Load())
		_, err := r.must(c, http.StatusNoContent, http.MethodDelete, "/v1/sandboxes/"+id, nil)
		return d, err
	}
	direct := func(k *kind, id string) (time.Duration, error) {
		t0 := time.Now()
		if err := r.directCreate(c, id, k.template); err != nil {
			return 0, fmt.Errorf("Manager.Create %s: %w", id, err)
		}
		d := time.Since(t0)
		return d, r.m.Destroy(c, id)
	}
	fmt.Fprintf(os.Stderr, "creating %d sandboxes, %d of each kind and way...\n", 4*(n+1), n+1)
	for i := -1; i < n; i++ {
		for _, k := range kinds {
			h, d := fmt.Sprintf("http-%s-%d", k.name, i+1), fmt.Sprintf("direct-%s-%d", k.name, i+1)
			first, second := viaHTTP, direct
			if i%2 != 0 { // take turns going first
				first, second = direct, viaHTTP
			}
			a, err := first(k, h)
			if err != nil {
				return err
			}
			b, err := second(k, d)
			if err != nil {
				return err
			}
			if i%2 != 0 {
				a, b = b, a
			}
			if i >= 0 {
				k.http, k.direct, k.transport = append(k.http, a), append(k.direct, b), append(k.transport, transport)
			}
		}
	}
	for _, k := range kinds {
		what := "from the image"
		if k.template != "" {
			what = "from a template"
		}
		row("create "+what+", HTTP", k.http, "POST /v1/sandboxes until 201")
		row("create "+what+", Manager", k.direct, "Manager.Create, same options")
		ph, pd := benchkit.Pct(k.http, 50), benchkit.Pct(k.direct, 50)
		fmt.Printf("  HTTP / Manager p50: %.3f (%+.2f ms: a create's own spread dominates); HTTP outside the handler p50 %.3f ms\n",
			ph.Seconds()/pd.Seconds(), float64(ph-pd)/1e6, float64(benchkit.Pct(k.transport, 50))/1e6)
	}
	fmt.Println()
	return nil
}

// benchExec measures `exec true` over HTTP against Sandbox.Run of the same
// command on the same sandbox, interleaved, and an HTTP round trip
// (GET /health) as the floor.
func (r *rig) benchExec(n int) error {
	c, cancel := ctx(30 * time.Minute)
	defer cancel()
	if _, err := r.must(c, http.StatusCreated, http.MethodPost, "/v1/sandboxes", map[string]string{"name": "exec"}); err != nil {
		return err
	}
	sb, err := r.m.Sandbox("exec")
	if err != nil {
		return err
	}
	// What the server runs for {"command":"true"}: sh -c in the working
	// directory, stdin from the request (empty here).
	direct := func() error {
		st, err := sb.Run(c, agent.Cmd{Args: []string{"/bin/sh", "-c", "true"}, Dir: "/workspace", Stdin: bytes.NewReader(nil)})
		if err == nil && !st.Success() {
			err = fmt.Errorf("Sandbox.Run(sh -c true): %v", st)
		}
		return err
	}
	viaHTTP := func() error { return r.execOK(c, "exec", "true") }
	// What the bridge runs for {"argv":["true"]}: the words given to sh as
	// its positional parameters, in /workspace.
	bridgeDirect := func() error {
		st, err := sb.Run(c, agent.Cmd{Args: []string{"/bin/sh", "-c", `"$@"`, "sh", "true"}, Dir: "/workspace"})
		if err == nil && !st.Success() {
			err = fmt.Errorf("Sandbox.Run(the bridge's true): %v", st)
		}
		return err
	}
	viaBridge := func() error { return r.bridgeExec(c, "exec", "", "true") }
	// The same in a session: a bash that sources the session's shell
	// state and saves it, and the state read back.
	viaSession := func() error { return r.bridgeExec(c, "exec", "bench", "true") }
	health := func() error { _, err := r.must(c, http.StatusOK, http.MethodGet, "/health", nil); return err }
	for range 20 { // warm up every path and the connection
		for _, f := range []func() error{viaHTTP, direct, viaBridge, bridgeDirect, viaSession} {
			if err := f(); err != nil {
				return err
			}
		}
	}
	fmt.Fprintf(os.Stderr, "running `true` %d times each way...\n", n)
	var h, d, bh, bd, bs, floor []time.Duration
	for i := range n {
		fns := []func() error{viaHTTP, direct, viaBridge, bridgeDirect, viaSession, health}
		outs := []*[]time.Duration{&h, &d, &bh, &bd, &bs, &floor}
		if i%2 != 0 { // each HTTP call and its baseline take turns going first
			fns[0], fns[1], outs[0], outs[1] = fns[1], fns[0], outs[1], outs[0]
			fns[2], fns[3], outs[2], outs[3] = fns[3], fns[2], outs[3], outs[2]
			fns[2], fns[4], outs[2], outs[4] = fns[4], fns[2], outs[4], outs[2]
		}
		for j, fn := range fns {
			t0 := time.Now()
			if err := fn(); err != nil {
				return err
			}
			*outs[j] = append(*outs[j], time.Since(t0))
		}
	}
	row("exec true, HTTP (frames parsed)", h, "POST …/exec until the Exit frame and EOF")
	row("exec true, Sandbox.Run", d, "same command, same sandbox")
	row("exec true, bridge (SSE parsed)", bh, "POST /v1/sandbox/{id}/exec until the exit event and EOF")
	row("exec true, Sandbox.Run (bridge's)", bd, "sh -c '\"$@\"' sh true, same sandbox")
	row("exec true, bridge in a session", bs, "the same with Session-Id: the session's bash, its state saved and read back")
	row("GET /health", floor, "one HTTP round trip, no handler work")
	ph, pd := benchkit.Pct(h, 50), benchkit.Pct(d, 50)
	fmt.Printf("  protocol 1 adds %.3f ms at p50 (target < 1 ms), %.3f ms at p99; HTTP / Run p50 %.2f\n",
		float64(ph-pd)/1e6, float64(benchkit.Pct(h, 99)-benchkit.Pct(d, 99))/1e6, ph.Seconds()/pd.Seconds())
	pbh, pbd := benchkit.Pct(bh, 50), benchkit.Pct(bd, 50)
	fmt.Printf("  the bridge adds %.3f ms at p50, %.3f ms at p99; bridge / Run p50 %.2f; bridge / protocol 1 p50 %.2f\n\n",
		float64(pbh-pbd)/1e6, float64(benchkit.Pct(bh, 99)-benchkit.Pct(bd, 99))/1e6, pbh.Seconds()/pbd.Seconds(), pbh.Seconds()/ph.Seconds())
	pbs := benchkit.Pct(bs, 50)
	fmt.Printf("  a session adds %.3f ms at p50; session / bridge p50 %.2f\n\n", float64(pbs-pbh)/1e6, pbs.Seconds()/pbh.Seconds())
	return nil
}

// bridgeExec runs argv in sandbox id through the Cloudflare bridge's exec
// route (in session sid unless ""), as its clients do (Bearer key, JSON,
// the event stream read to its end), and fails unless the exit event says
// 0.
func (r *rig) bridgeExec(ctx context.Context, id, sid string, argv ...string) error {
	body, err := json.Marshal(map[string]any{"argv": argv})
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.addr+"/v1/sandbox/"+id+"/exec", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+bridgeKey)
	req.Header.Set("Content-Type", "application/json")
	if sid != "" {
		req.Header.Set("Session-Id", sid)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("bridge exec %q: the stream broke: %w", argv, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("bridge exec %q: status %d: %s", argv, resp.StatusCode, bytes.TrimSpace(data))
	}
	if !bytes.HasSuffix(data, []byte("event: exit\ndata: {\"exit_code\":0}\n\n")) {
		return fmt.Errorf("bridge exec %q: the stream does not end with exit 0: %q", argv, data)
	}
	return nil
}
