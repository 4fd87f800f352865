package agent

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
)

// ProtocolVersion is the version of the wire protocol this package speaks.
// The hello exchange refuses a peer of any other version: the service and
// the agent in the sandbox image must come from the same release.
const ProtocolVersion = 1

// Frame kinds. Every operation stream (all but the raw bytes of a port or
// egress stream after their first exchange) is a sequence of frames:
// a 5-byte header (kind, then the payload length as a big-endian uint32)
// and the payload.
const (
	kindMsg    byte = 1 // a JSON message: request, response, end, exit
	kindData   byte = 2 // bytes: stdin, stdout, file or tar content
	kindStderr byte = 3 // bytes a command wrote to its stderr
)

// Frame limits. A peer that sends more is broken or hostile: the stream is
// cut with a protocol error.
const (
	maxMsgBytes  = 4 << 20  // argv and environment fit (the kernel caps them at ~2 MiB)
	maxDataBytes = 64 << 10 // a data frame's payload
	dataChunk    = 32 << 10 // what this package puts in one data frame
	headerBytes  = 5
)

// errProtocol marks a frame or message the peer should never have sent.
var errProtocol = errors.New("agent protocol error")

// request is the first message of every stream the service opens (and of
// the streams the agent opens, with Op "egress"). One flat struct keeps the
// parser one piece; each op reads the fields it documents in README.md.
type request struct {
	Op string `json:"op"`

	// hello
	Version int     `json:"version,omitempty"`
	Config  *Config `json:"config,omitempty"`

	// exec
	Args        []string `json:"args,omitempty"`
	Env         []string `json:"env,omitempty"`
	Dir         string   `json:"dir,omitempty"`
	Stdin       bool     `json:"stdin,omitempty"`
	WaitDelayMS int64    `json:"waitDelayMs,omitempty"`
	// BaseURLs, when set (HasBaseURLs), replace the agent's configured
	// base URLs for this command: the service's current ones, which a
	// change of the sandbox's network changes between commands.
	BaseURLs    map[string]string `json:"baseUrls,omitempty"`
	HasBaseURLs bool              `json:"hasBaseUrls,omitempty"`
	// TTY, when set, runs the command on a terminal of that size: a PTY
	// the agent allocates (execPTY).
	TTY *wireSize `json:"tty,omitempty"`

	// deadline: how long from now the agent lets commands run; when it
	// passes without a new deadline, it kills every command and starts
	// none until one comes. 0 lifts it.
	DeadlineMS int64 `json:"deadlineMs,omitempty"`

	// pause: stop every command (SIGSTOP) for at most PauseMS, after which
	// the agent continues them itself; 0 continues them now.
	PauseMS int64 `json:"pauseMs,omitempty"`

	// signal, killall
	ID     uint64 `json:"id,omitempty"`
	Signal int    `json:"signal,omitempty"`

	// files and tar
	Path      string `json:"path,omitempty"`
	Mode      uint32 `json:"mode,omitempty"`
	MaxBytes  int64  `json:"maxBytes,omitempty"`
	Recursive bool   `json:"recursive,omitempty"`

	// dial
	Port int `json:"port,omitempty"`
	// PassFD (dial) asks for the connection as a passed socket (response
	// FD), which the agent does when it passes sockets (fdpass); an older
	// service never asks, and gets the bytes on the stream.
	PassFD bool `json:"passFd,omitempty"`

	// egress (agent → service)
	From string `json:"from,omitempty"`
	// FD names the socket passed with SCM_RIGHTS for this egress
	// connection, by its number in the order the agent attached sockets to
	// the link (from 1); zero means the connection's bytes follow on the
	// stream.
	FD uint64 `json:"fd,omitempty"`
	// To (egress) is, for a connection captured in the sandbox, where the
	// process connected: the name the DNS responder gave the address it
	// dialed (or that address, if it gave none), and the port.
	To string `json:"to,omitempty"`

	// dnsmode: the capture prefix the DNS responder gives names addresses
	// of (capture is in place).
	Prefix string `json:"prefix,omitempty"`

	// lookup (agent → service): a name the sandbox looked up, refused
	// because nothing is captured, and the query type.
	Name  string `json:"name,omitempty"`
	QType string `json:"qtype,omitempty"`

	// Peer is the process that opened the connection, when the agent
	// could tell.
	Peer *Peer `json:"peer,omitempty"`
}

