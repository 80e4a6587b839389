package engine_test

import (
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// faultyStore is the node's store with its first copy held until gate
// closes (entered says it began), each copy and abort reported, and a
// decision that panics once arm is set: the request actor deciding fails
// in that turn.
type faultyStore struct {
	request.Store
	arm     atomic.Bool
	held    atomic.Bool
	entered chan struct{}
	gate    chan struct{}
	copies  chan []sched.JobChunk
	aborts  chan []sched.JobChunk
}

// holdingFaultyStore is a faultyStore whose first copy waits for gate
// (closed at the test's end, if the test has not), telling entered; each
// copy and abort is told on copies and aborts.
func holdingFaultyStore(t *testing.T) *faultyStore {
	fs := &faultyStore{entered: make(chan struct{}), gate: make(chan struct{}),
		copies: make(chan []sched.JobChunk, 8), aborts: make(chan []sched.JobChunk, 8)}
	t.Cleanup(func() {
		select {
		case <-fs.gate:
		default:
			close(fs.gate)
		}
	})
	return fs
}

// over makes s wrap a store of 8 chunks of 64 bytes for engine e1 with lay.
func (s *faultyStore) over(lay *sched.Layout) {
	s.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).
		Engine("e1", lay, testkit.NopDevice{})
}

func (s *faultyStore) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	if s.arm.CompareAndSwap(true, false) {
		panic("request actor failure injected in its store decision")
	}
	return s.Store.PrepareStoreInto(out, keys, sizes)
}

func (s *faultyStore) Copy(dir backend.Direction, chunks []sched.JobChunk, live func() error) error {
	if s.held.CompareAndSwap(false, true) {
		close(s.entered)
		<-s.gate
	}
	err := s.Store.Copy(dir, chunks, live)
	s.copies <- chunks
	return err
}

func (s *faultyStore) Abort(dir backend.Direction, chunks []sched.JobChunk) {
	s.Store.Abort(dir, chunks)
	s.aborts <- chunks
}

// chunk is request id's chunk index i: its hash, block and tokens.
func chunk(id string, i int) []messages.Event {
	return []messages.Event{
		{Type: messages.EvHashes, Request: id, Start: i, Hashes: []messages.Hash{messages.Hash("h-" + id + string(rune('0'+i)))}},
		{Type: messages.EvBlocks, Request: id, Start: i, IDs: []messages.BlockID{messages.BlockID(i + 1)}},
		tokens(id, 4*(i+1))}
}

// A request actor that fails (a panic in its turn: a bug, a poisoned
// message) while one of its copies runs and another waits in the copy
// queue is not released at once (PROTOCOL.md: the engine reuses the blocks
// once released, and the running copy still reads them): its queued copy is
// cancelled (its pool side aborted; it never runs), and its one release,
// aborted, goes out once the running copy is done, whatever the engine
// sends for r meanwhile (finished). A retire waits for that release and
// then ends; the live-requests gauge, the owed count and the failure count
// are right.
func TestAFailedRequestIsReleasedOnlyOnceItsCopiesEnd(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	fs := holdingFaultyStore(t)
	var owed atomic.Int64
	system, pid, m, _ := startEngineWith(t, nc, closed, func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		fs.over(lay)
		d.Store = fs
		d.Owed = &owed
		oneWorkerTransfer(system, d) // one copy at a time: the second waits in the queue
	})

	sendBatch(system, pid, 1, append([]messages.Event{added("r")}, chunk("r", 0)...)...)
	select {
	case <-fs.entered: // r's first copy runs, held
	case <-time.After(5 * time.Second):
		t.Fatal("r's first copy did not start")
	}
	sendBatch(system, pid, 2, chunk("r", 1)...) // r's second copy waits behind it
	reqs := requestsOf(t, system, pid)
	require.Len(t, reqs, 1)
	require.Len(t, reqs[0].InFlight, 2, "r has one copy running and one queued")
	require.Equal(t, 1.0, testutil.ToFloat64(m.RequestsLive))

	fs.arm.Store(true)
	sendBatch(system, pid, 3, chunk("r", 2)...) // r fails deciding its third chunk
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if testutilValue(m) != 1 {
			return errString("r's failure not handled yet")
		}
		return nil
	})
	aborted := false
	select {
	case <-fs.aborts:
		aborted = true
	case <-time.After(time.Second):
	}
	require.NoError(t, nc.Flush())
	early := false
	select {
	case <-released:
		early = true
	case <-time.After(100 * time.Millisecond):
	}
	// The engine ends r (finished) and retires meanwhile: neither releases
	// r, and the retire waits for r's release.
	sendBatch(system, pid, 4, finished("r"))
	require.Empty(t, requestsOf(t, system, pid), "r is no longer a live request")
	count := make(chan int, 1)
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: count})
	require.NoError(t, nc.Flush())
	stoppedEarly := false
	select {
	case <-released:
		early = true
	case <-closed:
		stoppedEarly = true
	case <-time.After(100 * time.Millisecond):
	}

	owedMeanwhile := owed.Load()
	close(fs.gate) // r's first copy ends
	testkit.Recv(t, fs.copies, 5*time.Second, "r's first copy's end")
	ranLate := false
	select {
	case <-fs.copies:
		ranLate = true
	case <-time.After(200 * time.Millisecond):
	}
	assert.False(t, early, "r released while its copy was still reading its blocks")
	assert.False(t, ranLate, "r's queued copy ran after r failed")
	assert.True(t, aborted, "r's queued copy was not cancelled")
	assert.False(t, stoppedEarly, "the retired engine stopped before r's release")
	assert.Equal(t, int64(1), owedMeanwhile, "r's release is owed until it goes out")
	if t.Failed() {
		t.FailNow()
	}

	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted},
		recvRelease(t, released, "r's release once its copy is done"))
	testkit.Closed(t, closed, 5*time.Second, "the retired engine's stop")
	require.Zero(t, testkit.Recv(t, count, 5*time.Second, "the retire's count"))
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
	require.Zero(t, testutil.ToFloat64(m.RequestsLive))
	require.Equal(t, 1.0, testutilValue(m))
	require.Zero(t, owed.Load())
	require.Zero(t, testutil.ToFloat64(m.Rejected.WithLabelValues(messages.RejectReleased)),
		"r's finished, sent after r's failure resynced epoch a, is dropped with the epoch, not routed")
}

