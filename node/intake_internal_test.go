package node

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

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
	t.Parallel()
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
	reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.register", spec, 5*time.Second)
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

	taken := takeWholeBudget(t, in)
	lookup, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.lookup", []byte(`{"hashes":[]}`), 5*time.Second)
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
	freeTotal(in, taken)
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

// An engine's lease check leaves it alive while its intake shard holds
// messages taken and not yet handled (some may be its own signs of life;
// engine.Deps.Backlogged), queued or in the shard worker's hands, and only
// that shard counts.
func TestALeaseCheckSeesTheEnginesShardBacklog(t *testing.T) {
	in := &ingester{queues: []chan inbound{make(chan inbound, 4), make(chan inbound, 4)},
		marks: make([]shardMarks, 2)}
	require.False(t, in.backlogged("e1"))
	s := in.shard("e1")
	mk := &in.marks[s]
	mk.queuing(1) // take, as it queues message 1
	in.queues[s] <- inbound{engine: "e1", n: 1}
	mk.sent(1, true)
	require.True(t, in.backlogged("e1"))
	other := "e2"
	for in.shard(other) == s {
		other += "x"
	}
	require.False(t, in.backlogged(other), "another shard's backlog is not the engine's")
	x := <-in.queues[s] // the worker takes it: the queue is empty, the message in its hands
	require.True(t, in.backlogged("e1"), "a message the worker holds")
	mk.handled.Store(x.n) // handled: in the engine actor's mailbox now
	require.False(t, in.backlogged("e1"))

	mk.queuing(2) // the queue refuses message 2: take puts the mark back
	mk.sent(2, false)
	require.False(t, in.backlogged("e1"), "a message never queued is no backlog")

	// A message intake dropped is a sign of life until flushLost has told
	// the engine actor: while it is recorded, and while flushLost sends it.
	in.anyLost.Store(true)
	require.True(t, in.backlogged(other), "a drop not yet told")
	in.anyLost.Store(false)
	in.flushing.Add(1)
	require.True(t, in.backlogged(other), "a drop being told")
	in.flushing.Add(-1)
	require.False(t, in.backlogged(other))
}

// A message read off the connection before the round trip that ended a
// lapse may have waited in the node's socket through it: it is stamped with
// the lapse's generation, so the session it begins (a load, an epoch) never
// copies. Later messages, and any outside that window, get the fence's
// generation.
func TestMessagesReadBeforeALapseEndedAreStampedLapsed(t *testing.T) {
	end := &lapseBoundary{gen: 2, upTo: 10}
	for _, tc := range []struct {
		gen, n, want uint64
		why          string
	}{
		{0, 5, 0, "no lapse yet"},
		{1, 5, 1, "during the lapse: its own generation"},
		{2, 10, 1, "read before the round trip that ended it"},
		{2, 11, 2, "read after it"},
		{4, 5, 4, "a later lapse's end: this boundary is not its"},
	} {
		require.Equal(t, tc.want, stamp(tc.gen, tc.n, end), tc.why)
	}
	require.Equal(t, uint64(2), stamp(2, 1, nil), "no lapse ended")
}

// markLapseEnd counts every message read before the round trip's answer,
// the one take is handling included (its callback still runs: nats.go
// counts it delivered and still pending), so none of them is stamped as
// fresh; at most one too many is.
func TestTheLapseEndCoversEveryMessageReadBeforeIt(t *testing.T) {
	_, nc := testkit.NATS(t)
	inside, release := make(chan struct{}, 1), make(chan struct{})
	sub, err := nc.Subscribe("x", func(*nats.Msg) {
		select {
		case inside <- struct{}{}:
			<-release // the first message's callback runs on
		default:
		}
	})
	require.NoError(t, err)
	defer close(release)
	for range 3 {
		require.NoError(t, nc.Publish("x", nil))
	}
	require.NoError(t, nc.Flush()) // all three read before this answer
	testkit.Recv(t, inside, 5*time.Second, "the first message's callback")
	in := &ingester{sub: sub}
	in.markLapseEnd(2)
	end := in.lapseEnd.Load()
	require.NotNil(t, end)
	require.Equal(t, uint64(2), end.gen)
	require.GreaterOrEqual(t, end.upTo, uint64(3), "every message read before the answer")
	require.LessOrEqual(t, end.upTo, uint64(4), "at most the one being handled counted twice")
	for n := uint64(1); n <= 3; n++ {
		require.Equal(t, uint64(1), stamp(2, n, end), "message %d belongs to the lapse", n)
	}
}

