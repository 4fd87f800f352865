package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func isRoot() bool { return os.Geteuid() == 0 }

func skipUnlessRoot(t testing.TB) {
	t.Helper()
	if !isRoot() {
		t.Skip("needs root: overlay whiteouts are 0/0 character devices and opaque dirs use trusted.* xattrs")
	}
}

// genOptions shapes a generated tree.
type genOptions struct {
	Whiteouts bool // 0/0 devices and opaque dirs (root only)
	Owners    bool // random uid/gid (root only)
	MaxFiles  int
	MaxSize   int // largest regular file; 0 means up to 500 kB
}

var nameParts = []string{"a", "bin", "node_modules", "é", "日本語", "файл", "🙂", "x y", "dash-", "dot.", "long"}

// genName returns a name, sometimes unicode, sometimes longer than 100 bytes.
func genName(r *rand.Rand, i int) string {
	var b strings.Builder
	n := 1 + r.IntN(3)
	for range n {
		b.WriteString(nameParts[r.IntN(len(nameParts))])
	}
	if r.IntN(6) == 0 {
		b.WriteString(strings.Repeat("L", 100+r.IntN(100)))
	}
	fmt.Fprintf(&b, "%d", i)
	return b.String()
}

// genTree builds a random tree under dir from seed: files, empty dirs,
// symlinks, hardlinks, fifos, xattrs and, when asked, whiteouts and opaque
// directories. Times are set last so directories keep theirs.
func genTree(t testing.TB, dir string, seed uint64, o genOptions) {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	if o.MaxFiles == 0 {
		o.MaxFiles = 60
	}
	dirs := []string{dir}
	var files []string
	var all []string
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	for i := range o.MaxFiles {
		parent := dirs[r.IntN(len(dirs))]
		p := filepath.Join(parent, genName(r, i))
		switch k := r.IntN(20); {
		case k < 9:
			data := make([]byte, r.IntN(5000))
			if r.IntN(15) == 0 {
				data = make([]byte, 200_000+r.IntN(300_000))
			}
			if o.MaxSize > 0 && len(data) > o.MaxSize {
				data = data[:o.MaxSize]
			}
			for j := range data {
				data[j] = byte(r.IntN(7))
			}
			must(os.WriteFile(p, data, 0o600))
			modes := []os.FileMode{0o644, 0o600, 0o755, 0o444, 0o640}
			must(os.Chmod(p, modes[r.IntN(len(modes))]))
			files = append(files, p)
		case k < 13:
			must(os.Mkdir(p, 0o755))
			if r.IntN(3) == 0 {
				must(os.Chmod(p, 0o700))
			}
			dirs = append(dirs, p)
		case k < 15:
			targets := []string{"../x", "/etc/passwd", "sibling", "日本", strings.Repeat("t", 150)}
			must(os.Symlink(targets[r.IntN(len(targets))], p))
		case k < 17 && len(files) > 0:
			must(os.Link(files[r.IntN(len(files))], p))
		case k < 18:
			must(unix.Mkfifo(p, 0o644))
		case k < 19 && o.Whiteouts:
			must(unix.Mknod(p, unix.S_IFCHR, 0))
		default:
			if o.Whiteouts && r.IntN(2) == 0 {
				must(os.Mkdir(p, 0o755))
				must(unix.Setxattr(p, xattrOpaque, []byte("y"), 0))
				dirs = append(dirs, p)
			} else {
				must(os.Mkdir(p, 0o755)) // stays empty
			}
		}
		all = append(all, p)
	}
	for _, p := range all {
		st, err := os.Lstat(p)
		must(err)
		writable := isRoot() || st.Mode()&0o200 != 0 // user.* xattrs need write permission
		if (st.Mode().IsRegular() || st.IsDir()) && writable && r.IntN(3) == 0 {
			must(unix.Lsetxattr(p, "user.sandgate.test", []byte(genName(r, 0)), 0))
		}
		if o.Owners {
			must(os.Lchown(p, r.IntN(70000), r.IntN(70000)))
		}
	}
	// Times last, deepest first, with nanoseconds.
	all = append(all, dir)
	sort.Slice(all, func(i, j int) bool { return len(all[i]) > len(all[j]) })
	for _, p := range all {
		ts := time.Unix(1_600_000_000+r.Int64N(100_000_000), r.Int64N(1e9))
		must(unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{unix.NsecToTimespec(ts.UnixNano()), unix.NsecToTimespec(ts.UnixNano())}, unix.AT_SYMLINK_NOFOLLOW))
	}
}

