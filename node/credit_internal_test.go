package node

import (
	"context"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/wire"
)

// holder stands in for an engine actor that does not get to its mailbox: it
// keeps every batch unhandled until the test lets go.
type holder struct {
	mu      sync.Mutex
	done    []actors.Signal
	last    uint64 // seq of the newest batch
	charged int64  // the credits of the batches held
	decoded int64  // what the batches held hold, decoded (heldBytes)
}

func (h *holder) Receive(c actor.Context) {
	if b, ok := c.Message().(*engine.Batch); ok {
		h.mu.Lock()
		h.done = append(h.done, b.Done)
		h.last = max(h.last, b.Batch.Seq)
		if c, ok := b.Done.(*credit); ok {
			h.charged += c.size
		}
		h.decoded += heldBytes(&b.Batch)
		h.mu.Unlock()
	}
}

// bytes are the credits of the batches held and what those hold decoded.
func (h *holder) bytes() (charged, decoded int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.charged, h.decoded
}

func (h *holder) newest() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.last
}

func (h *holder) held() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.done)
}

// handleAll is the actor handling what it holds: each credit goes back.
func (h *holder) handleAll(t *testing.T) {
	h.mu.Lock()
	done := h.done
	h.done, h.charged, h.decoded = nil, 0, 0
	h.mu.Unlock()
	for _, d := range done {
		require.NotNil(t, d, "a batch handed over without its credit")
		d.Signal()
	}
}

// creditOf is what intake counts for an events message of engineID's on
// subject with body data once a worker decoded it: its decoded size where
// that is more than its wire size (heldBytes).
func creditOf(t *testing.T, n *Node, engineID, subject string, data []byte) int64 {
	t.Helper()
	size := msgBytes(&nats.Msg{Subject: subject, Data: data})
	b, _, err := ingest.DecodeBatchInto(engineID, data, n.cfg.Limits, eventSlices.Get())
	require.NoError(t, err)
	defer eventSlices.Put(b.Events)
	return max(size, heldBytes(&b))
}

