package agent

import (
	"bufio"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"
)

// connect (a helper program, AGENT_TEST_HELPER=connect) connects to
// AGENT_TEST_ADDR, says so on stdout, and holds the connection until its
// stdin ends.
func connect() {
	c, err := net.Dial("tcp", os.Getenv("AGENT_TEST_ADDR"))
	if err != nil {
		os.Exit(3)
	}
	defer c.Close()
	os.Stdout.WriteString("connected\n")
	bufio.NewReader(os.Stdin).ReadString('\n')
}

// The process behind a connection is found by its socket: its pid and
// its arguments, as the kernel has them.
func TestFindPeer(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			host := "127.0.0.1"
			if network == "tcp6" {
				host = "::1"
			}
			ln, err := net.Listen(network, net.JoinHostPort(host, "0"))
			if err != nil {
				t.Skip(err)
			}
			defer ln.Close()
			cmd := exec.Command(os.Args[0], "-test.run=^$", "npm install left-pad")
			cmd.Env = append(os.Environ(), "AGENT_TEST_HELPER=connect", "AGENT_TEST_ADDR="+ln.Addr().String())
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() { stdin.Close(); cmd.Wait() }()
			if line, _ := bufio.NewReader(stdout).ReadString('\n'); line != "connected\n" {
				t.Fatalf("the helper said %q", line)
			}
			ln.(*net.TCPListener).SetDeadline(time.Now().Add(time.Minute))
			c, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			// A generous bound: the machine is shared, and a miss is
			// "unknown", not a failure, in production.
			p := findPeerIn("/proc", c, time.Now().Add(10*time.Second))
			if p == nil {
				t.Fatal("the connection's process was not found")
			}
			if p.PID != cmd.Process.Pid || !slices.Equal(p.Args, []string{os.Args[0], "-test.run=^$", "npm install left-pad"}) {
				t.Errorf("found %d %q, want %d and its arguments", p.PID, p.Args, cmd.Process.Pid)
			}
		})
	}
}

// A connection whose other end the agent's own process holds (or nobody
// does any more) has no peer.
func TestFindPeerNone(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if p := findPeerIn("/proc", s, time.Now().Add(10*time.Second)); p != nil {
		t.Errorf("found %+v, but the other end is this process's own", p)
	}
}

func TestParseProcAddr(t *testing.T) {
	for in, want := range map[string]string{
		"0100007F:0CEA":                         "127.0.0.1:3306",
		"00000000000000000000000001000000:1F90": "[::1]:8080",
		"0000000000000000FFFF00000100007F:0050": "127.0.0.1:80",
	} {
		got, ok := parseProcAddr(in)
		if !ok || got != netip.MustParseAddrPort(want) {
			t.Errorf("parseProcAddr(%q) = %v %v, want %s", in, got, ok, want)
		}
	}
	for _, bad := range []string{"", "0100007F", "0100007F:XYZ", "01007F:0050", "0100007F:10000"} {
		if _, ok := parseProcAddr(bad); ok {
			t.Errorf("parseProcAddr(%q) read an address", bad)
		}
	}
}
