package bridge_test

import (
	"context"
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