// routeStandIn spawns props as engine's actor on n's intake, and returns it,
// an engine connection and the engine's events subject.
func routeStandIn(t *testing.T, n *Node, engine string, props *actor.Props) (*actor.PID, *nats.Conn, string) {
	t.Helper()
	pid := n.system.Root.Spawn(props)
	t.Cleanup(func() { _ = n.system.Root.StopFuture(pid).Wait() })
	n.ingest.route(engine, pid, &transfer.Hearing{}, nil)
	nc, err := nats.Connect(n.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return pid, nc, n.cfg.Prefix + "." + engine + ".events"
}

// A burst cannot grow what waits for an engine actor past the credit window:
// with the actor not handling anything, the batches it was handed hold at
// most the intake budget, the rest of a burst 20× the budget is dropped
// (the engine resyncs), and once the actor handles its batches the window
// opens again. An engine whose route ends gives its credits back.
func TestBurstBoundedByCreditWindow(t *testing.T) {
	t.Parallel()
	const maxPending = 64 << 10
	// A 16 KiB max payload, so a 64 KiB budget is allowed (4 of the
	// largest messages).
	s := testkit.NATSServerWith(t, func(o *server.Options) { o.MaxPayload = 16 << 10 })
	n, err := Start(context.Background(), Config{NATSURL: s.ClientURL(), HTTPAddr: HTTPOff, ShmDir: t.TempDir(),
		PoolBytes: 1 << 20, MaxPendingBytes: maxPending, Registry: prometheus.NewRegistry(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	budget := n.ingest.budget

	h := &holder{}
	pid, nc, subject := routeStandIn(t, n, "hold", actor.PropsFromProducer(func() actor.Actor { return h }))
	var b wire.Batch
	seq := uint64(100_000) // fixed width: every message has the same size
	body := func() []byte {
		b.Reset()
		for i := range 40 {
			b.Added(fmt.Sprintf("req-%06d-%02d", seq, i), 16)
		}
		seq++
		return b.Body(nil, "ep", seq)
	}
	size := msgBytes(&nats.Msg{Subject: subject, Data: body()})
	burst := int(20 * budget / size)
	for range burst {
		require.NoError(t, nc.Publish(subject, body()))
	}
	require.NoError(t, nc.Flush())
	// The server has routed the burst; a round trip on the node's connection
	// brings all of it into nats.go's queue.
	require.NoError(t, n.nc.Flush())

	// Settled: everything not dropped reached the holder, the queues are
	// empty, and what the holder has is exactly what intake counts.
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if msgs, _, err := n.subs[0].Pending(); err != nil || msgs > 0 {
			return fmt.Errorf("nats.go still holds %d messages (%v)", msgs, err)
		}
		if got, want := n.ingest.pending.Load(), func() int64 { c, _ := h.bytes(); return c }(); got != want {
			return fmt.Errorf("pending %d bytes, holder holds %d", got, want)
		}
		return nil
	})
	held := h.held()
	require.Positive(t, held)
	charged, decoded := h.bytes()
	// A batch's credit is its decoded size where that is the larger (here:
	// 40 events of ~45 bytes of JSON each, 120 bytes each decoded), so the
	// window bounds the memory the actor holds, not its JSON.
	require.Greater(t, decoded, int64(held)*size, "the batches hold more decoded than on the wire")
	require.Equal(t, decoded, charged, "every decoded byte counted")
	// The gauge reads intake's own count at scrape time.
	require.Equal(t, float64(charged), testutil.ToFloat64(n.metrics.PendingBytes),
		"kvactors_ingest_pending_bytes while the actor holds its batches")
	require.LessOrEqual(t, charged, budget, "the actor was handed more than the window")
	require.Less(t, held, burst/4, "most of the burst was dropped, not queued")
	require.LessOrEqual(t, n.ingest.peak.Load(), budget)
	require.LessOrEqual(t, n.IntakePeak(), int64(maxPending))

	// Handling gives the credits back; the window opens again.
	h.handleAll(t)
	require.Zero(t, n.ingest.pending.Load())
	require.Zero(t, testutil.ToFloat64(n.metrics.PendingBytes))
	require.NoError(t, nc.Publish(subject, body()))
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if h.newest() != seq {
			return fmt.Errorf("the batch after the window opened has not arrived (newest %d, want %d)", h.newest(), seq)
		}
		return nil
	})

	// The route ends with a batch unhandled: its credit comes back, once.
	charged, _ = h.bytes()
	require.Equal(t, charged, n.ingest.pending.Load())
	n.ingest.unroute("hold", pid)
	require.Zero(t, n.ingest.pending.Load())
	h.handleAll(t) // a late Done after the route ended returns nothing twice
	require.Zero(t, n.ingest.pending.Load())
}

// A batch's decoded bytes past its wire size are admitted within the
// budget, or past it only when that batch is all intake holds: one batch
// larger than the budget decoded still goes (alone), never beside others.
func TestDecodedBytesPastTheWireAreAdmittedWithinTheBudget(t *testing.T) {
	in := &ingester{budget: 100}
	require.True(t, in.admit(1, 60))
	require.True(t, in.admitMore(1, 80, 60), "alone: past the budget")
	require.False(t, in.admit(2, 1), "nothing beside it")
	in.release(1, 140)

	require.True(t, in.admit(1, 60)) // another engine's batch
	require.True(t, in.admit(2, 30))
	require.False(t, in.admitMore(2, 50, 30), "beside another: within the budget only")
	require.True(t, in.admitMore(2, 10, 30))
	require.EqualValues(t, 100, in.pending.Load())
	require.EqualValues(t, 140, in.peak.Load())
}

