package transfer_test

import (
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
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

// The fence holds every device call of a copy, not only its first: with
// the node's outbound link stalled (no round trip completes for lease/2)
// but the engine still heard, a job of several tiles already running
// starts no further device call (it fails with ErrFencedMidCopy, and its
// owner retries it), rather than going on until the 5/8-lease watchdog.
func TestNoDeviceCallOfARunningCopyStartsPastTheFence(t *testing.T) {
	const lease = 10 * time.Second
	start := time.Unix(1_800_000_000, 0)
	var clock atomic.Int64
	clock.Store(start.UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()) }
	fence := transfer.NewFence(lease, now, nil)
	h := &transfer.Hearing{}
	h.Heard(start)
	dev := &gatedDevice{gate: make(chan struct{}), starts: make(chan struct{}, 8)}
	sys := actor.NewActorSystem()
	t.Cleanup(sys.Shutdown)
	t.Cleanup(func() { close(dev.gate) })
	done := make(chan *transfer.JobDone, 8)
	pid := sys.Root.Spawn(transfer.Props(transfer.Deps{
		Config:  transfer.Config{Workers: 1, EngineSilence: lease / 2},
		Metrics: metrics.NewTransfer(nil), Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Fence: fence, Now: now}))
	owner := sys.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	const bb = 512 << 10
	l, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "a"}},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: bb, BlockBytes: bb}}}}})
	require.NoError(t, err)
	st := store.New(heapArena(make([]byte, 4*bb)), bb, nil, metrics.NewPool(nil))
	e := st.Engine("e1", l, dev)
	keys := []messages.Key{"a", "b", "c"}
	_, err = e.PrepareStore(keys, []int64{bb, bb, bb})
	require.NoError(t, err)
	s := &transfer.Submit{Owner: owner, ID: 1, Dir: backend.DeviceToHost, Store: e, Bytes: 3 * bb,
		Session: fence.Gen(), Hearing: h, HearingGen: h.Gen()}
	for i, k := range keys {
		s.Chunks = append(s.Chunks, sched.JobChunk{Key: k, Blocks: []messages.BlockID{messages.BlockID(1 + i)}})
	}
	sys.Root.Send(pid, s)
	testkit.Recv(t, dev.starts, 5*time.Second, "the first tile's device call")
	// No round trip for lease/2 + 1s (below the 3/4-lease lapse); the engine is still heard.
	later := start.Add(lease/2 + time.Second)
	clock.Store(later.UnixNano())
	h.Heard(later)
	require.True(t, fence.Fenced())
	dev.gate <- struct{}{}
	select {
	case <-dev.starts:
		t.Fatalf("a device call started %v after the last round trip (fence: lease/2 = %v)", lease/2+time.Second, lease/2)
	case d := <-done:
		require.ErrorIs(t, d.Err, transfer.ErrFencedMidCopy)
	}
}
