package node_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// A message the node could not publish is lost: it is counted in
// kvactors_nats_publish_failures_total by kind and logged, five lines a
// kind a minute (docs/OBSERVABILITY.md). The fault: the node's link cut,
// with no reconnect buffer (it stands for a full one), so each node
// heartbeat (every lease/4) is refused while it reconnects.
func TestAMessageTheNodeCouldNotPublishIsCountedAndLoggedRateLimited(t *testing.T) { // not parallel: a lease-timed outage
	const lease = 400 * time.Millisecond
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, s.Addr().String())
	reg := prometheus.NewRegistry()
	var logs testkit.SyncBuffer
	cfg := node.Config{NATSURL: "nats://" + link.Addr, ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: "off",
		Registry: reg, Lease: lease, Log: slog.New(slog.NewTextHandler(&logs, nil)),
		FailStop: func(reason string) { t.Errorf("the node fail-stopped: %s", reason) }}
	node.WithNATSOptions(nats.ReconnectBufSize(-1), nats.IgnoreDiscoveredServers())(&cfg)
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { checkDocumentedLabelValues(t, reg) })
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	failed := func() float64 {
		return metricValue(t, reg, "kvactors_nats_publish_failures_total", map[string]string{"kind": "node"})
	}
	require.Zero(t, failed())

	link.Cut()
	const want = 8 // more than the five a kind logs
	testkit.Eventually(t, 10*want*lease/4, 10*time.Millisecond, func() error {
		if v := failed(); v < want {
			return fmt.Errorf("%v node heartbeats lost, want %d", v, want)
		}
		return nil
	})
	var logged int
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, "publish failed: message lost") {
			require.Contains(t, l, "reason=publish_node")
			require.Contains(t, l, nats.ErrReconnectBufExceeded.Error())
			logged++
		}
	}
	require.Equal(t, 5, logged, "past five a minute, a kind's failures are only counted")
	for _, kind := range []string{"released", "stored", "kv_events", "resync", "reply"} {
		require.Zero(t, metricValue(t, reg, "kvactors_nats_publish_failures_total", map[string]string{"kind": kind}),
			"kind %s", kind)
	}
}
