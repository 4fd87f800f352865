package netpolicy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"time"
)

// ErrNotAllowed is returned by Dial for a decision that did not allow.
var ErrNotAllowed = errors.New("destination not allowed")

// Dial connects to one of the addresses the decision checked, in order,
// never resolving a name: what was judged is what is dialed. It records the
// address connected to in dec.Addr. Each attempt is bounded by DialTimeout
// and the whole by ctx.
func (d *Decider) Dial(ctx context.Context, dec *Decision) (net.Conn, error) {
	if !dec.Allow || len(dec.Addrs) == 0 {
		return nil, fmt.Errorf("dial %s: %w", dec.Host, ErrNotAllowed)
	}
	timeout := d.DialTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	var errs []error
	for _, a := range dec.Addrs {
		if err := ctx.Err(); err != nil {
			errs = append(errs, err)
			break
		}
		want := netip.AddrPortFrom(a, uint16(dec.Port))
		nd := net.Dialer{Timeout: timeout, Control: pinControl(want)}
		c, err := nd.DialContext(ctx, "tcp", want.String())
		if err == nil {
			dec.Addr = a
			return c, nil
		}
		errs = append(errs, err)
	}
	return nil, &DialError{Host: dec.Host.String(), Errs: errs}
}

// pinControl refuses, at the socket, any connect to an address other than
// the one that was checked: a last line of defence should anything between
// the decision and the syscall ever resolve a name.
func pinControl(want netip.AddrPort) func(network, address string, c syscall.RawConn) error {
	return func(network, address string, _ syscall.RawConn) error {
		got, err := netip.ParseAddrPort(address)
		if err != nil || got.Addr().Unmap() != want.Addr().Unmap() || got.Port() != want.Port() {
			return fmt.Errorf("refusing to connect to %s: checked address was %s", address, want)
		}
		return nil
	}
}

// DialError reports that every checked address failed to connect.
type DialError struct {
	Host string
	Errs []error
}

func (e *DialError) Error() string {
	if len(e.Errs) == 1 {
		return fmt.Sprintf("connect to %s: %v", e.Host, e.Errs[0])
	}
	return fmt.Sprintf("connect to %s: all %d addresses failed: %v", e.Host, len(e.Errs), errors.Join(e.Errs...))
}

// Unwrap returns the per-address errors.
func (e *DialError) Unwrap() []error { return e.Errs }

// Timeout reports whether every attempt timed out.
func (e *DialError) Timeout() bool {
	for _, err := range e.Errs {
		var ne net.Error
		if !(errors.As(err, &ne) && ne.Timeout()) && !errors.Is(err, context.DeadlineExceeded) {
			return false
		}
	}
	return len(e.Errs) > 0
}
