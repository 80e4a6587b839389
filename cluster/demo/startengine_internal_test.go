package demo

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// An engine registered by another node than the one it names (here the
// standby for its node, which is not live, claims it) fails startEngine,
// and nothing of it is left: its client is closed (the node drops the
// engine), its NATS connection closed, its shm segment removed.
func TestStartEngineOnTheWrongNodeLeavesNothing(t *testing.T) {
	s := testkit.NATSServer(t)
	o := Options{Log: slog.New(slog.DiscardHandler), ShmDir: t.TempDir()}.withDefaults()
	n, err := node.Start(context.Background(), node.Config{NATSURL: s.ClientURL(), NodeID: "standby",
		StandbyFor: "node-x", ClusterReplicas: 1, Lease: lease, ShmDir: o.ShmDir, PoolBytes: 1 << 20,
		HTTPAddr: node.HTTPOff, Log: o.Log, Registry: prometheus.NewRegistry()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	clients := s.NumClients()

	_, err = startEngine(t.Context(), s.ClientURL(), "node-x", "node-x-e1", 8, o)
	require.ErrorContains(t, err, "engine node-x-e1 naming node-x was registered by standby")

	entries, err := os.ReadDir(o.ShmDir)
	require.NoError(t, err)
	require.Empty(t, entries, "the engine's shm segment")
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		if got := s.NumClients(); got != clients {
			return fmt.Errorf("%d NATS clients, want %d: the engine's connection is open", got, clients)
		}
		if got := n.Engines(); len(got) != 0 {
			return fmt.Errorf("the node still serves %v", got)
		}
		return nil
	})
}