// nodeInfo is everything compareTrees checks about one path.
type nodeInfo struct {
	Mode   os.FileMode
	UID    uint32
	GID    uint32
	Size   int64
	Mtime  int64
	Rdev   uint64
	Link   string
	Data   string // sha256 of the content
	Xattrs string
	Group  int // hardlink group: index of the first path with this inode
}

func snapshotTree(t testing.TB, dir string) map[string]nodeInfo {
	t.Helper()
	out := map[string]nodeInfo{}
	inodes := map[uint64]int{}
	var paths []string
	err := filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		paths = append(paths, p)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(paths)
	for i, p := range paths {
		st, err := os.Lstat(p)
		if err != nil {
			t.Fatal(err)
		}
		sys := st.Sys().(*syscall.Stat_t)
		rel, _ := filepath.Rel(dir, p)
		n := nodeInfo{Mode: st.Mode(), UID: sys.Uid, GID: sys.Gid, Mtime: sys.Mtim.Nano(), Rdev: sys.Rdev, Group: -1}
		switch {
		case st.Mode().IsRegular():
			n.Size = st.Size()
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			sum := sha256.Sum256(b)
			n.Data = hex.EncodeToString(sum[:])
			if sys.Nlink > 1 {
				if g, ok := inodes[sys.Ino]; ok {
					n.Group = g
				} else {
					inodes[sys.Ino] = i
					n.Group = i
				}
			}
		case st.Mode()&os.ModeSymlink != 0:
			n.Link, _ = os.Readlink(p)
		}
		var xs []string
		names, _ := listXattrs(p)
		for _, x := range names {
			v, _ := getXattr(p, x)
			xs = append(xs, x+"="+v)
		}
		slices.Sort(xs)
		n.Xattrs = strings.Join(xs, ",")
		out[rel] = n
	}
	return out
}

// compareTrees fails unless a and b hold the same paths with the same
// type, mode, owner, size, content, mtime, link target, xattrs and
// hardlink structure.
func compareTrees(t testing.TB, a, b string) {
	t.Helper()
	ta, tb := snapshotTree(t, a), snapshotTree(t, b)
	var keys []string
	for k := range ta {
		keys = append(keys, k)
	}
	for k := range tb {
		if _, ok := ta[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	bad := 0
	for _, k := range keys {
		x, okx := ta[k]
		y, oky := tb[k]
		switch {
		case !okx:
			t.Errorf("%q: only in unpacked tree", k)
		case !oky:
			t.Errorf("%q: missing from unpacked tree", k)
		default:
			gx, gy := x.Group >= 0, y.Group >= 0
			x.Group, y.Group = 0, 0
			if gx != gy {
				t.Errorf("%q: hardlinked %v, want %v", k, gy, gx)
			}
			if x != y {
				t.Errorf("%q:\n got %+v\nwant %+v", k, y, x)
			}
		}
		if t.Failed() {
			bad++
			if bad > 10 {
				t.Fatal("too many differences")
			}
		}
	}
	checkLinkGroups(t, a, b, ta, tb)
}

// checkLinkGroups checks that paths sharing an inode in a share one in b.
func checkLinkGroups(t testing.TB, a, b string, ta, tb map[string]nodeInfo) {
	t.Helper()
	group := func(m map[string]nodeInfo) map[string]string {
		first := map[int]string{}
		out := map[string]string{}
		var keys []string
		for k := range m {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			if g := m[k].Group; g >= 0 {
				if _, ok := first[g]; !ok {
					first[g] = k
				}
				out[k] = first[g]
			}
		}
		return out
	}
	ga, gb := group(ta), group(tb)
	for k, v := range ga {
		if gb[k] != v {
			t.Errorf("%q: hardlinked with %q, want with %q", k, gb[k], v)
		}
	}
}

func mkdir(t testing.TB, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}
