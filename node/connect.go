package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/natsauth"
)

// MaxPayload is the embedded server's largest message (and the size P.E.status
// pages to stay under on any server with at least the NATS default of 1 MiB:
// see statusPageBytes).
const MaxPayload = 8 << 20

// MaxControlLine is the embedded server's longest protocol line (a
// message's subject and reply with its verb and size; nats-server's default
// is 4 KiB): kvactors' own subjects and inboxes take a few hundred bytes
// (a --prefix of at most 256), and the node's intake bound counts each
// pending message's at this much (natsMsgCost).
const MaxControlLine = 2048

// defaultMaxControlLine is nats-server's: what the node assumes of a
// server it did not start (docs/OPERATIONS.md asks for no more).
const defaultMaxControlLine = 4096

// portFree reports an embedded NATS port that is already taken as an error
// an operator can act on. Port -1 (any free port) is always free.
func portFree(host string, port int) error {
	if port < 0 {
		return nil
	}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err == nil {
		return ln.Close()
	}
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("embedded nats on %s: address already in use: pick a free port with --nats-port "+
			"(-1: any free port) or use a running server with --nats URL: %w", addr, err)
	}
	return fmt.Errorf("embedded nats on %s: %w", addr, err)
}

// Backoff of the first connection's retries.
const (
	connectBackoffMin = 100 * time.Millisecond
	connectBackoffMax = 5 * time.Second
)

// connectWithRetry connects to url, retrying with doubling backoff until
// timeout: a node started before its NATS cluster (a host booting, a
// DaemonSet rolling out first) waits for it rather than exiting. Once
// connected, the client's own reconnect takes over. ctx ends the wait.
// refused, when set, says why a server refused an attempt begun at since
// (nil: it cannot tell); an authorization error ends the retries.
func connectWithRetry(ctx context.Context, url string, opts []nats.Option, timeout time.Duration,
	refused func(since time.Time) error, log *slog.Logger) (*nats.Conn, error) {
	deadline := time.Now().Add(timeout)
	backoff := connectBackoffMin
	for attempt := 1; ; attempt++ {
		since := time.Now()
		nc, err := nats.Connect(url, opts...)
		if err == nil {
			return nc, nil
		}
		if refused != nil {
			if why := refused(since); why != nil {
				err = fmt.Errorf("%w (the client saw: %w)", why, err)
			}
		}
		left := time.Until(deadline)
		if left <= 0 || errors.Is(err, nats.ErrAuthorization) {
			return nil, fmt.Errorf("connect to nats %s (%d attempts in %v): %w", url, attempt, timeout, err)
		}
		wait := min(backoff, left)
		log.Warn("nats not reachable, retrying", "url", url, "attempt", attempt, "in", wait, "err", err)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("connect to nats %s: %w (last error: %w)", url, ctx.Err(), err)
		case <-t.C:
		}
		backoff = min(2*backoff, connectBackoffMax)
	}
}

// connect starts the embedded server (no --nats) and connects to NATS.
func (n *Node) connect(ctx context.Context) error {
	url := n.cfg.NATSURL
	if url == "" {
		if err := n.startEmbedded(ctx); err != nil {
			return err
		}
		// nats:// even when the server has TLS (its ClientURL is then
		// tls://, which nats.go takes to mean TLS): see plainInProcess.
		url = n.ns.ClientURL()
		if addr, ok := strings.CutPrefix(url, "tls://"); ok {
			url = "nats://" + addr
		}
	}
	opts, err := n.natsOptions()
	if err != nil {
		return err
	}
	var refused func(time.Time) error
	if n.ns != nil {
		opts = append(opts, nats.InProcessServer(inProcess{n.ns}), plainInProcess)
		refused = n.inProcessRefused
	}
	nc, err := connectWithRetry(ctx, url, opts, n.cfg.NATSConnectTimeout, refused, n.log)
	if err != nil {
		return err
	}
	n.nc = nc
	n.metrics.NATSConnected.Set(1)
	return nil
}

