package node_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// --nats: the node joins an existing server, and when that server goes away
// and comes back on the same address it reconnects by itself, resubscribes,
// and serves the engine again (issue 3, "reconnect forever with backoff").
func TestExternalNATSAndReconnect(t *testing.T) {
	port := freePort(t)
	start := func() *server.Server {
		s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
		require.NoError(t, err)
		s.Start()
		require.True(t, s.ReadyForConnections(10*time.Second))
		return s
	}
	s := start()
	url := s.ClientURL()
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	n, err := node.Start(context.Background(), node.Config{NATSURL: url, ShmDir: dir, PoolBytes: 1 << 20,
		HTTPAddr: "off", Registry: reg, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	require.Equal(t, url, n.NATSURL())

	e := &env{t: t, node: n, reg: reg, dir: dir}
	e.nc, err = nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(e.nc.Close)
	te := e.newEngine("ext", defaultOpts())
	te.register()
	te.send(added("r", 4), hashesEv("r", 0, hash("x", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4))
	recv(t, te.stored, "stored before the outage")

	s.Shutdown()
	s.WaitForShutdown()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n.Ready() == nil {
			return fmt.Errorf("node still ready with its server down")
		}
		return nil
	})
	s = start()
	t.Cleanup(s.Shutdown)
	testkit.Eventually(t, 10*time.Second, 20*time.Millisecond, func() error {
		if err := n.Ready(); err != nil {
			return err
		}
		if !e.nc.IsConnected() {
			return fmt.Errorf("test client not reconnected")
		}
		return nil
	})
	require.NoError(t, e.nc.Flush())
	te.send(added("r2", 4), hashesEv("r2", 0, hash("y", 0)), blocksEv("r2", 0, 0, 2), tokensEv("r2", 4, 4))
	recv(t, te.stored, "stored after the reconnect")
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