// Each bucket of engine ids holds at most its share of the intake budget,
// three quarters, so engines of the other buckets always have the last
// quarter; every release gives back to the bucket it names. A batch past
// the share decoded still goes while it is all its bucket holds (within the
// budget), and past the budget while it is all intake holds.
func TestABucketHoldsAtMostItsShareOfTheIntakeBudget(t *testing.T) {
	in := &ingester{budget: 100} // share 75
	require.True(t, in.admit(1, 70))
	require.True(t, in.admit(1, 5))
	require.False(t, in.admit(1, 1), "bucket 1 is full at its share")
	require.True(t, in.admit(2, 25), "another bucket gets the last quarter")
	require.False(t, in.admit(3, 1), "the budget is full")
	require.EqualValues(t, 100, in.pending.Load())
	require.EqualValues(t, 75, in.buckets[1].n.Load())
	require.Zero(t, in.buckets[3].n.Load(), "a refusal leaves nothing counted")
	require.EqualValues(t, 75, in.fullestBucket())

	in.release(2, 25)
	require.False(t, in.admit(1, 1), "room in the budget, none in bucket 1's share")
	require.True(t, in.admit(3, 25))
	in.release(1, 5)
	require.True(t, in.admit(1, 5), "the release went back to bucket 1")
	in.release(1, 75)
	in.release(3, 25)
	requireEmpty(t, in)

	// A batch of 40 bytes on the wire that holds 90 decoded.
	require.True(t, in.admit(4, 10)) // another engine's message
	require.True(t, in.admit(1, 40))
	require.True(t, in.admitMore(1, 50, 40), "all its bucket holds: past the share, within the budget")
	require.False(t, in.admit(1, 1), "nothing beside it in its bucket")
	in.release(1, 90)
	require.True(t, in.admit(1, 40))
	require.True(t, in.admit(1, 20)) // another message of the bucket
	require.False(t, in.admitMore(1, 30, 40), "beside another of its bucket: within the share only")
	require.EqualValues(t, 60, in.buckets[1].n.Load(), "the refused bytes undone")
	in.release(1, 20)
	require.False(t, in.admitMore(1, 70, 40), "all its bucket holds, not all intake holds: within the budget only")
	require.EqualValues(t, 40, in.buckets[1].n.Load(), "the refused bytes undone")
	in.release(4, 10)
	require.True(t, in.admitMore(1, 70, 40), "all intake holds: past the budget")
	require.EqualValues(t, 110, in.buckets[1].n.Load())
	in.release(1, 110)
	requireEmpty(t, in)

	// A credit gives its bytes back to the bucket it was admitted to, once:
	// signalled by its actor, or returned when its engine's route ends.
	in.engines, in.credits, in.hearing = map[string]*actor.PID{}, map[string]map[*credit]struct{}{}, map[string]*transfer.Hearing{}
	pid := actor.NewPID("nonhost", "e")
	in.route("e", pid, &transfer.Hearing{}, nil)
	require.True(t, in.admit(7, 30))
	c := in.lend("e", 7, pid, 30)
	require.NotNil(t, c)
	require.EqualValues(t, 30, in.buckets[7].n.Load())
	c.Signal()
	c.Signal()
	requireEmpty(t, in)
	require.True(t, in.admit(7, 30))
	c = in.lend("e", 7, pid, 30)
	in.unroute("e", pid)
	requireEmpty(t, in)
	c.Signal() // after its route ended: returns nothing twice
	requireEmpty(t, in)
}

// An engine's shard is what it was before buckets: FNV-1a of its id, which
// take now computes once for both.
func TestAnEnginesShardAndBucketComeFromOneFNVHash(t *testing.T) {
	for _, id := range []string{"", "e1", "vllm-0", "a-much-longer-engine-id.with.dots"} {
		h := fnv.New32a()
		_, _ = h.Write([]byte(id))
		require.Equal(t, h.Sum32(), idHash(id), id)
		require.Equal(t, int(h.Sum32()%7), shardOf(id, 7), id)
		require.Equal(t, uint8(h.Sum32()%buckets), bucketOf(idHash(id)), id)
	}
}

// requireEmpty: intake holds nothing, in total or in any bucket.
func requireEmpty(t *testing.T, in *ingester) {
	t.Helper()
	require.Zero(t, in.pending.Load())
	for i := range in.buckets {
		require.Zero(t, in.buckets[i].n.Load(), "bucket %d", i)
	}
}

// holdTotal counts size bytes in intake's total alone, as a message of no
// engine: every engine's admission sees them (the budget), no engine's
// share does. false: they do not fit. freeTotal gives them back.
func holdTotal(in *ingester, size int64) bool {
	cur := in.pending.Load()
	return cur+size <= in.budget && in.pending.CompareAndSwap(cur, cur+size)
}

func freeTotal(in *ingester, size int64) { in.pending.Add(-size) }
