package node

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/natsauth"
)

// refusingServer is a node's config whose embedded server verifies client
// certificates (the generated --nats-config, tls { verify: true }) and
// gives the node a valid one, which the start's check lets through; the
// server then refuses the handshake while refuse is set (a
// VerifyPeerCertificate hook, as OCSP or a certificate expired since would),
// counting its handshakes in attempts.
func refusingServer(t *testing.T, refuse *atomic.Bool, attempts *atomic.Int32) Config {
	t.Helper()
	certs := testkit.TLS(t)
	cfg := verifyingNATSNode(t, certs)
	cfg.NATSCert, cfg.NATSKey, cfg.NATSConnectTimeout = certs.ClientCert, certs.ClientKey, time.Minute
	cfg.embeddedExtra = func(o *server.Options) {
		o.TLSConfig.VerifyPeerCertificate = func([][]byte, [][]*x509.Certificate) error {
			attempts.Add(1)
			if refuse.Load() {
				return errors.New("refused by the test")
			}
			return nil
		}
	}
	return cfg
}

// verifyingNATSNode is a node's config whose embedded server runs
// nats-config's files for one engine with certs' server certificate,
// verifying clients' against certs' CA (tls { verify: true }); the node
// trusts that CA and presents no certificate of its own.
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

// The embedded server refusing the node's certificate for a reason the
// start's check does not model ends each in-process connect within nats.go's
// connect timeout, so the start's context ends the start: not a TLS handshake
// deadlocked on the synchronous pipe (the server writing its alert, the
// client its CONNECT) until nats.go's minute write timeout and tls' 5 s
// close_notify, 65 s an attempt.
func TestInProcessConnectRefusedByTheServerFailsStartInTime(t *testing.T) {
	t.Parallel()
	var refuse atomic.Bool
	var attempts atomic.Int32
	refuse.Store(true)
	cfg := refusingServer(t, &refuse, &attempts)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		n, err := Start(ctx, cfg)
		if err == nil {
			_ = n.Close(context.Background())
		}
		done <- err
	}()
	err := testkit.Recv(t, done, 15*time.Second, "the start's end, its context 5 s")
	t.Logf("took %v, %d handshakes: %v", time.Since(start), attempts.Load(), err)
	require.ErrorIs(t, err, context.DeadlineExceeded, "the start's context ended it")
	require.GreaterOrEqual(t, attempts.Load(), int32(2), "each attempt ended in time for another")
}

// A reconnect to the embedded server that refuses the node's handshake is
// bounded alike: the client tries again within seconds, not a minute, and
// is connected again once the server lets it in.
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
		if got := attempts.Load() - from; got < 2 {
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
