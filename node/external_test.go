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
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// --nats: the node joins an existing server, and when that server goes away
// and comes back on the same address it reconnects by itself, resubscribes,
// and serves the engine again (issue 3, "reconnect forever with backoff").
func TestExternalNATSAndReconnect(t *testing.T) { // not parallel: restarts a NATS server on the port it freed
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
	e := &env{t: t, reg: reg, dir: dir}
	var err error
	e.nc, err = nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(e.nc.Close)
	hellos := make(chan messages.Hello, 16)
	subscribeJSON(t, e.nc, "kvactors._node.ext-node.hello", hellos)
	require.NoError(t, e.nc.Flush())
	n, err := node.Start(context.Background(), node.Config{NATSURL: url, ShmDir: dir, PoolBytes: 1 << 20, Lease: time.Second,
		NodeID: "ext-node", HTTPAddr: "off", Registry: reg, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	require.Equal(t, url, n.NATSURL())
	e.node = n
	// PROTOCOL.md v2 "Hello and heartbeat": a hello at start.
	require.Equal(t, messages.Hello{Node: "ext-node", Boot: n.Boot(), LeaseMS: 1000}, recv(t, hellos, "hello at start"))
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
	t.Cleanup(func() { _ = n.Close(context.Background()) }) // before the server goes
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
	// PROTOCOL.md v2 "Delivery": batches sent while the node was away may be
	// lost, so after its reconnect the node says hello again and resyncs the
	// live epoch (reason reconnect); a batch of that epoch is not applied.
	// The hello or resync may have been published before this client was
	// back, so a batch of the old epoch asks for the (repeated) resync.
	var rs messages.Resync
	testkit.Eventually(t, 10*time.Second, 50*time.Millisecond, func() error {
		select {
		case rs = <-te.resync:
			return nil
		default:
		}
		te.send(added("lost", 4))
		return fmt.Errorf("no resync yet")
	})
	// The node's reconnect handler runs on nats.go's callback goroutine: a
	// "lost" batch (seq 2, contiguous, sent after the reconnect) may be
	// applied before it, so Expected is 2 or one past the batches sent.
	require.GreaterOrEqual(t, rs.Expected, uint64(2))
	require.Equal(t, messages.Resync{Node: n.NodeID(), Boot: n.Boot(), Epoch: "ep1", Expected: rs.Expected, Got: 0,
		Reason: messages.ResyncReconnect}, rs)
	require.LessOrEqual(t, rs.Expected, te.seq+1, "never past what was sent")
	select {
	case h := <-hellos:
		require.Equal(t, messages.Hello{Node: n.NodeID(), Boot: n.Boot(), LeaseMS: 1000}, h)
	default: // published while this client was still reconnecting: not delivered to it
	}
	require.Equal(t, 1.0, metricValue(t, reg, "kvactors_nats_events_total", map[string]string{"event": "reconnect"}))
	require.Equal(t, 1.0, metricValue(t, reg, "kvactors_nats_events_total", map[string]string{"event": "disconnect"}))
	require.Equal(t, 1.0, metricValue(t, reg, "kvactors_nats_disconnects_total", nil), "one disconnect, one cause")
	te.epoch, te.seq = "ep2", 0
	te.send(added("r2", 4), hashesEv("r2", 0, hash("y", 0)), blocksEv("r2", 0, 0, 2), tokensEv("r2", 4, 4))
	recv(t, te.stored, "stored after the reconnect and a new epoch")
	st := te.sync()
	require.Equal(t, "ep2", st.Epoch)
	require.False(t, st.Resyncing)
	require.Len(t, st.Requests, 1, "the lost request of the old epoch was never applied")
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