// plainInProcess drops any TLS option (NATSAuthOptions gives none there:
// natsTLS) from the node's connection to its embedded server: that is a pipe inside
// the process, which TLS protects from nothing, at a cost on every message
// of the node's hot path. nats-server lets an in-process client speak
// plain NATS even when its listener requires TLS or verifies client
// certificates (it sniffs for a handshake), and authenticates it by its
// credentials as any other client. It goes after every other option.
func plainInProcess(o *nats.Options) error {
	o.Secure, o.TLSConfig, o.TLSCertCB, o.RootCAsCB, o.TLSHandshakeFirst = false, nil, nil, nil, false
	return nil
}

// inProcessRefused says why the embedded server refused the node's
// in-process connect begun at since, when its record of the connections it
// closed tells: its credentials (nats.ErrAuthorization), or its
// max_connections. The client cannot tell: the server's -ERR is lost on
// the synchronous pipe (see connectBounded), and it sees a timeout or a
// closed pipe. Only in-process records count (no address: only the node
// opens in-process connections), since a name is what the client claims:
// any TCP client can call itself "kvactors <node id>". The node's own is
// found by its name (the CONNECT's, read before authenticating it); one
// refused for max_connections has none (the server never read its
// CONNECT). The server saves a record on a goroutine of its own, so one
// not found yet is looked for twice more, 50 ms apart.
func (n *Node) inProcessRefused(since time.Time) error {
	for try := 1; ; try++ {
		if err := n.inProcessRefusal(since); err != nil || try == 3 {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (n *Node) inProcessRefusal(since time.Time) error {
	cz, err := n.ns.Connz(&server.ConnzOptions{State: server.ConnClosed, Sort: server.ByStop, Limit: 64})
	if err != nil {
		return nil
	}
	for _, c := range cz.Conns {
		if c.Stop == nil || c.Stop.Before(since) {
			break // newest first
		}
		if c.IP != "" {
			continue // over TCP: another client's
		}
		switch {
		case c.Name == nodeConnName(n.cfg.NodeID) && c.Reason == server.AuthenticationViolation.String():
			hint := ""
			if n.embeddedOpts.TLSMap {
				hint = "; the configuration names users by their certificates (verify_and_map) and the in-process " +
					"connection presents none: give kvactors' user an nkey (docs/SECURITY.md)"
			}
			return fmt.Errorf("%w: the embedded server refused the node's credentials (%s)%s", nats.ErrAuthorization, c.Reason, hint)
		case c.Reason == server.MaxConnectionsExceeded.String():
			return fmt.Errorf("the embedded server refused the connection: %s (max_connections %d)", c.Reason,
				n.embeddedOpts.MaxConn)
		}
	}
	return nil
}

// inProcess hands out the embedded server's in-process connections, each
// one's connect bounded (connectBounded).
type inProcess struct{ ns *server.Server }

func (p inProcess) InProcessConn() (net.Conn, error) {
	c, err := p.ns.InProcessConn()
	if err != nil {
		return nil, err
	}
	return &connectBounded{Conn: c}, nil
}

// connectBounded is an in-process connection whose connect ends by the
// deadline nats.go sets around it (SetDeadline: its connect timeout, 2 s;
// cleared once connected or failed), at start and on each reconnect.
// net.Pipe is synchronous: a connect the server refuses after reading its
// CONNECT (bad credentials) leaves both ends writing, the server its -ERR
// and the client its PING, until the server's write deadline
// (write_deadline, 10 s by default) or nats.go's own (FlusherTimeout, a
// minute) ends it, plain or TLS alike. So, while the connect's deadline is
// set, no write deadline goes past it, and a read or write that times out
// closes the pipe. After the connect it is the pipe.
type connectBounded struct {
	net.Conn
	connect atomic.Pointer[time.Time] // the connect's deadline; nil outside it
}

func (c *connectBounded) SetDeadline(t time.Time) error {
	if t.IsZero() {
		c.connect.Store(nil)
	} else {
		c.connect.Store(&t)
	}
	return c.Conn.SetDeadline(t)
}

func (c *connectBounded) SetWriteDeadline(t time.Time) error {
	if d := c.connect.Load(); d != nil && (t.IsZero() || t.After(*d)) {
		t = *d
	}
	return c.Conn.SetWriteDeadline(t)
}

func (c *connectBounded) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.timedOut(err)
	}
	return n, err
}

func (c *connectBounded) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err != nil {
		c.timedOut(err)
	}
	return n, err
}

