// Package agent is the one process a sandbox runs for the service, and the
// service's side of its link.
//
// Inside a sandbox, `sandgate agent` (Serve) speaks a hashicorp/yamux
// session over its stdin and stdout. The service (Client) opens a stream per
// operation: run or spawn a command, signal it, kill every process, read,
// write, stat, make or remove files, move a directory in or out as a tar
// stream, dial a port on the sandbox's loopback, or ping. In the other
// direction the agent opens a stream per connection accepted on its relay
// listener (127.0.0.1:3128 by default), which the service hands to
// relay.Proxy under the sandbox's identity: the link a stream came on is the
// identity, never anything the stream says. When the link is a unix socket
// (`sandgate sandbox`), the agent passes the accepted socket itself
// (SCM_RIGHTS) and the stream only names it, so egress bytes never cross
// the agent.
//
// Only `sandgate agent` ever appears on a command line. Configuration,
// commands and environments travel over the link, in the first exchange
// (hello) and in each request, because sandbox CLIs log command lines.
//
// The wire protocol is described in README.md beside this file, so that a
// sandbox on Cloud Run and one made by `sandgate sandbox` speak exactly the
// same thing.
package agent
