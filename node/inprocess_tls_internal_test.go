package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/natsauth"
)

// verifyingNATSNode is a node's config whose embedded server runs
// nats-config's files for one engine with certs' server certificate,
// verifying clients' against certs' CA (tls { verify: true }); the node is
// given that CA (--nats-ca, which its in-process connection leaves unused)
// and no certificate of its own.
func verifyingNATSNode(t *testing.T, certs testkit.TLSFiles) Config {
	t.Helper()
	g, err := natsauth.Generate(natsauth.Options{Engines: []string{"gpu0"}, TLSCert: certs.Cert, TLSKey: certs.Key,
		TLSCA: certs.CA})
	require.NoError(t, err)
	dir := filepath.Join(t.TempDir(), "nats")
	_, err = g.Write(dir)
	require.NoError(t, err)
	return Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: t.TempDir(), PoolBytes: 1 << 20,
		HTTPAddr: HTTPOff, Registry: prometheus.NewRegistry(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		NATSConfig: filepath.Join(dir, natsauth.ConfigFile), NATSNKey: filepath.Join(dir, natsauth.ServiceUser+".nk"),
		NATSCA: certs.CA}
}

// refusingServer is a node's config whose embedded server (verifying
// clients' certificates, as verifyingNATSNode) refuses the node's
// credentials while refuse is set (a custom authenticator in place of the
// config's users, as a revoked user would be), counting the connects it
// checks in attempts.
func refusingServer(t *testing.T, refuse *atomic.Bool, attempts *atomic.Int32) Config {
	t.Helper()
	cfg := verifyingNATSNode(t, testkit.TLS(t))
	cfg.NATSConnectTimeout = time.Minute
	cfg.embeddedExtra = func(o *server.Options) {
		// The nonce the node's nkey signs, as the config's users have it.
		o.CustomClientAuthentication, o.AlwaysEnableNonce = refuser{refuse, attempts}, true
	}
	return cfg
}

type refuser struct {
	refuse   *atomic.Bool
	attempts *atomic.Int32
}

func (r refuser) Check(server.ClientAuthentication) bool {
	r.attempts.Add(1)
	return !r.refuse.Load()
}

// A node whose embedded server requires TLS and verifies client
// certificates starts without a certificate of its own (--nats-cert), on
// every interface too: its connection to that server is in-process and
// plain (no TLS on a pipe inside the process), and authenticated (its
// nkey). Clients over TCP still need TLS and a client certificate.
func TestEmbeddedTLSNodeConnectsInProcessInPlainText(t *testing.T) {
	t.Parallel()
	certs := testkit.TLS(t)
	cfg := verifyingNATSNode(t, certs)
	cfg.NATSHost, cfg.NodeID = "0.0.0.0", "n1"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := Start(ctx, cfg)
	require.NoError(t, err, "no --nats-cert")
	t.Cleanup(func() { _ = n.Close(context.Background()) })

	_, err = n.nc.TLSConnectionState()
	require.ErrorIs(t, err, nats.ErrConnectionNotTLS)
	require.Equal(t, "nats://"+strings.TrimPrefix(n.ns.ClientURL(), "tls://"), n.nc.ConnectedUrl())
	cz, err := n.ns.Connz(&server.ConnzOptions{Username: true})
	require.NoError(t, err)
	var own *server.ConnInfo
	for _, c := range cz.Conns {
		if c.Name == "kvactors n1" {
			own = c
		}
	}
	require.NotNil(t, own, "the node's connection: %+v", cz.Conns)
	require.Empty(t, own.TLSVersion, "the node's connection is not TLS")
	seed, err := os.ReadFile(cfg.NATSNKey)
	require.NoError(t, err)
	kp, err := nkeys.FromSeed(seed)
	require.NoError(t, err)
	pub, err := kp.PublicKey()
	require.NoError(t, err)
	require.Equal(t, pub, own.AuthorizedUser, "and authenticated, as kvactors' user (its nkey)")

	url := fmt.Sprintf("tls://127.0.0.1:%d", n.ns.Addr().(*net.TCPAddr).Port)
	engine, err := nats.NkeyOptionFromSeed(filepath.Join(filepath.Dir(cfg.NATSConfig), "gpu0.nk"))
	require.NoError(t, err)
	_, err = nats.Connect(url, engine, nats.RootCAs(certs.CA), nats.Timeout(2*time.Second))
	require.Error(t, err, "over TCP without a client certificate: refused")
	nc, err := nats.Connect(url, engine, nats.RootCAs(certs.CA), nats.ClientCert(certs.ClientCert, certs.ClientKey))
	require.NoError(t, err, "with one: let in")
	nc.Close()

	// A TCP client calling itself the node, refused for its credentials,
	// is not taken for the node's own refusal (which would end a start's
	// retries with a wrong diagnosis).
	since := time.Now()
	stranger, err := nkeys.CreateUser()
	require.NoError(t, err)
	strangerPub, err := stranger.PublicKey()
	require.NoError(t, err)
	_, err = nats.Connect(url, nats.Name(nodeConnName("n1")), nats.Nkey(strangerPub, stranger.Sign),
		nats.RootCAs(certs.CA), nats.ClientCert(certs.ClientCert, certs.ClientKey), nats.Timeout(2*time.Second))
	require.ErrorIs(t, err, nats.ErrAuthorization, "an impostor with a key the server does not know")
	require.NoError(t, n.inProcessRefusal(since), "another client's refusal taken for the node's")
}

