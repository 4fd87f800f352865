package bridge_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// A session is kept with the sandbox: it outlives a suspend (a use of the
// id resumes the sandbox), and destroying the sandbox removes it.
func TestSessionsSurviveSuspend(t *testing.T) {
	st, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	c.must(200, "POST", "/v1/sandbox/"+id+"/session", []byte(`{"id":"keep","cwd":"/workspace/w","env":{"TOKEN_NAME":"kept across suspend"}}`))
	c.must(200, "PUT", "/v1/sandbox/"+id+"/file/workspace/w/f.txt", []byte("file kept\n"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := st.Manager.Suspend(ctx, id); err != nil {
		t.Fatal(err)
	}
	if got := string(c.must(200, "GET", "/v1/sandbox/"+id+"/running", nil)); got != `{"running":false}` {
		t.Fatalf("running while suspended: %s", got)
	}
	res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", `pwd; echo "$TOKEN_NAME"; cat f.txt`}}, "Session-Id", "keep")
	if res.stdout != "/workspace/w\nkept across suspend\nfile kept\n" || res.exit != 0 {
		t.Errorf("after a suspend and a resume: %+v", res)
	}
	c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
	res = c.exec(id, map[string]any{"argv": []string{"sh", "-c", `echo "${TOKEN_NAME-none}"; ls /workspace`}}, "Session-Id", "keep")
	if res.stdout != "none\n" {
		t.Errorf("a destroyed sandbox's session came back: %+v", res)
	}
	c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
}

// A link inside /workspace never carries the persisted tar, or a
// hydrated one, out of it: the link is stored as a link, a /workspace
// that is itself a link is refused, and a tar that writes through a link
// replaces the link, never writes through it.
func TestLinksStayLinks(t *testing.T) {
	_, base := stack(t)
	c := &client{t: t, base: base, key: testKey}
	id := c.create()
	defer c.must(204, "DELETE", "/v1/sandbox/"+id, nil)
	if res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", "ln -s /etc /workspace/etc && ln -s ../../etc/passwd /workspace/pw && echo x > /workspace/f"}}); res.exit != 0 {
		t.Fatalf("%+v", res)
	}
	ents, _ := readTar(t, c.must(200, "POST", "/v1/sandbox/"+id+"/persist", nil))
	if e := ents["./etc"]; e.typ != '2' || e.link != "/etc" {
		t.Errorf("./etc: %+v", e)
	}
	if e := ents["./pw"]; e.typ != '2' || e.link != "../../etc/passwd" || e.content != "" {
		t.Errorf("./pw: %+v", e)
	}
	for name, e := range ents {
		if strings.HasPrefix(name, "./etc/") || strings.Contains(e.content, "root:") {
			t.Errorf("the tar holds %s from outside /workspace", name)
		}
	}
	// A tar entry below a link replaces the link with a directory: nothing
	// is written through it.
	c.must(200, "POST", "/v1/sandbox/"+id+"/hydrate", tarOf(t, "etc/evil", "x"))
	res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", "test -d /workspace/etc && ! test -L /workspace/etc && test -f /workspace/etc/evil && ! test -e /etc/evil"}})
	if res.exit != 0 {
		t.Errorf("a tar entry below a link went through it: %+v", res)
	}
	// /workspace itself a link.
	if res := c.exec(id, map[string]any{"argv": []string{"sh", "-c", "cd / && rm -rf /workspace && ln -s /etc /workspace"}}); res.exit != 0 {
		t.Fatalf("%+v", res)
	}
	resp, body := c.do(c.req("POST", "/v1/sandbox/"+id+"/persist", nil))
	if resp.StatusCode != 502 || bytes.Contains(body, []byte("root:")) {
		t.Errorf("persist of a /workspace that is a link to /etc: %d %.200s", resp.StatusCode, body)
	}
}
