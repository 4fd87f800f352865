package agent

import (
	"io"
	"strings"
	"syscall"
	"testing"
	"time"
)

// until waits (up to 30s) for s to appear in the output, and returns the
// output so far.
func (l *lineWaiter) until(t testing.TB, s string) string {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		l.mu.Lock()
		got := l.buf.String()
		l.mu.Unlock()
		if strings.Contains(got, s) {
			return got
		}
		select {
		case <-l.moved:
		case <-deadline:
			t.Fatalf("waited 30s for %q in the terminal's output, have %q", s, got)
		}
	}
}

// A command on a terminal: it has one (tty, the size given, a session of
// its own), its input is typed into it (and echoed, as by a console),
// resizes reach it, and its exit code comes back.
func TestTerminal(t *testing.T) {
	for _, kind := range []transport{netPipe, osPipes} {
		t.Run(kind.String(), func(t *testing.T) {
			l := startLinkOver(t, kind, ClientOptions{}, nil)
			out := newLineWaiter()
			script := `tty; stty size; echo "sid=$(ps -o sid= -p $$ | tr -d ' ') pid=$$"; read a; stty size; read line; echo "got:$line"; exit 5`
			p, err := l.c.Spawn(testCtx(t), Cmd{Args: []string{"sh", "-c", script}, TTY: &WinSize{Rows: 24, Cols: 80}, StdinPipe: true, Stdout: out})
			if err != nil {
				t.Fatal(err)
			}
			got := out.until(t, "sid=")
			if !strings.Contains(got, "/dev/pts/") || !strings.Contains(got, "24 80") {
				t.Errorf("the command's terminal: %q, want a /dev/pts device of 24 rows and 80 columns", got)
			}
			got = out.until(t, "\n")
			if i := strings.Index(got, "sid="); i >= 0 {
				line := strings.Fields(got[i:])
				if len(line) < 2 || strings.TrimPrefix(line[0], "sid=") != strings.TrimPrefix(line[1], "pid=") {
					t.Errorf("not a session leader: %q", got[i:])
				}
			}
			if err := p.Resize(WinSize{Rows: 40, Cols: 100}); err != nil {
				t.Fatal(err)
			}
			io.WriteString(p.Stdin, "\n")
			out.until(t, "40 100")
			io.WriteString(p.Stdin, "typed\n")
			got = out.until(t, "got:typed")
			if !strings.Contains(got, "typed\r\n") {
				t.Errorf("the input was not echoed as a console does: %q", got)
			}
			st, err := p.Wait(testCtx(t))
			if err != nil || st.Code != 5 {
				t.Errorf("exit: %v %v, want exit status 5", st, err)
			}
			if err := p.Resize(WinSize{Rows: 1, Cols: 1}); err == nil {
				t.Errorf("Resize after the exit: no error")
			}
		})
	}
}

// A terminal's stream dropped by the service kills the command, as a
// dropped exec does.
func TestTerminalDroppedKillsTheCommand(t *testing.T) {
	l := startLink(t, ClientOptions{})
	out := newLineWaiter()
	p, err := l.c.Spawn(testCtx(t), Cmd{Args: []string{"sh", "-c", "echo started; exec sleep 300"}, TTY: &WinSize{}, StdinPipe: true, Stdout: out})
	if err != nil {
		t.Fatal(err)
	}
	out.until(t, "started")
	p.o.abort()
	waitDead(t, p.PID)
}

func TestResizeWithoutTerminal(t *testing.T) {
	l := startLink(t, ClientOptions{})
	p, err := l.c.Spawn(testCtx(t), Cmd{Args: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Resize(WinSize{Rows: 2, Cols: 2}); err == nil {
		t.Errorf("Resize of a command without a terminal: no error")
	}
	if st, err := p.Wait(testCtx(t)); err != nil || st.Code != 0 {
		t.Errorf("%v %v", st, err)
	}
	// A signal reaches a terminal command's whole session.
	out := newLineWaiter()
	p, err = l.c.Spawn(testCtx(t), Cmd{Args: []string{"sh", "-c", "echo ready; sleep 300"}, TTY: &WinSize{Rows: 5, Cols: 5}, Stdout: out})
	if err != nil {
		t.Fatal(err)
	}
	out.until(t, "ready")
	if err := p.Signal(testCtx(t), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if st, err := p.Wait(testCtx(t)); err != nil || st.Signal != syscall.SIGTERM {
		t.Errorf("after SIGTERM: %v %v", st, err)
	}
}
