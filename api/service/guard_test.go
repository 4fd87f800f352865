package service_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/transforms"
)

// guardPH is the placeholder of the guard test's credential.
const guardPH = "aisdkhc_placeholder_guard_0123"

// wantGuardRefusal fails unless a reply is the credential guard's 400.
func wantGuardRefusal(t *testing.T, what string, code int, body string) {
	t.Helper()
	var e api.Error
	if code != http.StatusBadRequest || json.Unmarshal([]byte(body), &e) != nil ||
		!strings.HasPrefix(e.Error, transforms.CredentialPhrase+": ") || !strings.Contains(e.Error, "placeholder") {
		t.Errorf("%s: %d %s, want 400 with %q and the explanation", what, code, body, transforms.CredentialPhrase)
	}
}

// sandboxFilesHolding lists the files of the running sandboxes (their
// writable layers, as the host holds them) that contain needle, and how
// many files it read, so that a caller can tell the search saw them.
func (r *rig) sandboxFilesHolding(needle string) (hits []string, read int) {
	filepath.WalkDir(r.stack.StateDir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if b, err := os.ReadFile(p); err == nil {
				read++
				if bytes.Contains(b, []byte(needle)) {
					hits = append(hits, p)
				}
			}
		}
		return nil
	})
	return hits, read
}

// tarOf builds a tar of the entries, compressed as asked ("", "gzip",
// "zstd").
func tarOf(t *testing.T, compression string, entries ...guardEntry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range entries {
		h := e.hdr
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.body))
	}
	tw.Close()
	switch compression {
	case "gzip":
		var z bytes.Buffer
		zw := gzip.NewWriter(&z)
		zw.Write(b.Bytes())
		zw.Close()
		return z.Bytes()
	case "zstd":
		zw, _ := zstd.NewWriter(nil)
		return zw.EncodeAll(b.Bytes(), nil)
	}
	return b.Bytes()
}

type guardEntry struct {
	hdr  tar.Header
	body string
}

