package node_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// PROTOCOL.md v2 "Hello and heartbeat": "At start and after every NATS
// reconnect a node publishes P._node.<node>.hello {"node","boot",
// "lease_ms"}". The node reaches NATS through a link that is cut twice;
// the listener is connected to the server directly, so it hears every
// hello: one at start, one after each reconnect, each with the same boot
// (the process did not restart). TestExternalNATSAndReconnect restarts
// the server itself, so its client may miss that hello and cannot assert
// it.
func TestHelloAtStartAndAfterEveryReconnect(t *testing.T) { // not parallel: outages bounded by the lease
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, strings.TrimPrefix(s.ClientURL(), "nats://"))
	nc := testkit.Connect(t, s) // not through the link
	hellos := make(chan messages.Hello, 16)
	subscribeJSON(t, nc, "kvactors._node.hn.hello", hellos)
	require.NoError(t, nc.Flush())

	const lease = 4 * time.Second
	reg := prometheus.NewRegistry()
	n, err := node.Start(context.Background(), node.Config{NATSURL: "nats://" + link.Addr, NodeID: "hn",
		Lease: lease, ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: "off", Registry: reg,
		Log:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		FailStop: func(reason string) { t.Errorf("the node fail-stopped: %s", reason) }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	e := &env{t: t, node: n, nc: nc, reg: reg}
	want := messages.Hello{Node: "hn", Boot: n.Boot(), LeaseMS: lease.Milliseconds()}
	require.Equal(t, want, recv(t, hellos, "hello at start"))

	for i := 1; i <= 2; i++ {
		require.Empty(t, hellos, "a hello with no reconnect (outage %d)", i)
		disconnects := e.counter("kvactors_nats_events_total", "disconnect")
		link.Cut()
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			if e.counter("kvactors_nats_events_total", "disconnect") == disconnects {
				return errors.New("the node has not seen its connection drop")
			}
			return nil
		})
		link.Restore()
		require.Equal(t, want, recv(t, hellos, "hello after reconnect"), "outage %d", i)
		require.Equal(t, float64(i), e.counter("kvactors_nats_events_total", "reconnect"))
	}
}