// PROTOCOL.md "Back-pressure": the intake's byte budget counts what a
// message holds, its NATS headers too (a received message keeps them twice:
// the wire bytes and the parsed map). Counted without them, messages whose
// bytes are all headers queued nearly for free and the node held many times
// --max-pending-bytes. With 64 KiB of the budget left, a request carrying
// 256 KiB of headers and an empty body is refused as overloaded.
func TestHeaderBytesCountAgainstTheIntakeBudget(t *testing.T) {
	t.Parallel()
	const pad = 256 << 10
	m := nats.NewMsg("kvactors.e1.lookup")
	m.Header.Set("X-Pad", strings.Repeat("h", pad))
	require.Greater(t, msgBytes(m), int64(2*pad), "the header counted, as wire bytes and parsed")

	n, err := Start(context.Background(), Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: t.TempDir(),
		PoolBytes: 1 << 20, HTTPAddr: "off", Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err := nats.Connect(n.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	in := n.ingest
	const free = 64 << 10
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if holdTotal(in, in.budget-free) {
			return nil
		}
		return fmt.Errorf("intake holds %d bytes", in.pending.Load())
	})
	t.Cleanup(func() { freeTotal(in, in.budget-free) })

	m.Data = []byte(`{"hashes":[]}`)
	m.Reply = testkit.EngineInbox("e1")
	replies := testkit.Subscribe(t, nc, m.Reply)
	require.NoError(t, nc.PublishMsg(m))
	reply := testkit.Recv(t, replies, 5*time.Second, "a refused request is answered")
	require.Contains(t, string(reply.Data), messages.Overloaded, "256 KiB of headers do not fit in 64 KiB of budget")
}

// A message admitted while its shard's queue is full is dropped (overflow)
// and its bytes given back where they were counted: calm, to the total
// alone; past calm, to its engine's bucket too. Kept, or given to the other
// place, they would hold the budget (or a bucket) short for good. The
// intake here has one shard queue that nothing reads, of no room: always
// full.
func TestAMessageItsFullShardQueueDropsGivesItsBytesBack(t *testing.T) {
	t.Parallel()
	n, _, _ := startInternal(t, nil)
	in := &ingester{n: n, queues: []chan inbound{make(chan inbound)}, marks: make([]shardMarks, 1),
		budget: 1 << 20, lost: map[string]uint64{}, alive: map[string]time.Time{}}
	batch := &nats.Msg{Subject: "kvactors.e1.events", Data: []byte(`{"epoch":"a","seq":1,"events":[]}`)}
	size := msgBytes(batch)

	in.take(batch) // calm: intake holds nothing else
	require.Contains(t, in.lost, "e1", "dropped: e1 resyncs")
	requireEmpty(t, in)

	delete(in.lost, "e1")
	require.True(t, holdTotal(in, in.calm()), "intake past calm: the next message counts in its bucket")
	bucket := bucketOf(idHash("e1"))
	admittedAt, ok := in.admit(bucket, size)
	require.True(t, ok)
	require.Equal(t, bucket, admittedAt, "past calm, e1's batch is counted in its bucket")
	in.release(admittedAt, size)
	in.take(batch)
	require.Contains(t, in.lost, "e1", "dropped: e1 resyncs")
	require.Equal(t, in.calm(), in.pending.Load(), "the batch's bytes given back to the total")
	requireNoBucket(t, in)
	freeTotal(in, in.calm())
	requireEmpty(t, in)
}
