package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// A --max-pending-bytes under 4 of the server's largest messages is a
// config error (exit 2) that names the flag, as the other start errors
// name theirs, and what it must be.
func TestMaxPendingBytesUnderFourPayloadsNamesTheFlag(t *testing.T) {
	t.Parallel()
	s := testkit.NATSServerWith(t, func(o *server.Options) { o.MaxPayload = 16 << 10 })
	_, err := node.Start(context.Background(), node.Config{NATSURL: s.ClientURL(), MaxPendingBytes: 64<<10 - 1,
		HTTPAddr: "off", ShmDir: t.TempDir(), PoolBytes: 1 << 20, Log: slog.New(slog.DiscardHandler)})
	require.ErrorIs(t, err, node.ErrConfig)
	require.EqualError(t, err, "bad config: --max-pending-bytes 65535: want at least 65536 (4 × the NATS server's max payload, 16384)")
}

// Delivery, "Back-pressure": with a tiny --max-pending-bytes a flood cannot
// grow the intake; what does not fit is dropped, counted and resynced
// (reason overflow), and the node serves normally afterwards.
func TestOverflowResyncsAndRecovers(t *testing.T) {
	t.Parallel()
	const budget = 64 << 10
	// A server with a 16 KiB max payload, so a 64 KiB budget is allowed
	// (it must hold 4 of the largest messages).
	s := testkit.NATSServerWith(t, func(o *server.Options) { o.MaxPayload = 16 << 10 })
	_, err := node.Start(context.Background(), node.Config{NATSURL: s.ClientURL(), MaxPendingBytes: budget - 1,
		HTTPAddr: "off", ShmDir: t.TempDir(), PoolBytes: 1 << 20})
	require.ErrorIs(t, err, node.ErrConfig, "a budget under 4 max payloads is refused")
	e := startNode(t, func(c *node.Config) {
		c.NATSURL, c.MaxPendingBytes, c.DecodeWorkers = s.ClientURL(), budget, 1
	})
	te := e.newEngine("e1", defaultOpts())
	te.register()
	pad := strings.Repeat("x", 2000)
	var rs messages.Resync
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		select {
		case rs = <-te.resync:
			return nil
		default:
		}
		for range 200 { // unflushed: as fast as the client can write
			te.seq++
			body, _ := json.Marshal(map[string]any{"epoch": te.epoch, "seq": te.seq,
				"events": []map[string]any{added("r-"+pad, 4)}})
			require.NoError(t, e.nc.Publish("kvactors.e1.events", body))
		}
		require.NoError(t, e.nc.Flush())
		return fmt.Errorf("no resync yet")
	})
	// A drop in kvactors' queues resyncs with reason overflow at once; a drop
	// inside nats.go is reported to the node asynchronously, so the next batch
	// may reveal the gap first (reason gap). Either way the loss is counted
	// and resynced, never applied past.
	require.Contains(t, []string{"overflow", "gap"}, rs.Reason)
	require.Equal(t, "ep1", rs.Epoch)
	require.Positive(t, dropped(t, e, "overflow"))
	require.Positive(t, resyncs(t, e, "overflow")+resyncs(t, e, "gap"))
	// The intake never held more than its budget, and is empty again.
	require.LessOrEqual(t, e.node.IntakePeak(), int64(budget))
	t.Logf("flood: %v batches dropped (overflow), %v resyncs published, intake peak %d of %d bytes",
		dropped(t, e, "overflow"), resyncs(t, e, "overflow")+resyncs(t, e, "gap"), e.node.IntakePeak(), budget)
	require.Positive(t, e.node.IntakePeak())
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if v := metricValue(t, e.reg, "kvactors_ingest_pending_bytes", nil); v != 0 {
			return fmt.Errorf("pending bytes %v", v)
		}
		return nil
	})
	te.epoch, te.seq = "ep2", 0
	te.storeOne("a", 1)
	require.False(t, te.sync().Resyncing)
}
