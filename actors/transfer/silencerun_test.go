package transfer_test

import (
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

type heapArena []byte

func (a heapArena) Bytes() []byte { return a }
func (a heapArena) Close() error  { return nil }

const silence = 5 * time.Second // Config.EngineSilence: lease/2 of the default lease

// silenceRun is a transfer actor of one worker whose engine-silence clock
// the test moves, over a real store whose device calls wait on dev; with
// a fence (newFencedRun), the fence's clock is the same.
type silenceRun struct {
	pid, owner *actor.PID
	system     *actor.ActorSystem
	done       chan *transfer.JobDone
	m          *metrics.Transfer
	dev        *gatedDevice
	st         *store.Store
	e          *store.Engine
	start      time.Time
	clock      atomic.Int64
	h          *transfer.Hearing
	fence      *transfer.Fence // nil: none
}

func newSilenceRun(t *testing.T) *silenceRun { return newRun(t, false) }

// newFencedRun is a silenceRun whose copies pass a fence of lease
// 2×silence, its last round trip at the start.
func newFencedRun(t *testing.T) *silenceRun { return newRun(t, true) }

func newRun(t *testing.T, fenced bool) *silenceRun {
	t.Helper()
	r := &silenceRun{start: time.Unix(1_800_000_000, 0), m: metrics.NewTransfer(nil), h: &transfer.Hearing{},
		done: make(chan *transfer.JobDone, 8),
		dev:  &gatedDevice{gate: make(chan struct{}), starts: make(chan struct{}, 8)}}
	r.clock.Store(r.start.UnixNano())
	r.h.Heard(r.start)
	now := func() time.Time { return time.Unix(0, r.clock.Load()) }
	if fenced {
		r.fence = transfer.NewFence(2*silence, now, nil)
	}
	r.system = actor.NewActorSystem()
	t.Cleanup(r.system.Shutdown)
	t.Cleanup(func() { close(r.dev.gate) }) // first: a copy a failed test left waiting ends
	r.pid = r.system.Root.Spawn(transfer.Props(transfer.Deps{
		Config:  transfer.Config{Workers: 1, EngineSilence: silence},
		Metrics: r.m, Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Fence: r.fence, Now: now}))
	r.owner = r.system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: r.done} }))
	// Chunks of one 512 KiB block: a tile each.
	const bb = 512 << 10
	l, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "a"}},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: bb, BlockBytes: bb}}}}})
	require.NoError(t, err)
	r.st = store.New(heapArena(make([]byte, 4*bb)), bb, nil, metrics.NewPool(nil))
	r.e = r.st.Engine("e1", l, r.dev)
	return r
}

// storeJob prepares a store of three chunks (three tiles, three device
// calls) whose session began now, and submits it.
func (r *silenceRun) storeJob(t *testing.T) []messages.Key {
	t.Helper()
	keys := []messages.Key{"a", "b", "c"}
	prep, err := r.e.PrepareStore(keys, []int64{512 << 10, 512 << 10, 512 << 10})
	require.NoError(t, err)
	require.Len(t, prep.Keys, len(keys))
	s := &transfer.Submit{Owner: r.owner, ID: 1, Dir: backend.DeviceToHost, Store: r.e, Bytes: 3 * 512 << 10,
		Hearing: r.h, HearingGen: r.h.Gen()}
	if r.fence != nil {
		s.Session = r.fence.Gen()
	}
	for i, k := range keys {
		s.Chunks = append(s.Chunks, sched.JobChunk{Key: k, Blocks: []messages.BlockID{messages.BlockID(1 + i)}})
	}
	r.system.Root.Send(r.pid, s)
	return keys
}

// tile lets one device call run: it waits for the call to start, then
// lets it end.
func (r *silenceRun) tile(t *testing.T) {
	t.Helper()
	testkit.Recv(t, r.dev.starts, 5*time.Second, "a device call")
	r.dev.gate <- struct{}{}
}

// PROTOCOL.md "Engine silence": a copy that started before its engine's
// silence reached lease/2 is stopped when it does, between two device
// calls: its engine may have declared the node lost and reused the blocks
// it reads. The store's chunks are freed, none ready (it read blocks that
// may hold another request's KV), and the job ends with ErrEngineSilent,
// counted as a refused copy is, not as a failure (its owner retries it
// once the engine speaks again). The silence is either time (no message
// for lease/2, the node's clock moving while the copy runs), or a silence
// that ended (Hearing.Silenced) since the copy's session began. An engine
// heard meanwhile is not silent: its copy runs to the end.
func TestACopyRunningWhenItsEngineFallsSilentIsStopped(t *testing.T) {
	for _, tc := range []struct {
		name    string
		silence func(r *silenceRun)
		stopped bool
	}{
		{"lease/2 with no message", func(r *silenceRun) { r.clock.Store(r.start.Add(silence).UnixNano()) }, true},
		{"a silence ended meanwhile", func(r *silenceRun) { r.h.Silenced(); r.h.Heard(r.start.Add(time.Second)) }, true},
		{"heard meanwhile", func(r *silenceRun) {
			r.h.Heard(r.start.Add(time.Second))
			r.clock.Store(r.start.Add(silence).UnixNano())
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newSilenceRun(t)
			keys := r.storeJob(t)
			testkit.Recv(t, r.dev.starts, 5*time.Second, "the first tile's device call")
			tc.silence(r) // while the first tile copies
			r.dev.gate <- struct{}{}
			if !tc.stopped {
				r.tile(t)
				r.tile(t)
				d := testkit.Recv(t, r.done, 5*time.Second, "the job's JobDone")
				require.NoError(t, d.Err)
				for _, k := range keys {
					require.True(t, r.st.Ready(k), "%s not ready", k)
				}
				require.Zero(t, testutil.ToFloat64(r.m.CopiesSilent))
				return
			}
			d := testkit.Recv(t, r.done, 5*time.Second, "the job's JobDone")
			require.ErrorIs(t, d.Err, transfer.ErrEngineSilent)
			require.False(t, d.Cancelled)
			require.Len(t, r.dev.startedCopies(), 1, "device calls after the engine fell silent")
			for _, k := range keys {
				require.False(t, r.st.Ready(k), "%s ready: bytes read after its engine fell silent", k)
			}
			require.Zero(t, r.st.Stats().Used, "the store's room not freed")
			require.Equal(t, 1.0, testutil.ToFloat64(r.m.CopiesSilent))
			require.Zero(t, testutil.ToFloat64(r.m.CopyFailures.WithLabelValues(backend.DeviceToHost.String())),
				"a stopped copy counted as a failure")
		})
	}
}

