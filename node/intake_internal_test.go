package node

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// When the intake's own queues are full (its budget is taken), a request
// gets an error reply naming the node, never silence, and a batch marks its
// engine lost: the engine's next resync says overflow. The full budget is
// injected by taking it all before the messages arrive.
func TestFullIntakeRepliesAndResyncs(t *testing.T) {
	dir := t.TempDir()
	n, err := Start(context.Background(), Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir,
		PoolBytes: 1 << 20, HTTPAddr: "off", Lease: 2 * time.Second, // the overflow resync waits for the next lease/4 tick; the engine must not expire meanwhile
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err := nats.Connect(n.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	in := n.ingest

	// An engine with a live epoch.
	seg, err := shm.Create(dir, "e1-kv", 4096)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	spec, _ := json.Marshal(messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 4,
		Segments: []messages.Segment{seg.Spec()}, Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 1024, BlockBytes: 1024}}}}})
	reply, err := nc.Request("kvactors.e1.register", spec, 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"ok":true`)
	resync := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	batch := func(seq int) {
		require.NoError(t, nc.Publish("kvactors.e1.events", []byte(fmt.Sprintf(`{"epoch":"a","seq":%d,"events":[]}`, seq))))
		require.NoError(t, nc.Flush())
	}
	batch(1)
	st, err := nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second) // batch 1 applied
	require.NoError(t, err)
	require.Contains(t, string(st.Data), `"seq":1`)

	taken := in.budget
	require.True(t, in.admit(taken), "take the whole budget")
	lookup, err := nc.Request("kvactors.e1.lookup", []byte(`{"hashes":[]}`), 5*time.Second)
	require.NoError(t, err, "a refused request is answered")
	var r map[string]any
	require.NoError(t, json.Unmarshal(lookup.Data, &r))
	require.Contains(t, r["error"], "overloaded")
	require.Equal(t, n.NodeID(), r["node"])
	require.Equal(t, n.Boot(), r["boot"])
	testkit.NoRecv(t, resync, 10*time.Millisecond, "a resync for a refused request")

	// A batch that cannot be taken: dropped, counted, and its engine resyncs
	// (got 0: the node never read its seq).
	batch(2)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if v := testutil.ToFloat64(n.metrics.DroppedBatches.WithLabelValues("overflow")); v != 1 {
			return fmt.Errorf("overflow drops %v", v)
		}
		return nil
	})
	in.release(taken)
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resync, 5*time.Second, "overflow resync").Data, &rs))
	require.Equal(t, messages.Resync{Node: n.NodeID(), Boot: n.Boot(), Epoch: "a", Expected: 2, Got: 0,
		Reason: messages.ResyncOverflow}, rs)
	require.Equal(t, 1.0, testutil.ToFloat64(n.metrics.DroppedBatches.WithLabelValues("overflow")))
	batch(3) // after the loss: dropped until a new epoch
	st, err = nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(st.Data), `"seq":1`)
	require.Contains(t, string(st.Data), `"resyncing":true`)
}

// A message taken for a routed engine is a sign of life at once, before
// its actor handles it (a batch in a backlog), and also when the intake
// drops it: the engine actor's lease check reads the count
// (engine.Deps.Arrivals). An engine no longer routed is not counted.
func TestTakenMessagesAreSignsOfLife(t *testing.T) {
	dir := t.TempDir()
	n, err := Start(context.Background(), Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir,
		PoolBytes: 1 << 20, HTTPAddr: "off", Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	in := n.ingest
	pid := n.system.Root.Spawn(actor.PropsFromFunc(func(actor.Context) {}))
	in.route("e1", pid)
	require.Zero(t, in.taken("e1"), "nothing taken yet")

	take := func() {
		in.take(&nats.Msg{Subject: "kvactors.e1.heartbeat", Data: []byte(`{}`)})
	}
	take()
	require.Equal(t, uint64(1), in.taken("e1"))
	in.take(&nats.Msg{Subject: "kvactors.e1.stored", Data: []byte(`{}`)})
	require.Equal(t, uint64(1), in.taken("e1"), "a verb only a node publishes is not the engine's sign")
	in.take(&nats.Msg{Subject: "kvactors.e1.status", Data: []byte(`{}`)})
	require.Equal(t, uint64(1), in.taken("e1"), "anyone may ask for status: not the engine's sign")

	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if p := in.pending.Load(); p != 0 {
			return fmt.Errorf("%d bytes still pending", p)
		}
		return nil
	})
	full := in.budget
	require.True(t, in.admit(full), "take the whole budget: the next message is dropped")
	take()
	require.Equal(t, uint64(2), in.taken("e1"), "a dropped message counts too")
	in.release(full)

	in.unroute("e1", pid)
	require.Zero(t, in.taken("e1"), "an engine no longer routed is not counted")
	take()
	require.Zero(t, in.taken("e1"))
}
