// Command gentree builds the benchmark tree for bench/snapshot/run.sh: a
// directory shaped like an agent's install (tens of thousands of small,
// compressible source files in nested package directories, plus a few large
// binaries that compress poorly), deterministically from a seed. With
// -mutate it instead changes a fraction of an existing tree, as a session
// would, for the delta measurement.
package main

import (
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	dir := flag.String("dir", "", "directory to create (must not exist) or, with -mutate, to change")
	totalMB := flag.Int("mb", 650, "approximate total size in MB")
	small := flag.Int("small", 40000, "number of small files")
	large := flag.Int("large", 8, "number of large files")
	seed := flag.Uint64("seed", 1, "random seed")
	mutate := flag.Float64("mutate", 0, "if > 0, change this fraction of the files of an existing tree")
	flag.Parse()
	if *dir == "" {
		log.Fatal("gentree: -dir is required")
	}
	r := rand.New(rand.NewPCG(*seed, *seed*7919))
	if *mutate > 0 {
		if err := mutateTree(r, *dir, *mutate); err != nil {
			log.Fatal(err)
		}
		return
	}
	if err := build(r, *dir, *totalMB<<20, *small, *large); err != nil {
		log.Fatal(err)
	}
}

var words = strings.Fields(`function return const let var import export default from require module
exports async await class extends constructor this null undefined true false if else for while
switch case break continue throw try catch finally new typeof instanceof object string number
promise resolve reject then value key length push map filter reduce prototype call apply bind`)

// source returns n bytes of JavaScript-looking text.
func source(r *rand.Rand, n int) []byte {
	var b strings.Builder
	for b.Len() < n {
		b.WriteString(words[r.IntN(len(words))])
		switch r.IntN(8) {
		case 0:
			b.WriteString(";\n  ")
		case 1:
			fmt.Fprintf(&b, "(_%x) ", r.IntN(1<<16))
		default:
			b.WriteByte(' ')
		}
	}
	return []byte(b.String()[:n])
}

// binary returns n bytes that compress roughly 2:1, like executables.
func binary(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := 0; i < n; i += 4096 {
		end := min(i+4096, n)
		if r.IntN(2) == 0 {
			for j := i; j < end; j += 8 {
				v := r.Uint64()
				for k := 0; k < 8 && j+k < end; k++ {
					b[j+k] = byte(v >> (8 * k))
				}
			}
		} else {
			copy(b[i:end], source(r, end-i))
		}
	}
	return b
}

func build(r *rand.Rand, dir string, total, small, large int) error {
	if _, err := os.Stat(dir); err == nil {
		return fmt.Errorf("%s exists", dir)
	}
	smallBytes := total * 2 / 5
	avg := max(smallBytes/max(small, 1), 1)
	written := 0
	for i := range small {
		pkg := fmt.Sprintf("node_modules/pkg%04d", i/25)
		sub := []string{"", "lib", "dist", "src/internal"}[r.IntN(4)]
		p := filepath.Join(dir, pkg, sub, fmt.Sprintf("file%05d.js", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		n := r.IntN(2*avg) + 1
		if err := os.WriteFile(p, source(r, n), 0o644); err != nil {
			return err
		}
		written += n
	}
	rest := max(total-written, 0)
	for i := range large {
		p := filepath.Join(dir, "bin", fmt.Sprintf("tool%d", i))
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, binary(r, rest/max(large, 1)), 0o755); err != nil {
			return err
		}
	}
	return nil
}

func mutateTree(r *rand.Rand, dir string, frac float64) error {
	var files []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			files = append(files, p)
		}
		return nil
	})
	n := int(float64(len(files)) * frac)
	for i := range n {
		p := files[r.IntN(len(files))]
		if !strings.HasSuffix(p, ".js") {
			continue
		}
		if i%4 == 0 {
			os.Remove(p)
			continue
		}
		f, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
		if err != nil {
			continue
		}
		f.Write(source(r, 200))
		f.Close()
	}
	for i := range n / 4 {
		p := filepath.Join(dir, "node_modules", "new-dep", fmt.Sprintf("f%d.js", i))
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, source(r, 3000), 0o644); err != nil {
			return err
		}
	}
	fmt.Printf("changed %d of %d files\n", n, len(files))
	return nil
}