// timedOut closes the pipe when err is the connect's deadline: the server's
// blocked write fails, and so does anything the client writes on closing.
func (c *connectBounded) timedOut(err error) {
	if errors.Is(err, os.ErrDeadlineExceeded) && c.connect.Load() != nil {
		_ = c.Conn.Close()
	}
}

// startEmbedded starts the embedded NATS server (its options from the
// config, and --nats-config's file when set). A port already taken is found
// before the server starts, and named as such: the server would otherwise
// only fail to become ready. ctx ends the wait for it (SIGTERM during the
// start stops at once, not after embeddedReady).
func (n *Node) startEmbedded(ctx context.Context) error {
	sopts, err := n.cfg.embeddedOptions()
	if err != nil {
		return err
	}
	if n.cfg.embeddedExtra != nil {
		n.cfg.embeddedExtra(sopts)
	}
	if err := portFree(sopts.Host, sopts.Port); err != nil {
		return err
	}
	if sopts.JetStream && sopts.StoreDir == "" {
		sopts.StoreDir = n.cfg.NATSStoreDir
		if sopts.StoreDir == "" {
			tmp, err := os.MkdirTemp("", "kvactors-js-")
			if err != nil {
				return fmt.Errorf("jetstream dir: %w", err)
			}
			sopts.StoreDir, n.storeDir = tmp, tmp
		}
	}
	ns, err := server.NewServer(sopts)
	if err != nil {
		return fmt.Errorf("embedded nats: %w", err)
	}
	ns.SetLoggerV2(natsLog{log: n.log, reject: n.rejectLog}, false, false, false)
	ns.Start()
	if err := waitReady(ctx, ns, embeddedReady); err != nil {
		ns.Shutdown()
		if ctx.Err() != nil {
			return fmt.Errorf("embedded nats on %s:%d: start stopped: %w", sopts.Host, sopts.Port, err)
		}
		if err := portFree(sopts.Host, sopts.Port); err != nil { // lost a race for the port
			return err
		}
		return fmt.Errorf("embedded nats on %s:%d did not become ready", sopts.Host, sopts.Port)
	}
	n.ns, n.embeddedOpts = ns, sopts
	return nil
}

// embeddedReady bounds the wait for the embedded server's listeners (one
// that cannot listen, a --nats-config websocket port in use say, leaves it
// unready without saying so).
const embeddedReady = 10 * time.Second

var errNotReady = errors.New("not ready")

// waitReady waits up to d for ns to accept connections, in short slices so
// that ctx can end the wait.
func waitReady(ctx context.Context, ns *server.Server, d time.Duration) error {
	deadline := time.Now().Add(d)
	for !ns.ReadyForConnections(50 * time.Millisecond) {
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return errNotReady
		}
	}
	return nil
}

// natsWriteBuffer is the client's write buffer. A publish that fills it
// writes to the socket in the publisher's turn; at 32 KiB (nats.go's
// default) a store-heavy node did that several thousand times a second.
const natsWriteBuffer = 256 << 10

func writeBuffer(n int) nats.Option {
	return func(o *nats.Options) error {
		o.WriteBufferSize = n
		return nil
	}
}

// nodeConnName is the NATS connection name of node id's client.
func nodeConnName(id string) string { return "kvactors " + id }

