package agent

import (
	"context"
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// BenchmarkEgressOverPipes measures the byte path egress takes when the
// link is a pair of pipes (Google's CLI): a download from the service's
// side of an egress connection (written in 1 MiB pieces, as relay.Proxy's
// tunnel writes bulk data) to a TCP client of the agent's relay listener,
// through the agent and the yamux link. Both ends run in this process;
// cpu-s/GiB is the process's CPU (user and system) per GiB carried.
func BenchmarkEgressOverPipes(b *testing.B) {
	skipIfNotLinux(b)
	const size = 64 << 20
	svcEnd, agentEnd := pipePair(b, osPipes)
	for _, end := range []io.ReadWriteCloser{svcEnd, agentEnd} {
		GrowPipe(end.(rwc).w) // as the launcher and StdioLink do
	}
	s := newServer(ServerOptions{})
	served := make(chan error, 1)
	go func() { served <- s.serve(context.Background(), agentEnd) }()
	cfg := testConfig()
	chunk := make([]byte, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := NewClient(ctx, svcEnd, ClientOptions{Config: cfg, Egress: func(conn net.Conn, _ Peer) {
		defer conn.Close()
		for n := 0; n < size; n += len(chunk) {
			if _, err := conn.Write(chunk); err != nil {
				return
			}
		}
	}})
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		c.Close()
		<-served
	}()
	buf := make([]byte, 256<<10)
	b.SetBytes(size)
	var ru0, ru1 syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	b.ResetTimer()
	for b.Loop() {
		conn, err := net.Dial("tcp", c.Info().RelayAddr)
		if err != nil {
			b.Fatal(err)
		}
		var n int64
		for {
			k, err := conn.Read(buf) // in large reads, as curl does
			n += int64(k)
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatalf("read %d of %d bytes: %v", n, size, err)
			}
		}
		conn.Close()
		if n != size {
			b.Fatalf("read %d of %d bytes", n, size)
		}
	}
	b.StopTimer()
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	cpu := time.Duration(ru1.Utime.Nano() - ru0.Utime.Nano() + ru1.Stime.Nano() - ru0.Stime.Nano())
	b.ReportMetric(cpu.Seconds()/(float64(b.N)*size/(1<<30)), "cpu-s/GiB")
}
