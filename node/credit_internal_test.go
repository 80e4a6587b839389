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

// admitted admits a message of size bytes of an engine of bucket, which
// must fit, and returns where it counts.
func admitted(t *testing.T, in *ingester, bucket uint8, size int64) uint8 {
	t.Helper()
	counted, ok := in.admit(bucket, size)
	require.True(t, ok, "%d bytes of bucket %d refused", size, bucket)
	return counted
}

// admittedMore admits extra bytes more for a message of size bytes counting
// in counted (home: its engine's bucket), which must fit, and returns where
// it counts then.
func admittedMore(t *testing.T, in *ingester, counted, home uint8, extra, size int64) uint8 {
	t.Helper()
	now, ok := in.admitMore(counted, home, extra, size)
	require.True(t, ok, "%d bytes more of bucket %d refused", extra, home)
	return now
}

func refused(t *testing.T, in *ingester, bucket uint8, size int64, msg string) {
	t.Helper()
	_, ok := in.admit(bucket, size)
	require.False(t, ok, msg)
}

func refusedMore(t *testing.T, in *ingester, counted, home uint8, extra, size int64, msg string) {
	t.Helper()
	_, ok := in.admitMore(counted, home, extra, size)
	require.False(t, ok, msg)
}

// A batch's decoded bytes past its wire size are admitted within the
// budget, or past it only when that batch is all intake holds: one batch
// larger than the budget decoded still goes (alone), never beside others.
func TestDecodedBytesPastTheWireAreAdmittedWithinTheBudget(t *testing.T) {
	in := &ingester{budget: 100} // calm 25, share 50
	require.EqualValues(t, 1, admitted(t, in, 1, 40), "past calm: counted")
	require.EqualValues(t, 1, admittedMore(t, in, 1, 1, 80, 40), "alone: past the budget")
	refused(t, in, 2, 1, "nothing beside it")
	in.release(1, 120)

	require.EqualValues(t, 1, admitted(t, in, 1, 40)) // another engine's batch
	require.EqualValues(t, 2, admitted(t, in, 2, 30))
	refusedMore(t, in, 2, 2, 50, 30, "beside another: within the budget only")
	require.EqualValues(t, 2, admittedMore(t, in, 2, 2, 30, 30))
	require.EqualValues(t, 100, in.pending.Load())
	require.EqualValues(t, 120, in.peak.Load())
}

// Each bucket of engine ids holds at most its share of the intake budget
// counted, half; every release gives back to the bucket it names. A batch
// past the share decoded still goes while it is all its bucket holds
// (within the budget), and past the budget while it is all intake holds.
// Here the calm quarter is taken first (a message of no engine), so every
// message counts in its bucket.
func TestABucketHoldsAtMostItsShareOfTheIntakeBudget(t *testing.T) {
	in := &ingester{budget: 100} // calm 25, share 50
	require.True(t, holdTotal(in, in.calm()))
	require.EqualValues(t, 1, admitted(t, in, 1, 45))
	require.EqualValues(t, 1, admitted(t, in, 1, 5))
	refused(t, in, 1, 1, "bucket 1 is full at its share")
	require.EqualValues(t, 2, admitted(t, in, 2, 25), "another bucket gets the last quarter")
	refused(t, in, 3, 1, "the budget is full")
	require.EqualValues(t, 100, in.pending.Load())
	require.EqualValues(t, 50, in.buckets[1].n.Load())
	require.Zero(t, in.buckets[3].n.Load(), "a refusal leaves nothing counted")
	require.EqualValues(t, 50, in.fullestBucket())

	in.release(2, 25)
	refused(t, in, 1, 1, "room in the budget, none in bucket 1's share")
	require.EqualValues(t, 3, admitted(t, in, 3, 25))
	in.release(1, 5)
	require.EqualValues(t, 1, admitted(t, in, 1, 5), "the release went back to bucket 1")
	in.release(1, 50)
	in.release(3, 25)
	freeTotal(in, in.calm())
	requireEmpty(t, in)

	// A batch of 30 bytes on the wire that holds 65 decoded.
	require.True(t, holdTotal(in, in.calm()))
	require.EqualValues(t, 4, admitted(t, in, 4, 10)) // another engine's message
	require.EqualValues(t, 1, admitted(t, in, 1, 30))
	require.EqualValues(t, 1, admittedMore(t, in, 1, 1, 35, 30), "all its bucket holds: past the share, within the budget")
	refused(t, in, 1, 1, "nothing beside it in its bucket")
	in.release(1, 65)
	require.EqualValues(t, 1, admitted(t, in, 1, 30))
	require.EqualValues(t, 1, admitted(t, in, 1, 15)) // another message of the bucket
	refusedMore(t, in, 1, 1, 10, 30, "beside another of its bucket: within the share only")
	require.EqualValues(t, 45, in.buckets[1].n.Load(), "the refused bytes undone")
	in.release(1, 15)
	refusedMore(t, in, 1, 1, 40, 30, "all its bucket holds, not all intake holds: within the budget only")
	require.EqualValues(t, 30, in.buckets[1].n.Load(), "the refused bytes undone")
	in.release(4, 10)
	freeTotal(in, in.calm())
	require.EqualValues(t, 1, admittedMore(t, in, 1, 1, 80, 30), "all intake holds: past the budget")
	require.EqualValues(t, 110, in.buckets[1].n.Load())
	in.release(1, 110)
	requireEmpty(t, in)

	// A credit gives its bytes back to the bucket it was admitted to, once:
	// signalled by its actor, or returned when its engine's route ends.
	in.engines, in.credits, in.hearing = map[string]*actor.PID{}, map[string]map[*credit]struct{}{}, map[string]*transfer.Hearing{}
	pid := actor.NewPID("nonhost", "e")
	in.route("e", pid, &transfer.Hearing{}, nil)
	require.EqualValues(t, 7, admitted(t, in, 7, 30))
	c := in.lend("e", 7, pid, 30)
	require.NotNil(t, c)
	require.EqualValues(t, 30, in.buckets[7].n.Load())
	c.Signal()
	c.Signal()
	requireEmpty(t, in)
	require.EqualValues(t, 7, admitted(t, in, 7, 30))
	c = in.lend("e", 7, pid, 30)
	in.unroute("e", pid)
	requireEmpty(t, in)
	c.Signal() // after its route ended: returns nothing twice
	requireEmpty(t, in)
}

