package main

import (
	"context"
	"errors"
	"io"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/sandgate/sandgate/api/client"
)

// serviceBar draws, on a terminal, the progress the service reports of a
// long call (a suspend's save, a resume's fetch, a template's save);
// elsewhere it draws nothing, and the call asks the service for no
// progress at all.
type serviceBar struct {
	w     io.Writer // nil: not a terminal
	label string

	mu   sync.Mutex
	p    *progress
	step string
}

func newServiceBar(c *cli.Context, label string) *serviceBar {
	if f, ok := c.App.ErrWriter.(*os.File); !ok || !term.IsTerminal(int(f.Fd())) {
		return &serviceBar{}
	}
	return &serviceBar{w: c.App.ErrWriter, label: label}
}

// context is ctx, asking for the call's progress when there is a bar.
func (b *serviceBar) context(ctx context.Context) context.Context {
	if b.w == nil {
		return ctx
	}
	return client.WithProgress(ctx, b.report)
}

// stepNames are the service's steps in words.
var stepNames = map[string]string{"save": "saving", "fetch": "fetching"}

func (b *serviceBar) report(p client.Progress) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.p == nil || p.Step != b.step {
		if b.p != nil {
			b.p.finish()
		}
		name := stepNames[p.Step]
		if name == "" {
			name = p.Step
		}
		b.p = &progress{w: b.w, verb: b.label + ": " + name, total: p.Total, start: time.Now()}
		b.step = p.Step
	}
	b.p.set(p.Bytes)
}

func (b *serviceBar) finish() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.p != nil {
		b.p.finish()
		b.p = nil
	}
}

// execTTY runs command on a terminal in the sandbox (exec -t), this
// process's terminal standing in for it: its size followed, and with -i
// what is typed here carried there, this terminal in raw mode meanwhile.
func execTTY(c *cli.Context, s *client.Session, command string, env map[string]string) error {
	in, _ := c.App.Reader.(*os.File)
	out, _ := c.App.Writer.(*os.File)
	interactive := c.Bool("interactive")
	inTerm := in != nil && term.IsTerminal(int(in.Fd()))
	if interactive && !inTerm {
		return badInput("exec -it: the input is not a terminal: drop -t to pipe input to the command, or run it from a terminal")
	}
	if env == nil {
		env = map[string]string{}
	}
	if _, ok := env["TERM"]; !ok {
		env["TERM"] = os.Getenv("TERM")
		if env["TERM"] == "" {
			env["TERM"] = "xterm"
		}
	}
	size := func() (uint16, uint16) {
		for _, f := range []*os.File{out, in} {
			if f != nil && term.IsTerminal(int(f.Fd())) {
				if w, h, err := term.GetSize(int(f.Fd())); err == nil {
					return uint16(h), uint16(w)
				}
			}
		}
		return 0, 0
	}
	rows, cols := size()
	t, err := s.Terminal(c.Context, client.TerminalOptions{Command: command, WorkingDirectory: c.String("workdir"), Env: env, Rows: rows, Cols: cols})
	if err != nil {
		return err
	}
	defer t.Close()

	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	defer signal.Stop(winch)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-winch:
				r, c := size()
				t.Resize(r, c)
			case <-stop:
				return
			}
		}
	}()

	if interactive {
		if old, err := term.MakeRaw(int(in.Fd())); err == nil {
			defer term.Restore(int(in.Fd()), old)
		}
		// Stops at this process's exit, or at its input's end: a terminal
		// has no end of input but a hangup.
		go io.Copy(t, in)
	}
	io.Copy(c.App.Writer, t)
	code, err := t.Wait(context.WithoutCancel(c.Context))
	if err != nil && !errors.Is(err, context.Canceled) {
		if code > 0 {
			return &exitError{code: code, err: err}
		}
		return err
	}
	if code != 0 {
		return &exitError{code: code}
	}
	return nil
}
