package main

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandgate/sandgate/internal/testkit/gobuild"
)

// The Dockerfile at the root of the module.
const dockerfile = "../../Dockerfile"

// imageBuild is the sandgate binary built as the image's build stage
// builds it, once per test process.
var imageBuild struct {
	once                  sync.Once
	path, version, commit string
	err                   error
}

// imageBinary builds sandgate exactly as the Dockerfile's build stage does
// (the shell lines between "# image-build-begin" and "# image-build-end",
// run as they are, with the stage's VERSION and COMMIT arguments set and
// /out/ a directory of this process) and returns its path and the version
// and commit it was given. Checks of the image's binary (static, its
// version; the service starting with Cloud Run's environment) take it from
// here.
func imageBinary(t *testing.T) (path, version, commit string) {
	t.Helper()
	b := &imageBuild
	b.once.Do(func() {
		script, err := imageBuildScript()
		if err != nil {
			b.err = err
			return
		}
		out := gobuild.Scratch(t, "image")
		b.version, b.commit = "v0.0.0-imagetest", "0123456789abcdef0123456789abcdef01234567"
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "sh", "-ec", strings.ReplaceAll(script, "/out/", out+"/"))
		cmd.Dir = "../.." // the build context: the module root
		// The build stage's environment: its arguments, and no GOFLAGS of
		// this machine's.
		cmd.Env = append(os.Environ(), "VERSION="+b.version, "COMMIT="+b.commit, "GOFLAGS=")
		if msg, err := cmd.CombinedOutput(); err != nil {
			b.err = &buildError{script: script, err: err, out: msg}
			return
		}
		b.path = filepath.Join(out, "sandgate")
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path, b.version, b.commit
}

type buildError struct {
	script string
	err    error
	out    []byte
}

func (e *buildError) Error() string {
	return "the Dockerfile's build stage (" + e.script + "): " + e.err.Error() + "\n" + string(e.out)
}

// imageBuildScript returns the RUN lines between the Dockerfile's markers
// as one shell script.
func imageBuildScript() (string, error) {
	f, err := os.Open(dockerfile)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var lines []string
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		switch strings.TrimSpace(l) {
		case "# image-build-begin":
			in = true
			continue
		case "# image-build-end":
			in = false
		}
		if in {
			lines = append(lines, l)
		}
	}
	if len(lines) == 0 || !strings.HasPrefix(lines[0], "RUN ") {
		return "", &buildError{script: dockerfile, err: os.ErrNotExist, out: []byte("no RUN line between # image-build-begin and # image-build-end")}
	}
	lines[0] = strings.TrimPrefix(lines[0], "RUN ")
	return strings.Join(lines, "\n"), nil
}

// TestImageBinary: the binary the image ships is static (it is also
// bind-mounted into every sandbox, whatever libc the image has), stripped,
// holds no path of the machine that built it, and reports the version and
// commit the build was given.
func TestImageBinary(t *testing.T) {
	bin, version, commit := imageBinary(t)
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("the image's binary is dynamically linked (program header %v)", p.Type)
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("the image's binary needs %v", libs)
	}
	for _, name := range []string{".symtab", ".debug_info"} {
		if f.Section(name) != nil {
			t.Errorf("the image's binary has %s: not built with -s -w", name)
		}
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(data, []byte(root+"/")) {
		t.Errorf("the image's binary holds the build machine's path %s: not built with -trimpath", root)
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	want := regexp.MustCompile(`^sandgate version ` + regexp.QuoteMeta(version) + `\ngo version go\S+ linux/\S+\ncommit ` + commit + `\n$`)
	if !want.Match(out) {
		t.Errorf("sandgate version printed %q; want version %s and commit %s", out, version, commit)
	}
}

// TestImageBuildMatchesTests: the tests' binary (internal/testkit/gobuild) is
// compiled as the image's is, so that what the tests run is what the image
// runs.
func TestImageBuildMatchesTests(t *testing.T) {
	script, err := imageBuildScript()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range append(append([]string{}, gobuild.ImageEnv...), gobuild.ImageFlags...) {
		if !strings.Contains(script, want) {
			t.Errorf("the Dockerfile's build (%s) lacks %s, with which internal/testkit/gobuild builds the tests' binary", script, want)
		}
	}
}

// TestImageHoldsNoConfiguration: the runtime stage is every sandbox's
// root, so it carries no secret, no credential helper and none of the
// service's configuration; it has the tools the README promises and serves
// by default.
func TestImageHoldsNoConfiguration(t *testing.T) {
	data, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	stages := regexp.MustCompile(`(?m)^FROM `).Split(string(data), -1)
	runtime := stages[len(stages)-1]
	forbidden := regexp.MustCompile(`(?i)(SANDBOX_|SNAPSHOT_|TOKEN|SECRET|PASSWORD|CREDENTIAL|API_KEY|GOOGLE_APPLICATION|gcloud|google-cloud)`)
	for _, l := range strings.Split(runtime, "\n") {
		t0 := strings.TrimSpace(l)
		if strings.HasPrefix(t0, "#") || t0 == "" {
			continue
		}
		if strings.HasPrefix(t0, "ENV ") || strings.HasPrefix(t0, "ARG ") || forbidden.MatchString(t0) {
			t.Errorf("the runtime stage sets %q: every sandbox reads the image; configuration belongs in the service's environment", t0)
		}
		if strings.HasPrefix(t0, "COPY ") && !strings.HasPrefix(t0, "COPY --from=build /out/sandgate ") {
			t.Errorf("the runtime stage copies %q: only the binary goes in", t0)
		}
	}
	for _, tool := range []string{"ca-certificates", "curl", "e2fsprogs", "git", "procps", "python3", "ripgrep", "tini", "node --version"} {
		if !strings.Contains(runtime, tool) {
			t.Errorf("the runtime stage lacks %s", tool)
		}
	}
	if !strings.Contains(runtime, `CMD ["sandgate", "serve"]`) {
		t.Error(`the image does not run CMD ["sandgate", "serve"]`)
	}
}