// strangerNKey gives c an nkey seed the server knows nothing of.
func strangerNKey(t *testing.T, c *Config) {
	t.Helper()
	kp, err := nkeys.CreateUser()
	require.NoError(t, err)
	seed, err := kp.Seed()
	require.NoError(t, err)
	c.NATSNKey = filepath.Join(t.TempDir(), "stranger.nk")
	require.NoError(t, os.WriteFile(c.NATSNKey, seed, 0o600))
}

// An in-process connect the embedded server refuses fails the start in
// time, saying why: bad credentials at the first attempt (not retried for
// --nats-connect-timeout, each attempt a timeout on the synchronous pipe,
// the server's -ERR lost), a server taking no more connections at
// --nats-connect-timeout, each attempt ending in time for the next.
func TestInProcessConnectRefusedFailsStartPromptly(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, want string
		auth       bool
		setup      func(*testing.T, *Config)
	}{
		{name: "bad credentials", auth: true, want: "the embedded server refused the node's credentials (Authentication Failure)",
			setup: func(t *testing.T, c *Config) {
				strangerNKey(t, c)
			}},
		{name: "users named by certificates", auth: true, want: "(verify_and_map) and the in-process connection presents none",
			setup: func(t *testing.T, c *Config) {
				strangerNKey(t, c)
				c.embeddedExtra = func(o *server.Options) { o.TLSMap = true }
			}},
		{name: "no more connections", want: "the embedded server refused the connection: Maximum Connections Exceeded",
			setup: func(_ *testing.T, c *Config) {
				c.NATSConnectTimeout = 2 * time.Second
				c.embeddedExtra = func(o *server.Options) { o.MaxConn = -1 } // every connection over the limit
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := verifyingNATSNode(t, testkit.TLS(t))
			cfg.NATSConnectTimeout = time.Minute
			tc.setup(t, &cfg)
			const bound = 8 * time.Second
			ctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			start := time.Now()
			n, err := Start(ctx, cfg)
			took := time.Since(start)
			if err == nil {
				_ = n.Close(context.Background())
			}
			t.Logf("took %v: %v", took, err)
			require.ErrorContains(t, err, tc.want)
			require.Equal(t, tc.auth, errors.Is(err, nats.ErrAuthorization))
			require.NotErrorIs(t, err, context.DeadlineExceeded, "ended by the refusal, not the start's context")
			require.Less(t, took, bound)
		})
	}
}

// A reconnect the embedded server refuses (its credentials, say) ends
// within nats.go's connect timeout (connectBounded): three refusals in
// 15 s, not one per server write deadline (10 s), and the client is
// connected again once the server lets it in.
func TestInProcessReconnectRefusedByTheServerIsBounded(t *testing.T) {
	t.Parallel()
	var refuse atomic.Bool
	var attempts atomic.Int32
	n, err := Start(context.Background(), refusingServer(t, &refuse, &attempts))
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	require.True(t, n.nc.IsConnected())

	refuse.Store(true)
	from := attempts.Load()
	n.nc.ForceReconnect()
	testkit.Eventually(t, 15*time.Second, 20*time.Millisecond, func() error {
		if got := attempts.Load() - from; got < 3 {
			return fmt.Errorf("%d refused reconnects", got)
		}
		return nil
	})
	refuse.Store(false)
	testkit.Eventually(t, 15*time.Second, 20*time.Millisecond, func() error {
		if !n.nc.IsConnected() {
			return fmt.Errorf("not connected: %v", n.nc.Status())
		}
		return nil
	})
}

// connectBounded bounds only the connect: while its deadline is set, a
// later write deadline (nats.go's minute) is cut to it and the write that
// times out closes the pipe; once cleared (connected), the pipe's own
// deadlines apply and it stays open.
func TestConnectBoundedOnlyDuringTheConnect(t *testing.T) {
	t.Parallel()
	a, b := net.Pipe()
	c := &connectBounded{Conn: a}
	require.NoError(t, c.SetDeadline(time.Now().Add(-time.Millisecond))) // the connect's, passed
	require.NoError(t, c.SetWriteDeadline(time.Now().Add(time.Minute)))
	_, err := c.Write([]byte("CONNECT"))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "the write is cut to the connect's deadline")
	_ = b.SetReadDeadline(time.Now().Add(5 * time.Second)) // ErrClosedPipe once closed
	_, err = b.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "and the pipe closed")

	a, b = net.Pipe()
	t.Cleanup(func() { _, _ = a.Close(), b.Close() })
	c = &connectBounded{Conn: a}
	require.NoError(t, c.SetDeadline(time.Now().Add(-time.Millisecond)))
	require.NoError(t, c.SetDeadline(time.Time{})) // connected
	require.NoError(t, c.SetWriteDeadline(time.Now().Add(time.Minute)))
	read := func() {
		go func() { _, _ = io.ReadFull(b, make([]byte, 3)) }()
	}
	read()
	_, err = c.Write([]byte("PUB"))
	require.NoError(t, err, "after the connect, the write's own deadline")
	require.NoError(t, c.SetReadDeadline(time.Now().Add(-time.Millisecond)))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	read()
	_, err = c.Write([]byte("PUB"))
	require.NoError(t, err, "a timeout after the connect leaves the pipe open")
}