// peer is what the request says of the process behind an egress
// connection: untrusted (the agent can be taken over), so only within the
// agent's own bounds.
func (r request) peer() Peer {
	if r.Peer == nil || r.Peer.PID <= 0 {
		return Peer{}
	}
	p := Peer{PID: r.Peer.PID}
	n := 0
	for _, a := range r.Peer.Args[:min(len(r.Peer.Args), maxPeerArgs)] {
		if n += len(a); n > maxPeerBytes {
			break
		}
		p.Args = append(p.Args, a)
	}
	return p
}

// response answers a request, and also carries the messages that end a
// stream's data: End (data complete, from either side) and Exit (a command
// finished).
type response struct {
	Error *wireError `json:"error,omitempty"`

	// hello
	Version   int    `json:"version,omitempty"`
	RelayAddr string `json:"relayAddr,omitempty"`
	PID       int    `json:"pid,omitempty"`

	// fdpass: the agent passes egress connections as sockets from now on
	FDPass bool `json:"fdPass,omitempty"`

	// hello: why the DNS responder could not start (Config.DNS), if it
	// could not.
	DNSError string `json:"dnsError,omitempty"`

	// dial: when the agent passes sockets, the connection to the port is
	// passed too, and FD names it as an egress request does (the stream
	// then carries nothing more). capture: the capture listener, passed.
	FD uint64 `json:"fd,omitempty"`

	// exec
	ID uint64 `json:"id,omitempty"`

	Stat    *wireStat `json:"stat,omitempty"`
	Written int64     `json:"written,omitempty"`
	Killed  int       `json:"killed,omitempty"`

	End  bool      `json:"end,omitempty"`
	Exit *wireExit `json:"exit,omitempty"`
	// Size (service → agent, on a terminal's stream) resizes the terminal.
	Size *wireSize `json:"size,omitempty"`
}

// wireSize is a terminal's size in character cells.
type wireSize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// wireError is an error as it crosses the link: a code the client maps to
// errors.Is targets, and a message for people.
type wireError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

type wireStat struct {
	Name    string `json:"name"`
	Size    int64  `json:"size"`
	Mode    uint32 `json:"mode"` // io/fs.FileMode bits
	ModTime int64  `json:"modTime"`
}

type wireExit struct {
	Code   int `json:"code"`
	Signal int `json:"signal,omitempty"`
}

// ops the agent serves.
var knownOps = map[string]bool{
	"hello": true, "ping": true, "exec": true, "signal": true, "killall": true,
	"read": true, "write": true, "stat": true, "mkdir": true, "remove": true,
	"tarin": true, "tarout": true, "dial": true, "egress": true, "fdpass": true,
	"capture": true, "dnsmode": true, "lookup": true,
	"deadline": true, "pause": true,
}

// readFrame reads one frame from r into buf (grown as needed) and returns
// its kind and payload, which stays valid until the next call with buf.
// A clean io.EOF is returned only before a frame's first byte.
func readFrame(r io.Reader, buf *[]byte) (byte, []byte, error) {
	return readFrameMax(r, buf, maxMsgBytes)
}

// allocAhead is the most of a frame's payload allocated before its bytes
// arrive: a larger frame grows its buffer as it is read, so a header alone
// (5 bytes from the other side) never pins megabytes.
const allocAhead = 64 << 10

// readFrameMax is readFrame with messages capped at maxMsg bytes.
func readFrameMax(r io.Reader, buf *[]byte, maxMsg uint32) (byte, []byte, error) {
	var h [headerBytes]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, err
	}
	kind, n := h[0], binary.BigEndian.Uint32(h[1:])
	switch kind {
	case kindMsg:
		if n > maxMsg {
			return 0, nil, fmt.Errorf("%w: a %d-byte message (at most %d)", errProtocol, n, maxMsg)
		}
	case kindData, kindStderr:
		if n > maxDataBytes {
			return 0, nil, fmt.Errorf("%w: a %d-byte data frame (at most %d)", errProtocol, n, maxDataBytes)
		}
	default:
		return 0, nil, fmt.Errorf("%w: unknown frame kind %d", errProtocol, kind)
	}
	if int(n) > cap(*buf) && n > allocAhead {
		var b bytes.Buffer
		b.Grow(allocAhead)
		if _, err := io.CopyN(&b, r, int64(n)); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return 0, nil, err
		}
		*buf = b.Bytes()
		return kind, *buf, nil
	}
	if cap(*buf) < int(n) {
		*buf = make([]byte, n)
	}
	p := (*buf)[:n]
	if _, err := io.ReadFull(r, p); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return kind, p, nil
}

