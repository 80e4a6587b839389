package node

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/wire"
)

// An engine whose actor does not keep up fills at most three quarters of
// the intake budget (the calm quarter and its bucket's share, half): its
// batches pile up, lent to its held actor, until it overflows, while an
// engine of another bucket still gets every batch in (no overflow, each
// applied). Before the shares, the flooder's batches
// took the whole budget and the other engine's were dropped too.
func TestAFloodingEngineOverflowsAloneWhileAnotherBucketsEngineIsAdmitted(t *testing.T) {
	t.Parallel()
	// A 16 KiB max payload allows a 256 KiB --max-pending-bytes: intake's
	// budget is 128 KiB, a few dozen of these batches.
	s := testkit.NATSServerWith(t, func(o *server.Options) { o.MaxPayload = 16 << 10 })
	n, nc, dir := startInternal(t, func(c *Config) {
		c.NATSURL, c.NATSPort, c.NATSStoreDir, c.MaxPendingBytes = s.ClientURL(), 0, "", 256<<10
	})
	flooder, other := "fa", ""
	for i := 0; other == ""; i++ {
		if id := fmt.Sprintf("fb%d", i); bucketOf(idHash(id)) != bucketOf(idHash(flooder)) {
			other = id
		}
	}
	h := registerHeldEngine(t, n, nc, dir, flooder)
	registerOneEngine(t, nc, dir, other)

	// The flooder's actor is held in a turn (a Tick's, on this test's
	// goroutine), so every batch of it waits in its mailbox, its credit
	// counted.
	h.arm.Store(true)
	go n.system.Root.Send(n.engine(flooder).pid, &engine.Tick{})
	testkit.Recv(t, h.holding, 5*time.Second, "the flooder's actor held in a turn")
	var b wire.Batch
	body := func(id string, seq uint64) []byte { // every batch of the same size, of both engines
		b.Reset()
		for i := range 40 {
			b.Added(fmt.Sprintf("%s-%06d-%02d", id[:2], seq, i), 16)
		}
		return b.Body(nil, "ep", seq)
	}
	overflows := func() float64 { return testutil.ToFloat64(n.metrics.DroppedBatches.WithLabelValues("overflow")) }
	// In rounds of 8, each taken before the next: nats.go's own queue (28
	// messages here) never overflows, which would resync every engine.
	for seq := uint64(1); seq <= 40; seq++ {
		require.NoError(t, nc.Publish("kvactors."+flooder+".events", body(flooder, seq)))
		if seq%8 != 0 {
			continue
		}
		require.NoError(t, nc.Flush())
		require.NoError(t, n.nc.Flush()) // the round is in nats.go's queue
		testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
			if msgs, _, err := n.subs[0].Pending(); err != nil || msgs > 0 {
				return fmt.Errorf("nats.go still holds %d messages (%v)", msgs, err)
			}
			for i := range n.ingest.marks {
				if mk := &n.ingest.marks[i]; mk.queued.Load() != mk.handled.Load() {
					return fmt.Errorf("shard %d still holds messages", i)
				}
			}
			return nil
		})
	}
	require.Positive(t, overflows(), "the flooder overflowed")
	require.Zero(t, n.intakeDropped(), "nats.go dropped nothing")
	flooded := overflows()
	in := n.ingest
	require.LessOrEqual(t, in.pending.Load(), in.budget-in.budget/4, "the flooder holds at most three quarters")
	fullest := in.fullestBucket()
	require.LessOrEqual(t, fullest, in.share(), "the flooder's bucket holds at most its share counted")
	require.GreaterOrEqual(t, fullest, in.pending.Load()-in.calm(), "the flooder's bucket: all intake holds past calm")
	require.Equal(t, float64(fullest), testutil.ToFloat64(n.metrics.FullestBucketBytes),
		"kvactors_ingest_fullest_bucket_bytes: the flooder's")

	// The other engine, one batch at a time, each applied before the next.
	for seq := uint64(1); seq <= 5; seq++ {
		require.NoError(t, nc.Publish("kvactors."+other+".events", body(other, seq)))
		m, err := nc.Request("kvactors."+other+".status", []byte(`{}`), 5*time.Second)
		require.NoError(t, err)
		var st StatusReply
		require.NoError(t, json.Unmarshal(m.Data, &st))
		require.Empty(t, st.Error)
		require.False(t, st.Resyncing, "batch %d of the other engine was dropped: it resyncs", seq)
		require.Equal(t, seq, st.Seq, "batch %d of the other engine applied", seq)
	}
	require.Equal(t, flooded, overflows(), "no batch of the other engine dropped")

	// The flooder's actor handles its batches: every byte comes back, each
	// to the bucket it counts in (a calm credit given back to a bucket would
	// leave that bucket below 0, which the fullest bucket does not show).
	h.release()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		f := map[string]int{}
		in.footprintBytes(f)
		if p, b, held := f["ingest_pending_bytes"], f["ingest_bucket_bytes"], f["ingest_buckets_held"]; p != 0 || b != 0 || held != 0 {
			return fmt.Errorf("intake holds %d bytes, its buckets %d, %d of them not 0", p, b, held)
		}
		return nil
	})
}
