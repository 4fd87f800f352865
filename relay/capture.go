package relay

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/sandgate/sandgate/relay/audit"
)

// ServeCaptured serves one connection a sandbox process made without the
// proxy — to an address the sandbox's DNS responder gave host, captured
// inside the sandbox on any port (appliance/agent, internal/netcapture) —
// as tenant, exactly as CONNECT host:port on ServeConn would be served:
// the same decision, pinned dial, ClientHello check, interception and
// audit (kind capture). A refusal closes the connection: there is no HTTP
// exchange to answer it in; the audit event says why. host and port are
// what the sandbox says it dialed, no more trusted than a CONNECT line.
// peer names the process that made the connection in its events, as for
// ServePeer. ServeCaptured closes c and returns when the connection is
// finished.
func (p *Proxy) ServeCaptured(ctx context.Context, c net.Conn, tenant *Tenant, host string, port int, peer Peer) {
	if !p.track(c) {
		c.Close()
		return
	}
	defer p.untrack(c)
	cc := newClientConn(p, tenant, c)
	cc.pid, cc.cmd = peerCmd(tenant, peer)
	defer cc.release()
	defer c.Close()
	ev := cc.event(audit.Capture)
	ev.Host, ev.Port = host, port
	if !tenant.acquire(p.cfg.MaxConns) {
		e := limitError(fmt.Sprintf("sandbox %s already has %d connections open", tenant.id, p.cfg.MaxConns), time.Second)
		ev.Code, ev.Reason, ev.Status = e.Code, e.Reason, e.Status
		p.record(ev)
		return
	}
	defer tenant.release()
	cc.serveCtx = ctx
	cc.setBusy(true) // a tunnel in progress is let finish at a graceful stop
	stop := context.AfterFunc(ctx, cc.stop)
	defer stop()
	stopSoft := context.AfterFunc(p.soft, cc.stop)
	defer stopSoft()
	cc.tunnel(p.hard, &ev, host, port, func(*Error) {}, func() bool { return true })
}

// RecordLookup audits a name a process in tenant's sandbox looked up there
// (qtype: A, AAAA, …) that its DNS responder refused, there being no
// capture in that sandbox: the process tried a direct connection, not one
// through the proxy, and could not make it (kind dns, code
// direct_lookup). name is the sandbox's word: it is only recorded.
func (p *Proxy) RecordLookup(tenant *Tenant, name, qtype string) {
	p.record(audit.Event{
		Sandbox: tenant.id, Kind: audit.DNS, Host: truncate(name, 253), Method: truncate(qtype, 10),
		Code:   audit.CodeDirectLookup,
		Reason: fmt.Sprintf("%s was looked up inside the sandbox, for a direct connection; a sandbox has no network of its own and nothing is captured here, so it got NXDOMAIN at once: connect through the proxy (HTTPS_PROXY, which every command has) or a base URL", truncate(name, 253)),
	})
}