// decodeMsg decodes a message payload strictly: unknown fields and trailing
// data are protocol errors, since both sides come from the same release.
func decodeMsg(p []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(p))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%w: bad message: %v", errProtocol, err)
	}
	if dec.More() {
		return fmt.Errorf("%w: trailing data after a message", errProtocol)
	}
	return nil
}

// decodeRequest reads a request payload and checks its op.
func decodeRequest(p []byte) (request, error) {
	var req request
	if err := decodeMsg(p, &req); err != nil {
		return req, err
	}
	if !knownOps[req.Op] {
		return req, fmt.Errorf("%w: unknown op %q", errProtocol, req.Op)
	}
	return req, nil
}

// readMsg reads the next frame, which must be a message, into v.
func readMsg(r io.Reader, buf *[]byte, v any) error {
	kind, p, err := readFrame(r, buf)
	if err != nil {
		return err
	}
	if kind != kindMsg {
		return fmt.Errorf("%w: got a data frame where a message was due", errProtocol)
	}
	return decodeMsg(p, v)
}

// framer writes frames to one stream. Writes are serialised (a command's
// stdout and stderr pumps share it); a write blocks while the peer's
// receive window is full, which is the backpressure every stream relies on.
type framer struct {
	mu  sync.Mutex
	w   io.Writer
	buf []byte
}

func newFramer(w io.Writer) *framer { return &framer{w: w} }

// frame writes one frame (header and payload in one write).
func (f *framer) frame(kind byte, p []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := headerBytes + len(p)
	if cap(f.buf) < n {
		f.buf = make([]byte, n)
	}
	b := f.buf[:n]
	b[0] = kind
	binary.BigEndian.PutUint32(b[1:], uint32(len(p)))
	copy(b[headerBytes:], p)
	_, err := f.w.Write(b)
	return err
}

// msg writes v as a message frame.
func (f *framer) msg(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return f.frame(kindMsg, b)
}

// data writes p as data frames of at most dataChunk bytes.
func (f *framer) data(kind byte, p []byte) error {
	for len(p) > 0 {
		n := min(len(p), dataChunk)
		if err := f.frame(kind, p[:n]); err != nil {
			return err
		}
		p = p[n:]
	}
	return nil
}

// dataWriter is an io.Writer of data frames of one kind.
type dataWriter struct {
	f    *framer
	kind byte
}

func (w dataWriter) Write(p []byte) (int, error) {
	if err := w.f.data(w.kind, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// dataReader reads data frames until the message that ends them. It
// returns io.EOF at an End message, the peer's error at an error message,
// and io.ErrUnexpectedEOF if the stream ends without either (the sender
// gave up: what it sent must not be taken as complete).
type dataReader struct {
	r    io.Reader
	buf  []byte
	rest []byte
	err  error
	// final is the message that ended the data, once read.
	final response
}

func (d *dataReader) Read(p []byte) (int, error) {
	for len(d.rest) == 0 {
		if d.err != nil {
			return 0, d.err
		}
		kind, payload, err := readFrame(d.r, &d.buf)
		switch {
		case err == io.EOF:
			d.err = io.ErrUnexpectedEOF
		case err != nil:
			d.err = err
		case kind == kindData:
			d.rest = payload
		case kind == kindMsg:
			var m response
			if err := decodeMsg(payload, &m); err != nil {
				d.err = err
				break
			}
			d.final = m
			switch {
			case m.Error != nil:
				d.err = m.Error.toError("")
			case m.End:
				d.err = io.EOF
			default:
				d.err = fmt.Errorf("%w: a message that neither ends nor fails the data", errProtocol)
			}
		default:
			d.err = fmt.Errorf("%w: stderr frame in a data stream", errProtocol)
		}
	}
	n := copy(p, d.rest)
	d.rest = d.rest[n:]
	return n, nil
}
