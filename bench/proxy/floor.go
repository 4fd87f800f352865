package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// The floor is what any proxy on this machine pays for the second hop: a
// process of its own that forwards each request's bytes to the upstream
// over a kept-alive TLS connection and the answer's bytes back, reading
// only as much HTTP as it takes to find where a message ends (GET
// requests, answers with a Content-Length). No policy, no parser, no
// transform, no audit. Its added latency and request rate, measured beside
// the route's, say how much of the route's cost is the hop itself.

// floorEnv tells a re-executed bench program to be the floor forwarder:
// "UPSTREAM_ADDR HOST CA_FILE".
const floorEnv = "SANDGATE_BENCH_FLOOR"

// floorChild serves the floor forwarder if this process is one.
func floorChild() (bool, error) {
	spec := os.Getenv(floorEnv)
	if spec == "" {
		return false, nil
	}
	f := strings.Fields(spec)
	if len(f) != 3 {
		return true, fmt.Errorf("%s=%q: want UPSTREAM_ADDR HOST CA_FILE", floorEnv, spec)
	}
	pem, err := os.ReadFile(f[2])
	if err != nil {
		return true, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	cfg := &tls.Config{RootCAs: pool, ServerName: f[1], NextProtos: []string{"http/1.1"}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return true, err
	}
	fmt.Println(ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			return true, err
		}
		go forward(c, f[0], cfg)
	}
}

// forward carries one client connection's requests, one at a time.
func forward(c net.Conn, upstream string, cfg *tls.Config) {
	defer c.Close()
	up, err := tls.Dial("tcp", upstream, cfg)
	if err != nil {
		return
	}
	defer up.Close()
	cr, ur := bufio.NewReaderSize(c, 64<<10), bufio.NewReaderSize(up, 64<<10)
	for {
		req, err := readHead(cr)
		if err != nil {
			return
		}
		if _, err := up.Write(req); err != nil {
			return
		}
		resp, err := readHead(ur)
		if err != nil {
			return
		}
		n, err := contentLength(resp)
		if err != nil {
			return
		}
		body := make([]byte, n)
		if _, err := io.ReadFull(ur, body); err != nil {
			return
		}
		if _, err := c.Write(append(resp, body...)); err != nil {
			return
		}
	}
}

// readHead reads a message's head, through the blank line.
func readHead(r *bufio.Reader) ([]byte, error) {
	var head []byte
	for {
		line, err := r.ReadSlice('\n')
		head = append(head, line...)
		if err != nil {
			return nil, err
		}
		if len(line) <= 2 && strings.TrimSpace(string(line)) == "" {
			return head, nil
		}
	}
}

func contentLength(head []byte) (int, error) {
	for line := range bytes.SplitSeq(head, []byte("\r\n")) {
		k, v, ok := bytes.Cut(line, []byte(":"))
		if ok && strings.EqualFold(string(k), "Content-Length") {
			return strconv.Atoi(strings.TrimSpace(string(v)))
		}
	}
	return 0, errors.New("no Content-Length")
}

// startFloor runs this program again as the floor forwarder and returns
// its address, a function that stops it, and its pid.
func startFloor(upstream, host, caFile string) (string, func(), int, error) {
	self, err := os.Executable()
	if err != nil {
		return "", nil, 0, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), floorEnv+"="+upstream+" "+host+" "+caFile)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, 0, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, 0, err
	}
	stop := func() { cmd.Process.Kill(); cmd.Wait() }
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			addr <- sc.Text()
		}
		close(addr)
		io.Copy(io.Discard, out)
	}()
	select {
	case a, ok := <-addr:
		if !ok {
			stop()
			return "", nil, 0, errors.New("the floor forwarder did not say its address")
		}
		return a, stop, cmd.Process.Pid, nil
	case <-time.After(30 * time.Second):
		stop()
		return "", nil, 0, errors.New("the floor forwarder did not start within 30s")
	}
}