// The credential guard covers every way into a sandbox: the command, its
// variables (names and values), its working directory, its stdin, files
// and workspace tars written through the API. Each refusal is protocol 1's
// 400, and afterwards the canary is in no file of the sandbox; the
// placeholder passes everywhere.
func TestCredentialGuard(t *testing.T) {
	r := newRig(t, nil)
	r.create("box", nil)
	canary := r.canary
	// A second credential with a slash: a ustar name can be split there.
	slashed := "sk/" + strings.TrimPrefix(canary, "sk-canary-")
	r.must(204, "POST", "/v1/sandboxes/box/transformations", map[string]any{"transformations": []any{map[string]any{
		"match":     map[string]any{"host": "api.example.com", "headers": []any{map[string]any{"key": map[string]string{"exact": "x-api-key"}, "value": map[string]string{"exact": guardPH}}}},
		"transform": map[string]any{"headers": map[string]string{"x-api-key": canary, "authorization": "Bearer " + slashed}},
	}}})
	exec := func(line string, stdin string) (int, string) {
		code, out, _ := r.do("POST", "/v1/sandboxes/box/exec", line+"\n"+stdin)
		return code, out
	}

	t.Run("exec", func(t *testing.T) {
		for _, tc := range []struct{ what, line, stdin string }{
			{"the command", `{"command":"echo ` + canary + `"}`, ""},
			{"the command, the credential less its last byte", `{"command":"echo ` + canary[:len(canary)-1] + `"}`, ""},
			{"the command, 12 bytes from the credential's middle", `{"command":"echo x` + canary[5:5+transforms.MinPartialRun] + `x"}`, ""},
			{"a variable's value", `{"command":"true","env":{"K":"Bearer ` + canary + `"}}`, ""},
			{"a variable's name", `{"command":"true","env":{"` + canary + `":"x"}}`, ""},                                       // not a valid name either: never quoted
			{"a variable's name and value", `{"command":"true","env":{"sk":"` + strings.TrimPrefix(slashed, "sk") + `"}}`, ""}, // sk=/… holds "sk/" less two bytes: a run
			{"the working directory", `{"command":"true","workingDirectory":"/workspace/` + canary + `"}`, ""},
			{"the working directory, the other credential", `{"command":"true","workingDirectory":"/workspace/` + slashed + `"}`, ""},
			{"a base URL variable", `{"command":"true","env":{"ANTHROPIC_BASE_URL":"https://h.example/` + canary + `"}}`, ""},
		} {
			code, out := exec(tc.line, tc.stdin)
			wantGuardRefusal(t, tc.what, code, out)
		}
		// Stdin that is all there when the command would start: refused
		// before it starts (400), or, if the service had not yet read it
		// all, the command is killed as it arrives (137). Either way the
		// command never reads it.
		code, out := exec(`{"command":"cat > /workspace/small.txt"}`, "key="+canary+"\n")
		t.Logf("stdin holding the credential, all there at the start: %d", code)
		if code == http.StatusOK {
			res := readFrames(t, strings.NewReader(out))
			if res.exit != 137 || !strings.Contains(res.stderr, transforms.CredentialPhrase) {
				t.Errorf("stdin holding the credential, started: %+v", res)
			}
		} else {
			wantGuardRefusal(t, "stdin", code, out)
		}
		// The placeholder passes in each place.
		line := `{"command":"cat; echo \" $K\"; pwd","env":{"K":"` + guardPH + `"},"workingDirectory":"/workspace/` + guardPH + `"}`
		r.exec("box", "mkdir -p /workspace/"+guardPH, nil)
		if res := r.exec("box", "", []byte(guardPH), line); res.exit != 0 || res.stdout != guardPH+" "+guardPH+"\n/workspace/"+guardPH+"\n" {
			t.Errorf("the placeholder everywhere: %+v", res)
		}
	})

	t.Run("stdin streamed", func(t *testing.T) {
		// The credential arrives in pieces while the command runs: it is
		// killed, its stdin cut short before the credential's first byte,
		// and its stderr says why.
		for _, cuts := range [][]int{{3}, {1, len(canary) - 2}, {len(canary) / 2, 1}} {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			pr, pw := io.Pipe()
			body := io.MultiReader(strings.NewReader(`{"command":"echo ready; cat > /workspace/streamed.txt; echo finished"}`+"\n"), pr)
			req, _ := http.NewRequestWithContext(ctx, "POST", r.hs.URL+"/v1/sandboxes/box/exec", body)
			req.Header.Set(api.HeaderToken, r.token)
			type reply struct {
				resp *http.Response
				err  error
			}
			replies := make(chan reply, 1)
			go func() {
				resp, err := http.DefaultClient.Do(req)
				replies <- reply{resp, err}
			}()
			pw.Write([]byte("hello "))
			rep := <-replies
			if rep.err != nil {
				t.Fatal(rep.err)
			}
			fr := api.NewFrameReader(rep.resp.Body)
			for stdout := ""; stdout != "ready\n"; {
				f, err := fr.Next()
				if err != nil {
					t.Fatalf("before ready: %v", err)
				}
				if f.Type == api.FrameData && f.Channel == api.ChannelStdout {
					stdout += string(f.Payload)
				}
			}
			rest := canary
			for _, n := range cuts {
				pw.Write([]byte(rest[:n]))
				rest = rest[n:]
			}
			pw.Write([]byte(rest + " and more\n"))
			pw.Close() // without the guard, cat would end here and "finished"
			// The rest of the stream, past its Open frame.
			var res execResult
			for {
				f, err := fr.Next()
				if err != nil {
					t.Fatalf("after ready: %v (%+v)", err, res)
				}
				if f.Type == api.FrameExit {
					res.exit, _ = strconv.Atoi(string(f.Payload))
					break
				}
				if f.Channel == api.ChannelStdout {
					res.stdout += string(f.Payload)
				} else {
					res.stderr += string(f.Payload)
				}
			}
			rep.resp.Body.Close()
			cancel()
			if res.exit != 137 || strings.Contains(res.stdout, "finished") || !strings.Contains(res.stderr, transforms.CredentialPhrase) {
				t.Errorf("the credential in stdin, cut %v: %+v; want the command killed (137) and stderr saying why", cuts, res)
			}
			got := r.exec("box", "cat /workspace/streamed.txt 2>/dev/null", nil).stdout
			if !strings.HasPrefix("hello ", got) {
				t.Errorf("cut %v: the command read %q, want at most %q", cuts, got, "hello ")
			}
		}
		// A stdin that only begins like the credential (fewer bytes of it
		// than a run), and the placeholder, pass whole.
		for _, in := range []string{canary[:transforms.MinPartialRun-1], "a " + guardPH + " b", strings.Repeat("x", 100<<10) + canary[:10]} {
			if res := r.exec("box", "cat", []byte(in)); res.exit != 0 || res.stdout != in {
				t.Errorf("stdin %.40q: exit %d, %d bytes back of %d", in, res.exit, len(res.stdout), len(in))
			}
		}
	})

	t.Run("files", func(t *testing.T) {
		r.must(204, "PUT", "/v1/sandboxes/box/files/workspace/f/kept.txt", "old")
		big := bytes.Repeat([]byte("0123456789abcdef"), 256<<10) // 4 MiB
		copy(big[64<<10-7:], canary)                             // across the 64 KiB boundary
		for _, tc := range []struct {
			what, path string
			body       any
		}{
			{"content", "/workspace/f/new.txt", "token=" + canary},
			{"content at 64 KiB of 4 MiB", "/workspace/f/big.bin", big},
			{"content over an existing file", "/workspace/f/kept.txt", "new " + canary},
			{"the path", "/workspace/f/" + canary + ".txt", "x"},
		} {
			code, out, _ := r.do("PUT", "/v1/sandboxes/box/files"+tc.path, tc.body)
			wantGuardRefusal(t, "PUT file: "+tc.what, code, out)
		}
		code, out, _ := r.do("GET", "/v1/sandboxes/box/files/workspace/"+canary, nil)
		wantGuardRefusal(t, "GET a file whose path holds the credential", code, out)
		// Nothing was written: not the new files, not a temporary, and the
		// old file is as it was.
		if res := r.exec("box", "ls -A /workspace/f; cat /workspace/f/kept.txt", nil); res.stdout != "kept.txt\nold" {
			t.Errorf("after refused writes: %+v", res)
		}
		r.must(204, "PUT", "/v1/sandboxes/box/files/workspace/f/"+guardPH, "value="+guardPH)
		if got := r.must(200, "GET", "/v1/sandboxes/box/files/workspace/f/"+guardPH, nil); got != "value="+guardPH {
			t.Errorf("the placeholder written and read: %q", got)
		}
	})

	t.Run("workspace tar", func(t *testing.T) {
		ok := guardEntry{hdr: tar.Header{Name: "from-tar/ok.txt", Typeflag: tar.TypeReg}, body: "applied"}
		// A ustar name split at the credential's own slash into the prefix
		// and name fields: the raw tar never holds it whole.
		rest := strings.TrimPrefix(slashed, "sk/")
		split := "from-tar/sk/" + rest + strings.Repeat("f", 100-len(rest))
		if raw := tarOf(t, "", guardEntry{hdr: tar.Header{Name: split, Typeflag: tar.TypeReg, Format: tar.FormatUSTAR}}); bytes.Contains(raw, []byte(slashed)) {
			t.Fatal("the split name is whole in the raw tar: the case tests the wrong thing")
		}
		for _, tc := range []struct {
			what, compression string
			entry             guardEntry
		}{
			{"a file's content", "", guardEntry{hdr: tar.Header{Name: "from-tar/secret.txt", Typeflag: tar.TypeReg}, body: "key=" + canary}},
			{"a file's content at 64 KiB, gzip", "gzip", guardEntry{hdr: tar.Header{Name: "from-tar/big.bin", Typeflag: tar.TypeReg}, body: strings.Repeat("z", 64<<10-5) + canary + strings.Repeat("z", 100<<10)}},
			{"a file name, zstd", "zstd", guardEntry{hdr: tar.Header{Name: "from-tar/" + canary, Typeflag: tar.TypeReg}}},
			{"a name across the ustar prefix and name", "gzip", guardEntry{hdr: tar.Header{Name: split, Typeflag: tar.TypeReg, Format: tar.FormatUSTAR}}},
			{"a symlink target", "", guardEntry{hdr: tar.Header{Name: "from-tar/link", Typeflag: tar.TypeSymlink, Linkname: "../" + canary}}},
			{"a PAX record", "zstd", guardEntry{hdr: tar.Header{Name: "from-tar/x", Typeflag: tar.TypeReg, PAXRecords: map[string]string{"SCHILY.xattr.user.k": canary}}}},
		} {
			data := tarOf(t, tc.compression, ok, tc.entry, ok)
			code, out, _ := r.do("PUT", "/v1/sandboxes/box/workspace", data)
			wantGuardRefusal(t, "workspace tar: "+tc.what, code, out)
		}
		// Nothing of a refused tar is applied, nor left staged.
		if res := r.exec("box", "ls -A / /workspace", nil); strings.Contains(res.stdout, ".unpack-") || strings.Contains(res.stdout, "from-tar") {
			t.Errorf("a refused tar left %q", res.stdout)
		}
		// Not a tar, under the guard: the service's own parser says so.
		if code, out, _ := r.do("PUT", "/v1/sandboxes/box/workspace", strings.Repeat("not a tar ", 200)); code != 400 {
			t.Errorf("not a tar: %d %s, want 400", code, out)
		}
		// Placeholders pass, in every compression, and are applied.
		for _, c := range []string{"", "gzip", "zstd"} {
			data := tarOf(t, c, ok,
				guardEntry{hdr: tar.Header{Name: "from-tar/" + guardPH + ".txt", Typeflag: tar.TypeReg}, body: "key=" + guardPH},
				guardEntry{hdr: tar.Header{Name: "from-tar/ph-link", Typeflag: tar.TypeSymlink, Linkname: guardPH + ".txt"}})
			r.must(204, "PUT", "/v1/sandboxes/box/workspace", data)
			if res := r.exec("box", "cat /workspace/from-tar/ok.txt /workspace/from-tar/ph-link", nil); res.stdout != "appliedkey="+guardPH {
				t.Errorf("a tar of placeholders (%q): %+v", c, res)
			}
			r.exec("box", "rm -rf /workspace/from-tar", nil)
		}
	})

	// The canary is in no file of the sandbox; the search does see the
	// sandbox's files (the placeholder written above is found).
	if hits, _ := r.sandboxFilesHolding(guardPH); len(hits) == 0 {
		t.Fatalf("the search of the sandbox's files found not even the placeholder: it looks in the wrong place")
	}
	for _, secret := range []string{canary, slashed} {
		if hits, read := r.sandboxFilesHolding(secret); len(hits) > 0 {
			t.Errorf("after the refusals, a credential is in %d of the sandbox's %d files: %q", len(hits), read, hits)
		}
	}
}