// holdsDrains is a transfer actor that keeps store jobs (in flight until
// the test ends them) and Drains (never answered: a failed request's copy
// runs on).
type holdsDrains struct {
	jobs   chan *transfer.Submit
	drains chan *transfer.Drain
}

func (h *holdsDrains) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *transfer.Submit:
		h.jobs <- m
	case *transfer.Drain:
		h.drains <- m
	}
}

// An engine actor stopped as a last resort (it failed again inside its own
// end) while a failed request waits for its copies hands that request's
// release to the transfer actor (Drain.Then: the Drained would find no
// one): it goes out, aborted, once, only when the copies end, and Closed
// closes only after it.
func TestAFailedRequestWaitingForItsCopiesIsReleasedOnceThemEndWhenItsEngineStops(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	fs := &faultyStore{}
	h := &holdsDrains{jobs: make(chan *transfer.Submit, 8), drains: make(chan *transfer.Drain, 8)}
	var always atomic.Bool
	system, pid, m, _ := startEngineDeps(t, nc, closed, func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		fs.over(lay)
		d.Store = fs
		d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return h }))
	}, func(d *engine.Deps) {
		d.Session = func() uint64 {
			if always.Load() {
				panic("engine actor failure injected")
			}
			return 0
		}
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
	})
	sendBatch(system, pid, 1, append([]messages.Event{added("r")}, chunk("r", 0)...)...)
	testkit.Recv(t, h.jobs, 5*time.Second, "r's store job") // stays in flight
	fs.arm.Store(true)
	sendBatch(system, pid, 2, chunk("r", 1)...) // r fails
	d := testkit.Recv(t, h.drains, 5*time.Second, "the engine's Drain for r")
	require.Equal(t, pid.Id+"/", d.Owner.Id[:len(pid.Id)+1], "the Drain names r's actor")
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "r released while its copy runs")

	always.Store(true)
	system.Root.Send(pid, &engine.Tick{}) // the engine actor fails, and fails again in its end: it stops
	d2 := testkit.Recv(t, h.drains, 5*time.Second, "the stopping engine's Drain for r")
	require.True(t, d2.Owner.Equal(d.Owner))
	require.NotNil(t, d2.Then, "the stopping engine's Drain runs a release, not a reply")
	system.Root.Send(pid, &transfer.Drained{Owner: d.Owner}) // the first Drain's late answer changes nothing
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "r released while its copy runs, the engine stopped")
	select {
	case <-closed:
		t.Fatal("Closed closed while r's copy runs")
	default:
	}

	d2.Then() // r's copy has ended
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted},
		recvRelease(t, released, "r's release once its copy ended"))
	testkit.Closed(t, closed, 5*time.Second, "Closed, once the last release went out")
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
	require.Equal(t, 1.0, testutilValue(m))
}