// A calm intake (a quarter of the budget or less, with the message) counts
// a message in the total only: no bucket is touched, at admission, for its
// decoded bytes while they fit calm too, or at its release. A calm batch
// whose decoded bytes do not fit calm moves into its engine's bucket, all
// of it (within the share, past it only when the bucket holds nothing
// else), or stays calm when refused; from then on it is released there.
func TestACalmIntakeCountsInNoBucket(t *testing.T) {
	in := &ingester{budget: 100} // calm 25, share 50
	require.Equal(t, noBucket, admitted(t, in, 1, 10))
	require.Equal(t, noBucket, admitted(t, in, 2, 15), "calm up to a quarter, with it")
	requireNoBucket(t, in)
	require.EqualValues(t, 25, in.pending.Load())
	require.EqualValues(t, 1, admitted(t, in, 1, 1), "past calm: counted in its bucket")
	require.EqualValues(t, 1, in.buckets[1].n.Load())
	in.release(noBucket, 10)
	require.EqualValues(t, 1, in.buckets[1].n.Load(), "a calm release touches no bucket")
	require.EqualValues(t, 16, in.pending.Load())
	in.release(1, 1)
	in.release(noBucket, 15)
	requireEmpty(t, in)

	// Decoded bytes that fit calm: calm too.
	require.Equal(t, noBucket, admitted(t, in, 1, 10))
	require.Equal(t, noBucket, admittedMore(t, in, noBucket, 1, 5, 10))
	requireNoBucket(t, in)
	// Decoded bytes that do not: the batch moves into its bucket, its wire
	// bytes too, and is released there.
	require.Equal(t, noBucket, admitted(t, in, 2, 5))
	require.EqualValues(t, 2, admittedMore(t, in, noBucket, 2, 20, 5))
	require.EqualValues(t, 25, in.buckets[2].n.Load(), "its wire and decoded bytes")
	require.EqualValues(t, 40, in.pending.Load())
	in.release(2, 25)
	in.release(noBucket, 15)
	requireEmpty(t, in)

	// Its bucket full at its share: it stays calm, nothing counted.
	require.Equal(t, noBucket, admitted(t, in, 3, 5))
	require.True(t, holdTotal(in, 20))
	require.EqualValues(t, 3, admitted(t, in, 3, 50))
	refusedMore(t, in, noBucket, 3, 10, 5, "its bucket holds its share")
	require.EqualValues(t, 50, in.buckets[3].n.Load(), "the refused move undone")
	require.EqualValues(t, 75, in.pending.Load())
	in.release(3, 50)
	in.release(noBucket, 5)
	freeTotal(in, 20)
	requireEmpty(t, in)

	// The budget full: it stays calm, nothing counted.
	require.Equal(t, noBucket, admitted(t, in, 5, 10))
	require.EqualValues(t, 6, admitted(t, in, 6, 45))
	require.EqualValues(t, 7, admitted(t, in, 7, 40))
	refusedMore(t, in, noBucket, 5, 10, 10, "the budget is full")
	require.Zero(t, in.buckets[5].n.Load(), "the refused move undone")
	in.release(noBucket, 10)
	in.release(6, 45)
	in.release(7, 40)
	requireEmpty(t, in)

	// Beside another message of its bucket: within the share only, however
	// small that message.
	require.Equal(t, noBucket, admitted(t, in, 3, 10))
	require.True(t, holdTotal(in, 15))
	require.EqualValues(t, 3, admitted(t, in, 3, 5))
	refusedMore(t, in, noBucket, 3, 45, 10, "beside another of its bucket: within the share only")
	require.EqualValues(t, 5, in.buckets[3].n.Load(), "the refused move undone")
	in.release(3, 5)
	in.release(noBucket, 10)
	freeTotal(in, 15)
	requireEmpty(t, in)

	// Alone in its bucket: past the share (within the budget); alone in
	// intake: past the budget too.
	require.Equal(t, noBucket, admitted(t, in, 4, 10))
	require.EqualValues(t, 4, admittedMore(t, in, noBucket, 4, 70, 10))
	require.EqualValues(t, 80, in.buckets[4].n.Load())
	in.release(4, 80)
	require.Equal(t, noBucket, admitted(t, in, 4, 10))
	require.EqualValues(t, 4, admittedMore(t, in, noBucket, 4, 150, 10))
	in.release(4, 160)
	requireEmpty(t, in)

	// A calm credit gives its bytes back to the total only.
	in.engines, in.credits, in.hearing = map[string]*actor.PID{}, map[string]map[*credit]struct{}{}, map[string]*transfer.Hearing{}
	pid := actor.NewPID("nonhost", "e")
	in.route("e", pid, &transfer.Hearing{}, nil)
	require.Equal(t, noBucket, admitted(t, in, 7, 20))
	require.EqualValues(t, 7, admitted(t, in, 7, 30))
	in.buckets[7].n.Add(1) // marks the bucket: a calm release must leave it as it is
	c := in.lend("e", noBucket, pid, 20)
	require.NotNil(t, c)
	c.Signal()
	require.EqualValues(t, 31, in.buckets[7].n.Load())
	require.EqualValues(t, 30, in.pending.Load())
	in.buckets[7].n.Add(-1)
	in.release(7, 30)
	requireEmpty(t, in)
}