// natsOptions are the client's options: reconnect for ever once connected,
// with the connection gauge and logs kept current.
func (n *Node) natsOptions() ([]nats.Option, error) {
	// NoEcho: the node subscribes to P.*.* and must not receive what it
	// publishes itself (released, stored, kv_events, resync). The inbox
	// prefix is the one natsauth lets kvactors' user read.
	opts := []nats.Option{nats.Name(nodeConnName(n.cfg.NodeID)), nats.NoEcho(), nats.MaxReconnects(-1),
		nats.CustomInboxPrefix(natsauth.InboxPrefix(natsauth.ServiceUser)),
		nats.ReconnectWait(250 * time.Millisecond), nats.ReconnectJitter(100*time.Millisecond, time.Second),
		writeBuffer(natsWriteBuffer),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			n.metrics.NATSConnected.Set(0)
			if err != nil { // nil: our own Close
				n.metrics.NATSEvents.WithLabelValues("disconnect").Inc()
				n.metrics.NATSDisconnect.WithLabelValues(disconnectCause(err)).Inc()
				n.log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			n.log.Info("nats reconnected: resyncing every engine", "url", c.ConnectedUrl())
			n.reconnected()
		}),
		nats.ErrorHandler(func(_ *nats.Conn, s *nats.Subscription, err error) {
			subj := ""
			if s != nil {
				subj = s.Subject
			}
			// Rate-limited: an engine flooding the intake makes a slow
			// consumer episode after episode (docs/SECURITY.md "Bounds").
			reason := "nats_error"
			if errors.Is(err, nats.ErrSlowConsumer) {
				reason = "nats_slow_consumer"
				n.metrics.NATSEvents.WithLabelValues("slow_consumer").Inc()
				n.slow.dropped(s)
			} else {
				n.metrics.NATSEvents.WithLabelValues("error").Inc()
			}
			n.rejectLog.Reject(reason, "nats async error", "subject", subj, "err", err)
		})}
	auth, err := n.cfg.NATSAuthOptions()
	if err != nil {
		return nil, err
	}
	return append(append(opts, auth...), n.cfg.natsExtra...), nil
}

// NATSAuthOptions are the client options for c's NATS credentials and TLS:
// NATSCreds, NATSUser/NATSPassword, NATSToken, NATSNKey, and with NATSURL
// (natsTLS) NATSCA, NATSCert and NATSKey: nats.go reads those when the
// option is applied, so an ignored file that cannot be read would fail
// every connect to the embedded server. serve and
// `kvactors nodes` both use it, so they authenticate alike. The error wraps
// ErrConfig.
func (c Config) NATSAuthOptions() ([]nats.Option, error) {
	var opts []nats.Option
	if c.NATSCreds != "" {
		opts = append(opts, nats.UserCredentials(c.NATSCreds))
	}
	if c.NATSUser != "" {
		opts = append(opts, nats.UserInfo(c.NATSUser, c.NATSPassword))
	}
	if c.NATSToken != "" {
		opts = append(opts, nats.Token(c.NATSToken))
	}
	if c.NATSNKey != "" {
		opt, err := nats.NkeyOptionFromSeed(c.NATSNKey)
		if err != nil {
			return nil, fmt.Errorf("%w: --nats-nkey: %w", ErrConfig, err)
		}
		opts = append(opts, opt)
	}
	if !c.natsTLS() {
		return opts, nil
	}
	if c.NATSCA != "" {
		opts = append(opts, nats.RootCAs(c.NATSCA))
	}
	if c.NATSCert != "" {
		opts = append(opts, nats.ClientCert(c.NATSCert, c.NATSKey))
	}
	return opts, nil
}

// NATSSecretsFromEnv sets c's NATS user, password and token from NATS_USER,
// NATS_PASSWORD and NATS_TOKEN. Secrets come from the environment only,
// never a flag or file (ps and config repositories would show them).
func (c *Config) NATSSecretsFromEnv() {
	c.NATSUser, c.NATSPassword, c.NATSToken = os.Getenv("NATS_USER"), os.Getenv("NATS_PASSWORD"), os.Getenv("NATS_TOKEN")
}

// disconnectCause labels why the NATS connection dropped.
func disconnectCause(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, io.EOF):
		return "eof"
	case errors.Is(err, nats.ErrStaleConnection):
		return "stale_connection"
	case errors.Is(err, nats.ErrAuthorization), errors.Is(err, nats.ErrAuthExpired), errors.Is(err, nats.ErrAuthRevoked):
		return "auth"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return "other"
}

// NATSURL is the URL engines connect to.
func (n *Node) NATSURL() string {
	if n.ns != nil {
		return n.ns.ClientURL()
	}
	return n.cfg.NATSURL
}
