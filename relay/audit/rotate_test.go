package audit

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// linesOf reads the JSON lines of the audit log file path and its old
// files (path.1 ...), checking each line is one whole event.
func linesOf(t *testing.T, path string) (events map[string]bool, files int) {
	t.Helper()
	events = map[string]bool{}
	names, _ := filepath.Glob(path + ".*")
	for _, name := range append(names, path) {
		f, err := os.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		files++
		sc := bufio.NewScanner(f)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var m map[string]any
			if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
				t.Fatalf("%s holds a torn line %q: %v", name, sc.Text(), err)
			}
			h, _ := m["host"].(string)
			if events[h] {
				t.Fatalf("event %s written twice", h)
			}
			events[h] = true
		}
		f.Close()
	}
	return events, files
}

// The audit log file grew without limit: rotated by size, under
// concurrent writers, no line is lost, torn or split between two files.
func TestAuditLogRotatedBySizeLosesNoLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	f, err := OpenFile(path, FileOptions{MaxBytes: 16 << 10, Keep: 1000})
	if err != nil {
		t.Fatal(err)
	}
	// Two sinks on one file, as serve's journals and proxy have.
	sinks := []*JSONLines{NewJSONLines(f), NewJSONLines(f)}
	const writers, each = 8, 250
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				sinks[w%2].Record(Event{Sandbox: "sb", Kind: Connect, Allow: true, Host: fmt.Sprintf("h%d-%d.example.com", w, i), Port: 443})
			}
		})
	}
	wg.Wait()
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.RotateErr(); err != nil {
		t.Fatal(err)
	}
	events, files := linesOf(t, path)
	if len(events) != writers*each {
		t.Errorf("%d events in the files, want %d", len(events), writers*each)
	}
	if files < 3 {
		t.Errorf("%d files: the log was not rotated", files)
	}
	names, _ := filepath.Glob(path + ".*")
	for _, name := range append(names, path) {
		fi, err := os.Stat(name)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size() > 16<<10+4<<10 { // a file ends at a batch past the size at most
			t.Errorf("%s is %d bytes, over the size it rotates at", name, fi.Size())
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", name, fi.Mode().Perm())
		}
	}
}

// Only Keep old files stay: the oldest go.
func TestAuditLogRotationKeepsSoManyFiles(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	f, err := OpenFile(path, FileOptions{MaxBytes: 4 << 10, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	j := NewJSONLines(f)
	for i := range 400 {
		j.Record(Event{Sandbox: "sb", Kind: Connect, Host: fmt.Sprintf("h%d.example.com", i), Port: 443})
	}
	f.Close()
	names, _ := filepath.Glob(path + "*")
	if len(names) != 3 {
		t.Fatalf("files %v, want the log and 2 old ones", names)
	}
	newest, _ := linesOf(t, path)
	if !newest["h399.example.com"] || newest["h0.example.com"] {
		t.Errorf("the files kept are not the newest")
	}
	// A file opened again appends, and rotates by its size on disk.
	f, err = OpenFile(path, FileOptions{MaxBytes: 4 << 10, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.size == 0 {
		t.Errorf("an opened file counts from 0, not its size")
	}
}