// One engine that floods, its batches several times their wire size
// decoded, never holds more than three quarters of the intake budget, calm
// and counted together, and an engine of another bucket still gets the
// last quarter in.
func TestAFlooderHoldsAtMostThreeQuartersOfTheIntakeBudget(t *testing.T) {
	for _, extra := range []int64{0, 1, 3, 15} {
		in := &ingester{budget: 100}
		var held int64
		for range 100 {
			counted, ok := in.admit(1, 5)
			if !ok {
				continue
			}
			if extra > 0 {
				if _, ok := in.admitMore(counted, 1, extra, 5); !ok {
					in.release(counted, 5)
					continue
				}
				held += extra
			}
			held += 5
			require.LessOrEqual(t, held, in.budget-in.budget/4, "extra %d: the flooder holds past three quarters", extra)
		}
		require.Equal(t, held, in.pending.Load())
		require.LessOrEqual(t, in.buckets[1].n.Load(), in.share())
		require.Equal(t, uint8(2), admitted(t, in, 2, in.budget/4), "extra %d: another bucket gets the last quarter", extra)
	}
}

// A message larger than a bucket's share (half the budget) on the wire is
// admitted while it is all its bucket holds, within the budget: the smallest
// budget allowed (twice the server's max_payload: node.Start) has a share
// just under a largest message with its subject and overhead, which would
// otherwise never go.
func TestAMessageLargerThanTheShareIsAdmittedAloneInItsBucket(t *testing.T) {
	in := &ingester{budget: 100} // calm 25, share 50
	require.EqualValues(t, 1, admitted(t, in, 1, 55), "alone in its bucket: past the share")
	refused(t, in, 1, 1, "nothing beside it in its bucket")
	require.EqualValues(t, 2, admitted(t, in, 2, 45), "another bucket, within the budget")
	in.release(2, 45)
	require.EqualValues(t, 2, admitted(t, in, 2, 5))
	refused(t, in, 2, 55, "beside another of its bucket: within the share only")
	in.release(1, 55)
	require.True(t, holdTotal(in, 50))
	refused(t, in, 3, 55, "past the budget: refused, alone in its bucket or not")
	require.Zero(t, in.buckets[3].n.Load(), "the refused bytes undone")
	freeTotal(in, 50)
	in.release(2, 5)
	requireEmpty(t, in)
}

// requireNoBucket: no bucket counts anything.
func requireNoBucket(t *testing.T, in *ingester) {
	t.Helper()
	for i := range in.buckets {
		require.Zero(t, in.buckets[i].n.Load(), "bucket %d", i)
	}
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
	requireNoBucket(t, in)
}

// holdTotal counts size bytes in intake's total alone, as a message of no
// engine: every engine's admission sees them (the budget), no engine's
// share does. false: they do not fit. freeTotal gives them back.
func holdTotal(in *ingester, size int64) bool {
	cur := in.pending.Load()
	return cur+size <= in.budget && in.pending.CompareAndSwap(cur, cur+size)
}

func freeTotal(in *ingester, size int64) { in.pending.Add(-size) }