// A request with a copy in flight when its engine actor is stopped as a
// last resort (it failed again inside its own end, before the retire) is
// released, aborted, only once that copy has ended, and Closed (the node
// unmaps the device) closes only after that release; its queued copy never
// runs. The node is told (Failed); the owed count comes back to zero.
func TestARequestOfAStoppedEngineActorIsReleasedOnlyOnceItsCopyEnds(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	fs := holdingFaultyStore(t)
	var owed atomic.Int64
	var armed atomic.Bool
	reports := make(chan *actor.PID, 2)
	system, pid, m, _ := startEngineDeps(t, nc, closed, func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		fs.over(lay)
		d.Store = fs
		d.Owed = &owed
		oneWorkerTransfer(system, d)
	}, func(d *engine.Deps) {
		d.Session = func() uint64 {
			if armed.CompareAndSwap(true, false) {
				panic("engine actor failure injected")
			}
			return 0
		}
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
		d.Failed = func(_ string, self *actor.PID, _ <-chan int) { reports <- self }
	})
	sendBatch(system, pid, 1, append([]messages.Event{added("r")}, chunk("r", 0)...)...)
	select {
	case <-fs.entered: // r's first copy runs, held
	case <-time.After(5 * time.Second):
		t.Fatal("r's first copy did not start")
	}
	sendBatch(system, pid, 2, chunk("r", 1)...) // r's second copy waits behind it
	require.Len(t, requestsOf(t, system, pid)[0].InFlight, 2, "r has one copy running and one queued")

	armed.Store(true)
	system.Root.Send(pid, &engine.Tick{}) // fails, and fails again in its end: stopped
	require.True(t, testkit.Recv(t, reports, 5*time.Second, "the report to the node").Equal(pid))
	testkit.Recv(t, fs.aborts, 5*time.Second, "r's queued copy cancelled")
	require.NoError(t, nc.Flush())
	early := false
	select {
	case <-released:
		early = true
	case <-closed:
		early = true
	case <-time.After(100 * time.Millisecond):
	}
	owedMeanwhile := owed.Load()
	close(fs.gate) // r's copy ends
	testkit.Recv(t, fs.copies, 5*time.Second, "r's running copy's end")
	require.False(t, early, "r released, or Closed closed, while r's copy ran")
	require.Equal(t, int64(1), owedMeanwhile, "r's release is owed until it goes out")
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted},
		recvRelease(t, released, "r's release once its copy ended"))
	testkit.Closed(t, closed, 5*time.Second, "Closed, once r's release went out")
	select {
	case <-fs.copies:
		t.Fatal("r's queued copy ran")
	case <-time.After(50 * time.Millisecond):
	}
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
	require.Zero(t, owed.Load())
	require.Zero(t, testutil.ToFloat64(m.RequestsLive))
	require.Zero(t, testutil.ToFloat64(m.EnginesLive))
}

// A new epoch while a failed request waits for its copies resets the
// engine's other requests, not it: its one release, aborted, still waits
// for Drained and carries its own epoch; the new epoch may reuse its id at
// once (a new request, released on its own).
func TestAFailedRequestWaitingForItsCopiesOutlivesAnEngineReset(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	fs := &faultyStore{}
	h := &holdsDrains{jobs: make(chan *transfer.Submit, 8), drains: make(chan *transfer.Drain, 8)}
	system, pid, _, _ := startEngineWith(t, nc, make(chan struct{}), func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		fs.over(lay)
		d.Store = fs
		d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return h }))
	})
	sendBatch(system, pid, 1, append([]messages.Event{added("r")}, chunk("r", 0)...)...)
	testkit.Recv(t, h.jobs, 5*time.Second, "r's store job") // stays in flight
	fs.arm.Store(true)
	sendBatch(system, pid, 2, chunk("r", 1)...) // r fails
	d := testkit.Recv(t, h.drains, 5*time.Second, "the engine's Drain for r")

	system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "b", Seq: 1,
		Events: []messages.Event{added("r")}}}) // a new epoch, r's id again
	reqs := requestsOf(t, system, pid)
	require.Len(t, reqs, 1, "the new epoch's r is live")
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "the failed r released by the reset")

	system.Root.Send(pid, &transfer.Drained{Owner: d.Owner}) // r's copy is done
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted},
		recvRelease(t, released, "the failed r's release"))
	system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "b", Seq: 2,
		Events: []messages.Event{finished("r")}}})
	require.Equal(t, messages.Released{Request: "r", Epoch: "b", RSeq: 1, Reason: messages.ReasonFinished},
		recvRelease(t, released, "the new r's release"))
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release")
}

// A failed request that is the last of an ended epoch numbers its release
// after the epoch's others (PROTOCOL.md v2: rseq 1, 2, … per epoch): the
// epoch's count is forgotten only once that release is out.
func TestAFailedRequestsLateReleaseKeepsItsEpochsNumbering(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	fs := &faultyStore{}
	h := &holdsDrains{jobs: make(chan *transfer.Submit, 8), drains: make(chan *transfer.Drain, 8)}
	system, pid, _, _ := startEngineWith(t, nc, make(chan struct{}), func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		fs.over(lay)
		d.Store = fs
		d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return h }))
	})
	sendBatch(system, pid, 1, append([]messages.Event{added("r"), added("q"),
		{Type: messages.EvBlocks, Request: "q", IDs: []messages.BlockID{9}}}, chunk("r", 0)...)...)
	testkit.Recv(t, h.jobs, 5*time.Second, "r's store job") // stays in flight
	fs.arm.Store(true)
	sendBatch(system, pid, 2, chunk("r", 1)...) // r fails
	d := testkit.Recv(t, h.drains, 5*time.Second, "the engine's Drain for r")

	system.Root.Send(pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "b", Seq: 1}}) // a new epoch resets q
	require.Equal(t, messages.Released{Request: "q", Epoch: "a", RSeq: 1, Reason: messages.ReasonEngineReset},
		recvRelease(t, released, "q's release"))
	statusOf(t, system, pid) // q's Done is handled
	system.Root.Send(pid, &transfer.Drained{Owner: d.Owner})
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 2, Reason: messages.ReasonAborted},
		recvRelease(t, released, "the failed r's release, the last of epoch a"))
}