// The last tile is copied after the last check between tiles: a store
// whose engine falls silent then is still not made ready.
func TestAStoreWhoseEngineFallsSilentInItsLastTileIsNotReady(t *testing.T) {
	r := newSilenceRun(t)
	keys := r.storeJob(t)
	r.tile(t)
	r.tile(t)
	testkit.Recv(t, r.dev.starts, 5*time.Second, "the last tile's device call")
	r.clock.Store(r.start.Add(silence).UnixNano())
	r.dev.gate <- struct{}{}
	d := testkit.Recv(t, r.done, 5*time.Second, "the job's JobDone")
	require.ErrorIs(t, d.Err, transfer.ErrEngineSilent)
	for _, k := range keys {
		require.False(t, r.st.Ready(k), "%s ready", k)
	}
	require.Zero(t, r.st.Stats().Used)
	require.Equal(t, 1.0, testutil.ToFloat64(r.m.CopiesSilent))
}

// PROTOCOL.md "Fencing": the fence holds every device call of a copy, not
// only its first. With the node's NATS round trips stalled for lease/2 while
// its engine is still heard, a store already running makes no further
// device call: it ends with ErrFencedMidCopy, its chunks freed, none ready,
// counted as a copy the fence stopped, not as a failure (its owner retries
// it), rather than going on until the 5/8-lease watchdog.
func TestNoDeviceCallOfARunningCopyStartsPastTheFence(t *testing.T) {
	r := newFencedRun(t)
	keys := r.storeJob(t)
	testkit.Recv(t, r.dev.starts, 5*time.Second, "the first tile's device call")
	later := r.start.Add(silence + time.Second) // lease/2 + 1s, below the 3/4-lease lapse
	r.clock.Store(later.UnixNano())
	r.h.Heard(later) // the engine is still heard: only the fence stops it
	require.True(t, r.fence.Fenced())
	r.dev.gate <- struct{}{}
	d := testkit.Recv(t, r.done, 5*time.Second, "the job's JobDone")
	require.ErrorIs(t, d.Err, transfer.ErrFencedMidCopy)
	require.Len(t, r.dev.startedCopies(), 1, "device calls past the fence")
	for _, k := range keys {
		require.False(t, r.st.Ready(k), "%s ready: its copy was stopped", k)
	}
	require.Zero(t, r.st.Stats().Used, "the store's room not freed")
	require.Equal(t, 1.0, testutil.ToFloat64(r.m.CopiesFenced))
	require.Zero(t, testutil.ToFloat64(r.m.CopiesSilent))
	require.Zero(t, testutil.ToFloat64(r.m.CopyFailures.WithLabelValues(backend.DeviceToHost.String())),
		"a stopped copy counted as a failure")
}

// The same for a load: one stopped by the fence between two device calls
// fails with ErrFencedMidCopy and leaves none of its keys pinned (they stay
// stored, evictable), so the pool does not fill with pins of loads that
// never ended.
func TestALoadTheFenceStopsUnpinsItsKeys(t *testing.T) {
	r := newFencedRun(t)
	keys := r.storeJob(t)
	for range keys {
		r.tile(t)
	}
	require.NoError(t, testkit.Recv(t, r.done, 5*time.Second, "the store's JobDone").Err)
	_, err := r.e.PrepareLoad(keys)
	require.NoError(t, err)
	require.Equal(t, len(keys), r.st.Stats().Pinned)
	s := &transfer.Submit{Owner: r.owner, ID: 2, Dir: backend.HostToDevice, Store: r.e, Bytes: 3 * 512 << 10,
		Hearing: r.h, HearingGen: r.h.Gen(), Session: r.fence.Gen()}
	for i, k := range keys {
		s.Chunks = append(s.Chunks, sched.JobChunk{Key: k, Blocks: []messages.BlockID{messages.BlockID(10 + i)}})
	}
	r.system.Root.Send(r.pid, s)
	testkit.Recv(t, r.dev.starts, 5*time.Second, "the load's first device call")
	later := r.start.Add(silence + time.Second)
	r.clock.Store(later.UnixNano())
	r.h.Heard(later)
	r.dev.gate <- struct{}{}
	d := testkit.Recv(t, r.done, 5*time.Second, "the load's JobDone")
	require.ErrorIs(t, d.Err, transfer.ErrFencedMidCopy)
	require.Len(t, r.dev.startedCopies(), len(keys)+1, "device calls of the load past the fence")
	require.Zero(t, r.st.Stats().Pinned, "a key left pinned")
	for _, k := range keys {
		require.True(t, r.st.Ready(k), "%s: still stored", k)
	}
}
